"""A real DCP client through the ucp backend (issue 29 item 4): torchtune 0.6.1's own distributed recipe.

    .venv/bin/python tools/run_dcp_client.py            # installs the side packages when missing, then runs
    .venv/bin/python tools/run_dcp_client.py --steps 4 --keep /tmp/client-run

The client is torchtune's ``recipes/full_finetune_distributed.py`` (``FullFinetuneRecipeDistributed``:
FSDP2 via ``training.shard_model``, TP via ``parallelize_module`` and ``base_llama_tp_plan``), unchanged,
on CPU with gloo ranks started by torchrun. With ``enable_async_checkpointing`` its ``CheckpointClient``
saves each intermediate epoch through ``DistributedCheckpointer`` (``dcp.async_save``) and resumes with
``dcp.load``. That checkpointer hard-codes ``FileSystemWriter(path)`` / ``FileSystemReader(path)`` and finds
the latest save by looking for DCP's ``.metadata`` file, so the harness substitutes the backend with one
line, :func:`install` (the client has no hook), never touching the library or torchtune:

- ``FileSystemWriter(".../dist_epoch_N", ...)`` -> ``UcpStorageWriter(STORE, "torchtune", N)``;
- ``FileSystemReader(".../dist_epoch_N")`` -> ``UcpStorageReader(STORE, "torchtune@N")``;
- the latest intermediate checkpoint -> the newest committed step of run ``torchtune`` in the store.

The debug model is ``torchtune.models.llama3.llama3`` with tiny dimensions, the data a seeded synthetic
token set (:func:`synthetic_dataset`, no hub download), the tokenizer a stand-in that only gives
``pad_id``. Runs (an epoch is ``--steps`` optimizer steps, two epochs in all):

1. ``reference``: FSDP=2, both epochs without a stop (it saves epoch 0 too, into its own store);
2. ``cut``: FSDP=2, stops once epoch 0's save has committed (a crash after the checkpoint);
3. ``resume``: FSDP=2, resumes from the store and runs epoch 1: its losses must equal the reference's
   bit for bit (``float.hex``);
4. ``resume-1rank``: 1 rank, twice the per-rank batch (the same samples per step), resumes the FSDP=2 save;
5. ``resume-tp2``: TP=2 on 2 ranks, twice the per-rank batch, resumes the FSDP=2 save.

Runs 4 and 5 sum gradients in another order, so their losses only come close to the reference's
(``--rtol``). The exit status is 0 when every check holds. torchtune's dependencies go into a folder of
their own (``--lib``, default ``~/.cache/ucp_store/dcp-client/lib``) with ``pip install --target --no-deps``,
so the project's environment and its torch stay as they are; the runs see it through ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_LIB = Path.home() / ".cache" / "ucp_store" / "dcp-client" / "lib"
RUN = "torchtune"

# torchtune 0.6.1 and what it imports, pinned to the versions this harness ran with. torchao 0.13 is the
# newest that still has ``torchao.dtypes.nf4tensor`` (torchtune imports it at module level); torch itself
# is never installed here: the runs use the project's.
SIDE_PACKAGES = [
    "torchtune==0.6.1", "torchdata==0.11.0", "torchao==0.13.0", "omegaconf==2.4.0",
    "antlr4-python3-runtime==4.9.3", "datasets==5.2.0", "pyarrow==26.0.1", "dill==0.4.1",
    "multiprocess==0.70.19", "pandas==3.1.1", "python-dateutil==4.0.0", "pytz==2026.6", "tzdata==2026.6",
    "sentencepiece==0.2.3", "tiktoken==0.14.0", "blobfile==3.3.0", "kagglehub==1.0.3",
]


# ------------------------------------------------------------------------------------------ in the ranks
def install(store: str | os.PathLike | None = None) -> None:
    """Put the ucp backend under torchtune's ``DistributedCheckpointer`` in this process (see the module doc).

    ``store``: the store's folder or URL; default ``$UCP_CLIENT_STORE``. Call it before the recipe runs."""
    import torchtune.training.checkpointing._checkpointer as ckpt

    from ucp_store.formats.dcp.storage import UcpStorageReader, UcpStorageWriter

    where = os.fspath(store or os.environ["UCP_CLIENT_STORE"])

    def epoch_of(path: str | os.PathLike) -> int:
        m = re.fullmatch(r"dist_epoch_(\d+)", Path(path).name)
        if m is None:
            raise ValueError(f"checkpoint path: expected .../dist_epoch_N (torchtune's naming), got {path}")
        return int(m.group(1))

    def writer(path: str | os.PathLike, **_filesystem_options: Any) -> UcpStorageWriter:
        # the group DCP saves on (see _checkpoint_group), so the writer bounds that group's timeout
        return UcpStorageWriter(where, RUN, epoch_of(path), process_group=_CHECKPOINT_GROUP.get("group"))

    def reader(path: str | os.PathLike) -> UcpStorageReader:
        return UcpStorageReader(where, f"{RUN}@{epoch_of(path)}")

    def latest(self: Any) -> str | None:
        from ucp_store.store import open_store

        if not Path(where).exists():
            return None
        steps = [c["step"] for c in open_store(where).list_checkpoints() if c["run"] == RUN]
        return str(Path(self._output_dir) / f"dist_epoch_{max(steps)}") if steps else None

    ckpt.FileSystemWriter, ckpt.FileSystemReader = writer, reader  # type: ignore[assignment]
    ckpt.DistributedCheckpointer._get_latest_intermediate_checkpoint = latest  # type: ignore[method-assign]


