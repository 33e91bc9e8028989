"""``ucp demo``: train in parallel, save through ``ucp_store.dist``, resume on other meshes, prove it.

1. Train the demo GPT (`model.py`) on generated text (`text.py`) in 4 spawned gloo processes, TP=2 x
   DP=2 (tensor parallelism x FSDP2), saving every `steps // 4` steps; the second save is an
   `async_save` (training goes on while it writes) and is the one the other runs resume from. This run
   goes on to the end uninterrupted: it is the reference.
2. Resume from that checkpoint on TP=2 x DP=2 again (bitwise), TP=1 x DP=4, TP=2 x DP=1 and one process
   with no process group (relative bound; `report.py` says why), each checking with `ucp_store.dist.verify`
   that its live state is the stored one before training on.
3. Print the losses side by side with the largest differences, draw `loss_curves.png` and `plan.png`
   (which chunks each rank of TP=2 x DP=1 reads), and tour the store with the `ucp` commands a user would
   type. Exit non-zero when a resumed run diverges beyond its tolerance.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time

from ..errors import ConfigurationError
from .procs import DemoError, run_job
from .report import RTOL, compare, draw_losses, print_table

__all__ = ["RUNS", "run_demo", "plan_topology", "DEFAULT_STEPS"]

DEFAULT_STEPS = 24
MARKER = "ucp-demo.json"
RUN = "demo"
# (key, label, tp, dp, rule); the first is the uninterrupted reference
RUNS = [
    ("2x2", "TP=2 x DP=2", 2, 2, "bitwise"),
    ("1x4", "TP=1 x DP=4", 1, 4, "relative"),
    ("2x1", "TP=2 x DP=1", 2, 1, "relative"),
    ("1x1", "1 process", 1, 1, "relative"),
]
PLAN_KEY = "2x1"  # the resumed mesh whose reads plan.png draws and `ucp plan` prints


def _console():
    from rich.console import Console

    width = shutil.get_terminal_size((140, 40)).columns if sys.stdout.isatty() else 140
    return Console(width=max(120, width), highlight=False)


def _prepare_dir(path: str) -> None:
    """Make `path` an empty demo folder; a previous demo's folder is cleared, anything else is refused."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigurationError(f"--dir {path}: exists and is not a folder")
        entries = os.listdir(path)
        if entries and MARKER not in entries:
            raise ConfigurationError(f"--dir {path}: folder is not empty and holds no previous demo ({MARKER}); "
                                     f"pick a new folder or remove it")
        for name in ("store", "loss_curves.png", "plan.png", MARKER):
            full = os.path.join(path, name)
            if os.path.isdir(full):
                shutil.rmtree(full)
            elif os.path.exists(full):
                os.remove(full)
    os.makedirs(path, exist_ok=True)


def _show_path(path: str) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def plan_topology(key: str):
    """The planner's `Topology` for a demo mesh."""
    from ..topology import Topology

    tp, dp = next((tp, dp) for k, _, tp, dp, _ in RUNS if k == key)
    return Topology(tp=tp, dp=dp)


