"""A DeepSpeed checkpoint engine that saves straight into a ucp store (no rank-local files, no converter).

DeepSpeed hands every file it would write to its pluggable checkpoint engine
(``deepspeed/runtime/checkpoint_engine/``: ``create``, ``save(state_dict, path)``, ``commit(info)``).
:class:`UcpCheckpointEngine` keeps those state dicts in memory instead of writing them, and at
``commit`` every rank writes *its own share* of every parameter-state into the store's logical arrays:

- ZeRO-1/2 (and the bf16 optimizer): the rank's fragments of the fp32 master and of every per-element
  optimizer state (``param_slice_mappings`` x ``single_partition_of_fp32_groups`` / ``base_optimizer_state``),
  through ``CheckpointWriter.write_shard`` with a :class:`~ucp_store.patterns.Fragment`; the fragment's
  offset in the parameter is the elements the lower DP ranks hold (metadata exchanged once per save);
- ZeRO-3: the rank's ``ceil(numel / dp)`` partition of every parameter (``fp32_flat_groups``) and of every
  frozen parameter (``frozen_param_fragments``);
- frozen parameters and buffers (and low-precision weights that are not the fp32 master cast down): whole,
  from DP rank 0 of their pipeline stage;
- the optimizer step, the scheduler, client state, global step counters and every rank's RNG state:
  JSON objects (never pickle), the same objects ``ucp import deepspeed`` stores, built by the same code.

The merge rules and patterns are the file importer's (:mod:`ucp_store.deepspeed.source`), so the stored
arrays are bit-equal to ``ucp import deepspeed`` of the folder the same step would have written
(``tests/deepspeed/test_direct.py`` checks every array's content hash). The version is committed by rank 0
once every rank's writes are durable (:mod:`ucp_store.distributed.commit`); a failure or a dead rank on any rank
aborts everywhere, and nothing is listed. Collectives run on a private gloo group with a bounded timeout.

``background=True``: ``save_checkpoint`` returns at once; a thread copies every tensor of the save into
reusable host buffers (pinned for device tensors; allocated on the first save, parallel copies), then
writes from them. The engine's optimizer ``step`` is wrapped to wait until that copy is done, so the
forward and backward passes of the next step overlap it and no step ever mutates state being saved
(no torn checkpoint). :meth:`wait` (called by the next save, by ``load``, or by you) joins the save and
re-raises its error.

    import ucp_store.deepspeed as ucpds
    ucpds.attach(engine, store="/ckpt/store", run="llama")   # once, after deepspeed.initialize
    engine.save_checkpoint()                                   # -> llama@<global_steps>, no files

Scope: ZeRO 1-3, bf16/fp16/fp32, the bf16 optimizer and pipeline engines; tensor parallelism (TP > 1) with
ZeRO-1/2 in Megatron's rank order (tp fastest, then dp, then pp: ``PipeModelDataParallelTopology`` or an mpu).
At TP > 1 (or with ``universal_checkpoint_info`` patterns) every parameter follows the file importer's rule
(``UniversalInfo.rule``, or the rule inferred from the data for a TP model without patterns):

- equal-width column/row-parallel parameters (rule ``cat``): each rank writes its ZeRO fragments of its TP slice
  through ``write_shard`` with the ``partitioned`` pattern, as at TP=1;
- every other one (TP-replicated norms and row-parallel biases, ``parameter_to_average_patterns``, fused
  sub-parameters, vocabularies, affine maps): its fragments go point to point (bytes, the save's gloo group,
  bounded timeout) to the first rank of its pipeline stage, which runs the importer's own merge
  (``DeepSpeedReader.merge_param``, in :mod:`ucp_store.deepspeed.write_tp`): one copy when the replicas are
  equal, a refusal when a parameter listed as replicated drifted, the element-wise mean with the ``averaged``
  pattern and its max deviation for averaged ones; and writes the result whole;
- frozen parameters and buffers: every TP rank's copy (from DP rank 0) goes to the same rank, merged by the
  importer's ``_weight_records``.

The stored bytes are the importer's (``tests/deepspeed/test_direct_tp.py``; ``tools/ds_direct_tp_check.py`` for
AutoTP, TP x PP, fp16/fp32, the bf16 optimizer and the background mode). Still refused, with the reason in the
error: ZeRO-3 x TP (the ZeRO-3 partitions of TP slices are not mapped yet; DeepSpeed's pipeline engine allows
ZeRO-1 only anyway), MoE engines (expert files and expert-parallel groups: ``ucp import deepspeed`` handles
them), and a rank order other than Megatron's. ``ds_load.load`` loads versions of any TP degree into engines
of any TP.

Durability: the save's writer defers it (``CheckpointWriter.defer_durability``): no fsync per file; once
its writes returned, every rank fsyncs all it wrote in one parallel pass on a thread, beside the one
agreement round (a gather to rank 0 of every rank's outcome, metadata and chunk digests, and a scatter back of
each rank's outcome and digests: JSON bytes, never a pickle) and the objects; then
one gather of every rank's rows to rank 0, ONE catalog transaction that records them and commits, and one
broadcast of the outcome (:func:`ucp_store.distributed.commit.distributed_commit`). No row is recorded before
every rank's pass is done.

``durability="background"`` (synchronous mode): ``save_checkpoint`` returns once every byte is written
(page cache) and the ranks agreed, which is when DeepSpeed's torch.save engine returns; the fsync pass and
the commit finish on a thread (collectives on the engine's private gloo group; the next save, ``load``,
``detach`` and ``wait()`` join it first). Safe because nothing of the live engine is read after the writes
returned (the low-precision weights that are stored are written before returning), and the version is
listed only once durable: a crash before then lists nothing, as a crash mid-save would.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import os
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

# What a save or a load runs is imported with the engine, next to DeepSpeed, and not inside the first
# save_checkpoint or load (the catalog's SQLAlchemy, TensorStore, the planner: seconds on a loaded machine).
import ucp_store.deepspeed.write
import ucp_store.distributed.commit
import ucp_store.io.read
import ucp_store.plan.planner
import ucp_store.registry.checkpoint
import ucp_store.save.writer
import ucp_store.store  # noqa: F401
from ucp_store.deepspeed.write_plan import RankSnapshot, SaveTarget
from ucp_store.errors import ConfigurationError, UcpError

__all__ = ["ENGINE_NAME", "UcpCheckpointEngine", "attach", "detach", "engine_topology"]

ENGINE_NAME = "UcpCheckpointEngine"
DURABILITY = ("blocking", "background")  # attach(durability=...): the synchronous save's fsync + commit
DEFAULT_TIMEOUT_S = 600.0

try:  # DeepSpeed is optional for the rest of ucp_store; this module needs it only at attach time
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
        CheckpointEngine as _Base,
    )
except Exception:  # pragma: no cover - deepspeed not installed
    _Base = object


# ------------------------------------------------------------------------------------------- helpers
_SPLIT_BYTES = 32 << 20  # tensors larger than this are staged in pieces, in parallel


class _Stager:
    """Host staging for the background mode: reusable buffers, parallel copies.

    Every tensor of a save gets a host buffer, allocated on the first save and reused by the next ones
    (keyed by its place in the state dicts, shape and dtype; pinned when the source is on an accelerator,
    so the device-to-host copies are asynchronous DMA). Views of one storage (a module weight in the
    model states and in the low-precision check) are copied once. Copies run on a small thread pool
    (``copy_`` releases the GIL), large tensors split in pieces."""

    def __init__(self, workers: int | None = None):
        self._bufs: dict[tuple, torch.Tensor] = {}
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self.bytes = 0

    def stage(self, obj: Any, versions: dict[int, tuple[torch.Tensor, int]] | None = None) -> Any:
        """A copy of ``obj`` (dicts, lists, tuples) with every tensor replaced by its staged host copy.

        ``versions`` (``tensor_versions(obj)`` taken when the save was called): every tensor's version counter
        must be the same before and after its copy, else ``SnapshotChangedError`` names it (something changed
        it in place before the step the copy is gated on: the copy would not be the saved step's state)."""
        jobs: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: dict[tuple, torch.Tensor] = {}
        used: set[tuple] = set()
        out = self._walk(obj, (), jobs, seen, used)
        for k in [k for k in self._bufs if k not in used]:  # a buffer no longer needed (the model changed)
            del self._bufs[k]
        self._guard(obj, versions, "before its copy")
        self._copy(jobs)
        self._guard(obj, versions, "while it was copied")
        return out

    @staticmethod
    def _guard(obj: Any, versions: dict[int, tuple[torch.Tensor, int]] | None, when: str) -> None:
        if versions is None:
            return
        from ucp_store.distributed.snapshot import SnapshotChangedError

        for path, t in _tensors(obj, ()):
            known = versions.get(id(t))
            if known is not None and t._version != known[1]:
                raise SnapshotChangedError(
                    f"background save: the tensor at {'/'.join(map(str, path))} ({tuple(t.shape)}, {t.dtype}) was "
                    f"changed in place after save_checkpoint, {when}, before the optimizer step the copy is gated "
                    "on; the save fails on every rank (nothing listed) instead of storing a later state")

    def _walk(self, obj, path, jobs, seen, used):
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            ident = (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype) if t.numel() else None
            if ident is not None and ident in seen:
                return seen[ident]
            key = (path, tuple(t.shape), t.dtype)
            used.add(key)
            buf = self._bufs.get(key)
            if buf is None:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type != "cpu")
                self._bufs[key] = buf
            jobs.append((buf, t))
            if ident is not None:
                seen[ident] = buf
            return buf
        if isinstance(obj, dict):
            out = {k: self._walk(v, path + (k,), jobs, seen, used) for k, v in obj.items()}
            return type(obj)(out) if type(obj) in (dict, OrderedDict) else out
        if isinstance(obj, list):
            return [self._walk(v, path + (i,), jobs, seen, used) for i, v in enumerate(obj)]
        if isinstance(obj, torch.Size):  # shapes stay torch.Size: the objects encode them as such (__size__)
            return obj
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._walk(v, path + (i,), jobs, seen, used) for i, v in enumerate(obj))
        return obj

    def _copy(self, jobs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dst, src in jobs:
            n = src.numel() * src.element_size()
            if n > _SPLIT_BYTES and src.is_contiguous() and src.dim() > 0:
                d, s_ = dst.view(-1), src.reshape(-1)
                step = max(1, _SPLIT_BYTES // src.element_size())
                pieces.extend((d[i:i + step], s_[i:i + step]) for i in range(0, d.numel(), step))
            else:
                pieces.append((dst, src))
        self.bytes = sum(s_.numel() * s_.element_size() for _, s_ in jobs)
        on_device = any(s_.device.type != "cpu" for _, s_ in pieces)

        def run(pair):
            pair[0].copy_(pair[1], non_blocking=pair[1].device.type != "cpu")

        if len(pieces) > 1 and self.workers > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(self.workers, thread_name_prefix="ucp-stage") as pool:
                list(pool.map(run, pieces))
        else:
            for pair in pieces:
                run(pair)
        if on_device:
            from deepspeed.accelerator import get_accelerator

            get_accelerator().synchronize()  # the asynchronous device-to-host copies have landed


def _tensors(obj: Any, path: tuple):
    """(path, tensor) of every tensor in nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, path + (k,))
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for i, v in enumerate(obj):
            yield from _tensors(v, path + (i,))


def tensor_versions(obj: Any) -> dict[int, tuple[torch.Tensor, int]]:
    """Every tensor's version counter now (by object id; the tensor is kept so the id stays its own)."""
    return {id(t): (t, t._version) for _, t in _tensors(obj, ())}


def engine_topology(engine) -> dict:
    """The (tp, pp, dp, zero stage, layers, layer_stages) of an initialised DeepSpeed engine, as a
    ``Topology`` keyword dict (ZeRO alignment: DeepSpeed's ``nccl_start_alignment_factor`` = 2)."""
    tp = int(getattr(engine, "mp_world_size", 1) or 1)
    if _is_pipe(engine):
        tp = max(1, tp // int(engine.num_stages))  # a pipeline engine's model parallelism is pp x tp
    if getattr(engine, "has_moe_layers", False):
        raise ConfigurationError("ucp_store.deepspeed: MoE engines (expert parallelism) are not supported yet; "
                                 "save with DeepSpeed's own engine and `ucp import deepspeed`")
    zero = int(engine.zero_optimization_stage()) if engine.zero_optimization() else 0
    if tp != 1:
        _check_tp(engine, tp, zero)
    if zero == 0 and not _is_bf16_optimizer(engine):
        raise ConfigurationError(
            "ucp_store.deepspeed: the engine has no ZeRO optimizer (zero_optimization.stage "
                                 "is 0 and no bf16 optimizer); expected ZeRO stage 1, 2 or 3")
    pp, layers, stages = 1, 0, None
    if _is_pipe(engine):
        pp = int(engine.num_stages)
        parts = list(engine.module.parts)
        layers = int(parts[-1])
        stages = tuple(next(s for s in range(pp) if parts[s] <= i < parts[s + 1]) for i in range(layers))
    dp = int(engine.dp_world_size)
    return {"tp": tp, "pp": pp, "dp": dp, "zero_stage": zero if zero else 1, "layers": layers,
            "layer_stages": stages, "zero_alignment": 2}


# ------------------------------------------------------------------------- tensor parallelism (TP > 1)
def _check_tp(engine, tp: int, zero: int) -> None:
    """Refuse what the engine cannot save at TP > 1 (ZeRO-3 x TP), and a rank order other than Megatron's
    (tp fastest, then dp, then pp), which ``Topology`` assumes when it maps a TP slice to its rank."""
    if zero >= 3:
        raise ConfigurationError(f"ucp_store.deepspeed: ZeRO-3 with tensor parallelism (tp={tp}) is not "
                                 "supported by the direct engine (ZeRO-1/2 and the bf16 optimizer are); save with "
                                 "DeepSpeed's own engine and `ucp import deepspeed`, which handles it")
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()):
        return  # one process holds no TP ranks to place (a unit test's stand-in engine)
    rank, stage, dp_rank = _coords(engine)
    tp_rank = tp_coord(engine)
    dp = int(engine.dp_world_size)
    want = tp_rank + tp * (dp_rank + dp * stage)
    if rank != want:
        raise ConfigurationError(f"ucp_store.deepspeed: global rank {rank} is (tp={tp_rank}, dp={dp_rank}, "
                                 f"pp={stage}), which Megatron's rank order (tp fastest, then dp, then pp) puts at "
                                 f"rank {want}; the direct engine supports TP only in that order")


def tp_coord(engine) -> int:
    """This process's tensor-parallel rank (0 without TP)."""
    if _is_pipe(engine):
        return int(engine.grid.get_slice_parallel_rank())
    mpu = getattr(engine, "mpu", None)
    if mpu is None:
        return 0
    for attr in ("get_tensor_model_parallel_rank", "get_model_parallel_rank"):
        if hasattr(mpu, attr):
            return int(getattr(mpu, attr)())
    raise ConfigurationError("ucp_store.deepspeed: the engine's mpu tells no tensor-parallel rank "
                             "(get_tensor_model_parallel_rank / get_model_parallel_rank)")


def _is_pipe(engine) -> bool:
    return hasattr(engine, "num_stages") and hasattr(engine.module, "parts")


def _is_bf16_optimizer(engine) -> bool:
    return type(getattr(engine, "optimizer", None)).__name__ == "BF16_Optimizer"


def _coords(engine) -> tuple[int, int, int]:
    """(global rank, pipeline stage, data-parallel rank) of this process."""
    import deepspeed.comm as dist

    if _is_pipe(engine):
        return dist.get_rank(), int(engine.stage_id), int(engine.grid.data_parallel_id)
    return dist.get_rank(), 0, int(dist.get_rank(group=engine.optimizer.dp_process_group))


# ------------------------------------------------------------------------------------------- engine
class UcpCheckpointEngine(_Base):
    """DeepSpeed ``CheckpointEngine`` that writes ``engine.save_checkpoint`` into a ucp store.

    Every rank reports itself a data-parallel writer of nothing: files never reach the disk. ``save``
    stages the state dict (by reference, or copied to host memory in ``background`` mode); ``commit``
    writes the rank's share and commits ``run@engine.global_steps`` (or ``step`` given to ``attach``)."""

    def __init__(self, engine, store, run: str, *, background: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 message: str | None = None, progress: bool = True, group=None, durability: str = "blocking"):
        if durability not in DURABILITY:
            raise ConfigurationError(f"durability={durability!r}: expected one of {', '.join(DURABILITY)}")
        self.name = ENGINE_NAME
        self.durability = durability
        self.engine = engine
        self.store = store
        self.run = run
        self.background = bool(background)
        self.message = message
        self.progress = progress
        self.group = group
        self.timeout_s = timeout_s
        self._staged: dict[str, Any] = {}
        self._tag: str | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_id: str | None = None
        self.stats: dict[str, float] = {}
        self._on_write = None  # test hook: called after each array write (the harness kills a rank here)
        self._before_stage = None  # test hook: called in the save thread before staging starts
        self._stager = _Stager()
        self.writer_nice = 10  # the background writer's niceness (0: unchanged)
        self._released = threading.Event()
        self._released.set()

    # --- the CheckpointEngine interface -----------------------------------------------------------
    def create(self, info) -> None:
        """A save begins: wait for a background save still running, then start staging."""
        self.wait()
        self._staged = {}
        self._tag = getattr(info, "tag", None)
        self._t0 = time.perf_counter()

    def makedirs(self, path, exist_ok=False) -> None:
        """Nothing: the store has no folders to create."""

    def save(self, state_dict, path: str) -> None:
        """Keep ``state_dict`` (what DeepSpeed would write to ``path``) for ``commit``."""
        name = os.path.basename(os.fspath(path))
        self._staged[name] = state_dict  # by reference; the background mode stages it in its thread

    def load(self, path: str, map_location=None):
        raise ConfigurationError(f"{ENGINE_NAME} cannot load the file {path!r}: a store version is loaded with "
                                 "ucp_store.deepspeed.load(engine, 'run@step'), not engine.load_checkpoint")

    def commit(self, info) -> bool:
        """Write this rank's share and commit (all ranks together); in background mode, start that."""
        staged, self._staged = self._staged, {}
        snap = self._snapshot()
        self.stats["staged_s"] = time.perf_counter() - self._t0
        if self.background:
            self._error = None
            self._released.clear()
            versions = tensor_versions((staged, snap.lp))  # the guard's reference: the state at the call
            self._thread = threading.Thread(target=self._run_bg, args=(staged, snap, versions), name="ucp-ds-save",
                                            daemon=True)
            self._thread.start()
        elif self.durability == "background":
            # every byte is written (page cache) and the ranks agreed when _write_share returns; the live state is
            # not read after that, so training goes on while a thread makes it durable and commits (a collective
            # on the engine's private gloo group: the next save's create() joins it first)
            self._error = None
            self.last_id = None
            finish = self._write_share(staged, snap)
            self.stats["returned_s"] = time.perf_counter() - self._t0
            self._thread = threading.Thread(target=self._run_finish, args=(finish,), name="ucp-ds-commit", daemon=True)
            self._thread.start()
        else:
            self.last_id = self._write(staged, snap)
        return True

    def is_data_parallel_writer(self, dp_rank) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def preserves_storage_sharing(self) -> bool:
        return False  # no torch.save: DeepSpeed need not clone tensors for us

    def cleanup(self) -> None:
        self.wait()

    # --- background mode --------------------------------------------------------------------------
    def _run_bg(self, staged: dict[str, Any], snap: RankSnapshot, versions=None) -> None:
        """Stage every tensor into the reusable host buffers (the optimizer's next step waits for this,
        ``wait_staged``; each tensor version-checked before and after its copy), release the live state, agree
        with the other ranks that every snapshot is sound, then write from the staged copies at a lower
        scheduling priority (the training threads get the CPU first)."""
        try:
            error: BaseException | None = None
            try:
                if self._before_stage is not None:
                    self._before_stage()
                t0 = time.perf_counter()
                staged, lp = self._stager.stage((staged, snap.lp), versions)
                snap = dataclasses.replace(snap, lp=lp)
                self.stats["stage_copy_s"] = time.perf_counter() - t0
                self.stats["staged_bytes"] = self._stager.bytes
            except BaseException as exc:  # noqa: BLE001 - every rank must learn of it before the write begins
                error = exc
            finally:
                self._released.set()
            self._agree(error)
            from ucp_store.distributed.snapshot import lower_writer_priority

            lower_writer_priority(self.writer_nice)
            self.last_id = self._write(staged, snap)
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            self._error = exc

    def _agree(self, error: BaseException | None) -> None:
        """Every rank raises when any rank's snapshot failed (one gather on the save's group)."""
        if self.group is None:
            if error is not None:
                raise error
            return
        from ucp_store.distributed.commit import gather_errors

        failures = gather_errors(error, self.group)  # JSON bytes through rank 0, never a pickle
        if error is not None:
            raise error
        if failures:
            detail = "; ".join(f"rank {r}: {m}" for r, m in failures)
            raise UcpError(f"background save: the snapshot failed on {detail}")

    def _run_finish(self, finish) -> None:
        try:
            self.last_id = finish()
            self.stats["durable_committed_s"] = time.perf_counter() - self._t0
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            self._error = exc

    def wait_staged(self) -> float:
        """Block until a background save has copied the live state it reads (the optimizer step calls this
        before mutating it); returns the seconds waited."""
        if self._released.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._released.wait()
        waited = time.perf_counter() - t0
        self.stats["step_wait_s"] = self.stats.get("step_wait_s", 0.0) + waited
        self.stats["step_waits"] = self.stats.get("step_waits", 0) + 1
        return waited

    def wait(self) -> str | None:
        """Join a background save; returns its version id, or re-raises its error."""
        th, self._thread = self._thread, None
        if th is not None:
            th.join()
        self._released.set()
        err, self._error = self._error, None
        if err is not None:
            raise UcpError(f"background save of run {self.run!r} failed (nothing listed)") from err
        return self.last_id

    # --- what the save needs from the live engine (taken in the training thread) --------------------
    def _snapshot(self) -> RankSnapshot:
        """This rank's coordinates, the topology, the low-precision weights, step, RNG and client state."""
        eng = self.engine
        rank, stage, dp_rank = _coords(eng)
        topo = engine_topology(eng)
        lp = {}
        if topo["zero_stage"] < 3:
            # low-precision module weights, to check them against the fp32 master (importer's lp_weights="auto")
            for n, p in eng.module.named_parameters():
                lp[n] = p
        step = int(eng.global_steps)
        rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
        from ucp_store import safe_pickle as sp

        # this rank's client state (JSON form, taken now): per-rank keys are recorded per rank (ds_perrank)
        client = sp.to_jsonable(getattr(self, "_client_state", None) or {}, notes=[], where="client_state")
        return RankSnapshot(rank=rank, stage=stage, dp_rank=dp_rank, tp_rank=tp_coord(eng), topo=topo, lp=lp, step=step,
                            rng=rng, client=client)

    # --- the write --------------------------------------------------------------------------------
    def _target(self) -> SaveTarget:
        """Where this save goes and how it reports (the settings now, the hook a test may have set)."""
        return SaveTarget(store=self.store, run=self.run, group=self.group, tag=self._tag, message=self.message,
                          progress=self.progress, stats=self.stats, on_write=self._on_write)

    def _write(self, staged: dict[str, Any], snap: RankSnapshot) -> str:
        """Write this rank's share and commit it with the other ranks; returns the version id."""
        t0 = time.perf_counter()
        cid = ucp_store.deepspeed.write.write_rank_share(self._target(), staged, snap)()
        self.stats["write_s"] = time.perf_counter() - t0
        return cid

    def _write_share(self, staged: dict[str, Any], snap: RankSnapshot) -> ucp_store.deepspeed.write.PendingCommit:
        """Write this rank's share and agree on it; returns the commit still to run (``durability="background"``)."""
        t0 = time.perf_counter()
        commit = ucp_store.deepspeed.write.write_rank_share(self._target(), staged, snap)
        self.stats["write_s"] = time.perf_counter() - t0
        return commit


def _store_everywhere(store, create: bool, group):
    """The store the engine saves into. One process: ``store`` opened (a URL or path; a ``Store`` as it is).
    Several (``group``, the save's gloo group): rank 0 alone opens it and touches the catalog; one broadcast
    (JSON bytes: location and settings, or rank 0's error, raised on every rank) gives the other ranks a store
    without a catalog (``coord.detached_store``), for the array I/O of their share. A collective of ``group``."""
    from ucp_store.distributed import coord
    from ucp_store.store import open_store

    def opened():
        return open_store(os.fspath(store), create=create) if isinstance(store, (str, os.PathLike)) else store

    if group is None:
        return opened()
    def work():
        st = opened()
        return st, {"store": coord.store_facts(st)}

    mine, answer = coord.from_coordinator(work, group, "ucp_store.deepspeed.attach (opening the store)")
    return mine if mine is not None else coord.detached_store(answer["store"])


def attach(engine, store, run: str, *, background: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
           message: str | None = None, progress: bool = True, create: bool = True,
           durability: str = "blocking") -> UcpCheckpointEngine:
    """Make ``engine.save_checkpoint(...)`` save into ``store`` (a ``Store`` or URL) as ``run@global_steps``.

    Call on every rank after ``deepspeed.initialize``. ``save_checkpoint``'s ``save_dir`` becomes optional
    and is ignored (nothing is written there: no ``latest`` file, no recovery script). ``background``:
    ``save_checkpoint`` returns once the state is staged in host memory. ``durability="background"`` (the
    synchronous mode): ``save_checkpoint`` returns once every byte is written into the store's files (the
    page cache, as DeepSpeed's torch.save engine returns) and the ranks agreed; the fsync pass and the commit
    finish on a thread, and the version is listed only once durable (``wait()`` joins it, the next save
    waits for it first; a crash before then lists nothing). Returns the engine object (``last_id``: the
    version id of the last save; ``wait()``: join a background save).

    One catalog client per job: over several ranks only rank 0 opens ``store`` and touches the catalog (here,
    at each save's begin and commit, and in ``load``); the other ranks get its location and settings in one
    broadcast and hold a store without a catalog (``coord.detached_store``)."""
    import deepspeed.comm as dist

    from ucp_store import names

    names.run_name(run)
    if durability not in DURABILITY:
        raise ConfigurationError(f"durability={durability!r}: expected one of {', '.join(DURABILITY)}")
    engine_topology(engine)  # refuse what is not supported before the first save
    group = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        import torch.distributed as tdist

        group = tdist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=timeout_s))
    store = _store_everywhere(store, create, group)
    ce = UcpCheckpointEngine(engine, store, run, background=background, timeout_s=timeout_s, message=message,
                             progress=progress, group=group, durability=durability)
    old = engine.checkpoint_engine
    engine.checkpoint_engine = ce
    engine._ucp_previous = (old, engine.save_checkpoint, engine.__dict__.get("_copy_recovery_script"))
    original = engine.save_checkpoint

    def save_checkpoint(save_dir=None, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's save_checkpoint into the ucp store (``save_dir`` and ``save_latest`` are ignored)."""
        if exclude_frozen_parameters:
            raise ConfigurationError("exclude_frozen_parameters=True is not supported by the ucp engine: the stored "
                                     "version must be complete")
        ce._client_state = client_state or {}  # every rank's: DeepSpeed writes only DP rank 0's into a file
        original(save_dir or f"ucp-store:{run}", tag=tag, client_state=client_state or {}, save_latest=False,
                 exclude_frozen_parameters=False)
        return True

    engine.save_checkpoint = save_checkpoint
    engine._copy_recovery_script = lambda *a, **k: None  # zero_to_fp32.py is a file; the store needs none
    opt = engine.optimizer
    opt_step = opt.step

    def step(*args, **kwargs):
        """The optimizer's step, once a background save has staged the state this step mutates."""
        ce.wait_staged()
        return opt_step(*args, **kwargs)

    opt.step = step
    engine._ucp_previous = (*engine._ucp_previous, opt)
    return ce


def detach(engine) -> None:
    """Undo :func:`attach` (waits for a background save first)."""
    ce = engine.checkpoint_engine
    if isinstance(ce, UcpCheckpointEngine):
        ce.wait()
    prev = engine.__dict__.pop("_ucp_previous", None)
    if prev is None:
        return
    engine.checkpoint_engine = prev[0]
    engine.__dict__.pop("save_checkpoint", None)
    engine.__dict__.pop("_copy_recovery_script", None)
    prev[3].__dict__.pop("step", None)
    if prev[2] is not None:
        engine._copy_recovery_script = prev[2]
