"""Executes read plans: fills preallocated torch tensors concurrently (the local read path or TensorStore).

The planner (pure) says, for one rank of a target topology, which logical boxes of which arrays land
where; this module is the only place that turns that into I/O. Reads are issued as TensorStore
futures (many in flight, bounded by bytes) and copied into their destinations as they complete,
casting on the way when the target asks for another dtype (bf16 weights from fp32 masters).
On the local path (localread) small reads run in batches (``_BATCH_READS``) on a pool of their own, at
most _SMALL_INFLIGHT_BYTES in flight, straight into their destinations; a large one runs at once, split
over localread's pool. Local readers are held per process (``_held``, bounded LRU), so a load does not
rebuild an array's read state or re-read a shard index that did not change.
Everything no read covers stays zero: vocab padding rows, ZeRO alignment gaps, clipped tails.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from ucp_store import config, dtypes
from ucp_store.dtypes import numpy_view
from ucp_store.errors import ChecksumError, UcpError
from ucp_store.geometry import Box
from ucp_store.io import format as fmt
from ucp_store.io.deltaio import open_any
from ucp_store.io.localread import PARALLEL_BYTES, LocalArray, get_stream_pool, settle
from ucp_store.io.pools import LazyPool
from ucp_store.io.window import FutureWindow, read_failed
from ucp_store.plan.planner import Plan, TensorPlan
from ucp_store.plan.planner import plan as make_plan
from ucp_store.records import TensorInfo

_MAX_INFLIGHT_BYTES = 512 << 20
# local reads below the local reader's split size run on their own pool (large reads split over
# localread's pool, so a small read never waits behind a large one and a pool never waits on itself);
# at most this many bytes of them are in flight
_SMALL_INFLIGHT_BYTES = 64 << 20
# small local reads go to the pool in batches (one task, one future per batch): a pool task costs tens of
# microseconds of Python and thread hand-off, more than a small read itself
_BATCH_READS = 64
# rows the page cache did not hold (``LocalArray.rows_cached``) go in smaller batches: each waits on the
# disk, so more of them in flight at once
_COLD_BATCH_READS = 8
# a small read the page cache lacked sends the next this many small reads straight to the pool before the
# calling thread tries one again: a cold load's reads then wait on the disk in parallel, opens included
# (opening a file whose inode is not cached waits for the disk, which RWF_NOWAIT does not prevent, so
# trying every read here first would serialise a cold load's opens in this thread)
_COLD_SKIP = 64
_BATCH_BYTES = 4 << 20
# held local readers, per process: (store root, array path, dtype, shape, chunk, shard) -> (codecs, handle,
# layout); a LocalArray rechecks each shard file's identity on every read, so a held one is never stale
_HELD_MAX = 4096
_held: OrderedDict[tuple, tuple] = OrderedDict()
_held_lock = threading.Lock()


_get_small_pool = LazyPool("ucp-small-read", "small_read_threads", lambda cpus: max(4, min(32, 4 * cpus))).get


def _target_dtype(dtype, state: str, stored: str) -> torch.dtype:
    if dtype is None:
        return dtypes.torch_dtype(stored)
    if isinstance(dtype, Mapping):
        chosen = dtype.get(state)
        return dtypes.torch_dtype(stored) if chosen is None else chosen
    return dtype


_layouts: dict[tuple, tuple[Any, fmt.ArrayLayout]] = {}  # catalog geometry + id(codecs) -> (codecs, layout)


class Reader:
    """Opens each array once and keeps bounded windows of reads in flight (``_window.FutureWindow``): one
    for TensorStore futures (``window_bytes``), one for small local reads on the small-read pool."""

    def __init__(self, checkpoint, window_bytes: int | None = _MAX_INFLIGHT_BYTES,
                 infos: Mapping[tuple[str, str], TensorInfo] | None = None):
        self.checkpoint = checkpoint
        self.window_bytes = window_bytes  # None: no bound
        self.store = checkpoint.store
        # the records the plan was made from (a stage's rows), else every row of the checkpoint
        self.infos: Mapping[tuple[str, str], TensorInfo] = (
            _by_key(checkpoint.tensors()) if infos is None else infos)
        self._handles: dict[str, Any] = {}
        self._remote: FutureWindow[tuple[Any, TensorInfo, Any, int]] = FutureWindow(window_bytes, self._complete)
        self._small: FutureWindow[tuple[list, int]] = FutureWindow(_SMALL_INFLIGHT_BYTES, self._complete_batch)
        self._batch: list[tuple] = []  # small local reads not yet handed to the pool
        self._batch_bytes = 0
        self._cold = 0  # small reads still to hand to the pool untried (``_COLD_SKIP``)
        self.bytes_copied = 0
        loc = self.store.location
        self._local_ok = loc.kind == "file" and config.current().local_read
        self._root = loc.root
        # destination key -> (numpy view, its address, the tensor it views)
        self._views: dict[Any, tuple[np.ndarray, int, torch.Tensor]] = {}

    def handle(self, info: TensorInfo):
        h = self._handles.get(info.array_id)
        if h is None:
            h = self._handles[info.array_id] = self._open(info)
        return h

    def _open(self, info: TensorInfo) -> tuple[Any, fmt.ArrayLayout]:
        """The array's reader and layout: a held LocalArray when this process opened it before (same
        geometry and codecs), else ``open_reader``'s choice (a LocalArray it returns is then held)."""
        loc = self.store.location
        key = (self._root, info.array, info.dtype, info.shape, info.chunk_shape, info.shard_shape)
        local_ok = self._local_ok
        if local_ok:
            with _held_lock:
                hit = _held.get(key)
                if hit is not None and (hit[0] is info.codecs or hit[0] == info.codecs):
                    _held.move_to_end(key)
                    return hit[1], hit[2]
        lkey = (info.dtype, info.shape, info.chunk_shape, info.shard_shape, id(info.codecs))
        hit = _layouts.get(lkey)
        if hit is None or hit[0] is not info.codecs:  # the entry holds the codecs object: its id stays valid
            if len(_layouts) >= 4096:
                _layouts.clear()
            hit = _layouts[lkey] = (info.codecs, fmt.ArrayLayout.from_catalog(
                info.dtype, info.shape, info.chunk_shape, info.shard_shape, info.codecs))
        layout = hit[1]  # one frozen layout per geometry: a model's layers share a few
        handle = open_any(loc, info, layout, self.store.context)  # a DeltaArray for an xor array (issue 39)
        if local_ok and isinstance(handle, LocalArray):
            with _held_lock:
                _held[key] = (info.codecs, handle, layout)
                while len(_held) > _HELD_MAX:
                    _held.popitem(last=False)
        return handle, layout

    def submit(self, info: TensorInfo, box, sink) -> None:
        handle, layout = self.handle(info)
        nbytes = box.numel * layout.itemsize
        if isinstance(handle, LocalArray):
            if nbytes >= PARALLEL_BYTES:
                self._read_local(info, handle, layout, box, sink)  # now, split over localread's pool
                return
            # a small read: here at once when the page cache holds it (as ``submit_into``), else batched with
            # others onto the small-read pool, copied or delivered (sink) in this thread when its batch completes
            if self._cached_into_sink(info, handle, layout, box, sink, nbytes):
                return
            self._batch.append((handle, box, None, None, sink, info))
            self._batch_bytes += nbytes
            if len(self._batch) >= _BATCH_READS or self._batch_bytes >= _BATCH_BYTES:
                self._flush()
            return
        self._remote.submit(handle[box.slices()].read(), nbytes, (sink, info, box, nbytes))

    def _cached_into_sink(self, info: TensorInfo, handle: LocalArray, layout, box, sink, nbytes: int) -> bool:
        """A small read for ``sink`` done here if the page cache holds it (``LocalArray.box_cached``): straight
        into the sink's destination when it can take it (``_direct_target``), else into fresh memory handed
        to the sink. False when not done (``_in_place``)."""
        target = _direct_target(sink, layout, box)
        data = None
        if target is None:
            data = target = np.empty(box.shape, handle.dtype)
        if not self._in_place(info, box, nbytes, handle.box_cached, box.ranges, target):
            return False
        if data is not None:
            sink(data)
        return True

    def _in_place(self, info: TensorInfo, box, nbytes: int, read: Any, *args: Any) -> bool:
        """``read(*args)`` (``LocalArray.rows_cached`` or ``box_cached``: a small read done in this thread if
        the page cache holds it), unless a read the cache lacked came fewer than ``_COLD_SKIP`` reads ago;
        True when done. A read that would wait starts the skip again."""
        if self._cold:
            self._cold -= 1
            return False
        try:
            done = read(*args)
        except ValueError as exc:
            raise self._failed(info, box, exc) from None
        if done:
            self.bytes_copied += nbytes
            return True
        if done is False:
            self._cold = _COLD_SKIP
        return False

    def submit_into(self, info: TensorInfo, handle: LocalArray, box, target: np.ndarray, addr: int | None) -> None:
        """A local read straight into ``target`` (a numpy view of the destination in the stored dtype, the
        box's shape; or with ``addr``, its address, the C-order bytes of a box of whole rows as a 1-d
        array): no sink, no torch on the read's path. Small reads the page cache holds are read here at
        once (``LocalArray.rows_cached``, ``box_cached``): handed to the pool, every system call of this
        thread would wait for a pool thread to give back the GIL, which costs a warm load more than the
        reads (tools/bench_planner.py's end-to-end loads). The rest go to the small-read pool in batches."""
        nbytes = target.nbytes
        if addr is not None and nbytes < PARALLEL_BYTES:
            r = box.ranges[0]
            if self._in_place(info, box, nbytes, handle.rows_cached, r[0], r[1], target, addr):
                return
            # not cached: to the pool, in small batches (parallel preads are what a cold cache needs)
            self._batch.append((handle, box, target, addr, None, info))
            self._batch_bytes += nbytes
            if len(self._batch) >= _COLD_BATCH_READS or self._batch_bytes >= _BATCH_BYTES:
                self._flush()
            return
        if nbytes >= PARALLEL_BYTES:
            try:
                _read_direct(handle, box, target, addr)
            except ValueError as exc:
                raise self._failed(info, box, exc) from None
            self.bytes_copied += nbytes
            return
        if self._in_place(info, box, nbytes, handle.box_cached, box.ranges, target):  # a box of a small read
            return
        self._batch.append((handle, box, target, addr, None, info))
        self._batch_bytes += nbytes
        if len(self._batch) >= _BATCH_READS or self._batch_bytes >= _BATCH_BYTES:
            self._flush()

    def view(self, key: Any, tensor: torch.Tensor) -> tuple[np.ndarray, int]:
        """A numpy view of a destination tensor (host, contiguous) and its address, made once per key."""
        hit = self._views.get(key)
        if hit is None or hit[2] is not tensor:
            arr = numpy_view(tensor)
            hit = self._views[key] = (arr, tensor.data_ptr(), tensor)  # ndarray.ctypes builds an object
        return hit[0], hit[1]

    def _flush(self) -> None:
        if self._batch:
            batch, nbytes = self._batch, self._batch_bytes
            self._batch, self._batch_bytes = [], 0
            self._small.submit(_get_small_pool().submit(_read_batch, batch), nbytes, (batch, nbytes))

    def _complete_batch(self, future: Any, item: tuple[list, int]) -> None:
        batch, nbytes = item
        results, failed = future.result()
        for read, data in zip(batch, results):
            if data is not None:  # None: the read already filled the destination
                read[4](data)
        if failed is not None:
            _h, box, _t, _a, _s, info = batch[len(results)]
            raise self._failed(info, box, failed) from None
        self.bytes_copied += nbytes

    def _failed(self, info: TensorInfo, box, exc: ValueError) -> UcpError:
        """The error for a failed read: the corrupt chunk named (``fmt.read_box`` raises ChecksumError), or
        the one wording of ``_window.read_failed``."""
        handle, layout = self.handle(info)
        what = f"tensor {info.name!r} state {info.state!r} of checkpoint {self.checkpoint.id}"
        url = self.store.array_url(info.array)
        if fmt.is_corruption(exc):
            fmt.read_box(handle, layout, box.ranges, what=what, array_url=url)
        return read_failed(what, url, exc)

    def _complete(self, future: Any, item: tuple[Any, TensorInfo, Any, int]) -> None:
        sink, info, box, nbytes = item
        try:
            data = future.result()
        except ValueError as exc:
            raise self._failed(info, box, exc) from None
        if data is not None:  # None: a local read already filled the destination
            sink(data)
        self.bytes_copied += nbytes

    def _read_local(self, info: TensorInfo, handle: LocalArray, layout, box, sink) -> None:
        """Read now, straight into the destination when it has the stored dtype (no buffer, no second copy);
        large reads spread over the local reader's threads."""
        try:
            target = _direct_target(sink, layout, box)
            if target is not None:
                handle.read_into(box.ranges, target)
            else:
                sink(handle.read(box.ranges))
        except ValueError as exc:
            raise self._failed(info, box, exc) from None
        self.bytes_copied += box.numel * layout.itemsize

    def drain(self) -> None:
        self._flush()
        self._small.drain()
        self._remote.drain()


