"""``async_save``: stage the state in host memory, return, and write + commit in the background.

The call blocks only for planning (none once the plan of the layout is cached: its check runs in the writer
thread, ``check="background"``) and the copy of this rank's boxes into a staging buffer (host memory,
pinned when the tensors are on a GPU, copied with ``non_blocking`` and one synchronise). The buffers are
kept and reused by the next call with the same layout. After the call returns, training may change its
tensors at will: the background writer only reads the staging buffers, so the committed version is the
state at the moment of the call.

Two background modes:
- ``"thread"``: a thread of this process writes and commits (TensorStore and hashing release the GIL for
  most of the work);
- ``"process"``: a persistent writer process per rank (its own gloo group among the writers), fed the
  staging buffers through shared memory once and then only small messages: the trainer's interpreter
  does none of the writing. Shared pages fault in far slower than private ones, so the first call of a
  layout stages into private memory and a background thread copies that into the shared buffers, which
  later calls stage into directly. ``tools/bench_dist.py`` measures both modes.

``prepare_async`` makes the buffers (and the writer process, or the background group) at setup, so even
the first call only copies.

A second ``async_save`` (or ``save`` / ``load``) first waits for the one in flight. ``handle.result()``
returns the version id or raises the background error; every rank raises when any rank failed, and
nothing is listed then.

Lazy snapshot (``lazy=True``; the default once an optimizer gate is installed, see ``async_save``): the call
copies only the buffers forward changes and returns after the plan; a background thread copies the rest
while the caller runs its next forward and backward, and the optimizer's step pre-hook waits for the boxes
that step changes. A version-counter guard fails the save, never storing a later state, when anything else
changed a tensor in place before its copy. ``snapshot.py`` holds that logic.
"""

from __future__ import annotations

import atexit
import math
import mmap
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ucp_store._killpoints import killpoint
from ucp_store.distributed import inflight
from ucp_store.distributed import snapshot as snap_mod
from ucp_store.distributed.context import Ctx
from ucp_store.distributed.inflight import AsyncSaveHandle, wait
from ucp_store.distributed.planner import SavePlan, confirm_cached_plan, forget_plan, plan_save, settle_cached_plan
from ucp_store.distributed.saver import open_everywhere, write_plan
from ucp_store.distributed.statedict import path_text
from ucp_store.errors import ConfigurationError, StalePlanError, UcpError

__all__ = ["AsyncSaveHandle", "async_save", "close", "prepare_async", "wait"]

_MODES = ("thread", "process")
_CHECKS = ("background", "call")


# ----------------------------------------------------------------------------------------- staging
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; older kernels refuse it and the first copy faults the pages in


def _populate(addr: int, nbytes: int) -> None:
    """Map the pages of ``[addr, addr + nbytes)`` now, in one call (ctypes releases the GIL meanwhile)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = addr & ~(mmap.PAGESIZE - 1)
    libc.madvise(ctypes.c_void_p(start), nbytes + addr - start, _MADV_POPULATE_WRITE)


def _host_buffer(shape: tuple, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor for staging: pinned for device tensors, otherwise prefaulted anonymous
    memory (``MAP_POPULATE``: the kernel maps every page in one call instead of one page fault per 4 KiB on
    the first copy, which is most of a first call's cost)."""
    if pin:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if not populate or nbytes < (1 << 20):
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate),
                           dtype=torch.uint8)  # the tensor keeps the mapping alive
    return raw.view(dtype).view(shape)


class _Arena:
    """The process mode's staging buffers: one ``memfd`` (Linux) that the writer process maps through
    ``/proc/<pid>/fd/<fd>``, every buffer at a page-aligned offset. Cheaper than torch's shared storages
    (created and faulted page by page), and nothing is left in /dev/shm when a process dies."""

    def __init__(self, specs: list[tuple[tuple, torch.dtype]]):
        self.layout: list[tuple[int, int, tuple, torch.dtype]] = []  # (offset, nbytes, shape, dtype)
        total = 0
        for shape, dtype in specs:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            self.layout.append((total, nbytes, shape, dtype))
            total += -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.size = max(total, mmap.PAGESIZE)
        self.fd = os.memfd_create("ucp-async-stage")
        os.ftruncate(self.fd, self.size)
        self.raw = torch.frombuffer(mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED), dtype=torch.uint8)
        self.buffers = [_arena_view(self.raw, *item) for item in self.layout]

    def populate(self, i: int) -> torch.Tensor:
        off, nbytes, _, _ = self.layout[i]
        if nbytes:
            _populate(self.raw.data_ptr() + off, nbytes)
        return self.buffers[i]

    def describe(self) -> dict:
        """What the writer process needs to map the same buffers."""
        return {"path": f"/proc/{os.getpid()}/fd/{self.fd}", "size": self.size, "layout": self.layout}

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            os.close(fd)


