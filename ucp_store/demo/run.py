"""``ucp demo``: train in parallel, save through ``ucp_store.distributed``, resume on other meshes, prove it.

1. Train the demo GPT (`model.py`) on generated text (`text.py`) in 4 spawned gloo processes, TP=2 x
   DP=2 (tensor parallelism x FSDP2), saving every `steps // 4` steps; the second save is an
   `async_save` (training goes on while it writes) and is the one the other runs resume from. This run
   goes on to the end uninterrupted: it is the reference.
2. Resume from that checkpoint on TP=2 x DP=2 again (bitwise), TP=1 x DP=4, TP=2 x DP=1 and one process
   with no process group (relative bound; `report.py` says why), each checking with `ucp_store.distributed.verify`
   that its live state is the stored one before training on. Each DP rank's data position
   (`text.Sampler`) is per-rank state in every save: on TP=2 x DP=2 each rank gets its own back (the
   default policy, bit for bit); on the other meshes DP changes, so the load declares
   ``per_rank={"sampler": reshard(text.resplit)}``, which re-splits the saved positions over the new DP
   ranks (no sample read twice or skipped). A mesh that changed only TP would use ``"by-coordinate:dp"``.
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

from ucp_store.demo.procs import DemoError, run_job
from ucp_store.demo.report import RTOL, compare, draw_losses, print_table
from ucp_store.errors import ConfigurationError

__all__ = ["DEFAULT_STEPS", "RUNS", "plan_topology", "run_demo"]

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
# The embedding, the one tensor big enough (8192 x 40 fp32, 1.25 MiB) for the store's 1 MiB chunk target to
# split it; the smaller tensors are one chunk each, which every rank that needs any of it reads whole.
PLAN_PARAM = "tok_embeddings.weight"


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


def _label(key: str) -> str:
    return next(label for k, label, *_ in RUNS if k == key)


def plan_topology(key: str):
    """The planner's `Topology` for a demo mesh."""
    from ucp_store.topology import Topology

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

    from rich.markup import escape

    from ucp_store import open_store
    from ucp_store.demo.model import ModelConfig

    # a character vocabulary of 32 in an 8192-row embedding: big enough to be chunked (see PLAN_PARAM)
    cfg = ModelConfig(seq=32, vocab=8192)
    open_store(store_url, create=True)
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump({"steps": steps, "saves": saves, "resume": resume, "cfg": cfg.to_json()}, f, indent=1)
    from ucp_store.demo.worker import pick_device

    device = pick_device(max(tp * dp for _, _, tp, dp, _ in RUNS))
    common = {"store": store_url, "run": RUN, "cfg": cfg.to_json(), "seed": 0, "lr": 1e-2, "timeout_s": 120,
              "device": device}

    console.print(f"[bold]ucp demo[/]: a {cfg.layers}-layer GPT on generated text, trained in real torch.distributed "
                  f"processes ({'NCCL on GPUs' if device == 'cuda' else 'gloo on CPUs'}), "
                  f"saved through ucp_store.distributed into {_show_path(store_url)}")
    save_txt = ", ".join(f"{s}{' (async_save)' if k == 'async' else ''}" for s, k in sorted(saves.items()))
    # (what, the RUNS entry, start step, load reference, {step: save kind})
    plan: list[tuple[str, tuple[str, str, int, int, str], int, str | None, dict[int, str]]] = \
        [("train", RUNS[0], 0, None, saves)] + [("resume", r, resume, f"{RUN}@{resume}", {}) for r in RUNS]
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
                   "perturb": what == "resume" and key == perturb,
                   # each DP rank's sampler position is per-rank state: its own back on the mesh that saved,
                   # re-split over the new DP ranks (text.resplit, a reshard policy) on the others
                   "per_rank": "same" if key == RUNS[0][0] else "reshard",
                   "boxes_of": PLAN_PARAM if what == "resume" and key == PLAN_KEY else None}
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

    with open(os.path.join(out, MARKER), "w") as f:  # the figures, for whoever explores DIR afterwards
        json.dump({"steps": steps, "saves": saves, "resume": resume, "cfg": cfg.to_json(), "rtol": RTOL,
                   "losses": {"uninterrupted": base, **{k: results[k][0] for k, *_ in RUNS}},
                   "verdicts": {v.key: {"rule": v.rule, "ok": v.ok, "max_abs": v.max_abs, "max_rel": v.max_rel}
                                for v in verdicts},
                   "runs": {k: {**{a: b for a, b in results[k][1].items() if a != "boxes"}, "wall_s": walls[k]}
                            for k in results}}, f, indent=1)
    loss_png = os.path.join(out, "loss_curves.png")
    draw_losses(loss_png, base_label, base, resumed, resume, saves)
    plan_png = os.path.join(out, "plan.png")
    drawn = _draw_plan(store_url, f"{RUN}@{resume}", plan_png, results[PLAN_KEY][1]["boxes"])
    console.print(f"wrote {_show_path(loss_png)} and {_show_path(plan_png)} (the chunks of {escape(drawn)} each "
                  f"rank of resumed {_label(PLAN_KEY)} read)")

    from ucp_store.demo.tour import tour

    tour(args.ucp_main, console, store_url, RUN, resume, plan_topology(PLAN_KEY),
         loaded=(_label(PLAN_KEY), results[PLAN_KEY][1]))
    wall = time.perf_counter() - t_start
    console.print(f"\ndemo finished in {wall:.0f} s (training runs: "
                  + ", ".join(f"{k} {w:.0f} s" for k, w in walls.items()) + ")")
    unverified = [k for k, _, *_ in RUNS if not results[k][1]["verify"]["ok"]]
    if unverified:
        raise DemoError(f"ucp_store.distributed.verify found the loaded state of resumed run(s) {unverified} different "
                        f"from the checkpoint: " + "; ".join(results[k][1]["verify"]["text"] for k in unverified))
    bad = [v for v in verdicts if not v.ok]
    if bad:
        raise DemoError("resumed run diverged beyond its tolerance: " + "; ".join(v.describe() for v in bad))
    console.print(f"[green bold]every resumed run matches the uninterrupted one[/] "
                  f"(explore: ucp --store {shlex.quote(_show_path(store_url))} ls)")
    return 0