def _read_batch(batch: list[tuple]) -> tuple[list, ValueError | None]:
    """Small local reads one after another (a pool thread): per read None when it went straight into its
    destination, else its data for the sink; stops at the first failure and returns it."""
    results: list[np.ndarray | None] = []
    for handle, box, target, addr, sink, _info in batch:
        try:
            if target is not None:
                _read_direct(handle, box, target, addr)
                results.append(None)
                continue
            target = _direct_target(sink, handle.layout, box)
            if target is not None:
                handle.read_into(box.ranges, target)
                results.append(None)
            else:
                results.append(handle.read(box.ranges))
        except ValueError as exc:
            return results, exc
    return results, None


def _read_direct(handle: LocalArray, box, target: np.ndarray, addr: int | None) -> None:
    """One local read into its numpy destination: ``addr`` given, ``target`` is the C-order bytes of a box
    of whole rows (any shape) at that address, read through ``read_rows`` (one preadv into place for a box
    inside one chunk); else ``target`` has the box's shape and goes through ``read_into``."""
    r = box.ranges
    if addr is not None:
        handle.read_rows(r[0][0], r[0][1], target, addr)
    else:
        handle.read_into(r, target)


def _direct_target(sink, layout, box) -> np.ndarray | None:
    """The sink's destination as a numpy view of the box's shape, when a local read can fill it directly
    (CPU, the stored dtype, same shape or contiguous); None otherwise."""
    target = getattr(sink, "target", None)
    shape = tuple(hi - lo for lo, hi in box.ranges)
    if (target is not None and target.device.type == "cpu" and target.dtype == dtypes.torch_dtype(layout.dtype)
            and (tuple(target.shape) == shape or target.is_contiguous())):
        return numpy_view(target).reshape(shape)  # a view: same shape or contiguous
    return None


