"""Inner chunks of one sharded array read one by one, each counted: the I/O under a pull.

A pull (``registry/pull.py``) reads only the stored chunks of a delta array that intersect a holder's box. This
reader fetches each shard file's index once (crc32c-checked), then, for each chunk asked for that the index
lists, exactly its bytes (a ``pread`` on a folder store, a byte-range read through TensorStore's kvstore
elsewhere), checks its crc32c and decodes it (``bytes`` little-endian, optionally ``zstd`` or ``blosc``). A
chunk the index does not list holds the fill value (zero): Zarr v3's meaning, and how a delta array leaves
unchanged chunks unwritten (``io/delta.py``, whose index decoding this uses); a missing shard file is an error
(every shard file of a delta array is written). ``bytes_read`` counts every byte fetched (indexes included),
which is what a pull reports and its tests bound. Unlike a TensorStore box read, which reads a shard's index
again for each read when nothing is cached, each index is read once per reader.

Any other codec chain is refused by name (``ReadError``): the store writes only these.
"""

from __future__ import annotations

import math
import os
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ucp_store import dtypes
from ucp_store.errors import ChecksumError, ReadError
from ucp_store.io import crc
from ucp_store.io import delta as dl
from ucp_store.io.location import Location, safe_rel

__all__ = ["ChunkReader"]


def _inner_chain(codecs: Any, what: str) -> tuple[tuple[int, ...], list[dict]]:
    """``(inner chunk shape, inner codecs)`` of a ``sharding_indexed`` chain the reader decodes."""
    if not (isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict)
            and codecs[0].get("name") == "sharding_indexed"):
        raise ReadError(f"{what}: codec chain {codecs!r} is not one sharding_indexed codec (a pull reads sharded "
                        "arrays)")
    cfg = codecs[0].get("configuration") or {}
    if cfg.get("index_location", "end") != "end":
        raise ReadError(f"{what}: shard index location {cfg.get('index_location')!r} is not 'end'")
    inner = list(cfg.get("codecs") or [])
    names = [c.get("name") for c in inner]
    if (not names or names[0] != "bytes" or names[-1] != "crc32c" or len(names) > 3
            or (len(names) == 3 and names[1] not in ("zstd", "blosc"))
            or (inner[0].get("configuration") or {}).get("endian", "little") != "little"):
        raise ReadError(f"{what}: inner codecs {names} are not bytes(little) [+ zstd | blosc] + crc32c")
    return tuple(int(c) for c in cfg["chunk_shape"]), inner


def _decoder(inner: list[dict]):
    if len(inner) == 2:
        return None
    name = inner[1]["name"]
    if name == "zstd":
        import zstandard

        local = threading.local()

        def unzstd(data: bytes, size: int) -> bytes:
            d = getattr(local, "d", None)
            if d is None:
                d = local.d = zstandard.ZstdDecompressor()
            return d.decompress(data, max_output_size=size)
        return unzstd
    from numcodecs import Blosc

    blosc = Blosc()
    return lambda data, size: blosc.decode(data)


