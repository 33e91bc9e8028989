"""``ucp demo --deepspeed``: the DeepSpeed story, end to end with real DeepSpeed on CPUs (2 gloo processes).

1. Train a small model with DeepSpeed ZeRO-2 (bf16) on DP=2, save a checkpoint, keep training to record
   the uninterrupted losses, and convert the checkpoint with DeepSpeed's ``ds_to_universal`` for comparison;
2. ``ucp import deepspeed`` the ZeRO tag folder straight into a store (no conversion step), and
   ``ucp import deepspeed-universal`` DeepSpeed's own universal folder next to it;
3. inspect: ``ucp ls``, ``show``, ``stats``, ``verify``, and ``diff`` ours against DeepSpeed's (all the same);
4. ``ucp plan`` the load into other ZeRO layouts (with a picture of which rank reads which chunks);
5. ``ucp export deepspeed-universal`` and resume DeepSpeed from it at DP=1 and DP=2; compare the losses with
   the uninterrupted run and draw them (``losses.png``).

Training runs under torchrun (``ucp_store/demo/ds_train.py``). Without DeepSpeed installed it says how to
install it (``pip install 'ucp_store[deepspeed]'``) and exits 1.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys

from ucp_store.demo.procs import DemoError, free_port
from ucp_store.errors import ConfigurationError

__all__ = ["main"]

STEPS, NEXT = 6, 6
RTOL = 1e-2  # bf16 weights: a resume at another DP degree sums bf16 gradients in another order


def _need_deepspeed() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigurationError("ucp demo --deepspeed needs DeepSpeed, which is not installed: "
                                 "pip install 'ucp_store[deepspeed]' (in a checkout: .venv/bin/pip install "
                                 "-c constraints-cpu.txt -e '.[deepspeed]'); plain `ucp demo` needs nothing more")


def _torchrun(console, out: str, nproc: int, jobs: list[dict]) -> None:
    path = os.path.join(out, f"jobs-{len([f for f in os.listdir(out) if f.startswith('jobs-')])}.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
           str(free_port()), "-m", "ucp_store.demo.ds_train", "--jobs", path]
    console.print(f"[bold cyan]$ DS_ACCELERATOR=cpu torchrun --nproc_per_node={nproc} -m ucp_store.demo.ds_train "
                  f"--jobs {os.path.relpath(path)}[/]", soft_wrap=True)
    res = subprocess.run(cmd, env={**os.environ, "DS_ACCELERATOR": "cpu", "UCP_PROGRESS": "0"}, text=True,
                         capture_output=True, check=False)
    if res.returncode != 0:
        raise DemoError(f"DeepSpeed training failed (exit {res.returncode}): {' '.join(cmd)}\n"
                        f"{(res.stdout + res.stderr)[-4000:]}")


def run_ucp(ucp_main, console, store: str, *argv: str, capture: bool = False) -> str:
    from ucp_store.demo.tour import run_ucp as run_ucp

    return run_ucp(ucp_main, console, store, *argv, capture=capture)


def main(args) -> int:
    """The DeepSpeed story into DIR/deepspeed (see the module docstring); returns 0 or raises."""
    _need_deepspeed()
    from ucp_store.demo.run import make_console, prepare_dir

    console = make_console()
    prepare_dir(os.path.abspath(args.dir))
    out = os.path.join(os.path.abspath(args.dir), "deepspeed")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    store = os.path.join(out, "store")
    ucp = functools.partial(run_ucp, args.ucp_main, console, store)  # ucp(*argv): one command of the tour
    ds = os.path.join(out, "ds")
    tag = f"global_step{STEPS}"
    model = {"model": "mlp", "zero": 2, "dtype": "bf16", "seed": 1234}

    console.print("\n[bold]== 1. train with DeepSpeed ZeRO-2 bf16 on DP=2, save, continue, convert with "
                  "ds_to_universal ==[/]")
    _torchrun(console, out, 2, [{**model, "kind": "train", "steps": STEPS, "next_steps": NEXT, "save_dir": ds,
                                 "tag": tag, "convert": True, "out": os.path.join(out, "train.json")}])

    console.print("\n[bold]== 2. import the ZeRO folder directly, and DeepSpeed's universal folder "
                  "for comparison ==[/]")
    ucp("init")
    ucp("import", "deepspeed", os.path.join(ds, tag), "--run", "demo")
    ucp("import", "deepspeed-universal", os.path.join(ds, f"{tag}_universal"), "--run",
         "ds-universal", "--step", str(STEPS))

    console.print("\n[bold]== 3. inspect ==[/]")
    ucp("ls")
    ucp("show", "demo@latest")
    ucp("stats", "demo@latest")
    ucp("verify", "demo@latest")
    diff = json.loads(ucp("diff", "demo@latest", "ds-universal@latest", "--json", capture=True))
    mine = {(r["name"], r["state"]) for r in diff}
    shared = [r for r in diff if r["status"] in ("same", "changed")]
    changed = [r for r in shared if r["status"] == "changed"]
    console.print(f"ours vs ds_to_universal: {len(shared) - len(changed)} of {len(shared)} shared tensor-states are "
                  f"bit-identical; {len(mine) - len(shared)} only on one side (frozen weights / buffers we also keep)")
    if changed:
        raise DemoError(f"import differs from ds_to_universal: {changed[:3]}")

    console.print("\n[bold]== 4. plan loads into other ZeRO layouts ==[/]")
    ucp("plan", "demo@latest", "--dp", "4", "--zero", "2")
    ucp("plan", "demo@latest", "--dp", "3", "--zero", "1", "--plot", os.path.join(out, "plan.png"))

    console.print("\n[bold]== 5. export a universal folder and resume DeepSpeed from it at DP=1 and DP=2 ==[/]")
    export = os.path.join(out, "export")
    ucp("export", "deepspeed-universal", "demo@latest", export, "--tag", "resumed")
    for n in (1, 2):
        _torchrun(console, out, n, [{**model, "kind": "resume", "load_dir": export, "tag": "resumed", "steps": NEXT,
                                     "out": os.path.join(out, f"resume-dp{n}.json")}])

    with open(os.path.join(out, "train.json")) as f:
        train = json.load(f)
    resumed = {}
    for n in (1, 2):
        with open(os.path.join(out, f"resume-dp{n}.json")) as f:
            resumed[n] = json.load(f)["losses"]
    before, cont = train["losses_before"], train["losses"]
    from rich.table import Table

    t = Table(title="DeepSpeed losses after the checkpoint", header_style="bold", title_justify="left")
    for col in ("step", "uninterrupted DP=2", "resumed from ucp export, DP=2", "resumed from ucp export, DP=1"):
        t.add_column(col, justify="right")
    for i, (a, b, c) in enumerate(zip(cont, resumed[2], resumed[1])):
        t.add_row(str(STEPS + i + 1), f"{a:.6f}", f"{b:.6f}", f"{c:.6f}")
    console.print(t)
    worst = max(max(abs(a - b), abs(a - c)) / max(abs(a), 1e-12) for a, b, c in zip(cont, resumed[2], resumed[1]))
    console.print(f"largest relative loss difference after resuming: {worst:.2e} (tolerance {RTOL:.0e}: bf16 "
                  f"weights, and DP=1 sums the gradients in another order)")
    _draw(os.path.join(out, "losses.png"), before, cont, resumed)
    console.print(f"wrote {os.path.relpath(os.path.join(out, 'losses.png'))} and "
                  f"{os.path.relpath(os.path.join(out, 'plan.png'))}")
    if not worst <= RTOL:
        raise DemoError(f"DeepSpeed resumed from the ucp export diverged: relative loss difference "
                        f"{worst:.2e} > {RTOL:.0e}")
    return 0


def _draw(path: str, before: list[float], cont: list[float], resumed: dict[int, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, STEPS + 1), before, "k.-", label="trained (DP=2, ZeRO-2)")
    nx = list(range(STEPS + 1, STEPS + NEXT + 1))
    ax.plot(nx, cont, "k--", label="uninterrupted")
    ax.plot(nx, resumed[2], "o", mfc="none", label="resumed from ucp export, DP=2")
    ax.plot(nx, resumed[1], "x", label="resumed from ucp export, DP=1")
    ax.axvline(STEPS + 0.5, color="grey", lw=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("DeepSpeed resumes from a ucp_store export at another DP degree")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