def _to_torch(data: np.ndarray) -> torch.Tensor:
    return dtypes.to_torch(np.require(data, requirements="C"))


class Sink:
    """Copies a read into ``target`` (a view of the destination); the local path reads into it directly."""

    __slots__ = ("target",)

    def __init__(self, target: torch.Tensor):
        self.target = target

    def __call__(self, data: np.ndarray) -> None:
        self.target.copy_(_to_torch(data).reshape(self.target.shape))


def box_sink(dest: torch.Tensor, dst_box) -> Sink:
    return Sink(dest[dst_box.slices()] if dest.dim() else dest)


def _flat_sink(dest_flat: torch.Tensor, start: int, stop: int) -> Sink:
    return Sink(dest_flat[start:stop])


@dataclass
class ShardState:
    """What one rank loads: TP-local tensors, per-parameter ZeRO-3 partitions and ZeRO group buffers.

    ``tensors[(local_name, state)]``: the TP/EP-local tensor, or for ZeRO-3 weights the rank's flat
    partition. ``buffers[key]``: a ZeRO-1/2/3 flat group buffer (``plan.buffers``); ``views`` gives each
    parameter's slot in it under ``(local_name, state)``.
    """

    plan: Plan
    tensors: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    views: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    bytes_read: int = 0

    def __getitem__(self, key: tuple[str, str]) -> torch.Tensor:
        if key in self.tensors:
            return self.tensors[key]
        return self.views[key]

    def state_dict(self, state: str) -> dict[str, torch.Tensor]:
        out = {n: t for (n, s), t in self.tensors.items() if s == state}
        out.update({n: t for (n, s), t in self.views.items() if s == state})
        return out


