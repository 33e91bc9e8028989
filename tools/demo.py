"""The main job, end to end, on this machine's CPUs (real DeepSpeed, 2 gloo processes):

1. train a small model with DeepSpeed ZeRO-2 (bf16) on DP=2, save a checkpoint, keep training to
   record the uninterrupted loss curve, and convert the checkpoint with ds_to_universal for comparison;
2. ``ucp import deepspeed`` the ZeRO tag folder straight into a store (no conversion step), and
   ``ucp import deepspeed-universal`` DeepSpeed's own universal folder next to it;
3. inspect: ``ucp ls``, ``show``, ``stats``, ``verify``, and ``diff`` ours against DeepSpeed's (all same);
4. plan the load into other topologies (``ucp plan``, with pictures of which rank reads which chunks),
   for the DeepSpeed model and for a Llama-like layer with tensor-parallel patterns (TP 2 -> 3);
5. ``ucp export deepspeed-universal`` and resume DeepSpeed from it at DP=1 and DP=2; compare the
   losses with the uninterrupted run and draw them (demo-out/losses.png).

    bash tools/demo.sh            # installs, then runs this
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "demo-out")
PY = sys.executable
STEPS, NEXT = 6, 6


def sh(*cmd: str, env: dict | None = None) -> str:
    print("$", " ".join(cmd), flush=True)
    res = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, text=True, capture_output=True)
    if res.stdout.strip():
        print(res.stdout.rstrip())
    if res.returncode != 0:
        print(res.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"demo step failed: {' '.join(cmd)}")
    return res.stdout


def torchrun(nproc: int, jobs: list[dict]) -> None:
    path = os.path.join(OUT, f"jobs-{len(os.listdir(OUT))}.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    sh(PY, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port", "29611",
       os.path.join(ROOT, "tools", "ds_train.py"), "--jobs", path, env={"DS_ACCELERATOR": "cpu"})


def ucp(*args: str) -> str:
    return sh(os.path.join(os.path.dirname(PY), "ucp"), "--store", os.path.join(OUT, "store"), *args)


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    os.environ.setdefault("UCP_PROGRESS", "0")
    ds = os.path.join(OUT, "ds")
    tag = f"global_step{STEPS}"
    model = {"model": "mlp", "zero": 2, "dtype": "bf16", "seed": 1234}

    print("\n== 1. train with DeepSpeed ZeRO-2 bf16 on DP=2, save, continue, convert with ds_to_universal ==")
    torchrun(2, [{**model, "kind": "train", "steps": STEPS, "next_steps": NEXT, "save_dir": ds, "tag": tag,
                  "convert": True, "out": os.path.join(OUT, "train.json")}])

    print("\n== 2. import the ZeRO folder directly, and DeepSpeed's universal folder for comparison ==")
    ucp("init")
    ucp("import", "deepspeed", os.path.join(ds, tag), "--run", "demo")
    ucp("import", "deepspeed-universal", os.path.join(ds, f"{tag}_universal"), "--run", "ds-universal",
        "--step", str(STEPS))

    print("\n== 3. inspect ==")
    ucp("ls")
    ucp("show", "demo@latest")
    ucp("stats", "demo@latest")
    ucp("verify", "demo@latest")
    diff = json.loads(ucp("diff", "demo@latest", "ds-universal@latest", "--json"))
    mine = {(r["name"], r["state"]) for r in diff}
    shared = [r for r in diff if r["status"] in ("same", "changed")]
    changed = [r for r in shared if r["status"] == "changed"]
    print(f"ours vs ds_to_universal: {len(shared) - len(changed)} of {len(shared)} shared tensor-states are "
          f"bit-identical; {len(mine) - len(shared)} only on one side (frozen weights / buffers we also keep)")
    if changed:
        raise SystemExit(f"import differs from ds_to_universal: {changed[:3]}")

    print("\n== 4. plan loads into other topologies ==")
    ucp("plan", "demo@latest", "--dp", "4", "--zero", "2")
    ucp("plan", "demo@latest", "--dp", "3", "--zero", "1", "--plot", os.path.join(OUT, "plan.png"))
    # the same on a Llama-like layer with tensor-parallel patterns (vocab-padded embedding, fused QKV with
    # GQA, fused SwiGLU with uneven widths for tp=3), written shard by shard from TP=2 ranks with chunks
    # aligned to the declared targets TP=4 and TP=3: each target rank reads whole chunks of its own
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_reshard import write_store

    from ucp_store.topology import Topology

    write_store(os.path.join(OUT, "store"), Topology(tp=2), [Topology(tp=4), Topology(tp=3)], layers=1,
                run="llama", create=False)
    ucp("plan", "llama@1", "--tp", "3", "--param", "layers.0.mlp.gate_up.weight", "--plot",
        os.path.join(OUT, "plan-tp3.png"))

    print("\n== 5. export a universal folder and resume DeepSpeed from it at DP=1 and DP=2 ==")
    export = os.path.join(OUT, "export")
    ucp("export", "deepspeed-universal", "demo@latest", export, "--tag", "resumed")
    torchrun(1, [{**model, "kind": "resume", "load_dir": export, "tag": "resumed", "steps": NEXT,
                  "out": os.path.join(OUT, "resume-dp1.json")}])
    torchrun(2, [{**model, "kind": "resume", "load_dir": export, "tag": "resumed", "steps": NEXT,
                  "out": os.path.join(OUT, "resume-dp2.json")}])

    train = json.load(open(os.path.join(OUT, "train.json")))
    dp1 = json.load(open(os.path.join(OUT, "resume-dp1.json")))["losses"]
    dp2 = json.load(open(os.path.join(OUT, "resume-dp2.json")))["losses"]
    before, cont = train["losses_before"], train["losses"]
    print(f"\n{'step':>5}{'uninterrupted':>15}{'resumed DP=2':>14}{'resumed DP=1':>14}")
    for i, (a, b, c) in enumerate(zip(cont, dp2, dp1)):
        print(f"{STEPS + i + 1:5d}{a:15.6f}{b:14.6f}{c:14.6f}")
    worst = max(max(abs(a - b), abs(a - c)) / max(abs(a), 1e-12) for a, b, c in zip(cont, dp2, dp1))
    print(f"largest relative loss difference after resuming: {worst:.2e}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(1, STEPS + 1))
    ax.plot(xs, before, "k.-", label="trained (DP=2, ZeRO-2)")
    nx = list(range(STEPS + 1, STEPS + NEXT + 1))
    ax.plot(nx, cont, "k--", label="uninterrupted")
    ax.plot(nx, dp2, "o", mfc="none", label="resumed from ucp export, DP=2")
    ax.plot(nx, dp1, "x", label="resumed from ucp export, DP=1")
    ax.axvline(STEPS + 0.5, color="grey", lw=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("DeepSpeed resumes from a ucp_store export at another DP degree")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "losses.png"), dpi=110)
    print(f"\ndrew {', '.join(os.path.join(OUT, f) for f in ('losses.png', 'plan.png', 'plan-tp3.png'))}")


if __name__ == "__main__":
    main()
