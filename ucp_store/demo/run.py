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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ucp_store.demo.procs import DemoError, run_job
from ucp_store.demo.report import RTOL, Verdict, compare, draw_losses, print_table
from ucp_store.errors import ConfigurationError

if TYPE_CHECKING:
    from ucp_store.demo.model import ModelConfig

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


def make_console():
    from rich.console import Console

    width = shutil.get_terminal_size((140, 40)).columns if sys.stdout.isatty() else 140
    return Console(width=max(120, width), highlight=False)


def prepare_dir(path: str) -> None:
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


@dataclass(frozen=True, slots=True)
class _Setup:
    """The demo's folder, schedule and the settings every job shares, fixed before the first process starts."""

    steps: int
    perturb: str | None               # the resumed run to perturb on purpose (a test of the verdicts)
    out: str                          # the demo folder (--dir), absolute
    store_url: str
    resume: int                       # the step the resumed runs load
    saves: dict[int, str]             # step -> "sync" / "async"
    cfg: ModelConfig
    device: str
    common: dict[str, Any]            # the job settings every run shares


@dataclass(frozen=True, slots=True)
class _Stage:
    """One training process group of the demo: the uninterrupted reference or a resumed run."""

    what: str                                 # "train" or "resume"
    run: tuple[str, str, int, int, str]       # its RUNS entry
    start: int                                # the step it starts after
    load: str | None                          # the checkpoint it loads
    saves: dict[int, str]                     # the steps it saves at, and how

    @property
    def name(self) -> str:
        label = self.run[1]
        return f"{label} uninterrupted" if self.what == "train" else f"resumed {label}"


@dataclass(slots=True)
class _Runs:
    """What the runs returned, by job key ("ref" for the reference): (losses, info), and their wall times."""

    results: dict[str, tuple[dict[int, float], dict[str, Any]]] = field(default_factory=dict)
    walls: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)   # the demo's phases' seconds (``run_demo``)
    plan: dict[str, Any] = field(default_factory=dict)        # what plan.png drew (``cli.plot.Drawn``)


@dataclass(frozen=True, slots=True)
class _Comparison:
    """The reference's losses, each resumed run's, and the verdict of each against the reference."""

    base_label: str
    base: dict[int, float]
    resumed: list[tuple[str, dict[int, float]]]
    verdicts: list[Verdict]


def _check_args(args: Any) -> None:
    """Refuse what the demo cannot do, naming the flag."""
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


def _saves(steps: int) -> tuple[int, dict[int, str]]:
    """The resume step and the reference's saves: every ``steps // 4`` steps, the resumed-from one async."""
    every = steps // 4
    resume = 2 * every
    saves = {s: ("async" if s == resume else "sync") for s in range(every, steps + 1, every)}
    saves[steps] = saves.get(steps, "sync")
    return resume, saves


def _create_store(args: Any, out: str, resume: int, saves: dict[int, str]) -> _Setup:
    """Create the demo's store and marker file, and pick the device the runs train on."""
    from ucp_store import open_store
    from ucp_store.demo.model import ModelConfig

    store_url = os.path.join(out, "store")
    # a character vocabulary of 32 in an 8192-row embedding: big enough to be chunked (see PLAN_PARAM)
    cfg = ModelConfig(seq=32, vocab=8192)
    open_store(store_url, create=True)
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump({"steps": args.steps, "saves": saves, "resume": resume, "cfg": cfg.to_json()}, f, indent=1)
    from ucp_store.demo.worker import pick_device

    device = pick_device(max(tp * dp for _, _, tp, dp, _ in RUNS))
    common = {"store": store_url, "run": RUN, "cfg": cfg.to_json(), "seed": 0, "lr": 1e-2, "timeout_s": 120,
              "device": device}
    return _Setup(args.steps, getattr(args, "perturb", None), out, store_url, resume, saves, cfg, device, common)


def _stages(setup: _Setup) -> list[_Stage]:
    """The reference run, then one resumed run per RUNS entry (the reference's mesh first)."""
    return ([_Stage("train", RUNS[0], 0, None, setup.saves)]
            + [_Stage("resume", r, setup.resume, f"{RUN}@{setup.resume}", {}) for r in RUNS])