_CHECKPOINT_GROUP: dict[str, Any] = {}


def _checkpoint_group() -> None:
    """Give torchtune's ``DistributedCheckpointer`` a gloo group of its own, as it has on GPUs.

    ``async_save`` runs DCP's collectives (plan gather, result gather, commit broadcast) in a thread while
    the next epoch trains. On GPUs the recipe's group is ``cuda:nccl,cpu:gloo``: FSDP talks over NCCL and
    DCP over gloo, so the two never meet (``async_save`` refuses a group without a CPU backend). On a
    CPU-only run both go over the one gloo group from two threads, in an order that differs between
    ranks, and the ranks wait on each other until a timeout (observed through the backend: FSDP's
    all-gather timed out on both ranks after the writer's 300 s; DCP's ``FileSystemWriter`` is saved
    through the same collectives, not tried: gloo's default wait is 30 minutes). ``DistributedCheckpointer`` takes a
    ``process_group`` but ``CheckpointClient`` never passes one; here it gets a new gloo group, made
    collectively when the client first builds its checkpointer (at the first save or load, on every rank)."""
    import torch.distributed as dist
    import torchtune.training.checkpointing._checkpointer as ckpt

    init = ckpt.DistributedCheckpointer.__init__

    def init_with_group(self: Any, checkpoint_dir: str, output_dir: str, process_group: Any = None) -> None:
        if process_group is None:
            process_group = _CHECKPOINT_GROUP.setdefault("group", dist.new_group(backend="gloo"))
        init(self, checkpoint_dir, output_dir, process_group=process_group)

    ckpt.DistributedCheckpointer.__init__ = init_with_group  # type: ignore[method-assign]


class ByteTokenizer:
    """The recipe asks its tokenizer only for ``pad_id`` (the data comes tokenised)."""

    pad_id = 0
    max_seq_len = None


def synthetic_dataset(tokenizer: Any, samples: int = 64, seq_len: int = 32, vocab: int = 256,
                      seed: int = 0) -> list[dict[str, list[int]]]:
    """A map-style data set of seeded random token rows (labels = tokens; the recipe shifts them)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, vocab, (samples, seq_len), generator=g).tolist()
    return [{"tokens": r, "labels": list(r)} for r in rows]


class LossLog:
    """A torchtune metric logger (rank 0) that keeps each step's loss exactly: ``float.hex`` per line."""

    def __init__(self, path: str):
        self.path = path

    def log_config(self, cfg: Any) -> None:
        pass

    def log(self, name: str, data: Any, step: int) -> None:
        self.log_dict({name: data}, step)

    def log_dict(self, payload: dict, step: int) -> None:
        if "loss" in payload:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "loss": float(payload["loss"]).hex()}) + "\n")

    def close(self) -> None:
        pass


def _stop_after_first_save() -> None:
    """The ``cut`` run: once epoch 0's save has committed on every rank, leave as a crash would (no final
    save, nothing of epoch 1)."""
    import torch.distributed as dist
    import torchtune.training.checkpointing._checkpointer as ckpt

    save = ckpt.DistributedCheckpointer.save_checkpoint

    def save_then_stop(self: Any, *args: Any, **kwargs: Any) -> None:
        save(self, *args, **kwargs)
        if self._checkpoint_future is not None:
            self._checkpoint_future.result()
        dist.barrier()
        dist.destroy_process_group()
        raise SystemExit(0)

    ckpt.DistributedCheckpointer.save_checkpoint = save_then_stop  # type: ignore[method-assign]


