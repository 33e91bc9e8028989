"""The lazy snapshot of an ``async_save``: which tensors are copied when, the version guard, the pre-step gate.

At the call only what the next forward may change is copied (buffers that forward updates: BatchNorm's
running statistics and any entry the caller names in ``eager=``); JSON values and per-rank contents are
taken by the plan. Every other box is copied by a background thread while the caller runs its next
forward and backward, into the staging buffers the writer then reads.

Order and gate: the boxes of tensors an optimizer with a gate will change (its parameters and their state,
matched by storage) are copied first, in that optimizer's parameter order; then the rest in the state
dict's order. The gate is a step pre-hook (``Optimizer.register_step_pre_hook``) that waits until the
boxes of *its* optimizer are copied, and for nothing else (a frozen base model may still be copying while
the adapter's optimizer steps: nothing changes it).

Guard: each tensor's version counter (``Tensor._version``: bumped by every in-place write, through any
view of its storage) is read at the call and checked again before and after its box is copied. A change
means the copy may not be the state at the call, which is lost by then, so the save fails with
:class:`SnapshotChangedError` naming the state dict entry (no recopy: a recopy would store a later state
under this step). Every rank learns of it before the save begins, and nothing is listed.

Device tensors: the box is copied on a side stream into pinned host memory after an event recorded on the
caller's stream at the call (the caller never synchronises). The background thread waits on an event per
box before its version is checked again, so the check sees every in-place write dispatched before the copy
had landed. Not exercised on this project's CPU-only CI: the ``tensor.is_cuda`` branches below are all of it.
"""

from __future__ import annotations

import ctypes
import fnmatch
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ucp_store.errors import ConflictError

__all__ = ["EAGER_SUFFIXES", "Job", "Snapshot", "SnapshotChangedError", "gated_optimizers", "install_gate",
           "is_eager", "lower_priority", "lower_writer_priority", "order_jobs", "remove_gate", "storage_key"]

#: state dict entries forward changes in place (BatchNorm and its kin in training mode): copied at the call
EAGER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


class SnapshotChangedError(ConflictError):
    """A tensor of a lazy ``async_save`` changed in place before the snapshot had copied it."""


_ADVICE = ("Change tensors only through an optimizer gated by async_save(optimizer=...) / "
           "prepare_async(optimizer=...), name buffers that forward updates in eager=, or pass lazy=False")
#: test hook: called by the background thread before the first copy (a test holds the snapshot back with it)
_before_run: Callable[[], None] | None = None