def _announce(console: Any, i: int, n: int, stage: _Stage, setup: _Setup) -> None:
    _, label, tp, dp, _ = stage.run
    world = tp * dp
    if stage.what == "train":
        save_txt = ", ".join(f"{s}{' (async_save)' if k == 'async' else ''}" for s, k in sorted(setup.saves.items()))
        console.print(f"[{i}/{n}] train on {label} ({world} processes), steps 1-{setup.steps}, "
                      f"saving at steps {save_txt}")
    else:
        console.print(f"[{i}/{n}] resume {stage.load} on {label} ({world} process{'es' if world > 1 else ''}"
                      f"{', no process group' if world == 1 else ''}), verify the loaded state, "
                      f"train steps {stage.start + 1}-{setup.steps}")


def _job(setup: _Setup, stage: _Stage) -> dict[str, Any]:
    """The settings `demo.worker` runs one stage with."""
    key, _, tp, dp, _ = stage.run
    resumed = stage.what == "resume"
    return {**setup.common, "key": ("ref" if not resumed else key), "label": stage.name, "tp": tp, "dp": dp,
            "start": stage.start, "end": setup.steps, "load": stage.load,
            "saves": {str(s): k for s, k in stage.saves.items()},
            "perturb": resumed and key == setup.perturb,
            # each DP rank's sampler position is per-rank state: its own back on the mesh that saved,
            # re-split over the new DP ranks (text.resplit, a reshard policy) on the others
            "per_rank": "same" if key == RUNS[0][0] else "reshard",
            "boxes_of": PLAN_PARAM if resumed and key == PLAN_KEY else None}


def _run_stages(setup: _Setup, console: Any, show_progress: bool) -> _Runs:
    """Run the reference, then every resumed run, one process group at a time."""
    stages = _stages(setup)
    runs = _Runs()
    with _progress(console, show_progress) as progress:
        for i, stage in enumerate(stages, 1):
            _announce(console, i, len(stages), stage, setup)
            job = _job(setup, stage)
            world = job["tp"] * job["dp"]
            task = (progress.add_task(stage.name, total=setup.steps - stage.start, loss="")
                    if progress is not None else None)
            t0 = time.perf_counter()
            runs.results[job["key"]] = run_job(job, world, progress=progress, task=task)
            runs.walls[job["key"]] = time.perf_counter() - t0
            _report_run(console, job, runs.results[job["key"]][1], runs.walls[job["key"]])
    return runs


def _compare_runs(runs: _Runs, console: Any) -> _Comparison:
    """Print the losses side by side and each resumed run's verdict against the reference."""
    results = runs.results
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
    return _Comparison(base_label, base, resumed, verdicts)


def _marker(setup: _Setup, runs: _Runs, cmp: _Comparison) -> None:
    """The marker file with every figure (losses, verdicts, runs, the phases' seconds, what plan.png drew), for
    whoever explores DIR afterwards (and the tests)."""
    results = runs.results
    with open(os.path.join(setup.out, MARKER), "w") as f:
        json.dump({"steps": setup.steps, "saves": setup.saves, "resume": setup.resume, "cfg": setup.cfg.to_json(),
                   "rtol": RTOL, "losses": {"uninterrupted": cmp.base, **{k: results[k][0] for k, *_ in RUNS}},
                   "verdicts": {v.key: {"rule": v.rule, "ok": v.ok, "max_abs": v.max_abs, "max_rel": v.max_rel}
                                for v in cmp.verdicts},
                   "runs": {k: {**{a: b for a, b in results[k][1].items() if a != "boxes"}, "wall_s": runs.walls[k]}
                            for k in results},
                   "phases_s": runs.phases, "plan": runs.plan}, f, indent=1)


def _write_figures(setup: _Setup, runs: _Runs, cmp: _Comparison, console: Any) -> None:
    """loss_curves.png and plan.png (what it drew goes to ``runs.plan``)."""
    from rich.markup import escape

    loss_png = os.path.join(setup.out, "loss_curves.png")
    draw_losses(loss_png, cmp.base_label, cmp.base, cmp.resumed, setup.resume, setup.saves)
    plan_png = os.path.join(setup.out, "plan.png")
    drawn = _draw_plan(setup.store_url, f"{RUN}@{setup.resume}", plan_png, runs.results[PLAN_KEY][1]["boxes"])
    runs.plan = drawn.to_json()
    console.print(f"wrote {_show_path(loss_png)} and {_show_path(plan_png)} (the chunks of {escape(drawn.label)} "
                  f"{list(drawn.shape)} each rank of resumed {_label(PLAN_KEY)} read: "
                  + ", ".join(f"rank {r} {n}" for r, n in zip(drawn.ranks, drawn.chunks_read))
                  + f" of its {_chunk_count(drawn)} chunks)")