def _cpu_fixes() -> None:
    """Three places where torchtune 0.6.1's recipe assumes a GPU, all unrelated to the storage:

    - ``get_distributed_backend("cpu", offload_ops_to_cpu=True)`` (what the recipe asks for with
      ``enable_async_checkpointing``) returns ``"cpu:gloo,cpu:gloo"``, which ``init_process_group`` rejects
      (duplicate device type); on CPU the answer is plain ``gloo``;
    - ``_setup_model`` logs memory stats on rank 0 unconditionally, and ``get_memory_stats`` raises on CPU
      ("not supported on CPU devices"); here it logs nothing;
    - ``train`` starts with ``cleanup_before_training``, which calls ``torch.cpu.empty_cache`` (absent from
      torch); here it only collects garbage, as that function does before."""
    import gc

    import torchtune.training as training

    chosen, stats, log_stats = training.get_distributed_backend, training.get_memory_stats, training.log_memory_stats

    def backend(device_type: str, offload_ops_to_cpu: bool = False) -> str:
        return chosen(device_type, offload_ops_to_cpu=offload_ops_to_cpu and device_type != "cpu")

    def memory_stats(device: Any, reset_stats: bool = True) -> dict:
        return {} if getattr(device, "type", device) == "cpu" else stats(device, reset_stats)

    def log_memory_stats(memory_stats: dict, *args: Any, **kwargs: Any) -> None:
        if memory_stats:
            log_stats(memory_stats, *args, **kwargs)

    training.get_distributed_backend = backend
    training.get_memory_stats, training.log_memory_stats = memory_stats, log_memory_stats
    training.cleanup_before_training = gc.collect


def worker(cfg_path: str) -> None:
    """One rank of one run: the patch, then torchtune's recipe as ``recipe_main`` runs it."""
    import importlib.util

    import torchtune
    from omegaconf import OmegaConf

    # ``tune run`` runs the recipe file by path (its folder is no package); load it the same way
    path = Path(torchtune.__file__).parent.parent / "recipes" / "full_finetune_distributed.py"
    spec = importlib.util.spec_from_file_location("full_finetune_distributed", path)
    assert spec is not None and spec.loader is not None, path
    recipe_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe_module)
    if os.environ.get("UCP_CLIENT_BASELINE") != "1":
        install()
    _cpu_fixes()
    _checkpoint_group()
    if os.environ.get("UCP_CLIENT_STOP_AFTER_SAVE") == "1":
        _stop_after_first_save()
    cfg = OmegaConf.load(cfg_path)
    recipe = recipe_module.FullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    # the recipe's cleanup destroys the process group without waiting for an async save still in flight
    # (the next DistributedCheckpointer save would wait for it; the final save goes through the other
    # checkpointer), which then fails; wait for it first
    dcp_ckpt = recipe._checkpoint_client._dcp_checkpointer
    if dcp_ckpt is not None and dcp_ckpt._checkpoint_future is not None:
        dcp_ckpt._checkpoint_future.result()
    recipe.cleanup()


def make_base(cfg_path: str) -> None:
    """The base checkpoint the recipe starts from: the debug model's seeded initial weights, as a
    torchtune-format ``.pt`` (``FullModelTorchTuneCheckpointer``'s input)."""
    import torch
    from omegaconf import OmegaConf
    from torchtune import config

    cfg = OmegaConf.load(cfg_path)
    torch.manual_seed(cfg.seed)
    model = config.instantiate(cfg.model)
    path = Path(cfg.checkpointer.checkpoint_dir) / cfg.checkpointer.checkpoint_files[0]
    torch.save(model.state_dict(), path)


# ------------------------------------------------------------------------------------------- the driver
@dataclass
class Run:
    """One launch of the recipe: its name, ranks, mesh, per-rank batch and whether it resumes or stops."""

    name: str
    nproc: int
    tp: int = 1
    batch: int = 2
    resume: bool = False
    stop_after_save: bool = False
    store: str = "store"
    losses: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0


def ensure_side_packages(lib: Path) -> None:
    """Install torchtune and its imports into ``lib`` (never into the project's environment) if missing."""
    if (lib / "torchtune").is_dir() and (lib / "recipes").is_dir():
        return
    print(f"run_dcp_client: installing torchtune's packages into {lib}", flush=True)
    lib.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(lib),
                    *SIDE_PACKAGES], check=True)


