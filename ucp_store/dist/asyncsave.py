"""``async_save``: stage the state in host memory, return, and write + commit in the background.

The call blocks only for planning (one small gather on the control group) and the copy of this rank's
boxes into a staging buffer (host memory, pinned when the tensors are on a GPU, copied with
``non_blocking`` and one synchronise). The buffers are kept and reused by the next call with the same
layout. After the call returns, training may change its tensors at will: the background writer only
reads the staging buffers, so the committed version is the state at the moment of the call.

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
"""

from __future__ import annotations

import atexit
import math
import mmap
import os
import sys
import threading
import time
from typing import Any

import torch

from ..errors import ConfigurationError, UcpError
from .api import _Ctx, _open_everywhere, _plan_save, _SavePlan, _write_plan

__all__ = ["AsyncSaveHandle", "async_save", "close", "prepare_async", "wait"]

_MODES = ("thread", "process")
_LOCK = threading.Lock()
_PENDING: AsyncSaveHandle | None = None


class AsyncSaveHandle:
    """The future of one ``async_save``: ``result()`` gives the version id or raises the background error."""

    def __init__(self, run: str, step: int, mode: str):
        self.run, self.step, self.mode = run, step, mode
        self._event = threading.Event()
        self._id: str | None = None
        self._error: BaseException | None = None
        #: seconds the caller was blocked (planning + staging)
        self.blocked_s = 0.0
        #: bytes this rank staged
        self.staged_bytes = 0

    def _finish(self, cid: str | None, error: BaseException | None) -> None:
        self._id, self._error = cid, error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> str:
        """Wait for the commit; returns the version id, or raises what failed (on any rank)."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"async save of {self.run}@{self.step} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._id  # type: ignore[return-value]

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"AsyncSaveHandle({self.run}@{self.step}, {self.mode}, {state})"


def wait() -> None:
    """Wait for the async save in flight, if any (its error stays on its handle)."""
    with _LOCK:
        pending = _PENDING
    if pending is not None:
        pending._event.wait()


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

    def stage(self, plan: _SavePlan, *, shared: bool, copy: bool = True,
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

    def __init__(self, ctx: _Ctx):
        import torch.multiprocessing as mp

        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), 0
        if ctx.rank == 0:
            import socket

            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        addr, port = ctx.gather((addr, port))[0] if ctx.dist is not None else (addr, port)
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

    from ..distributed import default_timeout

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
            ctx = _Ctx(None, tag="async-writer")
            plan = _SavePlan(payload["items"], [], payload["objects"], payload["provenance"], payload["per_rank"],
                             payload["rank_objects"])
            st = _open_everywhere(payload["store"], True, ctx)
            cid = _write_plan(st, plan, buffers, ctx, run=payload["run"], step=payload["step"],
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


# ----------------------------------------------------------------------------------------- the call
def _writer_for(ctx: _Ctx) -> _WriterProcess:
    key = (ctx.rank, ctx.world)
    writer = _WRITERS.get(key)
    if writer is None or not writer.proc.is_alive():
        writer = _WRITERS[key] = _WriterProcess(ctx)
    return writer


def prepare_async(state_dict: dict, *, mode: str = "thread", group=None, mesh=None) -> None:
    """Do at setup what the first ``async_save`` of this state's layout would do on the caller's clock: make
    the staging buffers (pinned for device tensors, else memory whose pages are mapped now), the background
    group, and in ``"process"`` mode start the writer process and hand it the buffers. Call on every rank,
    with the state dict (or one of the same layout) later passed to ``async_save``, like DCP's pinned-memory
    staging set up ahead; the first ``async_save`` then only copies. Optional: without it the first call
    does this work itself."""
    if mode not in _MODES:
        raise ConfigurationError(f"prepare_async: mode={mode!r}; expected one of {', '.join(_MODES)}")
    wait()
    ctx = _Ctx(group)
    plan = _plan_save(state_dict, ctx, mesh)
    _STAGER.stage(plan, shared=mode == "process", copy=False)
    if mode == "thread":
        _Ctx(group, tag="async")
    else:
        _writer_for(ctx).share(_STAGER.shared_spec(), _STAGER.generation)


def async_save(state_dict: dict, *, store: Any = None, run: str, step: int, message: str | None = None,
               parent: str | None = "auto", group=None, mode: str = "thread", create: bool = True,
               mesh=None) -> AsyncSaveHandle:
    """Like ``save``, but return once the state is staged in host memory; write and commit in the background.

    ``mode`` is ``"thread"`` or ``"process"`` (see the module docstring). Call on every rank. The returned
    handle's ``result()`` gives the version id or raises; a later call waits for this one first. Per-rank
    state is detected and stored as ``save`` does (its contents copied at the call), keyed by ``mesh``."""
    global _PENDING
    if mode not in _MODES:
        raise ConfigurationError(f"async_save: mode={mode!r}; expected one of {', '.join(_MODES)}")
    store_mod = sys.modules.get("ucp_store.store")  # not imported yet: ``store`` cannot be a Store (and the
    if mode == "process" and store_mod is not None and isinstance(store, store_mod.Store):  # import stays off
        store = store.location.url  # the caller's clock: the background opens the store)
    wait()
    t0 = time.perf_counter()
    ctx = _Ctx(group)
    plan = _plan_save(state_dict, ctx, mesh)
    # process mode, new layout: shared pages fault in far slower than private ones, so the caller stages
    # into private memory and a background thread fills the shared buffers from it for the writer
    cold_process = mode == "process" and _STAGER.signature != (plan.signature(), True)
    buffers = _Stager().stage(plan, shared=False) if cold_process else _STAGER.stage(plan, shared=mode == "process")
    handle = AsyncSaveHandle(run, step, mode)
    handle.staged_bytes = sum(b.numel() * b.element_size() for b in buffers)
    if mode == "thread":
        bg = _Ctx(group, tag="async")  # its own gloo group: its collectives never interleave with the caller's
        staged = list(buffers)

        def work() -> None:
            try:
                st = _open_everywhere(store, create, bg)
                cid = _write_plan(st, plan, staged, bg, run=run, step=step, message=message, parent=parent,
                                  progress=False)
                handle._finish(cid, None)
            except BaseException as exc:  # noqa: BLE001 - handed to result()
                handle._finish(None, exc)

        thread = threading.Thread(target=work, daemon=True, name="ucp-async-save")
    else:
        # started after staging (on the first call): its interpreter boots after this call returns, not
        # beside the copy (on a busy host the import competed with the staging for the CPU)
        writer = _writer_for(ctx)
        job = {"items": plan.items, "objects": plan.objects, "provenance": plan.provenance,
               "per_rank": plan.per_rank, "rank_objects": plan.rank_objects,
               "store": store if store is None else os.fspath(store) if not isinstance(store, str) else store,
               "run": run, "step": step, "message": message, "parent": parent}
        thread = None
        if cold_process:
            private = buffers

            def share() -> None:
                try:
                    _STAGER.stage(plan, shared=True, views=private)  # the next calls stage straight into these
                    writer.submit(handle, _STAGER.shared_spec(), _STAGER.generation, job)
                except BaseException as exc:  # noqa: BLE001 - handed to result()
                    handle._finish(None, exc)

            thread = threading.Thread(target=share, daemon=True, name="ucp-async-share")
    with _LOCK:
        _PENDING = handle
    if thread is not None:
        thread.start()
    else:  # process mode, buffers shared already: the writer was looked up or started above
        writer.submit(handle, _STAGER.shared_spec(), _STAGER.generation, job)
    handle.blocked_s = time.perf_counter() - t0
    return handle