def _by_key(infos: Iterable[TensorInfo]) -> dict[tuple[str, str], TensorInfo]:
    return {(i.name, i.state): i for i in infos}


def execute(checkpoint, plan: Plan, *, dtype=None, only: Iterable[tuple[str, str]] | None = None,
            infos: Iterable[TensorInfo] | None = None, into: Mapping[str, torch.Tensor] | None = None) -> ShardState:
    """Run every read of ``plan`` (or of the ``only`` tensor-states), concurrently.

    ``infos``: the catalog records the plan was made from (default: all of the checkpoint's).
    ``into``: ``{buffer key: tensor}`` to read group buffers straight into (a live optimizer's flat
    partition: host memory, contiguous, the planned dtype and size; zeroed first, as a new buffer would be)
    instead of allocating them. With ``only``, only the buffers those tensor-states use are allocated."""
    reader = Reader(checkpoint, infos=None if infos is None else _by_key(infos))
    out = ShardState(plan)
    wanted = None if only is None else set(only)
    used = None if wanted is None else {tp.buffer for tp in plan.tensors
                                        if tp.buffer is not None and (tp.name, tp.state) in wanted}
    for b in plan.buffers:
        if used is not None and b.key not in used:
            continue
        target = _target_dtype(dtype, b.state, b.dtype)
        dest = None if into is None else into.get(b.key)
        if dest is not None:
            if (dest.device.type != "cpu" or dest.dtype != target or dest.numel() != b.numel
                    or not dest.is_contiguous()):
                raise UcpError(f"buffer {b.key!r} ({b.state}): the tensor to read into is {dest.dtype} "
                               f"[{dest.numel()}] on {dest.device}, the plan needs {target} [{b.numel}] in host "
                               "memory, contiguous")
            out.buffers[b.key] = dest.view(-1).zero_()
        else:
            out.buffers[b.key] = torch.zeros(b.numel, dtype=target)  # large: see _dest
    for tp in plan.tensors:
        if wanted is not None and (tp.name, tp.state) not in wanted:
            continue
        _submit_tensor(reader, out, tp, dtype)
    reader.drain()
    out.bytes_read = reader.bytes_copied
    return out