def _arena_view(raw: torch.Tensor, off: int, nbytes: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return raw[off:off + nbytes].view(dtype).view(shape)


def _map_arena(desc: dict) -> list[torch.Tensor]:
    """The writer process's view of the trainer's arena."""
    fd = os.open(desc["path"], os.O_RDWR)
    try:
        raw = torch.frombuffer(mmap.mmap(fd, desc["size"], flags=mmap.MAP_SHARED), dtype=torch.uint8)
    finally:
        os.close(fd)
    return [_arena_view(raw, *item) for item in desc["layout"]]


class _Stager:
    """Host buffers for this rank's boxes, reused while the layout stays the same."""

    def __init__(self) -> None:
        self.signature: tuple | None = None
        self.buffers: list[torch.Tensor] = []
        self.arena: _Arena | None = None
        self.generation = 0

    def shared_spec(self) -> Any:
        """What the writer process maps: the arena's description, or the shared tensors themselves."""
        return self.arena.describe() if self.arena is not None else self.buffers

    def stage(self, plan: SavePlan, *, shared: bool, copy: bool = True,
              views: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """This rank's boxes copied into the staging buffers (made, and their pages mapped, when the layout is
        new). ``copy=False`` (``prepare_async``) only makes the buffers. ``views``: copy these instead of the
        plan's boxes (the same shapes: a private first staging moved into shared buffers)."""
        sig = (plan.signature(), shared)
        if views is None:
            views = [src[sl] if sl else src for src, sl in plan.sources]
        cuda = any(v.device.type == "cuda" for v in views)
        if sig == self.signature:
            if copy:
                for b, v in zip(self.buffers, views):
                    b.copy_(v, non_blocking=v.device.type == "cuda")
        else:
            # a new layout (the first call): a helper thread maps the next buffer's pages while this one
            # copies into the previous (both release the GIL), so allocation and copy overlap
            self.buffers, self.signature, self.arena = [], None, None
            from concurrent.futures import ThreadPoolExecutor

            specs = [(tuple(v.shape), v.dtype) for v in views]
            if shared and hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd"):
                self.arena = _Arena(specs)
                make = self.arena.populate
            elif shared:  # no memfd: torch's shared storages
                def make(i: int) -> torch.Tensor:
                    shape, dtype = specs[i]
                    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                    return torch.empty(0, dtype=dtype).set_(  # type: ignore[call-overload]
                        torch.UntypedStorage._new_shared(nbytes), 0, shape)
            else:
                def make(i: int) -> torch.Tensor:
                    return _host_buffer(*specs[i], pin=views[i].device.type == "cuda")
            with ThreadPoolExecutor(1, thread_name_prefix="ucp-stage") as pool:
                futures = [pool.submit(make, i) for i in range(len(views))]
                for f, v in zip(futures, views):
                    b = f.result()
                    if copy:
                        b.copy_(v, non_blocking=v.device.type == "cuda")
                    self.buffers.append(b)
            self.signature = sig
            self.generation += 1
        if cuda and copy:
            torch.cuda.synchronize()
        return self.buffers


_STAGER = _Stager()


# ----------------------------------------------------------------------------------------- process mode
class _WriterProcess:
    """One persistent writer process for this rank, and the thread that waits for its answers."""

    def __init__(self, ctx: Ctx):
        import torch.multiprocessing as mp

        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), 0
        if ctx.rank == 0:
            import socket

            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        # rank 0's address for the writer processes' own group (only its answer travels back)
        addr, port = ctx.agree([addr, port], lambda everyone: everyone[0]) if ctx.dist is not None else (addr, port)
        mpctx = mp.get_context("spawn")
        self.requests = mpctx.Queue()
        self.responses = mpctx.Queue()
        self.proc = mpctx.Process(target=_writer_main, args=(self.requests, self.responses, ctx.rank, ctx.world,
                                                             addr, port), daemon=True, name="ucp-async-writer")
        self.proc.start()
        self.generation = -1
        self.key = (ctx.rank, ctx.world)

    def share(self, buffers, generation: int) -> None:
        """Hand the writer the staging buffers of ``generation`` (it maps them once)."""
        if generation != self.generation:
            self.requests.put(("buffers", buffers))
            self.generation = generation

    def submit(self, handle: AsyncSaveHandle, buffers, generation: int, job: dict) -> None:
        self.share(buffers, generation)
        self.requests.put(("save", job))

        def waiter() -> None:
            while True:
                try:
                    kind, payload = self.responses.get(timeout=5)
                    break
                except Exception:  # noqa: BLE001 - queue.Empty: check that the writer is alive
                    if not self.proc.is_alive():
                        kind, payload = "error", f"the async writer process died (exit code {self.proc.exitcode})"
                        break
            if kind == "ok":
                handle._finish(payload, None)
            else:
                handle._finish(None, UcpError(f"async save of {handle.run}@{handle.step} failed: {payload}"))

        threading.Thread(target=waiter, daemon=True, name="ucp-async-wait").start()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.requests.put(("stop", None))
            self.proc.join(timeout=30)
            if self.proc.is_alive():
                self.proc.kill()


def _writer_main(requests, responses, rank: int, world: int, addr: str, port: int) -> None:
    """The writer process: its own gloo world among the ranks' writers; writes and commits each job."""
    import datetime as _dt

    import torch.distributed as dist

    from ucp_store.distributed.commit import default_timeout

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                                timeout=_dt.timedelta(seconds=default_timeout()))
    buffers: list[torch.Tensor] = []
    while True:
        kind, payload = requests.get()
        if kind == "stop":
            break
        if kind == "buffers":
            buffers = _map_arena(payload) if isinstance(payload, dict) else payload
            continue
        try:
            snap_mod.lower_writer_priority(payload.get("nice", 0))  # the trainer's processes get the CPU first
            ctx = Ctx(None, tag="async-writer")
            plan = SavePlan(payload["items"], [], payload["objects"], payload["provenance"], payload["per_rank"],
                             payload["rank_objects"])
            st = open_everywhere(payload["store"], True, ctx)
            cid = write_plan(st, plan, buffers, ctx, run=payload["run"], step=payload["step"],
                              message=payload["message"], parent=payload["parent"], progress=False)
            responses.put(("ok", cid))
        except BaseException as exc:  # noqa: BLE001 - reported to the trainer
            responses.put(("error", f"{type(exc).__name__}: {exc}"))
    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()


