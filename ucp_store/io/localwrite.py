"""The local write path: whole shard files of a folder store written without TensorStore.

Why: a rank of ``ucp_store.distributed`` that owns whole shard files (a ``Shard(d)`` box, shard files cut at the
source's split points) gains nothing from TensorStore's write machinery and pays for it: TensorStore
encodes every inner chunk into its own buffer, assembles the shard, writes it, while ``write_region``
copied every column-cut chunk once more to digest it. Here each inner chunk is gathered once into a
small scratch buffer (or taken in place when it is contiguous in memory), and from that one copy

- its crc32c is computed (the chain's ``crc32c`` codec),
- it is written with its crc by one ``writev``;

the units of the content hash that lie wholly inside the shard are digested from the source
(``format.box_unit_digests``: the array's content hash without a read-back); then the shard index
(``(offset, nbytes)`` uint64 pairs per inner chunk in C order, then its crc32c) ends the file, the file is
fsynced (its writeback started every 8 MiB along the way by ``sync_file_range``, so
the disk works while later chunks are encoded) and renamed into place, and its folder fsynced: the same
bytes TensorStore writes for the store's uncompressed chain (``localread.is_local_chain``), chunks in C
order, edge chunks padded with the fill value (0) to the full chunk shape, chunks wholly outside the
array left out of the index.
tests/test_localwrite.py reads the files back through TensorStore and ``localread`` and checks that.

Shard files run on a small thread pool (``config`` ``write_threads``, default 2-8 by CPU count): the copies,
xxh3, ``writev`` and ``fsync`` release the GIL. The scratch buffer sits at the file offset's position
in its page, so the kernel's copy into the page cache never runs at the distances at which some CPUs'
copies crawl (``localread._BAD_DISTANCE``); the gather into it uses ``localread.copy_into``, which avoids them too.

:func:`local_folder` is the one place that decides: a folder store, the store's own uncompressed chain,
a little-endian host, and the ``local_write`` setting on (``ucp_store.config``). :func:`whole_shards` says
whether a box is a union of whole shard files (anything else goes through TensorStore, whose conditional
writes merge writers).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import sys
import threading
from concurrent.futures import Future
from typing import Any

import numpy as np
import xxhash

from ucp_store import config
from ucp_store.io import format as fmt
from ucp_store.io.crc import value as _crc
from ucp_store.io.localread import PAGE, bad_distance, copy_into, is_local_chain
from ucp_store.io.location import Location, safe_rel
from ucp_store.io.pools import LazyPool

__all__ = ["local_folder", "whole_shards", "shard_boxes", "write_shard_file", "sync_dirs", "submit", "WriteLog",
           "record_writes", "log_object", "log_box"]

_MISSING = (1 << 64) - 1


class WriteLog:
    """The objects this process wrote to array folders (store-relative keys: ``<array>/zarr.json`` and each
    shard file ``<array>/c/i/j``), each with this process's ``label`` (its rank).

    Why: a multi-rank save must give every shard object and every ``zarr.json`` exactly one writer (two
    writers of one object rely on conditional read-modify-write, which S3 and NFS do not make atomic).
    Merging the ranks' logs shows who wrote what; :func:`record_writes` turns it on for a process."""

    def __init__(self, label: Any) -> None:
        self.label = label
        self.entries: list[str] = []
        self._lock = threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:
            self.entries.append(key)


_write_log: WriteLog | None = None


def record_writes(label: Any) -> WriteLog | None:
    """Start logging this process's array-object writes under ``label`` (``None``: stop); returns the log."""
    global _write_log
    _write_log = None if label is None else WriteLog(label)
    return _write_log


def log_object(rel: str, key: str) -> None:
    """Record a write of object ``key`` of the array at ``rel`` (no-op unless :func:`record_writes` is on)."""
    if _write_log is not None:
        _write_log.add(f"{rel}/{key}")