def is_eager(path: str, patterns: Iterable[str] = ()) -> bool:
    """Whether the state dict entry ``path`` (dotted text) is copied at the call: a BatchNorm statistic, or
    matched by one of ``patterns`` (fnmatch, as ``load``'s ``per_rank`` keys)."""
    last = path.rsplit(".", 1)[-1]
    return last in EAGER_SUFFIXES or any(fnmatch.fnmatchcase(path, p) for p in patterns)


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Where ``t``'s bytes live (a DTensor's local shard is matched by its storage, as a view would be)."""
    local = getattr(t, "_local_tensor", None)  # a DTensor's shard, without to_local()'s autograd call
    if local is None:
        local = t.to_local() if hasattr(t, "to_local") else t
    return str(local.device), local.untyped_storage().data_ptr()


def _optimizer_order(opt: torch.optim.Optimizer) -> dict[tuple[str, int], int]:
    """Storage -> position in the order ``opt.step`` walks it (each parameter, then its state tensors)."""
    order: dict[tuple[str, int], int] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            order.setdefault(storage_key(p), len(order))
            for v in opt.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and v.numel():
                    order.setdefault(storage_key(v), len(order))
    return order


#: bytes read at each end of a box for the second guard
SAMPLE_BYTES = 32


def take_samples(view: torch.Tensor) -> bytes | None:
    """The first and last bytes of a host box, read at the call (None for device or strided boxes).

    The second guard: ``p.data.mul_(2)`` writes through a tensor with its own version counter (torch's
    ``.data``; and ``get_state_dict`` hands out tensors whose counters are not the parameters'), which the
    version check cannot see; a change of the whole tensor (a scale, a reload) is then still caught by
    comparing these bytes with the copy's. Read straight from memory: the call pays about a microsecond a box."""
    if view.is_cuda or not view.is_contiguous() or view.numel() == 0:
        return None
    return _ends(view.data_ptr(), view.numel() * view.element_size())


def _ends(address: int, nbytes: int) -> bytes:
    k = min(SAMPLE_BYTES, nbytes)
    return ctypes.string_at(address, k) + ctypes.string_at(address + nbytes - k, k)


@dataclass
class Job:
    """One box to copy: ``src`` (a view of ``owner``) into staging buffer ``index``."""

    index: int
    src: torch.Tensor
    owner: torch.Tensor  # whose version counter guards the box
    version: int  # owner._version at the call
    what: str  # the state dict entry, for errors
    samples: bytes | None = None  # take_samples(src) at the call


def order_jobs(jobs: Sequence[Job], optimizers: Sequence[torch.optim.Optimizer]) -> tuple[list[Job], dict[int, int]]:
    """The gated optimizers' boxes first, in parameter order, then the rest in their given order; and per
    optimizer (``id``) how many of the ordered jobs its step must wait for."""
    orders = [_optimizer_order(o) for o in optimizers]
    first: dict[int, tuple[int, int]] = {}  # job position -> (optimizer index, place in its order)
    for i, job in enumerate(jobs):
        key = storage_key(job.owner)
        for k, order in enumerate(orders):
            if key in order:
                first[i] = (k, order[key])
                break
    ranked = sorted(range(len(jobs)), key=lambda i: (first.get(i, (len(orders), 0)), i))
    ordered = [jobs[i] for i in ranked]
    gates: dict[int, int] = {}
    for k, opt in enumerate(optimizers):
        keys = orders[k]
        ends = [n + 1 for n, j in enumerate(ordered) if storage_key(j.owner) in keys]
        gates[id(opt)] = max(ends, default=0)
    return ordered, gates


# ----------------------------------------------------------------------------------------- the copy
class Snapshot:
    """The background copy of one save: ``run`` (on its thread) copies the jobs in order into ``buffers``;
    ``wait_gate(opt)`` and ``wait()`` block until enough of it is done (or it failed)."""

    def __init__(self, jobs: list[Job], gates: dict[int, int], *, on_copy: Callable[[int], None] | None = None):
        self.jobs, self.gates = jobs, gates
        self._cond = threading.Condition()
        self._copied = 0
        self._finished = False
        self.error: BaseException | None = None
        self.gate_wait_s = 0.0  # the time optimizer steps waited for this snapshot
        self.copy_s = 0.0
        self._on_copy = on_copy  # test hook / kill point, after each box
        # device tensors: the caller's stream at the call, which the copies must follow
        self._events = {str(j.src.device): _record_event(j.src.device) for j in jobs if j.src.is_cuda}

    # --- the background side
    def run(self, buffers: list[torch.Tensor]) -> None:
        """Copy every job (version-checked before and after) into ``buffers[job.index]``; never raises:
        a failure is ``self.error`` and releases every waiter."""
        t0 = time.perf_counter()
        streams: dict[str, Any] = {}
        try:
            if _before_run is not None:
                _before_run()
            for n, job in enumerate(self.jobs):
                self._check(job, "before its copy")
                dst = buffers[job.index]
                if job.src.is_cuda:
                    # device path: a side stream after the caller's stream at the call, into pinned memory; this
                    # thread (never the caller) waits for the copy's event before the version check below
                    dev = str(job.src.device)
                    if dev not in streams:
                        streams[dev] = torch.cuda.Stream(device=job.src.device)
                        streams[dev].wait_event(self._events[dev])
                    with torch.cuda.stream(streams[dev]):
                        dst.copy_(job.src, non_blocking=True)
                        done = torch.cuda.Event()
                        done.record()
                    done.synchronize()
                else:
                    dst.copy_(job.src)
                self._check(job, "while it was copied")
                if job.samples is not None:
                    if _ends(dst.data_ptr(), dst.numel() * dst.element_size()) != job.samples:
                        raise SnapshotChangedError(
                            f"async_save (lazy): {job.what} was changed after the call without a version bump "
                            "(written through .data?) before the background snapshot copied it; the save fails "
                            "(nothing is listed). " + _ADVICE)
                if self._on_copy is not None:
                    self._on_copy(n)
                with self._cond:
                    self._copied = n + 1
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - the writer raises it on every rank
            self.error = exc
        finally:
            self.copy_s = time.perf_counter() - t0
            with self._cond:
                self._finished = True
                self.jobs = []  # the live tensors are not held past the copy
                self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The snapshot could not run (its buffers could not be made): release every waiter."""
        with self._cond:
            if self.error is None:
                self.error = exc
            self._finished = True
            self.jobs = []
            self._cond.notify_all()

    def _check(self, job: Job, when: str) -> None:
        if job.owner._version != job.version:
            raise SnapshotChangedError(
                f"async_save (lazy): {job.what} was changed in place after the call, {when} by the background "
                "snapshot; the saved version would not be the state at the call, so the save fails (nothing is "
                "listed). " + _ADVICE)

    # --- the caller's side
    def _wait_for(self, n: int) -> float:
        if n <= 0:
            return 0.0
        t0 = time.perf_counter()
        with self._cond:
            while self._copied < n and not self._finished:
                self._cond.wait()
        return time.perf_counter() - t0

    def wait_gate(self, opt: torch.optim.Optimizer) -> float:
        """Block until every box ``opt.step`` changes is copied; returns the seconds waited."""
        waited = self._wait_for(self.gates.get(id(opt), 0))
        self.gate_wait_s += waited
        return waited

    def wait(self) -> None:
        """Block until the whole snapshot is copied (or failed)."""
        self._wait_for(len(self.jobs) + 1)


def _record_event(device: torch.device):
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


# ----------------------------------------------------------------------------------------- the gate
_GATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> hook handle
_CURRENT: Snapshot | None = None  # the snapshot in flight (one save at a time)
_GATE_LOCK = threading.Lock()


def install_gate(opt: torch.optim.Optimizer) -> None:
    """Make ``opt.step`` wait for the boxes it changes of the snapshot in flight (installed once)."""
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizer= must be a torch.optim.Optimizer, got {type(opt).__name__}")
    with _GATE_LOCK:
        if opt not in _GATES:
            _GATES[opt] = opt.register_step_pre_hook(_pre_step)


def remove_gate(opt: torch.optim.Optimizer | None = None) -> None:
    """Remove the pre-step gate of ``opt`` (of every optimizer when None): later ``async_save`` calls are then
    lazy only when asked (``lazy=True``) or gated again."""
    with _GATE_LOCK:
        for o in [opt] if opt is not None else list(_GATES.keys()):
            handle = _GATES.pop(o, None)
            if handle is not None:
                handle.remove()


def gated_optimizers() -> list[torch.optim.Optimizer]:
    with _GATE_LOCK:
        return list(_GATES.keys())


def set_current(snap: Snapshot | None) -> None:
    global _CURRENT
    _CURRENT = snap


def _pre_step(opt, args, kwargs) -> None:
    snap = _CURRENT
    if snap is not None:
        snap.wait_gate(opt)


# ----------------------------------------------------------------------------------------- priority
def lower_priority(nice: int, threads: Iterable[threading.Thread] = ()) -> bool:
    """Raise the niceness of this thread (and of ``threads``) to ``nice`` where Linux allows it: ``setpriority``
    on a thread id changes that thread only, and threads it starts inherit it. Raising is always allowed,
    lowering again is not (so pool threads stay lower for later saves too). False where unsupported."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return False
    tids = [threading.get_native_id()] + [t.native_id for t in threads if t.native_id is not None]
    ok = True
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            ok = False
    return ok


def lower_writer_priority(nice: int) -> bool:
    """``lower_priority`` for the calling writer thread and the local write pool's threads (made earlier by
    another thread, they would not inherit it)."""
    from ucp_store.io import pools as _pools

    threads = [t for p in _pools._all if p.prefix == "ucp-write" and p._pool is not None
               for t in list(p._pool._threads)]
    return lower_priority(nice, threads)