_WRITERS: dict[tuple, _WriterProcess] = {}


def close() -> None:
    """Wait for the save in flight and stop the writer processes (also run at exit)."""
    wait()
    for w in list(_WRITERS.values()):
        w.stop()
    _WRITERS.clear()


atexit.register(close)


# ----------------------------------------------------------------------------------------- background threads
class _Worker:
    """One long-lived daemon thread that runs what is handed to it, in order: a call hands its background work
    over with a queue put instead of starting a thread (whose start-up handshake the caller would wait for)."""

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, daemon=True, name=self.name)
                self._thread.start()
        self._queue.put(fn)

    def _loop(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                fn()
            except BaseException:  # noqa: BLE001, S110 - each job hands its own error to its handle
                pass


#: the snapshot copy keeps the caller's priority; the writers run at the niceness each save asked for (a thread
#: cannot raise its priority back once lowered)
_SNAPSHOT_WORKER = _Worker("ucp-async-snapshot")
_WRITE_WORKERS: dict[int, _Worker] = {}


def _write_worker(nice: int) -> _Worker:
    w = _WRITE_WORKERS.get(nice)
    if w is None:
        w = _WRITE_WORKERS[nice] = _Worker(f"ucp-async-save-nice{nice}")
    return w


# ----------------------------------------------------------------------------------------- the call
def _writer_for(ctx: Ctx) -> _WriterProcess:
    key = (ctx.rank, ctx.world)
    writer = _WRITERS.get(key)
    if writer is None or not writer.proc.is_alive():
        writer = _WRITERS[key] = _WriterProcess(ctx)
    return writer


def _optimizers(optimizer) -> list:
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def prepare_async(state_dict: dict, *, mode: str = "thread", group=None, mesh=None, optimizer=None) -> None:
    """Do at setup what the first ``async_save`` of this state's layout would do on the caller's clock: make
    the staging buffers (pinned for device tensors, else memory whose pages are mapped now), the background
    group, and in ``"process"`` mode start the writer process and hand it the buffers. Call on every rank,
    with the state dict (or one of the same layout) later passed to ``async_save``, like DCP's pinned-memory
    staging set up ahead; the first ``async_save`` then only copies. Optional: without it the first call
    does this work itself. ``optimizer`` (one or a list): install the pre-step gate of the lazy snapshot on
    it (see ``async_save``), which makes later calls lazy by default."""
    if mode not in _MODES:
        raise ConfigurationError(f"prepare_async: mode={mode!r}; expected one of {', '.join(_MODES)}")
    wait()
    for opt in _optimizers(optimizer):
        snap_mod.install_gate(opt)
    ctx = Ctx(group)
    plan = plan_save(state_dict, ctx, mesh)
    _STAGER.stage(plan, shared=mode == "process", copy=False)
    Ctx(group, tag="async")
    if mode == "process":
        _writer_for(ctx).share(_STAGER.shared_spec(), _STAGER.generation)


def async_save(state_dict: dict, *, store: Any = None, run: str, step: int, message: str | None = None,
               parent: str | None = "auto", group=None, mode: str = "thread", create: bool = True,
               mesh=None, lazy: bool | None = None, optimizer=None, eager: tuple[str, ...] | list[str] = (),
               writer_nice: int = 10, check: str = "background", tier: str = "durable",
               **tiered: Any) -> AsyncSaveHandle:
    """Like ``save``, but return before the data is written; write and commit in the background.

    ``mode`` is ``"thread"`` or ``"process"`` (see the module docstring). Call on every rank. The returned
    handle's ``result()`` gives the version id or raises; a later call waits for this one first. Per-rank
    state is detected and stored as ``save`` does (its contents copied at the call), keyed by ``mesh``.

    ``lazy``: whether the parameters and optimizer state are copied after the call returns, overlapping
    the caller's next forward and backward (the JSON values, per-rank contents and the buffers forward
    changes are taken at the call either way). ``optimizer`` (one or a list) gets a step pre-hook that
    waits for the boxes its step will change, so the next step never changes what is not yet copied.
    Default (``None``): lazy exactly when such a gate is installed (here or by ``prepare_async``). Why not
    always: without a gate, whether the copy beats the next ``step`` is a matter of timing, so a save
    would fail now and then; with the gate, only an in-place change outside the optimizer (``p.data.mul_``,
    an EMA written in place, a buffer forward updates that ``eager`` does not name) can fail it, and it
    does so on every rank, naming the entry (``SnapshotChangedError``), never storing a later state.
    ``eager``: fnmatch patterns of dotted state-dict paths copied at the call (BatchNorm's
    ``running_mean``, ``running_var`` and ``num_batches_tracked`` always are). ``writer_nice``: the
    scheduling niceness of the background writer's threads (hashing and writes; 0 leaves it), so the
    training threads get the CPU first; the snapshot copy itself keeps the caller's priority.

    ``check``: where a cached plan (the layout of the last save) is checked against every rank's state.
    ``"background"`` (thread mode): the call runs no collective at all; the writer thread checks before it
    writes. When every rank's layout changed, each rank copied its state at the call and the background plans
    afresh; when it changed on some ranks only, or which entries are equal on every rank changed, that save
    fails (``StalePlanError`` from ``result()``, nothing listed) and the next one plans afresh in its call.
    ``"call"`` (and process mode): the check is four small collectives in the call, and a changed plan is
    made there, so no save fails for it.

    ``tier="fast"`` (thread mode; issue 38): the background writes to each node's fast tier, replicates and
    queues the drain, as ``save(tier="fast")`` does; ``result()`` is then a ``TieredResult`` (its ``wait(level)``
    and ``safety``). Its options (``replicas``, ``node``, ``fast_tier``, ...): ``distributed.tiered.setup``."""
    if mode not in _MODES:
        raise ConfigurationError(f"async_save: mode={mode!r}; expected one of {', '.join(_MODES)}")
    if check not in _CHECKS:
        raise ConfigurationError(f"async_save: check={check!r}; expected one of {', '.join(_CHECKS)}")
    if isinstance(eager, str):
        raise ConfigurationError(f"async_save: eager={eager!r}; expected a list of fnmatch patterns")
    store_mod = sys.modules.get("ucp_store.store")  # not imported yet: ``store`` cannot be a Store (and the
    if mode == "process" and store_mod is not None and isinstance(store, store_mod.Store):  # import stays off
        store = store.location.url  # the caller's clock: the background opens the store)
    wait()
    t0 = time.perf_counter()
    for opt in _optimizers(optimizer):
        snap_mod.install_gate(opt)
    gated = snap_mod.gated_optimizers()
    lazy = bool(gated) if lazy is None else bool(lazy)
    ctx = Ctx(group)
    tier_setup = _tier_setup(ctx, mode, tier, tiered)
    plan = plan_save(state_dict, ctx, mesh, cache=True)  # a cached plan: no collective; a first layout plans
    frozen = None
    if check == "call" or mode == "process":  # the cached plan's check: four small collectives, here
        plan = confirm_cached_plan(plan, state_dict, ctx, mesh)
    elif plan.check is not None and not plan.check["key_ok"]:
        # this rank's layout changed: it keeps a copy of its state, from which the background plans afresh when
        # every rank's did (its check finds out); the others run no collective in their call
        frozen = _freeze(state_dict)
    handle = AsyncSaveHandle(run, step, mode)
    job = {"store": store, "create": create, "run": run, "step": step, "message": message, "parent": parent,
           "group": group, "nice": writer_nice, "frozen": frozen, "mesh": mesh, "tier": tier_setup}
    launch: Callable[[], None] | None
    if lazy:
        launch = _start_lazy(handle, plan, ctx, job, gated, tuple(eager))
    else:
        launch = _start_eager(handle, plan, ctx, job)
    inflight.set_pending(handle)
    if launch is not None:
        launch()
    handle.blocked_s = time.perf_counter() - t0
    return handle


def _tier_setup(ctx: Ctx, mode: str, tier: str, options: dict) -> Any:
    """``async_save(tier="fast")``: the tiered save's call-time part (``tiered.setup``), or None."""
    if tier == "durable" and not options:
        return None
    from ucp_store.distributed import tiered

    known = tiered.option_names()
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigurationError(f"async_save: unexpected argument(s) {', '.join(unknown)}; besides save's own, it "
                                 f"takes the fast tier's options {', '.join(known)} (with tier='fast')")
    if tier != "fast" or mode != "thread":
        raise ConfigurationError(f"async_save: tier={tier!r} with mode={mode!r}; expected tier 'durable', or 'fast' "
                                 "in thread mode")
    return tiered.setup(ctx, **options)


def _process_job(plan: SavePlan, job: dict) -> dict:
    store = job["store"]
    return {"items": plan.items, "objects": plan.objects, "provenance": plan.provenance,
            "per_rank": plan.per_rank, "rank_objects": plan.rank_objects,
            "store": store if store is None else os.fspath(store) if not isinstance(store, str) else store,
            "run": job["run"], "step": job["step"], "message": job["message"], "parent": job["parent"],
            "nice": job["nice"]}


def _freeze(obj: Any) -> Any:
    """A copy of a state dict at the call (tensors cloned, DTensors as DTensors; containers rebuilt)."""
    import copy

    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, _freeze(v)) for k, v in obj.items()) if type(obj) is dict else \
            {k: _freeze(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_freeze(v) for v in obj)
    return copy.deepcopy(obj)


def _settle_in_background(plan: SavePlan, staged: list[torch.Tensor], bg: Ctx,
                          job: dict) -> tuple[SavePlan, list[torch.Tensor]]:
    """``check="background"``: the cached plan's check, before anything is begun (``settle_cached_plan``).
    Holds: write as planned. Every rank's layout changed: plan afresh from the copies taken at the call.
    Otherwise: every rank fails this save (``StalePlanError``) and drops the plan."""
    verdict = settle_cached_plan(plan, bg, "async save (the cached plan's check, in the background)")
    if verdict == "holds":
        plan.check = None  # settled: the commit carries no second check
        return plan, staged
    forget_plan(bg)  # on every rank: the next save (or the planning below) plans afresh
    if verdict == "replan" and job.get("frozen") is not None:
        fresh = plan_save(job["frozen"], bg, job.get("mesh"), cache=True)
        forget_plan(bg, plan=False, description=True)  # the plan stays; its description would hold the copies
        return fresh, [src[sl] if sl else src for src, sl in fresh.sources]
    raise StalePlanError(f"async save of {job['run']}@{job['step']}: the state dict's layout changed on some ranks "
                         "only, or which entries are equal on every rank changed, since the cached plan; aborted "
                         "(nothing listed). The next save plans afresh (check='call' plans in the call instead).")


def _write_thread(handle: AsyncSaveHandle, plan: SavePlan, staged: list[torch.Tensor], bg: Ctx, job: dict) -> None:
    """The thread mode's writer (on the background thread, at the writer's priority)."""
    snap_mod.lower_writer_priority(job["nice"])
    plan, staged = _settle_in_background(plan, staged, bg, job)
    if job.get("tier") is not None:  # tier="fast": written to the nodes' fast tiers, replicated, drain queued
        cid = job["tier"].run(write_plan, plan, staged, bg, store=job["store"], create=job["create"], run=job["run"],
                              step=job["step"], message=job["message"], parent=job["parent"], progress=False)
    else:
        st = open_everywhere(job["store"], job["create"], bg)
        cid = write_plan(st, plan, staged, bg, run=job["run"], step=job["step"], message=job["message"],
                         parent=job["parent"], progress=False)
    handle._finish(cid, None)


def _start_eager(handle: AsyncSaveHandle, plan: SavePlan, ctx: Ctx, job: dict) -> Callable[[], None] | None:
    """Today's path: every box copied into the staging buffers before the call returns."""
    mode = handle.mode
    # process mode, new layout: shared pages fault in far slower than private ones, so the caller stages
    # into private memory and a background thread fills the shared buffers from it for the writer
    cold_process = mode == "process" and _STAGER.signature != (plan.signature(), True)
    buffers = _Stager().stage(plan, shared=False) if cold_process else _STAGER.stage(plan, shared=mode == "process")
    handle.staged_bytes = sum(b.numel() * b.element_size() for b in buffers)
    if mode == "thread":
        bg = Ctx(job["group"], tag="async")  # its own gloo group: its collectives never interleave with the caller's
        staged = list(buffers)

        def work() -> None:
            try:
                _write_thread(handle, plan, staged, bg, job)
            except BaseException as exc:  # noqa: BLE001 - handed to result()
                handle._finish(None, exc)

        return lambda: _write_worker(job["nice"]).submit(work)
    # started after staging (on the first call): its interpreter boots after this call returns, not
    # beside the copy (on a busy host the import competed with the staging for the CPU)
    writer = _writer_for(ctx)
    pjob = _process_job(plan, job)
    if not cold_process:  # buffers shared already
        writer.submit(handle, _STAGER.shared_spec(), _STAGER.generation, pjob)
        return None
    private = buffers

    def share() -> None:
        try:
            _STAGER.stage(plan, shared=True, views=private)  # the next calls stage straight into these
            writer.submit(handle, _STAGER.shared_spec(), _STAGER.generation, pjob)
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            handle._finish(None, exc)

    return threading.Thread(target=share, daemon=True, name="ucp-async-share").start


#: tensors up to this size are copied at the call (a version check and samples would cost as much)
TINY_BYTES = 64

#: the last lazy call's jobs, kept while the plan is over the same tensors (``SavePlan.ident``) and the gated
#: optimizers hold the same parameters: (index, view, owner, what) in copy order, the gates, the
#: boxes copied at the call
_JOBS: dict[str, Any] = {}


def _opt_sig(opt: torch.optim.Optimizer) -> tuple:
    return id(opt), tuple(len(g["params"]) for g in opt.param_groups), len(opt.state)


def _lazy_jobs(plan: SavePlan, eager: tuple[str, ...],
               gated: list) -> tuple[list[snap_mod.Job], dict[int, int], dict[int, torch.Tensor]]:
    """The boxes the background copies, in copy order (each with its owner's version now), the gates' counts,
    and the boxes copied now. The order, the gates and which boxes are eager depend only on the tensors and the
    optimizers, so a call over the same ones (the same ``plan.ident``) reuses them and reads only the versions
    and samples now."""
    key = None if plan.ident is None else (plan.ident, eager, tuple(_opt_sig(o) for o in gated))
    if key is None or _JOBS.get("key") != key:
        jobs, now_idx = _describe_jobs(plan, eager)
        ordered, gates = snap_mod.order_jobs(jobs, gated)
        template = [(j.index, j.src, j.owner, j.what) for j in ordered]
        if key is not None:
            _JOBS.clear()
            _JOBS.update(key=key, template=template, gates=gates, now=now_idx)
    else:
        template, gates, now_idx = _JOBS["template"], _JOBS["gates"], _JOBS["now"]
    ordered = [snap_mod.Job(i, view, owner, owner._version, what, snap_mod.take_samples(view))
               for i, view, owner, what in template]
    now: dict[int, torch.Tensor] = {}
    for i in now_idx:  # forward changes it: copied now (a device buffer synchronously: these are small)
        src, sl = plan.sources[i]
        view = src[sl] if sl else src
        now[i] = view.to("cpu", copy=True) if view.is_cuda else view.clone()
    return ordered, gates, now


def _describe_jobs(plan: SavePlan, eager: tuple[str, ...]) -> tuple[list[snap_mod.Job], list[int]]:
    """Every box of the plan as a job to order (its version and samples are read by ``_lazy_jobs``), but those
    copied at the call (their indexes)."""
    paths = {tuple(o["tensor"]): path_text(tuple(o["path"])) for o in plan.objects if "tensor" in o}
    jobs: list[snap_mod.Job] = []
    now: list[int] = []
    for i, (it, (src, sl)) in enumerate(zip(plan.items, plan.sources)):
        path = paths.get((it.name, it.state), f"{it.name} [{it.state}]")
        view = src[sl] if sl else src
        # a tiny tensor (an optimizer's step count) is copied now: as cheap as sampling it for the guard
        if snap_mod.is_eager(path, eager) or view.numel() * view.element_size() <= TINY_BYTES:
            now.append(i)
            continue
        jobs.append(snap_mod.Job(i, view, src, src._version, f"state dict entry {path!r}"))
    return jobs, now


def _start_lazy(handle: AsyncSaveHandle, plan: SavePlan, ctx: Ctx, job: dict, gated: list,
                eager: tuple[str, ...]) -> Callable[[], None]:
    """The lazy path: only the eager boxes now; the snapshot thread copies the rest (the gates wait for it),
    then the writer thread agrees with every rank that the snapshot is sound and writes (thread mode) or hands
    the buffers to the writer process. Returns what starts it."""
    ordered, gates, now = _lazy_jobs(plan, eager, gated)
    snap = handle.snapshot = snap_mod.Snapshot(ordered, gates, on_copy=lambda n: killpoint("async.mid_copy"))
    snap_mod.set_current(snap)
    shared = handle.mode == "process"
    writer = _writer_for(ctx) if shared else None

    def copy() -> None:  # the snapshot thread, at the caller's priority
        staged: list[torch.Tensor] = []
        error: BaseException | None = None
        try:
            buffers = _STAGER.stage(plan, shared=shared, copy=False)  # made when the layout is new
            handle.staged_bytes = sum(b.numel() * b.element_size() for b in buffers)
            snap.run(buffers)
            staged = list(buffers)
            for i, t in now.items():
                if shared:  # the writer process reads the shared buffers only
                    buffers[i].copy_(t)
                else:
                    staged[i] = t
        except BaseException as exc:  # noqa: BLE001 - every rank learns of it below
            snap.fail(exc)
            error = exc
        _write_worker(job["nice"]).submit(lambda: write(staged, error or snap.error))

    def write(staged: list[torch.Tensor], error: BaseException | None) -> None:  # the writer thread
        try:
            bg = Ctx(job["group"], tag="async")  # its own gloo group: never interleaved with the caller's
            # every rank learns of a changed tensor before anything is begun: all raise, nothing is listed
            bg.raise_if_any_failed(error, f"async save of {job['run']}@{job['step']} (snapshot)")
            if writer is None:
                _write_thread(handle, plan, staged, bg, job)
            else:
                writer.submit(handle, _STAGER.shared_spec(), _STAGER.generation, _process_job(plan, job))
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            handle._finish(None, exc)

    return lambda: _SNAPSHOT_WORKER.submit(copy)
