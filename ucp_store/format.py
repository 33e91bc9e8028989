"""The on-disk / in-bucket format: one chunked Zarr v3 array per tensor-state, through TensorStore.

Codec chain of every array (innermost last)::

    sharding_indexed(chunk_shape=inner, codecs=[bytes(little), <compression>?, crc32c],
                     index_codecs=[bytes(little), crc32c])

- ``sharding_indexed``: a tensor-state is a few shard files, each holding many inner chunks and an
  index, so a slice read fetches only the inner chunks it intersects (byte-range reads on S3).
- ``crc32c`` on every inner chunk and on the shard index: TensorStore refuses to decode a chunk whose
  checksum does not match, so a flipped byte can never come back as wrong numbers.
- compression is per store: ``none`` (default, see tools/bench_compression.py for why), ``zstd`` or
  ``blosc`` (zstd with byte shuffle).
0-d arrays skip sharding (one chunk, nothing to index).

Everything that builds a TensorStore spec lives here (:func:`array_spec`); other modules open arrays
through :func:`create_array` / :func:`open_array` and validate settings through
:func:`check_compression`, never through this module's private helpers. Array paths come from
``location.array_path``.
"""

from __future__ import annotations

import functools
import math
import os
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts
import xxhash

from . import dtypes
from ._window import read_failed
from .chunking import DEFAULT_TARGET, choose_chunking
from .errors import ChecksumError, ConfigurationError, ReadError, WriteError
from .geometry import Box as _GeoBox
from .geometry import Ranges
from .location import Location

__all__ = [
    "COMPRESSIONS", "HASH_PREFIX", "Box", "ArrayLayout", "check_compression", "compression_of", "plan_layout",
    "make_context", "array_spec", "create_array", "open_array", "metadata_mismatch", "read_metadata", "box_index",
    "is_corruption", "locate_bad_chunks", "read_box", "ContentHasher", "content_hash", "slabs", "VerifyReport",
    "verify_array", "UNIT_BYTES", "WHOLE_HASH_PREFIX", "CHUNK_HASH_PREFIX", "LEGACY_HASH_PREFIXES", "hash_scheme",
    "units_hash", "missing_units", "box_unit_digests", "WholeHasher", "chunk_digest", "chunk_tree_hash",
    "legacy_chunk_tree_hash",
]

COMPRESSIONS = ("none", "zstd", "blosc")
HASH_PREFIX = "xxh3-128-units:"  # the content-hash scheme of every save path (see "content hashes")

#: a box as raw ranges, one half-open ``(start, stop)`` per dim (``geometry.Ranges``)
Box = Ranges


def _compression_codecs(compression: str, itemsize: int) -> list[dict]:
    if compression == "none":
        return []
    if compression == "zstd":
        return [{"name": "zstd", "configuration": {"level": 3, "checksum": False}}]
    if compression == "blosc":
        return [{"name": "blosc", "configuration": {"cname": "zstd", "clevel": 3, "shuffle": "shuffle",
                                                    "typesize": itemsize, "blocksize": 0}}]
    raise ConfigurationError(f"compression {compression!r} is unknown; expected one of {', '.join(COMPRESSIONS)}")


def check_compression(compression: str) -> str:
    """``compression`` if the format knows it, else a :class:`ConfigurationError` naming the choices."""
    _compression_codecs(compression, 4)
    return compression