def run_demo(args) -> int:
    """Everything `ucp demo` does (see the module docstring); returns 0, or raises DemoError."""
    steps = args.steps
    if steps < 4:
        raise ConfigurationError(f"--steps {steps}: the demo needs at least 4 steps (it saves every steps // 4)")
    perturb = getattr(args, "perturb", None)
    if perturb is not None and perturb not in [k for k, *_ in RUNS]:
        raise ConfigurationError(f"--perturb {perturb}: no such resumed run; choose one of {[k for k, *_ in RUNS]}")
    for flag in ("store", "catalog"):
        if getattr(args, flag, None):
            raise ConfigurationError(f"--{flag}: ucp demo keeps its own store under --dir (DIR/store); "
                                     f"drop --{flag} or use --dir")
    out = os.path.abspath(args.dir)
    _prepare_dir(out)
    store_url = os.path.join(out, "store")
    console = _console()
    every = steps // 4
    resume = 2 * every
    saves = {s: ("async" if s == resume else "sync") for s in range(every, steps + 1, every)}
    saves[steps] = saves.get(steps, "sync")
    t_start = time.perf_counter()

    from .. import open_store
    from .model import ModelConfig

    cfg = ModelConfig(seq=32)
    open_store(store_url, create=True)
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump({"steps": steps, "saves": saves, "resume": resume, "cfg": cfg.to_json()}, f, indent=1)
    common = {"store": store_url, "run": RUN, "cfg": cfg.to_json(), "seed": 0, "lr": 1e-2, "timeout_s": 120}

    console.print(f"[bold]ucp demo[/]: a {cfg.layers}-layer GPT on generated text, trained in real torch.distributed "
                  f"processes (gloo), saved through ucp_store.dist into {_show_path(store_url)}")
    save_txt = ", ".join(f"{s}{' (async_save)' if k == 'async' else ''}" for s, k in sorted(saves.items()))
    plan = [("train", RUNS[0], 0, None, saves)] + [("resume", r, resume, f"{RUN}@{resume}", {}) for r in RUNS]
    results: dict[str, tuple[dict, dict]] = {}
    walls: dict[str, float] = {}
    with _progress(console, not getattr(args, "no_progress", False)) as progress:
        for i, (what, (key, label, tp, dp, _), start, load, run_saves) in enumerate(plan, 1):
            world = tp * dp
            name = f"{label} uninterrupted" if what == "train" else f"resumed {label}"
            if what == "train":
                console.print(f"[{i}/{len(plan)}] train on {label} ({world} processes), steps 1-{steps}, "
                              f"saving at steps {save_txt}")
            else:
                console.print(f"[{i}/{len(plan)}] resume {load} on {label} ({world} process{'es' if world > 1 else ''}"
                              f"{', no process group' if world == 1 else ''}), verify the loaded state, "
                              f"train steps {start + 1}-{steps}")
            job = {**common, "key": ("ref" if what == "train" else key), "label": name, "tp": tp, "dp": dp,
                   "start": start, "end": steps, "load": load, "saves": {str(s): k for s, k in run_saves.items()},
                   "perturb": what == "resume" and key == perturb}
            task = progress.add_task(name, total=steps - start, loss="") if progress is not None else None
            t0 = time.perf_counter()
            results[job["key"]] = run_job(job, world, progress=progress, task=task)
            walls[job["key"]] = time.perf_counter() - t0
            _report_run(console, job, results[job["key"]][1], walls[job["key"]])

    base = results["ref"][0]
    base_label = f"{RUNS[0][1]} uninterrupted"
    resumed = [(f"resumed {label}", results[key][0]) for key, label, *_ in RUNS]
    verdicts = [compare(key, f"resumed {label}", rule, base, results[key][0]) for key, label, _, _, rule in RUNS]
    console.print()
    print_table(console, base_label, base, resumed, verdicts)
    console.print(f"tolerance: bitwise on the mesh that saved (same shards, kernels and reduction order); "
                  f"relative {RTOL:.0e} on other meshes (TP and DP change the order of floating-point sums)")
    for v in verdicts:
        console.print(("  [green]ok[/] " if v.ok else "  [red bold]FAIL[/] ") + v.describe())

    loss_png = os.path.join(out, "loss_curves.png")
    draw_losses(loss_png, base_label, base, resumed, resume, saves)
    plan_png = os.path.join(out, "plan.png")
    _draw_plan(store_url, f"{RUN}@{resume}", plan_png)
    console.print(f"wrote {_show_path(loss_png)} and {_show_path(plan_png)}")

    from .tour import tour

    tour(console, store_url, RUN, resume, plan_topology(PLAN_KEY))
    wall = time.perf_counter() - t_start
    console.print(f"\ndemo finished in {wall:.0f} s (training runs: "
                  + ", ".join(f"{k} {w:.0f} s" for k, w in walls.items()) + ")")
    bad = [v for v in verdicts if not v.ok]
    if bad:
        raise DemoError("resumed run diverged beyond its tolerance: " + "; ".join(v.describe() for v in bad))
    console.print(f"[green bold]every resumed run matches the uninterrupted one[/] "
                  f"(explore: ucp --store {shlex.quote(_show_path(store_url))} ls)")
    return 0


def _report_run(console, job: dict, info: dict, wall: float) -> None:
    bits = [f"{wall:.1f} s"]
    if "load_s" in info:
        bits.append(f"load {info['load_s']:.2f} s")
    for s in info.get("saves", []):
        bits.append(f"{s['kind']} save at {s['step']} blocked {s['blocked_s']:.2f} s")
    if "verify" in info:
        bits.append(f"verify: {_verify_text(info['verify'])}")
    if info.get("perturbed"):
        bits.append(f"[red]perturbed on purpose: {info['perturbed']}[/]")
    console.print("      " + "; ".join(bits))


def _verify_text(report) -> str:
    if isinstance(report, dict):
        if "ok" in report:
            return "loaded state equals the checkpoint" if report["ok"] else f"DIFFERS: {report}"
    if isinstance(report, list):
        return "loaded state equals the checkpoint" if not report else f"{len(report)} differences: {report[:3]}"
    return str(report)


class _NoProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _progress(console, enabled: bool):
    from ..progress import wanted

    if not wanted(enabled):
        return _NoProgress()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=False)


def _draw_plan(store_url: str, ref: str, path: str) -> None:
    """plan.png through `ucp plan --plot`'s drawing: which chunks each rank of the PLAN_KEY mesh reads."""
    from .. import open_store
    from ..plan_cli import draw_plan
    from ..planner import plan as make_plan

    store = open_store(store_url)
    ck = store.checkpoint(ref)
    topo = plan_topology(PLAN_KEY)
    infos = ck.tensors()
    plans = [make_plan(infos, topo, r) for r in range(topo.world_size)]
    draw_plan(ck, plans, None, path)