def _report_run(console, job: dict, info: dict, wall: float) -> None:

    bits = [f"{wall:.1f} s"]
    if "load_s" in info:
        bits.append(f"load {info['load_s']:.2f} s, {info.get('bytes_read', 0) / 1024:.0f} KiB read by rank 0")
    for s in info.get("saves", []):
        bits.append(f"{s['kind']} save at {s['step']} blocked {s['blocked_s']:.2f} s")
    if "verify" in info:
        bits.append(f"verify: {_verify_text(info['verify'])}")
    if info.get("perturbed"):
        bits.append(f"[red]perturbed on purpose: {info['perturbed']}[/]")
    console.print("      " + "; ".join(bits))
    if info.get("per_rank"):  # rank 0's per-rank restore (its sampler position), on a line of its own
        from rich.markup import escape

        console.print(f"      per-rank state of rank 0: {escape('; '.join(info['per_rank']))}")


def _verify_text(report: dict) -> str:
    from rich.markup import escape

    return "the live state equals the checkpoint, bit for bit" if report["ok"] else f"[red]{escape(report['text'])}[/]"


class _NoProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _progress(console, enabled: bool):
    from ucp_store.progress import wanted

    if not wanted(enabled):
        return _NoProgress()
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), console=Console(stderr=True))


class _Read:
    def __init__(self, box) -> None:
        from types import SimpleNamespace

        self.box = SimpleNamespace(ranges=tuple(tuple(b) for b in box))


class _RankReads:
    """What `cli.plot.draw_plan` reads from a plan: rank, coords and the boxes per tensor-state."""

    def __init__(self, rank: int, coords: dict, name: str, state: str, boxes: list) -> None:
        from types import SimpleNamespace

        self.rank, self.coords = rank, coords
        self.tensors = [SimpleNamespace(name=name, state=state, reads=[_Read(b) for b in boxes])]


def _draw_plan(store_url: str, ref: str, path: str, boxes: list[dict]) -> str:
    """plan.png with `ucp plan --plot`'s drawing: the chunks each rank of the PLAN_KEY mesh read on its load.

    The boxes come from the resumed ranks' live DTensors (what `ucp_store.distributed.load` read for them); the
    chunk grid is the stored array's. Returns the tensor drawn."""
    from ucp_store import open_store
    from ucp_store.cli.plot import draw_plan

    ck = open_store(store_url).checkpoint(ref)
    param = boxes[0]["param"]
    cands = [i for i in ck.tensors() if i.name == param]
    if not cands:
        raise DemoError(f"plan.png: checkpoint {ref} has no tensor named {param!r}")
    info = next((i for i in cands if i.state == "fp32"), cands[0])  # the state draw_plan picks
    plans = [_RankReads(r, b["coords"], info.name, info.state, b["boxes"]) for r, b in enumerate(boxes)]
    draw_plan(ck, plans, info.name, path)
    return f"{info.name} [{info.state}]"