# Destinations from this size are made with torch.zeros: its parallel fill faults the pages in ahead of the
# reads, which otherwise fault them 4 KiB at a time (tools/bench_reshard.py). Smaller ones are left
# uninitialised (zeroing a small ZeRO-3 partition costs more than its read), and so are those from
# _HUGE_BYTES that whole-row reads fill in place with preadv: numpy asks for transparent huge pages there,
# so the reads fault in 2 MiB pages instead of 4 KiB ones (figures: docs/perf.md).
_ZEROED_MIN_BYTES = 1 << 20
_HUGE_BYTES = 4 << 20


def _in_place(tp: TensorPlan, rest: tuple | None) -> bool:
    """Every read of ``tp`` is a box of whole rows of an array whose chunks hold whole rows (``rest`` the
    trailing full ranges, None otherwise): the reads go straight into place (``LocalArray.read_rows``)."""
    return rest is not None and all(r.box.ranges[1:] == rest for r in tp.reads)


def _dest(shape: tuple[int, ...], handle: LocalArray, target: torch.dtype,
          in_place: bool) -> tuple[np.ndarray, torch.Tensor]:
    """A destination for direct local reads in the array's stored dtype: the numpy array the reads fill and
    the tensor viewing it. Uninitialised (made by numpy: cheaper than ``torch.empty`` and a numpy view of
    it) unless it is large (``_ZEROED_MIN_BYTES``, ``_HUGE_BYTES``); the caller zeroes the padding."""
    nbytes = math.prod(shape) * handle.itemsize
    if _ZEROED_MIN_BYTES <= nbytes and not (in_place and nbytes >= _HUGE_BYTES):
        t = torch.zeros(shape, dtype=target)
        return numpy_view(t), t
    arr = np.empty(shape, handle.dtype)
    return arr, dtypes.from_numpy_as(arr, target)