@dataclass(frozen=True)
class ArrayLayout:
    """Everything needed to create or open one array without reading its metadata."""

    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    compression: str = "none"

    @property
    def itemsize(self) -> int:
        return dtypes.itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def sharded(self) -> bool:
        return len(self.shape) > 0

    def codecs(self) -> list[dict]:
        inner = [{"name": "bytes", "configuration": {"endian": "little"}}]
        inner += _compression_codecs(self.compression, self.itemsize)
        inner.append({"name": "crc32c"})
        if not self.sharded:
            return inner
        return [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": list(self.chunk_shape),
                "codecs": inner,
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                "index_location": "end",
            },
        }]

    def metadata(self) -> dict:
        grid = list(self.shard_shape) if self.sharded else []
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": self.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": _fill_value(self.dtype),
            "codecs": self.codecs(),
        }

    @classmethod
    def from_catalog(cls, dtype: str, shape, chunk_shape, shard_shape, codecs) -> "ArrayLayout":
        return cls(dtype, tuple(shape), tuple(chunk_shape), tuple(shard_shape), compression_of(codecs))

    # --- chunk geometry -----------------------------------------------------------------------
    def chunk_grid(self) -> tuple[int, ...]:
        return tuple(math.ceil(s / c) for s, c in zip(self.shape, self.chunk_shape))

    def chunk_box(self, index: Sequence[int]) -> Box:
        return _GeoBox.of_chunk(index, self.chunk_shape, self.shape).ranges

    def chunks_touching(self, box: Box) -> Iterator[tuple[int, ...]]:
        yield from _GeoBox(tuple(box)).chunk_indices(self.chunk_shape)

    def shard_key(self, chunk_index: Sequence[int]) -> str:
        if not self.sharded:
            return "c"
        per_shard = [sh // c for sh, c in zip(self.shard_shape, self.chunk_shape)]
        return "c/" + "/".join(str(i // p) for i, p in zip(chunk_index, per_shard))


def _fill_value(dtype: str):
    if dtype == "bool":
        return False
    if dtype.startswith("complex"):
        return [0.0, 0.0]
    return 0


def compression_of(codecs: list[dict]) -> str:
    chain = codecs
    if chain and chain[0]["name"] == "sharding_indexed":
        chain = chain[0]["configuration"]["codecs"]
    names = {c["name"] for c in chain}
    return "zstd" if "zstd" in names else "blosc" if "blosc" in names else "none"


def plan_layout(shape: Sequence[int], dtype: str, *, pattern: dict | None = None, compression: str = "none",
                target_bytes: int = DEFAULT_TARGET, boundaries: dict | None = None,
                shard_shape: Sequence[int] | None = None, units: dict | None = None) -> ArrayLayout:
    chunking = choose_chunking(shape, dtypes.itemsize(dtype), pattern=pattern, boundaries=boundaries,
                               target_bytes=target_bytes, units=units)
    shard = tuple(shard_shape) if shard_shape is not None else chunking.shard_shape
    return ArrayLayout(dtype, tuple(int(s) for s in shape), chunking.chunk_shape, shard, compression)


# --- TensorStore ------------------------------------------------------------------------------------

def make_context(io_concurrency: int = 32, *, sync: bool = True) -> ts.Context:
    """One context per store: bounded concurrency, no cache (checkpoint reads are read-once).

    ``sync=False``: local files are written without TensorStore's fsync of each file and folder; the writer
    that asks for it makes them durable itself, in one parallel pass (``CheckpointWriter.defer_durability``)."""
    return ts.Context({
        "file_io_sync": bool(sync),
        "cache_pool": {"total_bytes_limit": 0},
        "data_copy_concurrency": {"limit": max(1, os.cpu_count() or 1)},
        "file_io_concurrency": {"limit": io_concurrency},
        "s3_request_concurrency": {"limit": io_concurrency},
    })


def array_spec(location: Location, rel: str, layout: ArrayLayout) -> dict:
    """The TensorStore spec of the array at ``rel`` with ``layout`` (opened without reading zarr.json).

    Every chunk is stored, zeros included, and a missing chunk is an error on read: otherwise a lost
    shard file would silently read back as zeros."""
    return {"driver": "zarr3", "kvstore": location.kvstore(rel), "metadata": layout.metadata(),
            "fill_missing_data_reads": False, "store_data_equal_to_fill_value": True}


def create_array(location: Location, rel: str, layout: ArrayLayout, context: ts.Context, *,
                 shared: bool = False, what: str = "array", wait: bool = True) -> Any:
    """Create the array at ``rel``. ``shared``: several writers (ranks) open it at once, so an array that
    another rank created already is opened instead (its metadata must match ``layout``). ``wait=False``
    returns the future of the ``TensorStore`` (to create many at once; :func:`created` waits on it)."""
    try:
        future = ts.open(array_spec(location, rel, layout), create=True, open=shared, context=context)
    except ValueError as exc:
        raise _create_failed(exc, location, rel, what) from None
    return created(future, location, rel, what) if wait else future


@functools.lru_cache(maxsize=256)
def zarr_json(layout: ArrayLayout) -> bytes:
    """The exact zarr.json bytes TensorStore writes for ``layout`` (made once per layout, in memory)."""
    spec = {"driver": "zarr3", "kvstore": {"driver": "memory", "path": "a/"}, "metadata": layout.metadata()}
    kv = ts.open(spec, create=True, context=ts.Context()).result().kvstore
    assert kv is not None  # a zarr3 array opened on a kvstore has one
    return bytes(kv.read("zarr.json").result().value)


def create_local_arrays(location: Location, items: Sequence[tuple[str, ArrayLayout]], context: ts.Context,
                        ) -> list[Any]:
    """Create many arrays of a local store at once: each folder and its zarr.json are written directly (the
    bytes TensorStore writes for the layout, through a temporary file renamed into place, so several ranks
    creating one array write the same bytes atomically); each is opened with ``assume_metadata`` (no I/O) on
    first use (:class:`LazyArray`).
    Nothing is fsynced: only for a writer that makes its files durable itself (``defer_durability``)."""
    if location.kind != "file":
        raise ValueError("create_local_arrays: a local store only")
    out = []
    for rel, layout in items:
        folder = os.path.join(location.root, rel)
        try:
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f".zarr.json.{os.getpid()}.{threading.get_ident()}")
            with open(tmp, "wb") as fh:
                fh.write(zarr_json(layout))
            os.replace(tmp, os.path.join(folder, "zarr.json"))
        except OSError as exc:  # permissions, a full disk
            raise WriteError(f"creating array {location.display(rel)} failed: {exc}") from None
        spec = array_spec(location, rel, layout)
        out.append(LazyArray(lambda spec=spec: ts.open(spec, open=True, assume_metadata=True,
                                                       context=context).result()))
    return out


class LazyArray:
    """A TensorStore handle opened on first use (``create_local_arrays``: most arrays of a save are written by
    the local write path and never need one; opening each cost a third of creating them)."""

    __slots__ = ("_opener", "_handle")

    def __init__(self, opener):
        self._opener = opener
        self._handle = None

    def _get(self):
        if self._handle is None:
            self._handle = self._opener()
        return self._handle

    def __getitem__(self, index):
        return self._get()[index]

    def __getattr__(self, name: str):
        return getattr(self._get(), name)


def created(future: Any, location: Location, rel: str, what: str = "array") -> ts.TensorStore:
    """The array a ``create_array(wait=False)`` future opens; a failure names the array, not a spec dump."""
    try:
        return future.result()
    except ValueError as exc:  # unreachable bucket, permissions, a full disk
        raise _create_failed(exc, location, rel, what) from None


def _create_failed(exc: ValueError, location: Location, rel: str, what: str) -> WriteError:
    reason = str(exc).split(" [tensorstore_spec=", 1)[0]
    return WriteError(f"{what}: creating array {location.display(rel)} failed: {reason}")


def open_array(location: Location, rel: str, layout: ArrayLayout | None, context: ts.Context,
               *, assume_metadata: bool = True) -> ts.TensorStore:
    """Open an array; with ``assume_metadata`` the catalog's layout stands in for reading zarr.json."""
    if layout is not None and assume_metadata:
        return ts.open(array_spec(location, rel, layout), open=True, assume_metadata=True, context=context).result()
    spec = {"driver": "zarr3", "kvstore": location.kvstore(rel), "fill_missing_data_reads": False}
    try:
        return ts.open(spec, open=True, context=context).result()
    except ValueError as exc:
        raise ReadError(f"array {location.display(rel)} cannot be opened: {exc}") from None


def metadata_mismatch(location: Location, rel: str, layout: ArrayLayout, context: ts.Context) -> str | None:
    """Why the stored zarr.json does not match ``layout`` (None when it does).

    TensorStore normalises zarr.json on write (drops defaults such as ``index_location: "end"`` or the
    ``"/"`` separator), so the comparison is TensorStore's own metadata-constraint check, not dict equality.
    """
    try:
        ts.open(array_spec(location, rel, layout), open=True, context=context).result()
    except ValueError as exc:
        return str(exc).split(" [tensorstore_spec", 1)[0][:300]
    return None


def read_metadata(location: Location, rel: str) -> dict:
    import json
    location.check_regular(f"{rel}/zarr.json")  # a FIFO there would block TensorStore's read forever
    kv = ts.KvStore.open(location.kvstore(rel)).result()
    raw = kv.read("zarr.json").result()
    if raw.state != "value":
        raise ReadError(f"array {location.display(rel)} has no zarr.json")
    try:
        meta = json.loads(bytes(raw.value))
    except ValueError as exc:  # a damaged file: not UTF-8, not JSON (zero length included)
        raise ReadError(f"array {location.display(rel)}: zarr.json is corrupt ({len(raw.value)} bytes, not "
                        f"valid JSON: {str(exc)[:120]})") from None
    if not isinstance(meta, dict):
        raise ReadError(f"array {location.display(rel)}: zarr.json is corrupt (a JSON {type(meta).__name__}, "
                        "not an object)")
    return meta


def box_index(box: Box):
    return tuple(slice(lo, hi) for lo, hi in box)


# a truncated file or an index entry past its end reads as OUT_OF_RANGE / "Not enough data": corruption too
_CORRUPT = re.compile(r"checksum|crc|DATA_LOSS|corrupt|Invalid shard index|Error decoding|NOT_FOUND|is missing|"
                      r"Requested byte range|Not enough data|OUT_OF_RANGE|truncated", re.I)


_MISSING = re.compile(r"NOT_FOUND|is missing", re.I)


def is_corruption(exc: BaseException) -> bool:
    return isinstance(exc, ValueError) and bool(_CORRUPT.search(str(exc)))


def locate_bad_chunks(handle: ts.TensorStore, layout: ArrayLayout, box: Box, limit: int = 16) -> list[tuple]:
    """Read chunk by chunk to find which inner chunks in ``box`` fail to decode."""
    bad = []
    for idx in layout.chunks_touching(box):
        try:
            handle[box_index(layout.chunk_box(idx))].read().result()
        except ValueError as exc:
            bad.append((idx, str(exc).splitlines()[0][:200]))
            if len(bad) >= limit:
                break
    return bad


def read_box(handle: Any, layout: ArrayLayout, box: Box, *, what: str, array_url: str) -> np.ndarray:
    """Read a box; a checksum failure becomes a ChecksumError naming the array and the chunk."""
    try:
        return handle[box_index(box)].read().result()
    except ValueError as exc:
        if not is_corruption(exc):
            raise read_failed(what, array_url, exc) from None
        bad = locate_bad_chunks(handle, layout, box) or [((), str(exc)[:200])]
        first, cause = bad[0]
        # a missing chunk or shard file is never read as zeros; say it is missing, not that a crc failed
        failed = "is missing" if _MISSING.search(cause) else "failed its crc32c check"
        raise ChecksumError(
            f"{what}: array {array_url} chunk {list(first)} (shard file {layout.shard_key(first) if first else '?'}) "
            f"{failed}; the data is corrupt and was not returned ({len(bad)} bad chunk(s) in the region read)"
        ) from None


# --- content hashes ------------------------------------------------------------------------------
#
# One scheme for every save path (``HASH_PREFIX``, "units"): the array's C-order bytes are cut into units
# that depend only on its dtype and shape, never on the storage chunk grid (two save paths may choose
# different grids for one tensor: a whole-tensor write and a per-rank write with declared topologies):
#
# - a row is the last dimension (a 0-d array is one row of one element);
# - rows of at most ``UNIT_BYTES`` are grouped, ``UNIT_BYTES // row_bytes`` consecutive rows per unit (the
#   last unit shorter); a longer row is cut into pieces of ``UNIT_BYTES // itemsize`` elements (each row's
#   last piece shorter);
# - the hash is xxh3-128 over ``"<dtype>:<shape>;"`` and every unit's xxh3-128 digest, in C order.
#
# Every unit is contiguous in C order, so a writer holding the whole tensor hashes it in one pass, and a
# writer holding a box (a ZeRO fragment, a DTensor shard, a shard file) digests the units that lie wholly
# inside it from memory; only units that no single writer held whole are read back (``missing_units``).
# Arrays saved before this scheme keep their hashes: ``WHOLE_HASH_PREFIX`` (xxh3-128 over the whole byte
# stream) and ``CHUNK_HASH_PREFIX`` (per storage chunk); ``verify_array`` recomputes either, and ``diff``
# compares the data when two hashes are of different schemes.

#: bytes per unit of the content hash; part of the scheme's definition (changing it changes every hash)
UNIT_BYTES = 256 << 10
WHOLE_HASH_PREFIX = "xxh3-128:"
CHUNK_HASH_PREFIX = "xxh3-128-chunks:"
LEGACY_HASH_PREFIXES = (WHOLE_HASH_PREFIX, CHUNK_HASH_PREFIX)


def hash_scheme(h: str | None) -> str:
    """The scheme prefix of a content hash (``HASH_PREFIX`` or one of ``LEGACY_HASH_PREFIXES``), or ``""``."""
    for prefix in (HASH_PREFIX, CHUNK_HASH_PREFIX, WHOLE_HASH_PREFIX):  # the longer prefixes first
        if (h or "").startswith(prefix):
            return prefix
    return ""


@dataclass(frozen=True)
class _Units:
    """The unit cut of one (dtype, shape): ``span`` bytes of whole rows per unit, or (``span`` == 0) pieces of
    ``piece`` bytes within each row of ``row_bytes``."""

    total: int
    itemsize: int
    row_bytes: int
    rows: int
    span: int
    piece: int

    @classmethod
    def of(cls, dtype: str, shape: Sequence[int]) -> "_Units":
        itemsize = dtypes.itemsize(dtype)
        cols = int(shape[-1]) if len(shape) else 1
        rows = math.prod(int(s) for s in shape[:-1]) if len(shape) else 1
        row_bytes = cols * itemsize
        if row_bytes <= UNIT_BYTES:
            per_unit = UNIT_BYTES // max(row_bytes, 1)  # whole rows per unit
            return cls(rows * row_bytes, itemsize, row_bytes, rows, per_unit * row_bytes, 0)
        return cls(rows * row_bytes, itemsize, row_bytes, rows, 0, UNIT_BYTES // itemsize * itemsize)

    @property
    def per_row(self) -> int:
        return -(-self.row_bytes // self.piece) if self.piece else 0

    @property
    def count(self) -> int:
        if not self.total:
            return 0
        return -(-self.total // self.span) if self.span else self.rows * self.per_row

    def byte_range(self, u: int) -> tuple[int, int]:
        """Unit ``u``'s bytes ``[start, stop)`` in the C-order stream."""
        if self.span:
            return u * self.span, min((u + 1) * self.span, self.total)
        r, j = divmod(u, self.per_row)
        return r * self.row_bytes + j * self.piece, r * self.row_bytes + min((j + 1) * self.piece, self.row_bytes)

    def end_of(self, pos: int) -> int:
        """The end of the unit holding stream byte ``pos``."""
        if self.span:
            return min((pos // self.span + 1) * self.span, self.total)
        r, w = divmod(pos, self.row_bytes)
        return r * self.row_bytes + min((w // self.piece + 1) * self.piece, self.row_bytes)


def _header(dtype: str, shape: Sequence[int]) -> bytes:
    return f"{dtype}:{','.join(map(str, shape))};".encode()


def _bytes_of(array: np.ndarray) -> memoryview:
    # ``.data`` is the same bytes as a memoryview (numpy's stubs give ndarray ``__buffer__`` only on 3.12+)
    return np.require(array, requirements="C").reshape(-1).view(np.uint8).data


class ContentHasher:
    """The content hash (``HASH_PREFIX``) of an array fed in C order, in pieces of any size (slab by slab)."""

    def __init__(self, dtype: str, shape: Sequence[int]):
        self._u = _Units.of(dtype, shape)
        self._h = xxhash.xxh3_128(_header(dtype, shape))
        self._pos = 0
        self._cur: Any = None  # the unit begun in an earlier piece

    def update(self, array: np.ndarray) -> None:
        b = _bytes_of(array)
        i, n, u = 0, len(b), self._u
        while i < n:
            end = u.end_of(self._pos)
            take = min(end - self._pos, n - i)
            if self._cur is None and self._pos + take == end:
                self._h.update(xxhash.xxh3_128_digest(b[i:i + take]))  # a whole unit inside this piece
            else:
                if self._cur is None:
                    self._cur = xxhash.xxh3_128()
                self._cur.update(b[i:i + take])
                if self._pos + take == end:
                    self._h.update(self._cur.digest())
                    self._cur = None
            i += take
            self._pos += take

    def hexdigest(self) -> str:
        if self._pos != self._u.total:
            raise ValueError(f"content hash fed {self._pos} of {self._u.total} bytes")
        return HASH_PREFIX + self._h.hexdigest()


def content_hash(array: np.ndarray, dtype: str | None = None) -> str:
    """The content hash (``HASH_PREFIX``) of a whole array."""
    h = ContentHasher(dtype or dtypes.zarr_name(array.dtype), array.shape)
    h.update(array)
    return h.hexdigest()


def units_hash(dtype: str, shape: Sequence[int], digests: dict) -> str | None:
    """The content hash from every unit's digest (``box_unit_digests``, merged over writers); None when a
    unit's digest is missing (``missing_units`` says which)."""
    h = xxhash.xxh3_128(_header(dtype, shape))
    for k in range(_Units.of(dtype, shape).count):
        d = digests.get(k)
        if d is None:
            return None
        h.update(d)
    return HASH_PREFIX + h.hexdigest()


def missing_units(dtype: str, shape: Sequence[int], digests: dict) -> list[tuple[int, int, int]]:
    """``(unit, first element, stop element)`` of every unit without a digest, in C order."""
    u = _Units.of(dtype, shape)
    out = []
    for k in range(u.count):
        if k not in digests:
            a, b = u.byte_range(k)
            out.append((k, a // u.itemsize, b // u.itemsize))
    return out


def _row_runs(shape: Sequence[int], offset: Sequence[int], extent: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """The rows (index of every dim but the last) of a box as runs contiguous in C order: ``(first row, stop
    row, the run's first row counted in the box)``."""
    lead, off, ext = list(shape[:-1]), list(offset[:-1]), list(extent[:-1])
    if not lead:
        yield 0, 1, 0
        return
    t = len(lead) - 1
    while t > 0 and off[t] == 0 and ext[t] == lead[t]:
        t -= 1  # dims after t are whole in the box: a run spans dim t's range
    inner = math.prod(lead[t + 1:])
    strides = [math.prod(lead[d + 1:]) for d in range(len(lead))]
    q = 0
    import itertools

    for head in itertools.product(*(range(o, o + e) for o, e in zip(off[:t], ext[:t]))):
        first = sum(i * s for i, s in zip(head, strides)) + off[t] * strides[t]
        n = ext[t] * inner
        yield first, first + n, q
        q += n


def box_unit_digests(dtype: str, shape: Sequence[int], offset: Sequence[int], data: np.ndarray, out: dict) -> None:
    """Digest into ``out`` (unit -> digest) every unit of the content hash that lies wholly inside the box
    ``data`` at ``offset`` of an array of ``shape``; units the box cuts are left to other writers (or to a
    read-back). ``data`` is read, never kept."""
    u = _Units.of(dtype, shape)
    if not u.total or not data.size:
        return
    if not len(shape):
        out[0] = xxhash.xxh3_128_digest(_bytes_of(data))
        return
    cols, c0 = int(shape[-1]), int(offset[-1])
    c1 = c0 + int(data.shape[-1])
    if u.span:  # units of whole rows: a box that cuts the rows holds none
        if c0 or c1 != cols:
            return
        k = u.span // u.row_bytes
        b = None
        for ra, rb, q in _row_runs(shape, offset, data.shape):
            first, stop = -(-ra // k), (rb // k if rb != u.rows else -(-rb // k))
            if first >= stop:
                continue
            if b is None:
                b = _bytes_of(data)
            for j in range(first, stop):
                lo, hi = j * k, min((j + 1) * k, u.rows)
                out[j] = xxhash.xxh3_128_digest(b[(q + lo - ra) * u.row_bytes:(q + hi - ra) * u.row_bytes])
        return
    per, pe = u.per_row, u.piece // u.itemsize  # pieces of a row, elements per piece
    j0, j1 = -(-c0 // pe), (c1 // pe if c1 != cols else per)
    if j0 >= j1:
        return
    b, w = _bytes_of(data), (c1 - c0) * u.itemsize
    for ra, rb, q in _row_runs(shape, offset, data.shape):
        for r in range(ra, rb):
            base = (q + r - ra) * w - c0 * u.itemsize
            for j in range(j0, j1):
                lo, hi = j * u.piece, min((j + 1) * u.piece, u.row_bytes)
                out[r * per + j] = xxhash.xxh3_128_digest(b[base + lo:base + hi])


# --- the schemes of versions saved before "units" (verify recomputes them; nothing writes them) ---------

class WholeHasher:
    """``WHOLE_HASH_PREFIX``: xxh3-128 over (dtype, shape, C-order bytes), fed in row-major order."""

    def __init__(self, dtype: str, shape: Sequence[int]):
        self._h = xxhash.xxh3_128()
        self._h.update(_header(dtype, shape))

    def update(self, array: np.ndarray) -> None:
        self._h.update(_bytes_of(array))

    def hexdigest(self) -> str:
        return WHOLE_HASH_PREFIX + self._h.hexdigest()


def chunk_digest(data: np.ndarray) -> bytes:
    """xxh3-128 digest of one inner chunk's C-order bytes (the edge chunks clipped to the array)."""
    return xxhash.xxh3_128_digest(_bytes_of(data))


def chunk_indices(layout: "ArrayLayout") -> Iterator[tuple[int, ...]]:
    """Every inner-chunk index of the grid, in C order."""
    import itertools

    return itertools.product(*(range(n) for n in layout.chunk_grid()))


def chunk_tree_hash(layout: "ArrayLayout", digests: dict) -> str | None:
    """The content hash from the merged unit digests of every writer (``box_unit_digests``), as
    :func:`units_hash` (``layout`` gives dtype and shape; the chunk grid plays no part); None when a unit's
    digest is missing. The name stays for callers that combine every rank's digests (``ucp_store.dist``)."""
    return units_hash(layout.dtype, layout.shape, digests)


def legacy_chunk_tree_hash(layout: "ArrayLayout", digests: dict) -> str | None:
    """``CHUNK_HASH_PREFIX``: xxh3-128 over (dtype, shape, chunk shape) and every inner chunk's digest in C order
    of the chunk grid (what sharded saves recorded before "units"). None when a chunk's digest is missing."""
    h = xxhash.xxh3_128()
    h.update(f"{layout.dtype}:{','.join(map(str, layout.shape))}/{','.join(map(str, layout.chunk_shape))};".encode())
    for idx in chunk_indices(layout):
        d = digests.get(idx)
        if d is None:
            return None
        h.update(d)
    return CHUNK_HASH_PREFIX + h.hexdigest()


def slabs(layout: ArrayLayout, max_bytes: int = 64 << 20) -> Iterator[Box]:
    """Boxes along dim 0 in chunk-row multiples, each covering all other dims, in C order."""
    if not layout.shape:
        yield ()
        return
    row_bytes = math.prod(layout.shape[1:]) * layout.itemsize
    rows = layout.chunk_shape[0] * max(1, max_bytes // max(row_bytes * layout.chunk_shape[0], 1))
    full_rest = tuple((0, s) for s in layout.shape[1:])
    for lo in range(0, layout.shape[0], rows):
        yield ((lo, min(lo + rows, layout.shape[0])),) + full_rest


@dataclass
class VerifyReport:
    array_url: str
    bad_chunks: list[tuple]
    content_hash: str | None

    @property
    def ok(self) -> bool:
        return not self.bad_chunks


def verify_array(handle: ts.TensorStore, layout: ArrayLayout, array_url: str, *,
                 scheme: str = HASH_PREFIX) -> VerifyReport:
    """Decode every chunk (crc32c) and recompute the content hash, slab by slab.

    ``scheme`` is the prefix of the stored hash (:func:`hash_scheme`): ``HASH_PREFIX``, or for a version saved
    before it ``WHOLE_HASH_PREFIX`` or ``CHUNK_HASH_PREFIX``; the hash is recomputed in that scheme."""
    hasher: ContentHasher | WholeHasher = (WholeHasher(layout.dtype, layout.shape) if scheme == WHOLE_HASH_PREFIX
                                           else ContentHasher(layout.dtype, layout.shape))
    digests: dict = {}
    bad: list[tuple] = []
    for box in slabs(layout):
        try:
            data = handle[box_index(box)].read().result()
        except ValueError:
            bad.extend(locate_bad_chunks(handle, layout, box, limit=1 << 30))
            continue
        if bad:
            continue
        if scheme == CHUNK_HASH_PREFIX:
            lo = box[0][0] if box else 0
            for idx in chunk_indices(layout):
                cb = layout.chunk_box(idx)
                if cb and not lo <= cb[0][0] < (box[0][1] if box else 1):
                    continue
                local = tuple(slice(a - (lo if d == 0 else 0), b - (lo if d == 0 else 0))
                              for d, (a, b) in enumerate(cb))
                digests[idx] = chunk_digest(data[local] if local else data)
        else:
            hasher.update(data)
    if bad:
        return VerifyReport(array_url, bad, None)
    return VerifyReport(array_url, bad, legacy_chunk_tree_hash(layout, digests) if scheme == CHUNK_HASH_PREFIX
                        else hasher.hexdigest())
