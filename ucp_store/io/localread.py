"""The local read path: the store's own shard files read with ``pread`` straight into the caller's memory.

Why: TensorStore reads a shard's bytes into its own buffer, checks the crc32c, then copies into the
output, and pays a few hundred microseconds of per-read machinery. For the store's own codec chain the
bytes on disk are already the answer: an uncompressed inner chunk is the little-endian C-order data
followed by its 4-byte crc32c, and the shard index (``(offset, nbytes)`` uint64 pairs per inner chunk in
C order, then its crc32c) sits at the end of the file. So for a folder store this module

- reads the shard index and checks its crc32c,
- reads each needed inner chunk with ``os.preadv``: a whole chunk whose place in the destination is
  contiguous lands there directly (one copy, page cache -> destination), chunks that are contiguous in
  the file go in one call; a chunk the read only partly needs goes to a scratch buffer and only the
  needed part is copied,
- checks every chunk's crc32c with ``_crc.value`` (the ``crc32c`` package's hardware CRC32C, which
  releases the GIL; tools/bench_crc32c.py measured it against ``google_crc32c`` and numcodecs' CRC32C),
- splits large reads over a thread pool (``preadv``, the crc and numpy's copies release the GIL) as
  contiguous segments of each shard file, each read in file order through its own open file, and reads
  several whole arrays at once with one stream per shard file (``read_streamed``, for ``state_dict``),
- reads a box of whole rows (chunks holding whole rows, the chunk policy's usual cut) without per-chunk
  views: each whole chunk's destination is a byte range found by arithmetic and a shard's index entries
  are checked in one numpy pass (``_read_rows``),
- keeps every copy away from the distances at which some CPUs' copies crawl (``_BAD_DISTANCE``).

Bit-exact agreement with TensorStore is the contract (tests/test_localread.py). Errors mirror it: a bad
crc (chunk or index), a truncated or missing shard file, an index entry past the end of the file or a
missing chunk all raise :class:`LocalReadError`, a ``ValueError`` whose text ``format.is_corruption``
recognises, so ``format.read_box`` names the array and the first bad chunk exactly as it does for
TensorStore. A missing chunk is an error, never zeros.

:func:`open_reader` is the one place that decides which path an array takes: this one for a folder
store whose array has exactly the store's uncompressed chain, TensorStore for everything else (S3,
compressed stores, any other chain, and every array while the ``local_read`` setting of
:mod:`ucp_store.config` is off). A :class:`LocalArray` answers ``handle[slices].read().result()``
like a TensorStore handle, so ``format.read_box``, ``format.verify_array`` and ``locate_bad_chunks`` take
either.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import stat
import struct
import threading
from collections import OrderedDict
from typing import Any, overload

import numpy as np
import torch

from ucp_store import config, dtypes
from ucp_store.io import format as fmt
from ucp_store.io.crc import value as _crc
from ucp_store.io.location import Location, safe_rel
from ucp_store.io.pools import LazyPool

_MISSING = (1 << 64) - 1
_ENTRY = struct.Struct("<QQ")
try:
    _IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 16
RUN_BYTES = 4 << 20        # one preadv covers at most this much (the crc then reads it back from cache)
PARALLEL_BYTES = 16 << 20  # reads at least this large are split over the pool
# O_NONBLOCK: opening a FIFO planted in the store returns at once instead of waiting for a writer (the
# S_ISREG check then refuses it); on regular files it changes nothing (open(2))
_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
# preadv2's RWF_NOWAIT (Linux >= 4.14; buffered reads since 5.x): a read that would wait for the disk fails
# at once with EAGAIN. io reads a small read in place when the page cache holds it and hands only the
# others to its pool (parallel preads are what a cold cache needs; on a warm one the pool's thread
# hand-offs cost more than the read). 0 where the platform has no such flag: every small read goes to the pool.
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


_READ_POOL = LazyPool("ucp-read", "read_threads", lambda cpus: max(2, min(16, 2 * cpus)))
_threads = _READ_POOL.size
_get_pool = _READ_POOL.get


# Single-chunk reads of large chunks (a row of a big parameter) go through a mapping of the
# shard file: the crc32c is computed over the page cache in place and only the part the read needs is
# copied (a ``pread`` would first copy the whole chunk). Mappings are held per process, bounded (each one
# holds a file descriptor), keyed by path and checked against the file's identity (``stat`` by path) on
# every read, so a replaced file is mapped afresh. The store never truncates a shard file in place
# (TensorStore writes a new file and renames it), so a held mapping never reads past its file's end.
MAP_MIN_CHUNK_BYTES = 256 << 10  # smaller chunks: pread costs no more than the mapping's page faults
_MAP_MAX = 64
_maps: OrderedDict[str, tuple] = OrderedDict()  # path -> (identity, mmap, uint8 view, populated chunks, address)
_maps_lock = threading.Lock()
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; 22 on every architecture
_populate_ok = hasattr(mmap.mmap, "madvise")


def _ident(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _mapped(path: str, ident: tuple) -> tuple:
    """The held mapping of ``path`` whose identity is ``ident`` (made when missing or stale): ``(identity,
    mmap, uint8 view, set of chunk offsets already populated, the view's address)``; the identity is the
    opened file's (``fstat``), which the caller compares with its ``stat``."""
    with _maps_lock:
        hit = _maps.get(path)
        if hit is not None and hit[0] == ident:
            _maps.move_to_end(path)
            return hit
    fd = os.open(path, _RDONLY)
    try:
        st = os.fstat(fd)
        _check_regular(st, os.path.dirname(path), os.path.basename(path))
        # private (copy-on-write, never written): its view is writable for torch's copy, pages stay shared
        mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)  # st_size > 0: the caller checked the index fits
    finally:
        os.close(fd)
    view = np.frombuffer(mm, np.uint8)
    entry: tuple = (_ident(st), mm, view, set(), view.ctypes.data)
    with _maps_lock:
        _maps[path] = entry
        _maps.move_to_end(path)
        while len(_maps) > _MAP_MAX:
            _maps.popitem(last=False)  # unmapped once no read holds a view of it (never closed under one)
    return entry


def _populate(entry: tuple, off: int, nbytes: int) -> None:
    """Fault a chunk's pages in with one call the first time it is read through this mapping (fewer page
    faults; on a cold cache one read of the range); later reads find the page tables filled."""
    global _populate_ok
    done = entry[3]
    if off in done or not _populate_ok:
        return
    start = off - off % mmap.ALLOCATIONGRANULARITY
    try:
        entry[1].madvise(_MADV_POPULATE_READ, start, off + nbytes - start)
    except OSError:
        _populate_ok = False  # an older kernel: plain page faults do the same
    done.add(off)


# Large reads split over the pool read one file at several offsets at once. One POSIX_FADV_WILLNEED per
# file over the span the runs cover starts the whole span's reads at once (on a warm cache it finds the
# pages present). None where the platform has no such advice. (Whole reads of several arrays,
# ``read_streamed``, skip it: each file is then read in order as one stream, which the kernel's
# sequential readahead already serves in large requests; see docs/perf.md.)
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)