def _new(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A destination filled through sinks (a cast, TensorStore): zeros when large (see ``_dest``)."""
    if math.prod(shape) * dtype.itemsize >= _ZEROED_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype)


def _submit_tensor(reader: Reader, out: ShardState, tp: TensorPlan, dtype) -> None:
    info = reader.infos.get((tp.name, tp.state))
    if info is None:
        raise UcpError(f"plan names tensor {tp.name!r} state {tp.state!r}, which checkpoint {reader.checkpoint.id} "
                       "does not hold")
    handle, _layout = reader.handle(info)
    local = isinstance(handle, LocalArray)
    target = handle.torch_dtype if dtype is None and local else _target_dtype(dtype, tp.state, tp.dtype)
    key = (tp.local_name, tp.state)
    # a local array read in its stored dtype goes straight into a numpy view of the destination; boxes of
    # whole rows as the flat C-order bytes they fill (``LocalArray.read_rows``)
    direct = local and target == handle.torch_dtype
    rows = direct and handle.rows_ok
    rest = handle._rest if rows else None
    if tp.fragment is None:
        # the reads fill it, the padding is zeroed here; read directly, made as the numpy array they fill
        view, dest = (_dest(tp.local_shape, handle, target, _in_place(tp, rest)) if direct
                      else (None, _new(tp.local_shape, target)))
        for g in tp.padding:
            dest[g.slices()].zero_()  # type: ignore[union-attr]
        out.tensors[key] = dest
        if view is not None:
            for r in tp.reads:
                shape = r.box.shape
                t = view[r.dst.slices()] if view.ndim else view  # type: ignore[union-attr]
                if rows and r.box.ranges[1:] == rest and shape[0] and t.flags.c_contiguous:
                    reader.submit_into(info, handle, r.box, t.reshape(-1), t.ctypes.data)
                    continue
                if t.shape != shape:
                    if not t.flags.c_contiguous:
                        reader.submit(info, r.box, box_sink(dest, r.dst))
                        continue
                    t = t.reshape(shape)
                reader.submit_into(info, handle, r.box, t, None)
            return
        for r in tp.reads:
            reader.submit(info, r.box, box_sink(dest, r.dst))
        return
    flat: np.ndarray | None = None
    if tp.buffer is None:  # ZeRO-3 weight: the parameter's own partition
        # made by _dest / _new: small ones uninitialised (the reads and the zeroed padding tile the slot);
        # read directly, as the numpy array the reads fill, the tensor a view of it
        if direct:
            flat, slot = _dest((tp.fragment.slot,), handle, target, _in_place(tp, rest))
        else:
            slot = _new((tp.fragment.slot,), target)
        out.tensors[key] = slot
        base, vkey = 0, key
        owner = slot
    else:
        owner = out.buffers[tp.buffer]
        base, vkey = tp.fragment.buffer_start, tp.buffer  # type: ignore[assignment]
        slot = owner[base:base + tp.fragment.slot]
        out.views[key] = slot
    for g in tp.padding:
        slot[g.start:g.stop].zero_()  # type: ignore[union-attr]
    if direct:
        if flat is None:
            flat, addr = reader.view(vkey, owner)
        else:
            addr = slot.data_ptr()
        size = flat.itemsize
        submit_into = reader.submit_into
        for r in tp.reads:
            d = r.dst
            a, b = base + d.start, base + d.stop  # type: ignore[operator]
            ranges = r.box.ranges
            if rows and ranges[1:] == rest and ranges[0][0] < ranges[0][1]:
                submit_into(info, handle, r.box, flat[a:b], addr + a * size)  # the rows' flat bytes
            else:
                submit_into(info, handle, r.box, flat[a:b].reshape(r.box.shape), None)
        return
    for r in tp.reads:
        reader.submit(info, r.box, _flat_sink(slot, cast(int, r.dst.start), cast(int, r.dst.stop)))


class LazyShardState(ShardState):
    """Like ShardState, but each tensor-state is read on first access (a group buffer as a whole)."""

    def __init__(self, checkpoint, plan: Plan, dtype, infos: Iterable[TensorInfo] | None = None):
        super().__init__(plan)
        self._checkpoint = checkpoint
        self._dtype = dtype
        # built once: every access opens a reader over the same records
        self._infos = _by_key(checkpoint.tensors() if infos is None else infos)
        self._by_key = {(t.local_name, t.state): t for t in plan.tensors}
        self._loaded_buffers: set[str] = set()

    def keys(self):
        return self._by_key.keys()

    def __getitem__(self, key: tuple[str, str]) -> torch.Tensor:
        tp = self._by_key.get(key)
        if tp is None:
            raise KeyError(key)
        if tp.buffer is not None:
            self.buffer(tp.buffer)
            return self.views[key]
        if key not in self.tensors:
            reader = Reader(self._checkpoint, infos=self._infos)
            _submit_tensor(reader, self, tp, self._dtype)
            reader.drain()
            self.bytes_read += reader.bytes_copied
        return self.tensors[key]

    def buffer(self, key: str) -> torch.Tensor:
        if key not in self._loaded_buffers:
            b = next(b for b in self.plan.buffers if b.key == key)
            self.buffers[key] = torch.zeros(b.numel, dtype=_target_dtype(self._dtype, b.state, b.dtype))
            reader = Reader(self._checkpoint, infos=self._infos)
            for tp in self.plan.tensors:
                if tp.buffer == key:
                    _submit_tensor(reader, self, tp, self._dtype)
            reader.drain()
            self.bytes_read += reader.bytes_copied
            self._loaded_buffers.add(key)
        return self.buffers[key]


def read_tensors(checkpoint, infos: Iterable[TensorInfo]) -> dict[tuple[str, str], torch.Tensor]:
    """Whole tensor-states, read concurrently (the results own the buffers the reads filled).

    Large local reads (``PARALLEL_BYTES`` and up) run several at once on localread's stream pool, each
    shard file read in file order as one stream (``LocalArray.read_streamed``): from a cold cache, large
    sequential requests to several files at once are what a disk serves fastest (tools/bench_cold.py), and
    on a warm one the reads in flight keep the cores busy. Small reads and TensorStore's go through
    ``Reader`` as before."""
    # every result is kept, so a window on the reads in flight would save no memory; without one
    # TensorStore keeps every core busy
    reader = Reader(checkpoint, window_bytes=None)
    out: dict[tuple[str, str], torch.Tensor] = {}
    whole: list[tuple[TensorInfo, Box, Any]] = []  # (info, box, future) of the large local reads
    try:
        for info in infos:
            key = (info.name, info.state)
            box = Box(tuple((0, n) for n in info.shape))
            if reader._local_ok:
                handle, layout = reader.handle(info)
                if isinstance(handle, LocalArray) and box.numel * layout.itemsize >= PARALLEL_BYTES:
                    whole.append((info, box, get_stream_pool().submit(handle.read_streamed, box.ranges)))
                    continue

            def sink(data, key=key):
                out[key] = _to_torch(data)
            reader.submit(info, box, sink)
        reader.drain()
        for info, box, future in whole:
            try:
                data = future.result()
            except ValueError as exc:
                raise reader._failed(info, box, exc) from None
            out[(info.name, info.state)] = _to_torch(data)
            reader.bytes_copied += data.nbytes
    finally:  # no read left running when this returns or raises
        settle([future for _i, _b, future in whole])
    return out


def load_shard(checkpoint, topology, rank: int, *, states: Iterable[str] | None = None, dtype=None,
               lazy: bool = False, **plan_kwargs) -> ShardState:
    """Plan and load what ``rank`` of ``topology`` needs from ``checkpoint`` (see ``ShardState``).

    ``dtype``: one torch dtype for everything, or ``{state: dtype}`` (e.g. ``{"weight": torch.bfloat16}``
    to build bf16 weights from fp32 masters); default: the stored dtype.
    """
    records = checkpoint.plan_records(topology, rank)  # a pipeline stage gets its own layers' rows
    p = make_plan(records, topology, rank, states=None if states is None else list(states), **plan_kwargs)
    if lazy:
        return LazyShardState(checkpoint, p, dtype, infos=records)
    return execute(checkpoint, p, dtype=dtype, infos=records)


__all__ = ["ChecksumError", "LazyShardState", "ShardState", "execute", "load_shard"]