def config_for(run: Run, work: Path, steps: int) -> dict:
    """The recipe's config for ``run`` (what a user's YAML would hold)."""
    out = work / run.name
    # the checkpoints' folder is shared by the runs of one store (the resumes find the cut run's save
    # there on the baseline); each run logs its losses in a folder of its own
    ckpt = work / f"{run.store}-out"
    return {
        "output_dir": str(ckpt), "device": "cpu", "dtype": "fp32", "seed": 1234, "shuffle": True,
        "batch_size": run.batch, "epochs": 2, "max_steps_per_epoch": steps, "gradient_accumulation_steps": 1,
        "enable_async_checkpointing": True, "resume_from_checkpoint": run.resume,
        "tensor_parallel_dim": run.tp,
        "tensor_parallel_plan": {"_component_": "torchtune.models.llama3.base_llama_tp_plan"},
        "log_every_n_steps": 1, "log_peak_memory_stats": False, "optimizer_in_bwd": False, "compile": False,
        "enable_activation_checkpointing": False, "enable_activation_offloading": False,
        "model": {"_component_": "torchtune.models.llama3.llama3", "vocab_size": 256, "num_layers": 2,
                  "num_heads": 4, "num_kv_heads": 2, "embed_dim": 64, "max_seq_len": 64,
                  "intermediate_dim": 128},
        "tokenizer": {"_component_": "run_dcp_client.ByteTokenizer"},
        "dataset": {"_component_": "run_dcp_client.synthetic_dataset"},
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 2e-3, "fused": False},
        "metric_logger": {"_component_": "run_dcp_client.LossLog", "path": str(out / "losses.jsonl")},
        "checkpointer": {"_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
                         "checkpoint_dir": str(work / "base"), "checkpoint_files": ["model.pt"],
                         "model_type": "LLAMA3", "output_dir": str(ckpt)},
    }


@dataclass
class Options:
    """What the driver was asked for (``main``'s flags), passed to every launch."""

    lib: Path
    steps: int
    rtol: float
    timeout: float
    baseline: bool = False  # DCP's FileSystemWriter/Reader, the backend not substituted


class RunFailed(Exception):
    """A run exited non-zero or its checkpoint save failed; ``reason`` is the log's telling line."""

    def __init__(self, run: str, reason: str, log: Path):
        super().__init__(f"run {run!r} failed: {reason} (log: {log})")
        self.reason = reason