def _prefetch(runs: list[tuple]) -> None:
    """``posix_fadvise(WILLNEED)`` over the byte span of each file's runs ``(fd, key, items, expect)``."""
    spans: dict[int, list[int]] = {}
    for fd, _key, items, expect in runs:
        lo, hi = items[0][0], items[-1][0] + expect
        if items[-1][0] < lo:  # a run's items are in file order; be safe about any order
            lo, hi = min(it[0] for it in items), max(it[0] for it in items) + expect
        span = spans.get(fd)
        if span is None:
            spans[fd] = [lo, hi]
        else:
            span[0], span[1] = min(span[0], lo), max(span[1], hi)
    for fd, (lo, hi) in spans.items():
        try:
            os.posix_fadvise(fd, lo, hi - lo, _WILLNEED)  # type: ignore[arg-type]
        except OSError:
            pass  # advice only


# How a large read is split over the pool (``LocalArray._run_all``): each thread gets contiguous segments
# of whole files in file order, each read through its own open file, so that from a cold cache each
# stream gets the kernel's sequential readahead (large requests, read ahead of the copy). Runs submitted
# one task each would read one file at several offsets at once through one open file, which the kernel's
# readahead sees as random reads.
SEGMENT_MIN_BYTES = 8 << 20  # a file is split into segments no smaller than this
# Several whole reads in flight at once (``LocalArray.read_streamed``, ``io.read_tensors``): each shard file
# is read in file order as one stream (a file larger than this in streams of about this size), no WILLNEED;
# the concurrency comes from the reads in flight: several files read at once in large sequential requests
# keep a disk's queue full without turning any one file's reads random (tools/bench_cold.py;
# docs/perf.md).
STREAM_BYTES = 64 << 20
_streamed = threading.local()
SEGMENTS_PER_THREAD = 2  # segments per pool thread (balance: a thread that finishes early takes another)
_SEQUENTIAL = getattr(os, "POSIX_FADV_SEQUENTIAL", None)


# The pool whole reads run on when several are in flight at once (``read_streamed``); apart from the read
# pool (its tasks may wait on the read pool's, never the reverse).
_STREAM_POOL = LazyPool("ucp-stream", "stream_threads", lambda cpus: 2 * _threads())
get_stream_pool = _STREAM_POOL.get