def _chunk_count(drawn) -> int:
    import math

    return math.prod(-(-s // max(c, 1)) for s, c in zip(drawn.shape, drawn.chunk_shape))


def _conclude(setup: _Setup, runs: _Runs, cmp: _Comparison, console: Any) -> None:
    """Report the wall time and each phase's, then fail on a resumed run whose loaded state or losses are off."""
    results = runs.results
    phases = runs.phases
    console.print(f"\ndemo finished in {phases['total']:.0f} s (training runs: "
                  + ", ".join(f"{k} {w:.0f} s" for k, w in runs.walls.items())
                  + "; " + ", ".join(f"{k} {phases[k]:.1f} s" for k in ("setup", "compare", "figures", "tour"))
                  + ")")
    unverified = [k for k, _, *_ in RUNS if not results[k][1]["verify"]["ok"]]
    if unverified:
        raise DemoError(f"ucp_store.distributed.verify found the loaded state of resumed run(s) {unverified} different "
                        f"from the checkpoint: " + "; ".join(results[k][1]["verify"]["text"] for k in unverified))
    bad = [v for v in cmp.verdicts if not v.ok]
    if bad:
        raise DemoError("resumed run diverged beyond its tolerance: " + "; ".join(v.describe() for v in bad))
    console.print(f"[green bold]every resumed run matches the uninterrupted one[/] "
                  f"(explore: ucp --store {shlex.quote(_show_path(setup.store_url))} ls)")


def run_demo(args: Any) -> int:
    """Everything `ucp demo` does (see the module docstring); returns 0, or raises DemoError.

    The phases: check the flags, prepare the folder and store, run the reference and the resumed runs,
    compare them, write the figures, tour the store with the `ucp` commands, then give the verdict."""
    _check_args(args)
    out = os.path.abspath(args.dir)
    prepare_dir(out)
    console = make_console()
    resume, saves = _saves(args.steps)
    t_start = t = time.perf_counter()
    phases: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        phases[name], t = now - t, now

    setup = _create_store(args, out, resume, saves)
    console.print(f"[bold]ucp demo[/]: a {setup.cfg.layers}-layer GPT on generated text, trained in real "
                  f"torch.distributed processes ({'NCCL on GPUs' if setup.device == 'cuda' else 'gloo on CPUs'}), "
                  f"saved through ucp_store.distributed into {_show_path(setup.store_url)}")
    lap("setup")
    runs = _run_stages(setup, console, not getattr(args, "no_progress", False))
    runs.phases = phases
    lap("runs")
    cmp = _compare_runs(runs, console)
    lap("compare")
    _write_figures(setup, runs, cmp, console)
    lap("figures")

    from ucp_store.demo.tour import tour

    tour(args.ucp_main, console, setup.store_url, RUN, resume, plan_topology(PLAN_KEY),
         loaded=(_label(PLAN_KEY), runs.results[PLAN_KEY][1]))
    lap("tour")
    phases["total"] = time.perf_counter() - t_start
    _marker(setup, runs, cmp)
    _conclude(setup, runs, cmp, console)
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


def _draw_plan(store_url: str, ref: str, path: str, boxes: list[dict]):
    """plan.png with `ucp plan --plot`'s drawing (`cli.plot.draw_boxes`): the chunks each rank of the PLAN_KEY
    mesh read on its load, of the parameter's state by the one rule (`records.main_state`: its weight).

    The boxes come from the resumed ranks' live DTensors (what `ucp_store.distributed.load` read for them); the
    chunk grid is the stored array's. Returns what was drawn (`cli.plot.Drawn`)."""
    from ucp_store import open_store
    from ucp_store.cli.plot import Panel, draw_boxes, pick_tensor
    from ucp_store.errors import UcpError

    ck = open_store(store_url).checkpoint(ref)
    try:
        info = pick_tensor(ck.tensors(), boxes[0]["param"], flag="plan.png: parameter")
    except UcpError as exc:
        raise DemoError(f"plan.png: checkpoint {ref}: {exc}") from None
    panels = [Panel(r, b["coords"], b["boxes"]) for r, b in enumerate(boxes)]
    return draw_boxes(info, panels, path)