def _env(opt: Options, work: Path, run: Run | None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", UCP_PROGRESS="0",
               UCP_CLIENT_BASELINE="1" if opt.baseline else "0",
               PYTHONPATH=os.pathsep.join([str(HERE), str(opt.lib), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if run is not None:
        env["UCP_CLIENT_STORE"] = str(work / run.store)
        env["UCP_CLIENT_STOP_AFTER_SAVE"] = "1" if run.stop_after_save else "0"
    return env


def _reason(text: str) -> str:
    """The line of a failed run's log that says why: a ucp_store error, else the last exception line."""
    lines = [ln.split("]: ", 1)[-1].strip() for ln in text.splitlines()]
    for ln in lines:
        if ln.startswith("ucp_store.errors."):
            return ln
    exc = [ln for ln in lines if re.match(r"^[A-Za-z_.]+(Error|Exception): ", ln)]
    return exc[-1] if exc else (lines[-1] if lines else "no output")


def launch(run: Run, opt: Options, work: Path) -> None:
    """Start ``run`` under torchrun and read its losses back."""
    cfg_path = work / f"{run.name}.json"
    cfg_path.write_text(json.dumps(config_for(run, work, opt.steps), indent=1))
    (work / run.name).mkdir(exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={run.nproc}", str(Path(__file__).resolve()), "--worker", str(cfg_path)],
                          env=_env(opt, work, run), capture_output=True, text=True, timeout=opt.timeout)
    run.seconds = time.perf_counter() - t0
    log = work / f"{run.name}.log"
    log.write_text(proc.stdout + proc.stderr)
    # torchtune only logs a failed async save (its future's callback) or load (then starts from the base
    # model) and trains on
    text = proc.stdout + proc.stderr
    if proc.returncode != 0 or any(m in text for m in ("Checkpoint failed to save asynchronously",
                                                        "Failed to load distributed checkpoint")):
        raise RunFailed(run.name, _reason(text), log)
    for line in (work / run.name / "losses.jsonl").read_text().splitlines():  # LossLog's file
        rec = json.loads(line)
        run.losses[rec["step"]] = rec["loss"]


@dataclass
class Check:
    """One comparison of the report: what, whether it holds, and the figures behind it."""

    what: str
    ok: bool
    detail: str


def _compare(ref: Run, other: Run, steps: range, rtol: float | None) -> Check:
    """``other``'s losses at ``steps`` against ``ref``'s: bit for bit (``rtol`` None) or within ``rtol``."""
    missing = [s for s in steps if s not in other.losses or s not in ref.losses]
    if missing or set(other.losses) != set(steps):
        return Check(f"{other.name}: steps {steps.start}..{steps.stop - 1}", False,
                     f"logged steps {sorted(other.losses)}, expected {list(steps)}")
    a = [float.fromhex(ref.losses[s]) for s in steps]
    b = [float.fromhex(other.losses[s]) for s in steps]
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    if rtol is None:
        same = [ref.losses[s] == other.losses[s] for s in steps]
        return Check(f"{other.name} = {ref.name}, steps {steps.start}..{steps.stop - 1}, bit for bit", all(same),
                     f"{sum(same)}/{len(same)} equal; max rel diff {worst:.3g}")
    return Check(f"{other.name} ~ {ref.name}, steps {steps.start}..{steps.stop - 1}, rtol {rtol:g}",
                 worst <= rtol, f"max rel diff {worst:.3g}")


def _store_check(work: Path, baseline: bool) -> Check:
    """The cut run's checkpoint went where it should: through the backend, a committed step 0 of run
    ``torchtune`` and no DCP file folder; on the baseline, DCP's folder with its ``.metadata``."""
    folder = work / "store-out" / "dist_epoch_0"
    if baseline:
        return Check("cut's save is a DCP folder (baseline)", (folder / ".metadata").is_file(), str(folder))
    from ucp_store.store import open_store

    rows = [c for c in open_store(str(work / "store")).list_checkpoints() if c["run"] == RUN]
    ok = [c["step"] for c in rows] == [0] and not folder.exists()
    return Check("cut's save is a committed store version, no DCP files", ok,
                 f"versions {[(c['run'], c['step'], c['nbytes']) for c in rows]}; {folder} "
                 f"{'exists' if folder.exists() else 'absent'}")


def run_all(work: Path, opt: Options) -> tuple[list[Run], list[Check]]:
    """The five runs of the module doc, then the checks; a failed run ends the list with its reason."""
    (work / "base").mkdir(parents=True, exist_ok=True)
    ref = Run("reference", 2, store="reference-store")
    cfg_path = work / "base.json"
    cfg_path.write_text(json.dumps(config_for(ref, work, opt.steps)))
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--make-base", str(cfg_path)],
                   env=_env(opt, work, None), check=True, timeout=opt.timeout)
    runs = [ref, Run("cut", 2, stop_after_save=True), Run("resume", 2, resume=True),
            Run("resume-1rank", 1, batch=4, resume=True), Run("resume-tp2", 2, tp=2, batch=4, resume=True)]
    for run in runs:
        try:
            launch(run, opt, work)
        except RunFailed as exc:
            print(f"  {run.name:13s} FAILED: {exc}", flush=True)
            return runs, [Check(f"run {run.name}", False, exc.reason)]
        print(f"  {run.name:13s} {run.seconds:6.1f} s  losses "
              f"{[round(float.fromhex(v), 6) for v in run.losses.values()]}", flush=True)
    first, second = range(1, opt.steps + 1), range(opt.steps + 1, 2 * opt.steps + 1)
    checks = [_compare(ref, runs[1], first, None), _store_check(work, opt.baseline),
              _compare(ref, runs[2], second, None), _compare(ref, runs[3], second, opt.rtol),
              _compare(ref, runs[4], second, opt.rtol)]
    return runs, checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", type=Path, default=DEFAULT_LIB, help="the side packages' folder")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per epoch (N = M)")
    ap.add_argument("--rtol", type=float, default=1e-4, help="tolerance for the runs on another mesh")
    ap.add_argument("--baseline", action="store_true", help="DCP's own filesystem storage (no backend)")
    ap.add_argument("--keep", type=Path, default=None, help="work folder to keep (default: a temp folder)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--json", type=Path, default=None, help="write the losses and checks here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--make-base", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.make_base:
        make_base(args.make_base)
        return 0
    import tempfile

    ensure_side_packages(args.lib)
    opt = Options(args.lib, args.steps, args.rtol, args.timeout, args.baseline)
    with tempfile.TemporaryDirectory(prefix="ucp-dcp-client-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        runs, checks = run_all(work, opt)
    for c in checks:
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.what}: {c.detail}")
    if args.json:
        args.json.write_text(json.dumps({"runs": [{"name": r.name, "nproc": r.nproc, "tp": r.tp, "batch": r.batch,
                                                   "seconds": round(r.seconds, 1), "losses": r.losses}
                                                  for r in runs],
                                         "checks": [c.__dict__ for c in checks]}, indent=1))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