def _segments(runs: list[tuple], total: int, target: int = 0) -> list[tuple[bool, list[tuple]]]:
    """``(own, runs)`` pool tasks for ``runs`` (each file's runs together, in file order), ``total`` bytes:
    each file's runs cut into contiguous segments of about ``total / threads`` bytes (at least
    ``SEGMENT_MIN_BYTES``), or of about ``target`` bytes when given; ``own``: the file has more than one
    segment (each reads through its own file)."""
    files: list[list[tuple]] = []
    for r in runs:
        if files and files[-1][0][0] == r[0]:
            files[-1].append(r)
        else:
            files.append([r])
    target = target or max(SEGMENT_MIN_BYTES, -(-total // (SEGMENTS_PER_THREAD * _threads())))
    tasks: list[tuple[bool, list[tuple]]] = []
    for file_runs in files:
        nbytes = sum(len(r[2]) * r[3] for r in file_runs)
        n = max(1, min(len(file_runs), round(nbytes / target)))
        if n == 1:
            tasks.append((False, file_runs))
            continue
        per = nbytes / n  # cut where the bytes so far pass a multiple of ``per``
        seg: list[tuple] = []
        cut: list[list[tuple]] = []
        acc, k = 0, 1
        for r in file_runs:
            seg.append(r)
            acc += len(r[2]) * r[3]
            if acc >= k * per and k < n:
                cut.append(seg)
                seg, k = [], k + 1
        if seg:
            cut.append(seg)
        tasks += [(len(cut) > 1, c) for c in cut]
    return tasks


def settle(futures: list) -> None:
    """Leave none of ``futures`` running: cancel those not started, wait for the others (their errors are
    the caller's to report, not raised here)."""
    for f in futures:
        f.cancel()
    for f in futures:
        if not f.cancelled():
            f.exception()


def wait_all(futures: list) -> None:
    """The results of ``futures`` in order (the first failure raises); none left running either way."""
    try:
        for f in futures:
            f.result()
    finally:
        settle(futures)


class LocalReadError(ValueError):
    """A shard file or chunk fails a check (crc32c, size, index entry) or is missing.

    A ``ValueError`` like TensorStore's, and worded so that ``format.is_corruption`` recognises it."""


def _check_regular(st: os.stat_result, folder: str, key: str) -> None:
    """Refuse a shard file that is not a regular file (a FIFO, socket or device planted in the store)."""
    if not stat.S_ISREG(st.st_mode):
        raise LocalReadError(f"shard file {key} of {folder} is corrupt: not a regular file (mode "
                             f"{stat.filemode(st.st_mode)}); a store holds only regular files")


def _plain(chain: Any) -> bool:
    """``[bytes(little), crc32c]``: C-order little-endian bytes followed by their crc32c, nothing else."""
    if not isinstance(chain, list) or len(chain) != 2 or not all(isinstance(c, dict) for c in chain):
        return False
    first, second = chain
    cfg = first.get("configuration") or {}
    return (first.get("name") == "bytes" and set(first) <= {"name", "configuration"} and set(cfg) <= {"endian"}
            and cfg.get("endian", "little") == "little"
            and second.get("name") == "crc32c" and set(second) <= {"name", "configuration"}
            and not second.get("configuration"))


def is_local_chain(codecs: Any, layout: fmt.ArrayLayout) -> bool:
    """True when ``codecs`` is exactly ``sharding_indexed(bytes little + crc32c, index bytes + crc32c, end)``
    with the layout's inner chunk shape and no compression (or, for 0-d arrays, ``bytes + crc32c``).
    Defaults TensorStore drops (``index_location: end``, ``endian``) count as given."""
    if layout.compression != "none":
        return False
    if not layout.sharded:
        return _plain(codecs)
    if not isinstance(codecs, list) or len(codecs) != 1 or not isinstance(codecs[0], dict):
        return False
    c = codecs[0]
    cfg = c.get("configuration")
    if c.get("name") != "sharding_indexed" or set(c) - {"name", "configuration"} or not isinstance(cfg, dict):
        return False
    return (set(cfg) <= {"chunk_shape", "codecs", "index_codecs", "index_location"}
            and list(cfg.get("chunk_shape") or ()) == list(layout.chunk_shape)
            and _plain(cfg.get("codecs")) and _plain(cfg.get("index_codecs"))
            and cfg.get("index_location", "end") == "end")


def open_reader(location: Location, rel: str, layout: fmt.ArrayLayout, context, *, codecs: Any = None):
    """The reader for one array: the only place that chooses between the local path and TensorStore.

    Local (:class:`LocalArray`) when the store is a folder and the array's codec chain (``codecs``, the
    catalog's record; the layout's own chain when not given) is exactly the store's uncompressed chain;
    a TensorStore handle otherwise (S3, compression, any other chain). The ``local_read`` setting off
    (``config.override(local_read=False)``) forces TensorStore everywhere (tests and benchmarks compare
    the two)."""
    if location.kind == "file" and config.current().local_read:
        if codecs is None:
            local = is_local_chain(layout.codecs(), layout)
        else:
            # the catalog's records share one codecs object per distinct value (checkpoint._fetch_infos):
            # check each object once per chunk geometry; the entry holds the object so its id stays valid
            key = (id(codecs), layout.chunk_shape, layout.sharded, layout.compression)
            hit = _chain_checks.get(key)
            if hit is None or hit[0] is not codecs:
                if len(_chain_checks) >= 4096:
                    _chain_checks.clear()
                hit = _chain_checks[key] = (codecs, is_local_chain(codecs, layout))
            local = hit[1]
        if local:
            return LocalArray(os.path.join(location.root, safe_rel(rel)), layout)
        location.check_regular_tree(rel)
    return fmt.open_array(location, rel, layout, context)


_chain_checks: dict[tuple, tuple] = {}  # (id(codecs), chunk shape, sharded, compression) -> (codecs, local?)


class _Pending:
    """What ``LocalArray[...].read()`` returns: the read runs on ``result()`` (TensorStore-future-like)."""

    __slots__ = ("_array", "_box")

    def __init__(self, array: LocalArray, box):
        self._array, self._box = array, box

    def read(self) -> _Pending:
        return self

    def result(self) -> np.ndarray:
        return self._array.read(self._box)


_scratch = threading.local()
PAGE = 4096
# On some CPUs (``rep movsb`` with FSRM) the kernel's copy to user memory and glibc's memcpy slow down by
# an order of magnitude when the destination sits a few bytes after the source modulo a 4 KiB page (the
# band's width and the slowdown vary by CPU and kernel: tools/bench_align.py measures them,
# docs/perf.md has the figures). A chunk's file offset moves by 4 bytes (its crc) per chunk, so a
# read straight into the destination would hit that band for some chunks of every shard: those chunks are
# read into scratch placed at the file offset's page position (distance 0) and copied with torch's copy
# loop, which does not slow down. ``bad_distance`` counts every distance from 1 to ``_BAD_DISTANCE - 1``
# (1-63 bytes, a cache line) as slow: wider than the bands measured, because a chunk that needlessly goes
# through scratch costs one extra copy, while one that hits the band costs many times its read.
_BAD_DISTANCE = 64


def bad_distance(dst_addr: int, file_off: int) -> bool:
    return 0 < (dst_addr - file_off) % PAGE < _BAD_DISTANCE


def _scratch_buffer(nbytes: int) -> tuple[np.ndarray, int]:
    """This thread's scratch (at least ``nbytes`` + a page) and its address."""
    hit = getattr(_scratch, "buf", None)
    if hit is None or hit[0].nbytes < nbytes + PAGE:
        buf = np.empty(max(nbytes + PAGE, 1 << 20), np.uint8)
        hit = _scratch.buf = (buf, buf.ctypes.data)
    return hit


def _placed(buf: np.ndarray, addr: int, pos: int, file_off: int, nbytes: int,
            shift: int = 0) -> tuple[np.ndarray, int]:
    """``nbytes`` of ``buf`` at or after ``pos`` whose address is ``file_off + shift`` modulo a page.

    ``shift`` 0: the kernel copies at distance 0. ``_HALF_PAGE`` when the copy out of scratch would
    otherwise run at a slow distance: both copies then run at about half a page."""
    p = pos + (file_off + shift - addr - pos) % PAGE
    return buf[p:p + nbytes], p + nbytes


_HALF_PAGE = PAGE // 2


def _copy_distance_slow(dst: np.ndarray, src: np.ndarray) -> bool:
    """True when numpy's copy of ``src`` into ``dst`` would run at a slow distance on every row."""
    return dst.strides == src.strides and bad_distance(dst.__array_interface__["data"][0],
                                                        src.__array_interface__["data"][0])


_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


_PIECE = 16384  # elements per torch copy call: below torch's grain size, so one thread does it (under load
                # an OpenMP team for one chunk's copy can take milliseconds)


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (same shape and itemsize, any strides): numpy's copy (glibc memcpy) where every
    row keeps one distance between destination and source that is not a slow one (``_BAD_DISTANCE``),
    else torch's copy loop in pieces of at most ``_PIECE`` elements, which does not slow down."""
    if src.nbytes < 2048 or (dst.strides == src.strides and not _copy_distance_slow(dst, src)):
        dst[...] = src
        return
    ints = _INT_OF_SIZE.get(dst.itemsize)
    if ints is None:  # complex128: numpy's copy
        dst[...] = src
        return
    if dst.ndim == 0:
        dst[...] = src
        return
    if src.size > _PIECE and dst.flags.c_contiguous and src.flags.c_contiguous:
        dst, src = dst.reshape(-1), src.reshape(-1)
    per = src.size // max(src.shape[0], 1)
    if per > _PIECE and src.ndim > 1:
        for i in range(src.shape[0]):
            copy_into(dst[i], src[i])
        return
    td, ts = torch.from_numpy(dst.view(ints)), torch.from_numpy(src.view(ints))
    step = max(1, _PIECE // max(per, 1))
    for i in range(0, src.shape[0], step):
        td[i:i + step].copy_(ts[i:i + step])


def _derive(layout: fmt.ArrayLayout) -> dict[str, Any]:
    """A LocalArray's constants for one geometry (dtype, shape, chunk and shard shapes)."""
    g: dict[str, Any] = {}
    g["dtype"] = dtypes.numpy_dtype(layout.dtype)
    g["torch_dtype"] = dtypes.torch_dtype(layout.dtype)
    g["itemsize"] = itemsize = g["dtype"].itemsize
    shape, chunk = tuple(layout.shape), tuple(layout.chunk_shape)
    ndim = g["ndim"] = len(shape)
    if ndim:
        per_shard = tuple(sh // c for sh, c in zip(layout.shard_shape, chunk))
        g["n_index"] = math.prod(per_shard)
    else:
        per_shard, g["n_index"] = (), 0
    g["per_shard"] = per_shard
    chunk_bytes = g["chunk_bytes"] = math.prod(chunk) * itemsize
    g["shape"], g["chunk_shape"] = shape, chunk
    g["_expect"] = chunk_bytes + 4
    # chunks hold whole rows: a box of whole rows maps each whole chunk to one contiguous byte range
    g["_slab"] = ndim >= 1 and chunk[1:] == shape[1:]
    g["_rest"] = tuple((0, n) for n in shape[1:])
    g["_row_bytes"] = chunk_bytes // chunk[0] if ndim else 0
    g["_mapped_ok"] = chunk_bytes >= MAP_MIN_CHUNK_BYTES
    g["_local_mul"] = tuple(math.prod(per_shard[d + 1:]) for d in range(len(per_shard)))
    # the row fast path's constants (``read_rows``): rows per chunk, chunks per shard along dim 0, index
    # entries between consecutive chunks of dim 0
    g["_c0"] = chunk[0] if ndim else 1
    g["_per0"] = per_shard[0] if ndim else 1
    g["_step"] = math.prod(per_shard[1:]) if ndim else 1
    return g


_geometry: dict[tuple, dict[str, Any]] = {}


class LocalArray:
    """One array of a folder store, read without TensorStore (see the module docstring).

    A held handle keeps, per shard file, the parsed and crc-checked shard index together with the file's
    identity (device, inode, size, mtime and ctime in nanoseconds, from ``fstat`` of the file opened for
    this read). Every read opens the file by path, so a replaced file (a new save, a repair) is seen at
    once; an index whose file identity changed is read and checked again. The chunk bytes and their
    crc32c are read and checked on every read."""

    # per geometry (``_derive``), shared by every array of that geometry
    dtype: np.dtype
    torch_dtype: torch.dtype
    itemsize: int
    ndim: int
    n_index: int
    per_shard: tuple[int, ...]
    chunk_bytes: int
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    _expect: int
    _slab: bool
    _rest: tuple[tuple[int, int], ...]
    _row_bytes: int
    _mapped_ok: bool
    _local_mul: tuple[int, ...]
    _c0: int
    _per0: int
    _step: int

    def __init__(self, folder: str, layout: fmt.ArrayLayout):
        self.folder = folder
        self.layout = layout
        key = (layout.dtype, layout.shape, layout.chunk_shape, layout.shard_shape, MAP_MIN_CHUNK_BYTES)
        geo = _geometry.get(key)
        if geo is None:  # derived once per geometry: a model's layers share a few
            geo = _geometry[key] = _derive(layout)
        self.__dict__.update(geo)
        # shard key -> (file identity, index as [n_index, 2] uint64, end of the chunk data); see the class doc
        self._indexes: dict[str, tuple] = {}
        self._names: dict[tuple, tuple[str, str]] = {}  # shard grid index -> (key, path)
        self._shard_rows: dict[int, tuple[str, str]] = {}  # shard index along dim 0 -> (key, path)

    def __repr__(self) -> str:
        return f"LocalArray({self.folder!r}, shape={list(self.shape)}, chunks={list(self.layout.chunk_shape)})"

    # --- TensorStore-like surface --------------------------------------------------------------
    def __getitem__(self, index) -> _Pending:
        if not isinstance(index, tuple):
            index = (index,)
        box = []
        for s, n in zip(index, self.shape):
            if not isinstance(s, slice) or s.step not in (None, 1):
                raise TypeError(f"LocalArray reads boxes (slices with step 1), got {index!r}")
            lo, hi, _ = s.indices(n)
            box.append((lo, max(lo, hi)))
        box += [(0, n) for n in self.shape[len(index):]]
        return _Pending(self, tuple(box))

    # --- reads ----------------------------------------------------------------------------------
    def read(self, box: fmt.Box) -> np.ndarray:
        """The box as a new C-order array (fresh memory, filled once)."""
        out = np.empty(tuple(hi - lo for lo, hi in box), self.dtype)
        self.read_into(box, out)
        return out

    def read_streamed(self, box: fmt.Box) -> np.ndarray:
        """``read`` as one of several whole reads in flight at once (``io.read_tensors`` runs them on
        ``get_stream_pool``): each shard file is read in file order as one stream (``STREAM_BYTES``), in this
        thread when the box has one; the same checks and errors as ``read``."""
        _streamed.on = True
        try:
            return self.read(box)
        finally:
            _streamed.on = False

    def read_into(self, box: fmt.Box, out: np.ndarray, flags: int = 0) -> bool | None:
        """Fill ``out`` (shape of ``box``, this array's dtype, any strides) with the box's elements; True.

        Raises :class:`LocalReadError` on any corruption; ``out`` may then hold partial data. ``flags``
        ``RWF_NOWAIT`` (``box_cached``): False instead of waiting for the disk (a shard index or chunk not
        all in the page cache; ``out`` may then hold partial data), None for what it does not try (a 0-d
        array, a read the pool would split). A single chunk of a mapped array is then read by ``pread``
        (the mapping's page faults cannot be told not to wait)."""
        if out.dtype != self.dtype:
            raise TypeError(f"destination dtype {out.dtype} is not the array's {self.dtype}")
        if not self.ndim:
            if flags:
                return None
            self._read_scalar(out)
            return True
        if any(hi <= lo for lo, hi in box):
            return True
        chunk = self.chunk_shape
        idx = tuple(lo // c for (lo, _), c in zip(box, chunk))
        if all((hi - 1) // c == i for (_, hi), c, i in zip(box, chunk, idx)):
            if self._mapped_ok and not flags:
                self._read_single_mapped(idx, box, out)  # a row of a large chunk: crc in place, copy the row
                return True
            if self._slab and out.flags.c_contiguous and box[1:] == self._rest:
                flat = out.reshape(-1).view(np.uint8)  # whole rows: straight into place, no copy after
                return self._rows_in_chunk(box[0][0], box[0][1], flat, flat.ctypes.data, flags)
            return self._read_single(idx, box, out, flags)  # a small slice: one chunk, fewest steps
        if self._slab and out.flags.c_contiguous and all(b == (0, n) for b, n in zip(box[1:], self.shape[1:])):
            # whole rows: no per-chunk views, one check per shard
            return self._read_rows(box[0][0], box[0][1], out, flags)
        fds: list[int] = []
        try:
            runs = []
            for key, sidx, items in self._plan(box, out):
                fd = self._open(key, items)
                fds.append(fd)
                got = self._runs(fd, key, sidx, items, flags)
                if got is None:
                    return False
                runs += got
            return self._run_all(runs, flags)
        finally:
            for fd in fds:
                os.close(fd)

    def _run_all(self, runs: list[tuple], flags: int = 0) -> bool | None:
        """Read ``runs`` (``(fd, key, items, expect)``, each file's runs together in file order); a large
        read is split over the pool as contiguous segments of each file, read in file order, each through
        its own open file (``_segments``).
        ``flags`` ``RWF_NOWAIT``: the runs one after another here, False as soon as one would wait (a read
        the pool would split is not tried: None)."""
        total = sum(len(r[2]) for r in runs) * self.chunk_bytes
        if flags:
            if total >= PARALLEL_BYTES or getattr(_streamed, "on", False):
                return None
            return all(self._read_run(fd, key, items, expect, flags) for fd, key, items, expect in runs)
        if getattr(_streamed, "on", False) and runs:
            tasks = _segments(runs, total, STREAM_BYTES)  # one stream per file (or per STREAM_BYTES of one)
            if len(tasks) == 1:
                self._read_segment(*tasks[0])
                return True
            wait_all([_get_pool().submit(self._read_segment, *seg) for seg in tasks])
        elif total >= PARALLEL_BYTES and len(runs) > 1:
            if _WILLNEED is not None:
                _prefetch(runs)
            futures = [_get_pool().submit(self._read_segment, *seg) for seg in _segments(runs, total)]
            wait_all(futures)  # every run ends before its file is closed, also when one fails
        else:
            for r in runs:
                self._read_run(*r)
        return True

    def _read_segment(self, own: bool, runs: list[tuple]) -> None:
        """Runs of one file in file order (``_segments``). ``own``: other threads read other segments of
        the same file, so this one reads through a file of its own (the kernel keeps readahead state per
        open file: on a shared one, reads at several offsets look random and get no readahead); the file
        opened again must be the one whose index was checked (same identity), else the shared one is used.
        Either way the kernel is told the reads are sequential (a larger readahead window)."""
        fd, key = runs[0][0], runs[0][1]
        mine = -1
        if own:
            try:
                mine = os.open(os.path.join(self.folder, *key.split("/")), _RDONLY)
                st = os.fstat(mine)
                held = self._indexes.get(key)
                if held is None or held[0] != _ident(st):
                    os.close(mine)
                    mine = -1
            except OSError:
                if mine >= 0:
                    os.close(mine)
                mine = -1
        use = mine if mine >= 0 else fd
        try:
            if _SEQUENTIAL is not None:
                lo = min(it[0] for r in runs for it in (r[2][0], r[2][-1]))
                hi = max(it[0] for r in runs for it in (r[2][0], r[2][-1])) + runs[0][3]
                try:
                    os.posix_fadvise(use, lo, hi - lo, _SEQUENTIAL)
                except OSError:
                    pass  # advice only
            for _fd, _key, items, expect in runs:
                self._read_run(use, key, items, expect)
        finally:
            if mine >= 0:
                os.close(mine)

    def read_rows(self, lo: int, hi: int, out: np.ndarray, addr: int | None = None) -> None:
        """Rows ``[lo, hi)`` (``lo < hi``) of an array whose chunks hold whole rows (``rows_ok``) into
        C-contiguous ``out`` of this dtype holding their elements in C order, any shape (``addr``: its
        address, when the caller knows it): the lean entry of small reads (``io``'s plans), with the same
        checks and errors as ``read_into``."""
        c0 = self._c0
        if (hi - 1) // c0 == lo // c0 and not self._mapped_ok:
            flat = out.view(np.uint8) if out.ndim == 1 else out.reshape(-1).view(np.uint8)
            if self._rows_in_chunk(lo, hi, flat, flat.ctypes.data if addr is None else addr):
                return
        self.read_into(((lo, hi),) + self._rest, out.reshape(-1).view(self.dtype).reshape((hi - lo,) + self.shape[1:]))

    def rows_cached(self, lo: int, hi: int, flat: np.ndarray, addr: int) -> bool | None:
        """``read_rows`` done only if it needs no disk: the shard indexes (when not held) and the chunks read
        with ``RWF_NOWAIT``. True when done; False when a read would wait (``flat`` may hold partial data),
        None when it does not try (see ``read_into``): the caller then reads ``flat`` (1-d, the rows' C-order
        bytes at ``addr``) again elsewhere. Corruption raises as usual."""
        if not _NOWAIT:
            return None
        if (hi - 1) // self._c0 == lo // self._c0:
            return self._rows_in_chunk(lo, hi, flat.view(np.uint8), addr, _NOWAIT)
        return self.box_cached(((lo, hi),) + self._rest,
                               flat.view(self.dtype).reshape((hi - lo,) + self.shape[1:]))

    def box_cached(self, box: fmt.Box, out: np.ndarray) -> bool | None:
        """``read_into`` done only if it needs no disk, as ``rows_cached`` for any box: the shard indexes
        (when not held) and the chunks read with ``RWF_NOWAIT``. True when done; False when a read would
        wait (``out`` may hold partial data; a box inside one chunk leaves it untouched); None when it does
        not try (see ``read_into``). The caller then reads it again elsewhere. Corruption raises as usual."""
        if not _NOWAIT or out.dtype != self.dtype:
            return None
        return self.read_into(box, out, _NOWAIT)

    @property
    def rows_ok(self) -> bool:
        """Chunks hold whole rows: ``read_rows`` applies to boxes of whole rows."""
        return self._slab and self.chunk_bytes > 0

    def _row_shard(self, s: int) -> tuple[str, str]:
        names = self._shard_rows.get(s)
        if names is None:
            key = f"c/{s}" + "/0" * (self.ndim - 1)
            names = self._shard_rows[s] = (key, f"{self.folder}/{key}")  # the key is ours: c/<i>/0...
        return names

    def _rows_in_chunk(self, lo: int, hi: int, flat: np.ndarray, addr: int, flags: int = 0) -> bool:
        """Rows ``[lo, hi)`` of one chunk straight into ``flat`` (their C-order bytes, at ``addr``) with one
        ``preadv``: the chunk's bytes before the rows into scratch, the rows into ``flat``, the rest and
        the stored crc32c into scratch; the crc32c then runs over the three pieces in order. No copy
        after the read; when ``flat`` sits at a slow distance from the rows' file offset (``_BAD_DISTANCE``)
        the chunk goes to scratch half a page off and the rows are copied. True when done; ``flags``
        ``RWF_NOWAIT``: False (``flat`` may hold partial data) when the index or the chunk is not all in the
        page cache."""
        c0 = self._c0
        i = lo // c0
        s = i // self._per0
        names = self._shard_rows.get(s)
        key, path = names if names is not None else self._row_shard(s)
        local = (i - s * self._per0) * self._step
        try:
            fd = os.open(path, _RDONLY)
        except FileNotFoundError:
            raise LocalReadError(f"chunk {[i] + [0] * (self.ndim - 1)} of {self.folder}: shard file {key} is "
                                 "missing (NOT_FOUND)") from None
        except OSError as exc:
            raise ValueError(f"reading {path} failed: {exc}") from None
        try:
            st = os.fstat(fd)
            hit = self._indexes.get(key)
            if hit is None or hit[0] != (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns):
                got_index = self._index(fd, key, flags, st)
                if got_index is None:
                    return False
                index, _, data_end = got_index
            else:
                index, data_end = hit[1], hit[3]
            off, nb = index[local]
            expect = self._expect
            if nb != expect or off + nb > data_end:
                self._check_entry((i,) + (0,) * (self.ndim - 1), key, off, nb, expect, data_end)
            a = (lo - i * c0) * self._row_bytes
            b = a + flat.nbytes
            whole = a == 0 and b == expect - 4 and not 0 < (addr - off) % PAGE < _BAD_DISTANCE
            slow = False
            if whole:
                # the whole chunk (a ZeRO fragment of a chunk's size): its bytes straight into ``flat``, its
                # crc32c into four bytes of its own, no scratch
                iov: list[Any] = [flat, bytearray(4)]
            else:
                # scratch standing for the whole chunk, at distance 0 from its file offset: the bytes before the
                # rows and those after them (with the crc) land at their own place in it. When ``flat`` sits at
                # a slow distance from the rows' offset, the whole chunk goes to scratch half a page off instead
                # and the rows are copied out (both copies then run at about half a page).
                slow = 0 < (addr - off - a) % PAGE < _BAD_DISTANCE
                hit = getattr(_scratch, "buf", None)
                if hit is None or hit[0].nbytes < expect + PAGE:
                    hit = _scratch_buffer(expect)
                p = (off + (_HALF_PAGE if slow else 0) - hit[1]) % PAGE
                region = hit[0][p:p + expect]
                post = region[b:]
                pre = region[:a]
                iov = [region] if slow else [pre, flat, post] if a else [flat, post]
            got = self._preadv(fd, iov, off, flags, key)
        finally:
            os.close(fd)
        if got != expect:
            if flags:
                return False  # would wait, or partly cached (or truncated: the blocking read says which)
            raise LocalReadError(f"chunk {[i] + [0] * (self.ndim - 1)} of {self.folder}: shard file {key} is "
                                 "truncated (short read)")
        if whole:
            ok = _crc(flat) == int.from_bytes(iov[1], "little")
        elif slow:
            ok = _crc(region[:-4]) == int.from_bytes(region[-4:], "little")
        else:
            crc = _crc(flat, _crc(pre)) if a else _crc(flat)
            ok = _crc(post[:-4], crc) == int.from_bytes(post[-4:], "little")
        if not ok:
            raise LocalReadError(f"chunk {[i] + [0] * (self.ndim - 1)} of {self.folder}: crc32c checksum "
                                 f"mismatch in shard file {key}")
        if slow:
            flat[...] = region[a:b]
        return True

    def _read_rows(self, lo: int, hi: int, out: np.ndarray, flags: int = 0) -> bool | None:
        """Rows ``[lo, hi)`` of an array whose chunks hold whole rows (``chunk_shape[1:] == shape[1:]``) into
        C-contiguous ``out``: each whole chunk's destination is a contiguous byte range, found by arithmetic;
        the shard index entries are checked with numpy, one call per shard; a chunk the rows only partly
        cover (at most two) goes through ``_read_single``. True; ``flags`` ``RWF_NOWAIT``: False as soon as
        a read would wait (``read_into``)."""
        c0, n0 = self.chunk_shape[0], self.shape[0]
        rest = tuple((0, n) for n in self.shape[1:])
        zeros = (0,) * (self.ndim - 1)
        first = -(-lo // c0)                 # first chunk starting at or after lo
        end = min(hi // c0, n0 // c0)        # chunks [first, end) lie whole inside [lo, hi) and the array
        if end <= first:
            first = end = lo // c0 + 1       # two partial chunks, no whole one
        row_bytes = self.chunk_bytes // c0
        flat = out.reshape(-1).view(np.uint8)
        if lo < first * c0:
            a, b = lo, min(first * c0, hi)
            if not self._read_single((lo // c0,) + zeros, ((a, b),) + rest, out[a - lo:b - lo], flags):
                return False
        if end * c0 < hi:
            a = max(end * c0, lo)
            if not self._read_single((a // c0,) + zeros, ((a, hi),) + rest, out[a - lo:], flags):
                return False
        if end <= first:
            return True
        base = flat.ctypes.data
        expect, cb, per0 = self._expect, self.chunk_bytes, self.per_shard[0]
        most = max(1, min(_IOV_MAX // 2, RUN_BYTES // expect))
        tail = "/0" * (self.ndim - 1)
        step = math.prod(self.per_shard[1:])
        fds: list[int] = []
        try:
            runs: list[tuple] = []
            for s in range(first // per0, (end - 1) // per0 + 1):
                a, b = max(first, s * per0), min(end, (s + 1) * per0)
                key = f"c/{s}{tail}"
                fd = self._open(key, [((a,) + zeros,)])
                fds.append(fd)
                got_index = self._index(fd, key, flags)
                if got_index is None:
                    return False
                _, entries, data_end = got_index
                ent = entries[(a - s * per0) * step:(b - s * per0) * step:step]  # [i, 0, ..., 0] of the shard
                offs, nbs = ent[:, 0], ent[:, 1]
                bad = nbs != expect
                if data_end < expect:
                    bad[:] = True
                else:
                    bad |= offs > np.uint64(data_end - expect)
                if bad.any():
                    k = int(np.argmax(bad))
                    self._check_entry((a + k,) + zeros, key, int(offs[k]), int(nbs[k]), expect, data_end)
                offl = offs.tolist()
                items: list[tuple] = []
                d = (a * c0 - lo) * row_bytes
                prev = -1
                for k, off in enumerate(offl):
                    if items and (off != prev + expect or len(items) >= most):
                        runs.append((fd, key, items, expect))
                        items = []
                    items.append((off, (a + k,) + zeros, flat[d:d + cb], base + d, None, None))
                    prev = off
                    d += cb
                if items:
                    runs.append((fd, key, items, expect))
            return self._run_all(runs, flags)
        finally:
            for fd in fds:
                os.close(fd)

    def _read_single_mapped(self, idx: tuple, box: fmt.Box, out: np.ndarray) -> None:
        """One chunk through the held mapping of its shard file: crc32c over the page cache in place, then
        only the box's part copied into ``out`` (see ``_mapped``)."""
        key, path, local = self._shard_of(idx)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise LocalReadError(f"chunk {list(idx)} of {self.folder}: shard file {key} is missing "
                                 "(NOT_FOUND)") from None
        except OSError as exc:
            raise ValueError(f"reading {path} failed: {exc}") from None
        ident = _ident(st)
        hit = self._indexes.get(key)
        if hit is None or hit[0] != ident:
            fd = self._open(key, [(idx,)])
            try:
                index, _, data_end = self._index(fd, key)  # also checks the size covers the index
                ident = self._indexes[key][0]
            finally:
                os.close(fd)
        else:
            index, data_end = hit[1], hit[3]
        off, nb = index[local]
        expect = self._expect
        if nb != expect or off + nb > data_end:
            self._check_entry(idx, key, off, nb, expect, data_end)
        try:
            entry = _mapped(path, ident)
        except FileNotFoundError:
            raise LocalReadError(f"chunk {list(idx)} of {self.folder}: shard file {key} is missing "
                                 "(NOT_FOUND)") from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"reading {path} failed: {exc}") from None
        if entry[0] != ident:  # replaced between the stat and the mapping: the pread path reads it as it is
            self._read_single(idx, box, out)
            return
        _populate(entry, off, expect)
        enc = entry[2][off:off + expect]
        mem = enc[:-4]
        if _crc(mem) != int.from_bytes(enc[-4:], "little"):
            raise LocalReadError(f"chunk {list(idx)} of {self.folder}: crc32c checksum mismatch in shard file {key}")
        chunk = self.chunk_shape
        if self._slab and out.flags.c_contiguous and box[1:] == self._rest:
            # whole rows: one contiguous byte range of the chunk, one copy at a distance known by arithmetic
            a = (box[0][0] - idx[0] * chunk[0]) * self._row_bytes
            b = (box[0][1] - idx[0] * chunk[0]) * self._row_bytes
            dst = out.reshape(-1).view(np.uint8)
            if b - a < 2048 or not bad_distance(dst.ctypes.data, entry[4] + off + a):
                dst[...] = mem[a:b]
                return
        src = tuple(slice(lo - i * c, hi - i * c) for (lo, hi), i, c in zip(box, idx, chunk))
        copy_into(out, mem.view(self.dtype).reshape(chunk)[src])

    def _shard_of(self, idx: tuple) -> tuple[str, str, int]:
        """A chunk's shard file (key ``c/i/j``, path) and its entry in that shard's index."""
        local = 0
        sidx = []
        for i, p, m in zip(idx, self.per_shard, self._local_mul):
            s = i // p
            sidx.append(s)
            local += (i - s * p) * m
        t = tuple(sidx)
        names = self._names.get(t)
        if names is None:
            key = "c/" + "/".join(map(str, sidx))
            names = self._names[t] = (key, os.path.join(self.folder, *key.split("/")))
        return names[0], names[1], local

    def _read_single(self, idx: tuple, box: fmt.Box, out: np.ndarray, flags: int = 0) -> bool:
        """One chunk read into scratch, its crc32c checked, the box's part copied into ``out``. True when
        done; ``flags`` ``RWF_NOWAIT``: False (``out`` untouched) when the index or the chunk is not all in the
        page cache."""
        key, path, local = self._shard_of(idx)
        try:
            fd = os.open(path, _RDONLY)
        except FileNotFoundError:
            raise LocalReadError(f"chunk {list(idx)} of {self.folder}: shard file {key} is missing "
                                 "(NOT_FOUND)") from None
        except OSError as exc:
            raise ValueError(f"reading {path} failed: {exc}") from None
        try:
            got_index = self._index(fd, key, flags)
            if got_index is None:
                return False
            index, _, data_end = got_index
            off, nb = index[local]
            expect = self._expect
            if nb != expect or off + nb > data_end:
                self._check_entry(idx, key, off, nb, expect, data_end)
            buf, addr = _scratch_buffer(expect)
            enc, _ = _placed(buf, addr, 0, off, expect)
            src = tuple(slice(lo - i * c, hi - i * c) for (lo, hi), i, c in zip(box, idx, self.chunk_shape))
            view = enc[:-4].view(self.dtype).reshape(self.chunk_shape)[src]
            same_strides = out.strides == view.strides
            if same_strides and bad_distance(out.__array_interface__["data"][0],
                                              view.__array_interface__["data"][0]):
                enc, _ = _placed(buf, addr, 0, off, expect, _HALF_PAGE)
            got = self._preadv(fd, [enc.data], off, flags, key)
        finally:
            os.close(fd)
        if got != expect:
            if flags:
                return False  # would wait, or partly cached (or truncated: the blocking read says which)
            raise LocalReadError(f"chunk {list(idx)} of {self.folder}: shard file {key} is truncated (short read)")
        mem = enc[:-4]
        if _crc(mem) != int.from_bytes(enc[-4:], "little"):
            raise LocalReadError(f"chunk {list(idx)} of {self.folder}: crc32c checksum mismatch in shard file {key}")
        view = mem.view(self.dtype).reshape(self.chunk_shape)[src]
        if same_strides:  # the placement above keeps this copy at a fast distance
            out[...] = view
        else:
            copy_into(out, view)
        return True

    def _check_entry(self, idx: tuple, key: str, off: int, nb: int, expect: int, data_end: int) -> None:
        if off == _MISSING and nb == _MISSING:
            raise LocalReadError(f"chunk {list(idx)} of {self.folder} is missing from shard file {key}")
        if nb != expect:
            raise LocalReadError(f"chunk {list(idx)} of {self.folder}: shard file {key} index says {nb} "
                                 f"bytes, expected {expect}; the shard index is corrupt")
        if off + nb > data_end:
            raise LocalReadError(f"chunk {list(idx)} of {self.folder}: shard file {key} index entry "
                                 f"[{off}, {off + nb}) is past the end of the chunk data ({data_end} bytes); "
                                 "the file is truncated or corrupt")

    def _read_scalar(self, out: np.ndarray) -> None:
        path = os.path.join(self.folder, "c")
        raw = self._read_file(path, "c")
        if len(raw) != self.itemsize + 4:
            raise LocalReadError(f"chunk [] of {self.folder}: file c is truncated or corrupt: {len(raw)} bytes, "
                                 f"expected {self.itemsize + 4} (data and crc32c)")
        data = np.frombuffer(raw, np.uint8, self.itemsize)
        if _crc(data) != int.from_bytes(raw[-4:], "little"):
            raise LocalReadError(f"chunk [] of {self.folder}: crc32c checksum mismatch in file c")
        out[...] = data.view(self.dtype).reshape(())

    def _read_file(self, path: str, key: str) -> bytes:
        try:
            fd = os.open(path, _RDONLY)
            with open(fd, "rb", buffering=0) as f:
                _check_regular(os.fstat(fd), self.folder, key)
                return f.read()
        except FileNotFoundError:
            raise LocalReadError(f"shard file {key} of {self.folder} is missing (NOT_FOUND)") from None
        except OSError as exc:
            raise ValueError(f"reading {path} failed: {exc}") from None

    def _plan(self, box: fmt.Box, out: np.ndarray) -> list[tuple]:
        """Per shard file touched by ``box``: (key, shard index, [(chunk index, source slices, dest view)])."""
        shards: dict[tuple, list] = {}
        per = self.per_shard
        chunk = self.layout.chunk_shape
        shape = self.shape
        for idx in self.layout.chunks_touching(box):
            cbox = tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(idx, chunk, shape))
            inter = tuple((max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(cbox, box))
            dst = out[tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(inter, box))]
            whole = inter == cbox and all(b - a == c for (a, b), c in zip(cbox, chunk))
            src = None if whole else tuple(slice(a - c0, b - c0) for (a, b), (c0, _) in zip(inter, cbox))
            sidx = tuple(i // p for i, p in zip(idx, per))
            shards.setdefault(sidx, []).append((idx, src, dst))
        return [("c/" + "/".join(map(str, sidx)), sidx, items) for sidx, items in shards.items()]

    def _open(self, key: str, items: list) -> int:
        path = os.path.join(self.folder, *key.split("/"))
        try:
            return os.open(path, _RDONLY)
        except FileNotFoundError:
            raise LocalReadError(f"chunk {list(items[0][0])} of {self.folder}: shard file {key} is missing "
                                 "(NOT_FOUND)") from None
        except OSError as exc:
            raise ValueError(f"reading {path} failed: {exc}") from None

    def _runs(self, fd: int, key: str, sidx: tuple, items: list, flags: int = 0) -> list[tuple] | None:
        """Check the shard index and every needed entry; group the chunks into runs adjacent in the file.

        A run's items are ``(file offset, chunk index, mem, address, src, dst)``: ``mem`` the destination's
        bytes (a whole chunk with a contiguous destination at ``address``), else None with the chunk's
        ``src`` slices (None: all of it) and the destination view ``dst``. ``flags`` ``RWF_NOWAIT``: None
        when reading the index would wait."""
        got_index = self._index(fd, key, flags)
        if got_index is None:
            return None
        index, _, data_end = got_index
        per = self.per_shard
        expect = self._expect
        located = []
        for idx, src, dst in items:
            local = 0
            for i, p, s in zip(idx, per, sidx):
                local = local * p + (i - s * p)
            off, nb = index[local]
            self._check_entry(idx, key, off, nb, expect, data_end)
            if src is None and dst.flags.c_contiguous:
                mem = dst.reshape(-1).view(np.uint8)
                located.append((off, idx, mem, mem.ctypes.data, None, None))
            else:
                located.append((off, idx, None, 0, src, dst))
        located.sort(key=lambda t: t[0])
        runs = []
        i, n = 0, len(located)
        while i < n:
            j = i + 1
            end = located[i][0] + expect
            while (j < n and located[j][0] == end and (j - i + 1) * 2 <= _IOV_MAX
                   and (j - i + 1) * expect <= RUN_BYTES):
                end += expect
                j += 1
            runs.append((fd, key, located[i:j], expect))
            i = j
        return runs

    @overload
    def _index(self, fd: int, key: str) -> tuple[list, np.ndarray, int]: ...
    @overload
    def _index(self, fd: int, key: str, flags: int, st: os.stat_result | None = None
               ) -> tuple[list, np.ndarray, int] | None: ...

    def _index(self, fd: int, key: str, flags: int = 0, st: os.stat_result | None = None
               ) -> tuple[list, np.ndarray, int] | None:
        """The shard index of ``key`` (open as ``fd``) as ``[[offset, nbytes]]`` per inner chunk in C order
        (and the same as an ``[n, 2]`` uint64 array), and where the chunk data ends; read and crc-checked
        again whenever the file's identity changed. ``flags`` ``RWF_NOWAIT``: None when reading it would
        wait for the disk. ``st``: ``fd``'s ``fstat``, when the caller has it."""
        if st is None:
            st = os.fstat(fd)
        _check_regular(st, self.folder, key)
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        hit = self._indexes.get(key)
        if hit is not None and hit[0] == ident:
            return hit[1], hit[2], hit[3]
        raw = self._index_raw(fd, st.st_size, key, flags)
        if raw is None:
            return None
        entries = np.frombuffer(raw, "<u8", 2 * self.n_index).reshape(-1, 2)
        index = entries.tolist()  # [offset, nbytes] per chunk: Python ints, unpacked per read
        data_end = st.st_size - len(raw)
        self._indexes[key] = (ident, index, entries, data_end)
        return index, entries, data_end

    def _index_raw(self, fd: int, size: int, key: str, flags: int = 0) -> bytes | None:
        """The shard index with its crc32c (checked): ``(offset, nbytes)`` uint64 LE per inner chunk, C order
        (None: ``flags`` has ``RWF_NOWAIT`` and it is not all in the page cache)."""
        n = self.n_index
        want = 16 * n + 4
        if size < want:
            raise LocalReadError(f"shard file {key} of {self.folder} is truncated: {size} bytes, smaller than its "
                                 f"{want}-byte index (Invalid shard index)")
        if flags:
            buf = bytearray(want)
            try:
                got = os.preadv(fd, [buf], size - want, flags)
            except BlockingIOError:
                return None
            except OSError as exc:  # tmpfs (a fast tier under /dev/shm) refuses RWF_NOWAIT: read it blocking
                if exc.errno != errno.EOPNOTSUPP:
                    raise
                return None
            if got != want:
                return None
            raw = bytes(buf)
        else:
            raw = os.pread(fd, want, size - want)
        if len(raw) != want:
            raise LocalReadError(f"shard file {key} of {self.folder}: short read of its index (Invalid shard index)")
        if _crc(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            raise LocalReadError(f"shard file {key} of {self.folder}: shard index crc32c checksum mismatch")
        return raw

    def _preadv(self, fd: int, iov: list, off: int, flags: int, key: str) -> int:
        """``os.preadv`` of shard file ``key`` (``flags`` ``RWF_NOWAIT`` or 0): the bytes read, -1 when it would
        wait for the disk; any other failure as ValueError naming the file."""
        try:
            return os.preadv(fd, iov, off, flags) if flags else os.preadv(fd, iov, off)
        except BlockingIOError:
            if flags:
                return -1
            raise ValueError(f"reading shard file {key} of {self.folder} failed: would block") from None
        except OSError as exc:
            if flags and exc.errno == errno.EOPNOTSUPP:  # tmpfs refuses RWF_NOWAIT: the caller reads it blocking
                return -1
            raise ValueError(f"reading shard file {key} of {self.folder} failed: {exc}") from None

    def _read_run(self, fd: int, key: str, run: list, expect: int, flags: int = 0) -> bool:
        """One ``preadv`` for chunks adjacent in the file (see ``_runs`` for the items): straight into the
        destination where it is contiguous and not at a slow distance from the file offset, else into
        scratch placed at the file offset's page position and copied; then every crc32c checked. True;
        ``flags`` ``RWF_NOWAIT``: False when the chunks are not all in the page cache."""
        data_bytes = expect - 4
        n = len(run)
        crcs = np.empty(n, "<u4")
        crc_bytes = crcs.view(np.uint8)
        n_scratch = sum(1 for it in run if it[2] is None or bad_distance(it[3], it[0]))
        if n_scratch:
            buf, addr = _scratch_buffer(n_scratch * (expect + PAGE))
        pos = 0
        iov: list[Any] = []
        via: list[Any] = []  # per chunk: None (read in place) or its scratch bytes
        for k, (off, _idx, mem, maddr, _src, _dst) in enumerate(run):  # noqa: B007
            if mem is not None and not bad_distance(maddr, off):
                iov.append(mem)
                iov.append(crc_bytes[4 * k:4 * k + 4])
                via.append(None)
            else:
                enc, end = _placed(buf, addr, pos, off, expect)
                if mem is not None:  # a whole chunk at a slow distance: scratch half a page from both
                    slow = True
                else:
                    whole = enc[:data_bytes].view(self.dtype).reshape(self.chunk_shape)
                    slow = _copy_distance_slow(_dst, whole if _src is None else whole[_src])
                if slow:
                    enc, end = _placed(buf, addr, pos, off, expect, _HALF_PAGE)
                pos = end
                iov.append(enc)
                via.append(enc)
        got = self._preadv(fd, iov, run[0][0], flags, key)
        if got != expect * n:
            if flags:
                return False  # would wait, or partly cached (or truncated: the blocking read says which)
            raise LocalReadError(f"chunk {list(run[0][1])} of {self.folder}: shard file {key} is truncated "
                                 f"(short read)")
        stored = crcs.tolist()
        chunk = self.chunk_shape
        for (_off, idx, mem, _a, src, dst), enc, want in zip(run, via, stored):
            if enc is None:
                ok = _crc(mem) == want
            else:
                data = enc[:data_bytes]
                ok = _crc(data) == int.from_bytes(enc[data_bytes:], "little")
            if not ok:
                raise LocalReadError(f"chunk {list(idx)} of {self.folder}: crc32c checksum mismatch in shard file "
                                     f"{key}")
            if enc is not None:
                if mem is not None:
                    copy_into(mem, data)
                else:
                    whole = data.view(self.dtype).reshape(chunk)
                    copy_into(dst, whole if src is None else whole[src])
        return True