def log_box(rel: str, layout: fmt.ArrayLayout, offset: tuple[int, ...], shape: tuple[int, ...]) -> None:
    """Record the shard objects a box write touches (whole or in part: a part is a read-modify-write)."""
    if _write_log is None or not all(shape):
        return
    for idx in itertools.product(*(range(o // sh, -(-(o + n) // sh))
                                   for o, n, sh in zip(offset, shape, layout.shard_shape))):
        _write_log.add(f"{rel}/{layout.shard_file_key(idx)}")


def local_folder(location: Location, rel: str, layout: fmt.ArrayLayout) -> str | None:
    """The array's folder when its shard files may be written here directly, else None (TensorStore: also
    for every array while the ``local_write`` setting is off)."""
    if (location.kind != "file" or not layout.sharded or sys.byteorder != "little"
            or not config.current().local_write or not is_local_chain(layout.codecs(), layout)):
        return None
    return os.path.join(location.root, safe_rel(rel))


def whole_shards(layout: fmt.ArrayLayout, offset: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """True when the box ``shape`` at ``offset`` is a non-empty union of whole shard files of ``layout``
    (each edge lands on a shard edge or on the array's end)."""
    if not layout.sharded or len(offset) != len(layout.shape) or not all(shape):
        return False
    for o, n, sh, full in zip(offset, shape, layout.shard_shape, layout.shape):
        if o % sh or ((o + n) % sh and o + n != full):
            return False
    return True


def shard_boxes(layout: fmt.ArrayLayout, offset: tuple[int, ...], shape: tuple[int, ...]):
    """The shard grid indices of a :func:`whole_shards` box, in C order."""
    return itertools.product(*(range(o // sh, -(-(o + n) // sh))
                               for o, n, sh in zip(offset, shape, layout.shard_shape)))


_WRITE_POOL = LazyPool("ucp-write", "write_threads", lambda cpus: max(2, min(8, cpus)))
_threads = _WRITE_POOL.size


def submit(fn, *args: Any) -> Future:
    """Run ``fn(*args)`` on the write pool."""
    return _WRITE_POOL.get().submit(fn, *args)


_scratch = threading.local()


_BATCH_BYTES = 8 << 20  # bytes gathered per writev (one syscall, one inode time update, for many chunks)
_BATCH_PARTS = 1000  # iovecs per writev (Linux takes up to 1024)


class _Batch:
    """The chunks of one shard file gathered into few ``writev`` calls.

    A ``writev`` per chunk cost each 64 KiB chunk a system call with its own inode time update and a
    partial page at every chunk's end (its crc shifts the next one by 4 bytes): writing a shard that way ran
    at a third of one ``write`` of the same bytes. Here chunks written in place (views of the caller's
    memory) and chunks copied into this thread's scratch (each placed at its file offset's page position)
    are queued with their crcs and written together once ``_BATCH_BYTES`` or ``_BATCH_PARTS`` are reached."""

    def __init__(self, fd: int):
        self.fd = fd
        self.parts: list = []
        self.nbytes = 0
        buf = getattr(_scratch, "arena", None)
        if buf is None:
            buf = _scratch.arena = np.empty(_BATCH_BYTES + 2 * PAGE, np.uint8)
        self.arena = buf
        self.used = 0  # scratch bytes of the arena handed out since the last write

    def scratch(self, file_off: int, nbytes: int) -> np.ndarray:
        """``nbytes`` of scratch whose address equals ``file_off`` modulo a page, not overlapping any queued."""
        if nbytes + PAGE > self.arena.nbytes:  # a chunk larger than the arena: one of its own
            buf = np.empty(nbytes + PAGE, np.uint8)
            p = (file_off - buf.ctypes.data) % PAGE
            return buf[p:p + nbytes]
        p = self.used + (file_off - self.arena.ctypes.data - self.used) % PAGE
        if p + nbytes > self.arena.nbytes:
            self.write()  # the queued chunks leave the arena free
            p = (file_off - self.arena.ctypes.data) % PAGE
        self.used = p + nbytes
        return self.arena[p:p + nbytes]

    def add(self, *parts) -> None:
        self.parts.extend(parts)
        self.nbytes += sum(len(x) for x in parts)
        if self.nbytes >= _BATCH_BYTES or len(self.parts) >= _BATCH_PARTS:
            self.write()

    def write(self) -> None:
        if self.parts:
            _write_all(self.fd, self.parts)
        self.parts, self.nbytes, self.used = [], 0, 0


def _write_all(fd: int, parts: list) -> None:
    total = sum(len(p) for p in parts)
    done = os.writev(fd, parts)
    while done < total:  # a short write (rare): write the rest
        rest, skip = [], done
        for p in parts:
            mv = memoryview(p).cast("B")
            if skip >= len(mv):
                skip -= len(mv)
                continue
            rest.append(mv[skip:])
            skip = 0
        parts = rest
        total = sum(len(p) for p in parts)
        done = os.writev(fd, parts)


def _writeback_starter():
    """``sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE)`` (Linux): start writing a range to disk without
    waiting, so the disk works while later chunks are still being encoded and the final fsync finds
    most of the file written. None where libc has no such call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda fd, off, n: fn(fd, off, n, 2)  # SYNC_FILE_RANGE_WRITE; a failure only loses the head start


_start_writeback = _writeback_starter()
WRITEBACK_BYTES = 8 << 20  # start the disk on every this many bytes written


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=1024)
def _unit_runs(layout: fmt.ArrayLayout) -> tuple | None:
    """How a full chunk's bytes split into whole units of the content hash, when units nest in chunks (tile
    extents divide chunk extents in every dim): ``(tile, unit strides, run bytes, ((byte offset, unit index
    delta), ...), split)``, where ``split`` is None when every unit is already a contiguous run of the
    chunk's C-order bytes, else ``(shape, axes)`` that regroup the chunk's bytes tile by tile. None when
    units do not nest (a unit wider than a chunk).

    Why: each chunk is gathered into scratch for its crc anyway; digesting its units there, hot in cache
    (regrouped by one in-cache copy when they are not contiguous), replaces a second gather of the whole
    box from memory (``format.box_unit_digests``), which cost a fifth of the local write path's CPU."""
    (tile, strides), chunk, item = fmt.unit_grid(layout.dtype, layout.shape), layout.chunk_shape, layout.itemsize
    if len(tile) != len(chunk) or any(c % t for c, t in zip(chunk, tile)):
        return None
    run = math.prod(tile) * item
    per = [c // t for c, t in zip(chunk, tile)]
    runs = tuple((k * run, sum(i * st for i, st in zip(idx, strides)))
                 for k, idx in enumerate(itertools.product(*(range(n) for n in per))))
    j = next((d for d in range(len(chunk)) if tile[d] < chunk[d]), None)
    if j is None or all(tile[d] == chunk[d] for d in range(j + 1, len(chunk))):
        return tile, strides, run, runs, None
    tb = tile[:-1] + (tile[-1] * item,)  # the last dim in bytes
    shape = tuple(x for n, t in zip(per, tb) for x in (n, t))
    axes = tuple(range(0, 2 * len(per), 2)) + tuple(range(1, 2 * len(per), 2))
    return tile, strides, run, runs, (shape, axes)


def write_shard_file(folder: str, layout: fmt.ArrayLayout, shard: tuple[int, ...], data: np.ndarray,
                     offset: tuple[int, ...], digests: dict | None, dirs: set | None = None,
                     durable: bool = True) -> int:
    """Write shard file ``shard`` of the array in ``folder`` from ``data`` (a C-order-indexable box at global
    ``offset`` that covers the shard's part of the array); returns the bytes written.

    ``digests``: when given, the digest of each unit of the content hash that lies wholly inside the shard
    (``format.box_unit_digests``, from ``data``: the bytes this call writes) goes into it by unit.
    The file appears whole (written under a temporary name, fsynced, then renamed). Durable on return,
    its folder fsynced too, unless ``dirs`` is given: then the folders whose entries changed are added
    to it and the caller fsyncs each once (:func:`sync_dirs`) after all its files, before it relies on them.
    ``durable=False``: the file is not fsynced either (a writer that defers durability,
    ``CheckpointWriter.defer_durability``, fsyncs every file and folder it wrote in one pass before any row
    names them); its writeback is started (``sync_file_range``, no wait) as soon as it is written, so the
    disk works on it while later files are encoded and that pass mostly finds it on disk."""
    chunk, per = layout.chunk_shape, [sh // c for sh, c in zip(layout.shard_shape, layout.chunk_shape)]
    grid = layout.chunk_grid()
    itemsize = data.itemsize
    cbytes = math.prod(chunk) * itemsize
    index = np.full((math.prod(per), 2), _MISSING, "<u8")
    first = tuple(s * p for s, p in zip(shard, per))
    path = os.path.join(folder, *layout.shard_file_key(shard).split("/"))
    parent = os.path.dirname(path)
    made = not os.path.isdir(parent)
    if made:
        os.makedirs(parent, exist_ok=True)
    fused = _unit_runs(layout) if digests is not None else None  # units digested chunk by chunk, else per box
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.part"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        pos = flushed = 0
        batch = _Batch(fd)
        for k, local in enumerate(itertools.product(*(range(p) for p in per))):
            idx = tuple(f + i for f, i in zip(first, local))
            if any(i >= g for i, g in zip(idx, grid)):
                continue  # past the array's end (an overhanging edge shard): not stored
            lo = [i * c for i, c in zip(idx, chunk)]
            hi = [min(a + c, s) for a, c, s in zip(lo, chunk, layout.shape)]
            src = data[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset))]
            full = all(b - a == c for a, b, c in zip(lo, hi, chunk))
            if full and src.flags.c_contiguous and not bad_distance(pos, src.ctypes.data):
                enc = src.reshape(-1).view(np.uint8)  # in place: no copy
            else:
                enc = batch.scratch(pos, cbytes)
                view = enc.view(data.dtype).reshape(chunk)
                if not full:
                    enc[:] = 0  # the fill value pads an edge chunk to the full chunk shape
                copy_into(view[tuple(slice(0, b - a) for a, b in zip(lo, hi))], src)
            batch.add(enc, _crc(enc).to_bytes(4, "little"))
            if fused is not None:
                _chunk_unit_digests(fused, layout, lo, full, enc, src, digests)  # type: ignore[arg-type]
            index[k] = (pos, cbytes + 4)
            pos += cbytes + 4
            if _start_writeback is not None and pos - flushed >= WRITEBACK_BYTES:
                batch.write()
                _start_writeback(fd, flushed, pos - flushed)
                flushed = pos
        raw = index.reshape(-1).view(np.uint8)
        batch.add(raw, _crc(raw).to_bytes(4, "little"))
        if digests is not None and fused is None:
            _digest_units(layout, shard, data, offset, digests)
        batch.write()
        if durable:
            os.fdatasync(fd)
        elif _start_writeback is not None and pos + raw.nbytes + 4 > flushed:
            # deferred durability: start the disk on the rest now, so the writer's one fsync pass finds it written
            _start_writeback(fd, flushed, pos + raw.nbytes + 4 - flushed)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, path)
    changed = [parent]
    d = parent
    while made and d != folder and len(d) > len(folder):  # the new folders' entries too, up to the array's
        d = os.path.dirname(d)
        changed.append(d)
    if dirs is None:
        sync_dirs(changed)
    else:
        dirs.update(changed)
    return pos + raw.nbytes + 4


def _chunk_unit_digests(fused: tuple, layout: fmt.ArrayLayout, lo: list[int], full: bool, enc: np.ndarray,
                        src: np.ndarray, digests: dict) -> None:
    """The content hash's units of one chunk (``_unit_runs``): from its encoded bytes when it is full, else
    (an edge chunk, padded in ``enc``) from the source through ``format.box_unit_digests``."""
    tile, strides, run, runs, split = fused
    if not full:
        fmt.box_unit_digests(layout.dtype, layout.shape, tuple(lo), src, digests)
        return
    if split is not None:  # regroup tile by tile, in cache, into this thread's second scratch
        buf = getattr(_scratch, "tiles", None)
        if buf is None or buf.nbytes < enc.nbytes:
            buf = _scratch.tiles = np.empty(enc.nbytes, np.uint8)
        shape, axes = split
        out = buf[:enc.nbytes]
        np.copyto(out.reshape([shape[a] for a in axes]), enc.reshape(shape).transpose(axes))
        enc = out
    base = sum(a // t * st for a, t, st in zip(lo, tile, strides))
    mv = enc.data  # enc is flat bytes: the scratch, the source in place, or the regrouped copy
    digest = xxhash.xxh3_128_digest
    for off, du in runs:
        digests[base + du] = digest(mv[off:off + run])


def _digest_units(layout: fmt.ArrayLayout, shard: tuple[int, ...], data: np.ndarray, offset: tuple[int, ...],
                  digests: dict) -> None:
    lo = [s * sh for s, sh in zip(shard, layout.shard_shape)]
    hi = [min(a + sh, n) for a, sh, n in zip(lo, layout.shard_shape, layout.shape)]
    src = data[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset))]
    fmt.box_unit_digests(layout.dtype, layout.shape, tuple(lo), src, digests)


def sync_dirs(dirs) -> None:
    """fsync each folder once (their new entries: renamed shard files, created sub-folders)."""
    for d in sorted(set(dirs), key=len, reverse=True):
        _fsync_dir(d)
