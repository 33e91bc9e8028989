"""The local write path: a whole shard file of a folder store written with ``pwritev`` from the caller's memory.

Why: TensorStore copies every inner chunk into its own buffer, computes its crc32c, assembles the shard and
writes it (and, by default, fsyncs each file and folder). For the store's own uncompressed chain the shard
file is only the source bytes with 4 bytes after each inner chunk: an inner chunk is the little-endian
C-order data followed by its crc32c, chunks follow each other in C order, and the shard index
(``(offset, nbytes)`` uint64 pairs per inner chunk, then its crc32c) sits at the end (``localread`` reads the
same layout). When an inner chunk spans the shard's full trailing extent (the chunk policy's usual cut: whole
rows), each chunk is one contiguous run of the source box, so the file is written straight from it with
no copy: ``[chunk0, crc0, chunk1, crc1, ..., index, crc]`` in one ``pwritev``.

Scope (:func:`whole_shard`): a write box that is exactly one shard region wholly inside the array, on a
folder store, uncompressed, chunks of whole shard rows. A box that covers one shard entirely has exactly one
writer (one writer per element), so no other rank ever touches that file. Everything else goes through
TensorStore. Nothing is fsynced here: this path is used only by a writer that defers durability
(``CheckpointWriter.defer_durability``), whose flush fsyncs every file before any row names it.
The files are byte-identical to TensorStore's (tests/test_ds_direct_units.py checks it).
"""

from __future__ import annotations

import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import google_crc32c
import numpy as np

from . import format as fmt

__all__ = ["submit", "whole_shard", "write_shard_file"]

_crc = google_crc32c.value
try:
    _IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 16


_POOL = None
_POOL_LOCK = threading.Lock()
WORKERS = 4  # crc32c and pwritev release the GIL: a few files in flight at once


def submit(root: str, rel: str, layout: fmt.ArrayLayout, shard: tuple[int, ...], data: np.ndarray):
    """``write_shard_file`` on the module's small thread pool; returns its future (``data`` must stay alive
    and unchanged until it completes, as for a TensorStore write)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(WORKERS, thread_name_prefix="ucp-localwrite")
    return _POOL.submit(write_shard_file, root, rel, layout, shard, data)


def whole_shard(layout: fmt.ArrayLayout, box) -> tuple[int, ...] | None:
    """The shard grid index when ``box`` is exactly one shard region lying wholly inside the array, the
    chain is the store's uncompressed one and every inner chunk spans the shard's full trailing extent
    (so each chunk is a contiguous run of the box's C-order bytes); None otherwise."""
    if layout.compression != "none" or not layout.sharded or sys.byteorder != "little":
        return None
    if tuple(layout.chunk_shape[1:]) != tuple(layout.shard_shape[1:]):
        return None
    index = []
    for (lo, hi), sh, s in zip(box, layout.shard_shape, layout.shape):
        if lo % sh or hi - lo != sh or hi > s:
            return None
        index.append(lo // sh)
    return tuple(index)


def write_shard_file(root: str, rel: str, layout: fmt.ArrayLayout, shard: tuple[int, ...], data: np.ndarray) -> int:
    """Write the shard file ``shard`` of the array at ``rel`` (``whole_shard`` said yes) from ``data``, the
    box's values (C-contiguous, the array's dtype); returns the bytes written. Not fsynced."""
    if not data.flags.c_contiguous or tuple(data.shape) != tuple(layout.shard_shape):
        raise ValueError(f"local shard write of {rel}: expected a C-contiguous box of shape {layout.shard_shape}, "
                         f"got {tuple(data.shape)}")
    raw = data.reshape(-1).view(np.uint8)
    n_chunks = layout.shard_shape[0] // layout.chunk_shape[0]
    csize = layout.chunk_shape[0] * math.prod(layout.shard_shape[1:]) * data.itemsize
    iov: list = []
    index = np.empty((n_chunks, 2), dtype="<u8")
    off = 0
    for i in range(n_chunks):
        chunk = raw[i * csize:(i + 1) * csize]
        iov.append(chunk)
        iov.append(_crc(chunk).to_bytes(4, "little"))
        index[i] = (off, csize + 4)
        off += csize + 4
    tail = index.tobytes()
    iov.append(tail)
    iov.append(_crc(tail).to_bytes(4, "little"))
    path = os.path.join(root, rel, "c", *(str(i) for i in shard))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    total = off + len(tail) + 4
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos = 0
        for k in range(0, len(iov), _IOV_MAX):
            part = iov[k:k + _IOV_MAX]
            want = sum(len(p) for p in part)
            got = os.pwritev(fd, part, pos)
            if got != want:  # a short write: finish this part byte-wise
                flat = b"".join(bytes(p) for p in part)
                while got < want:
                    got += os.pwrite(fd, flat[got:], pos + got)
            pos += want
    finally:
        os.close(fd)
    return total