class ChunkReader:
    """Reads inner chunks of the sharded array at ``rel`` (``shape``, ``dtype``, catalog ``codecs`` and
    ``shard_shape``) one at a time; thread-safe; ``bytes_read`` counts every byte fetched."""

    def __init__(self, location: Location, rel: str, *, shape: Sequence[int], dtype: str, shard_shape: Sequence[int],
                 codecs: Any, what: str = ""):
        self.location = location
        self.rel = safe_rel(rel)
        self.what = what or location.display(rel)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.np_dtype = dtypes.numpy_dtype(dtype)
        self.shard_shape = tuple(int(s) for s in shard_shape)
        self.chunk_shape, inner = _inner_chain(codecs, self.what)
        self.decode = _decoder(inner)
        self.chunk_nbytes = math.prod(self.chunk_shape) * self.np_dtype.itemsize
        self.n_index = math.prod(s // c for s, c in zip(self.shard_shape, self.chunk_shape))
        self.index_nbytes = 16 * self.n_index + 4  # delta.index_nbytes: what reading one shard's index fetches
        self.bytes_read = 0
        self.chunks_read = 0
        self.requests = 0  # reads issued (a pread, or one ranged GET of a bucket)
        #: seconds per phase summed over the threads that read: wall time of ``index`` (fetching and checking
        #: shard indexes) and ``read`` (fetching chunk bytes: I/O), the threads' CPU time of ``crc`` (checking
        #: chunks) and ``decode`` (decompressing them), which a busy machine does not inflate
        self.seconds = {"index": 0.0, "read": 0.0, "crc": 0.0, "decode": 0.0}
        self._lock = threading.Lock()
        self._index_lock = threading.Lock()
        self._indexes: dict[tuple[int, ...], np.ndarray] = {}
        self._kv: Any = None

    # --- raw bytes ------------------------------------------------------------------------------------
    def _key(self, shard: tuple[int, ...]) -> str:
        return "c/" + "/".join(str(i) for i in shard)

    def _read_range(self, key: str, start: int | None, length: int) -> bytes:
        """``length`` bytes of file ``key`` from ``start`` (None: its last ``length`` bytes); a missing file is
        a ``ChecksumError``."""
        if self.location.kind == "file":
            path = os.path.join(self.location.root, self.rel, key)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except FileNotFoundError:
                raise ChecksumError(f"{self.what}: shard file {key} is missing (NOT_FOUND)") from None
            except OSError as exc:
                raise ReadError(f"{self.what}: shard file {key} cannot be opened: {exc}") from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ReadError(f"{self.what}: shard file {key} is not a regular file")
                off = st.st_size - length if start is None else start
                if off < 0:
                    raise ChecksumError(f"{self.what}: shard file {key} is truncated ({st.st_size} bytes, smaller "
                                        f"than its {length}-byte index)")
                data = os.pread(fd, length, off)
            finally:
                os.close(fd)
        else:
            got = self._kv_read(key, start, length)
            if got is None:
                raise ChecksumError(f"{self.what}: shard file {key} is missing (NOT_FOUND)")
            data = got
        with self._lock:
            self.bytes_read += len(data)
            self.requests += 1
        if len(data) != length:
            raise ChecksumError(f"{self.what}: shard file {key}: short read ({len(data)} of {length} bytes)")
        return data

    def _kv_read(self, key: str, start: int | None, length: int) -> bytes | None:
        import tensorstore as ts

        if self._kv is None:
            self._kv = ts.KvStore.open(self.location.kvstore(self.rel)).result()
        rng = slice(-length, None) if start is None else slice(start, start + length)
        try:
            res = self._kv.read(key, byte_range=rng).result()
        except ValueError as exc:
            raise ReadError(f"{self.what}: reading shard file {key} failed: {exc}") from None
        if res.state == "missing":
            return None
        return bytes(res.value)

    # --- index and chunks -----------------------------------------------------------------------------
    def index(self, shard: tuple[int, ...]) -> np.ndarray:
        """The shard file's index as an ``[n, 2]`` uint64 array (offset, nbytes per inner chunk, C order), read
        and crc-checked once (``delta.decode_index``)."""
        with self._index_lock:  # read once even when several threads ask at once
            hit = self._indexes.get(shard)
            if hit is not None:
                return hit
            key = self._key(shard)
            t0 = time.perf_counter()
            raw = self._read_range(key, None, self.index_nbytes)
            try:
                entries = dl.decode_index(raw, self.n_index, f"{self.what} shard file {key}")
            except dl.DeltaReadError as exc:
                raise ChecksumError(f"{exc} (crc32c checksum mismatch)") from None
            self._indexes[shard] = entries
            self._spent("index", time.perf_counter() - t0)
            return entries

    def _spent(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] += seconds

    def stored(self, shard: tuple[int, ...], slot: int) -> int:
        """The stored bytes of the chunk at ``slot`` of ``shard`` (0: not stored, it holds zero)."""
        off, nb = self.index(shard)[slot]
        return 0 if int(off) == dl.MISSING else int(nb)

    def chunks(self, shard: tuple[int, ...], wanted: Sequence[tuple[int, Sequence[int]]]
               ) -> list[tuple[np.ndarray | None, int]]:
        """``[(decoded chunk or None, stored bytes)]`` for ``wanted`` (``(slot, grid index)`` of one shard file),
        chunks adjacent in the file fetched in one read (unchanged chunks are not stored, so the changed chunks
        of a box are mostly one run): exactly their bytes, each crc-checked and decoded as :meth:`chunk`."""
        return list(self.iter_chunks(shard, wanted))

    def iter_chunks(self, shard: tuple[int, ...], wanted: Sequence[tuple[int, Sequence[int]]]
                    ) -> Iterator[tuple[np.ndarray | None, int]]:
        """:meth:`chunks` as it is consumed: every byte fetched first (the runs of adjacent chunks), then each
        chunk checked and decoded when the caller asks for it, so a caller that applies each chunk before the
        next finds it still in the CPU's cache (and holds one decoded chunk at a time)."""
        entries = self.index(shard)
        key = self._key(shard)
        items = []
        for slot, index in wanted:
            off, nb = int(entries[slot, 0]), int(entries[slot, 1])
            if off != dl.MISSING and nb < 4:
                raise ChecksumError(f"{self.what}: chunk {list(index)} (shard file {key}): index entry of {nb} bytes "
                                    "is too short (Invalid shard index)")
            items.append((off, nb, index))
        data: list[memoryview | None] = [None] * len(items)
        stored = sorted((off, nb, i) for i, (off, nb, _) in enumerate(items) if off != dl.MISSING)
        run: list[tuple[int, int, int]] = []
        for item in stored + [(-1, 0, -1)]:
            if run and item[0] != run[-1][0] + run[-1][1]:
                start = run[0][0]
                t0 = time.perf_counter()
                got = memoryview(self._read_range(key, start, run[-1][0] + run[-1][1] - start))
                self._spent("read", time.perf_counter() - t0)
                for off, nb, i in run:
                    data[i] = got[off - start:off - start + nb]
                with self._lock:
                    self.chunks_read += len(run)
                run = []
            if item[2] >= 0:
                run.append(item)
        for (_off, nb, index), raw in zip(items, data):
            yield (None, 0) if raw is None else (self._decode(raw, index, key), nb)

    def _decode(self, data: memoryview, index: Sequence[int], key: str) -> np.ndarray:
        body = data[:-4]
        t0 = time.thread_time()
        if crc.value(body) != int.from_bytes(data[-4:], "little"):
            raise ChecksumError(f"{self.what}: chunk {list(index)} (shard file {key}): crc32c checksum mismatch")
        raw: Any = body
        t1 = time.thread_time()
        if self.decode is not None:
            try:
                raw = self.decode(body, self.chunk_nbytes)
            except Exception as exc:  # noqa: BLE001 - any decoder failure is a corrupt chunk
                raise ChecksumError(f"{self.what}: chunk {list(index)} (shard file {key}): does not decode: "
                                    f"{exc}") from None
        t2 = time.thread_time()
        with self._lock:
            self.seconds["crc"] += t1 - t0
            self.seconds["decode"] += t2 - t1
        if len(raw) != self.chunk_nbytes:
            raise ChecksumError(f"{self.what}: chunk {list(index)} (shard file {key}): {len(raw)} bytes decoded, "
                                f"expected {self.chunk_nbytes}")
        return np.frombuffer(raw, self.np_dtype).reshape(self.chunk_shape)

    def raw(self, shard: tuple[int, ...], slot: int) -> bytes | None:
        """The stored bytes of the chunk at ``slot`` of ``shard`` (encoded body and its crc32c), or None when it is
        not stored; unchecked (what a benchmark holds in memory to time decoding alone)."""
        off, nb = (int(x) for x in self.index(shard)[slot])
        return None if off == dl.MISSING else self._read_range(self._key(shard), off, nb)

    def chunk(self, shard: tuple[int, ...], slot: int, index: Sequence[int] = ()) -> np.ndarray | None:
        """The decoded inner chunk at ``slot`` of ``shard`` (shape ``chunk_shape``, a read-only view), or None
        when it is not stored. A crc32c mismatch or a chunk that does not decode is a ``ChecksumError`` naming
        the array, shard file and chunk."""
        entries = self.index(shard)
        off, nb = int(entries[slot, 0]), int(entries[slot, 1])
        if off == dl.MISSING:
            return None
        key = self._key(shard)
        where = f"{self.what}: chunk {list(index)} (shard file {key})"
        if nb < 4:
            raise ChecksumError(f"{where}: index entry of {nb} bytes is too short (Invalid shard index)")
        data = self._read_range(key, off, nb)
        with self._lock:
            self.chunks_read += 1
        return self._decode(memoryview(data), index, key)
