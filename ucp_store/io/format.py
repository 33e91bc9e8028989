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
import itertools
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

from ucp_store import dtypes
from ucp_store.errors import ChecksumError, ConfigurationError, ReadError, WriteError
from ucp_store.geometry import Box as _GeoBox
from ucp_store.geometry import Ranges
from ucp_store.io.chunking import DEFAULT_TARGET, choose_chunking
from ucp_store.io.location import Location
from ucp_store.io.window import read_failed

__all__ = [
    "COMPRESSIONS", "HASH_PREFIX", "Box", "ArrayLayout", "check_compression", "compression_of", "plan_layout",
    "make_context", "array_spec", "create_array", "open_array", "metadata_mismatch", "read_metadata", "box_index",
    "is_corruption", "locate_bad_chunks", "read_box", "ContentHasher", "content_hash", "slabs", "VerifyReport",
    "verify_array", "UNIT_BYTES", "WHOLE_HASH_PREFIX", "CHUNK_HASH_PREFIX", "LEGACY_HASH_PREFIXES", "hash_scheme",
    "units_hash", "missing_units", "read_missing_units", "box_unit_digests", "tile_shape", "unit_grid", "WholeHasher",
    "chunk_digest", "chunk_tree_hash",
    "legacy_chunk_tree_hash",
]

COMPRESSIONS = ("none", "zstd", "blosc")
HASH_PREFIX = "xxh3-128-tiles:"  # the content-hash scheme of every save path (see "content hashes")

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

    def shard_file_key(self, shard_index: Sequence[int]) -> str:
        """The key of shard file ``shard_index`` (its index in the shard grid), as :meth:`shard_key` names it."""
        return "c/" + "/".join(str(int(i)) for i in shard_index) if self.sharded else "c"


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
_BASE = re.compile(r"\[in delta base ([^\]]+)\]")


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
        base = _BASE.search(cause)  # a delta's read names the array of its chain that failed (io/deltaio)
        if base is not None:
            failed += f" in its delta base {base.group(1)}"
        raise ChecksumError(
            f"{what}: array {array_url} chunk {list(first)} (shard file {layout.shard_key(first) if first else '?'}) "
            f"{failed}; the data is corrupt and was not returned ({len(bad)} bad chunk(s) in the region read)"
        ) from None


# --- content hashes ------------------------------------------------------------------------------
#
# One scheme for every save path (``HASH_PREFIX``, "tiles"): the array is cut into units that are the tiles of
# an N-d grid that depends only on its dtype and shape (``tile_shape``), never on the storage chunk grid or on
# a pattern (two save paths may choose different chunk grids for one tensor):
#
# - along each dim of size ``n`` the tile extent starts at ``n / 2**k`` for the largest ``k <= 6`` with
#   ``2**k | n`` (on the last dim, of an N-d array, also ``n / 2**k >= 256 B``: the tile's contiguous runs), so
#   every even power-of-two split <= 64 of any dim (ZeRO/FSDP row splits, TP column splits, EP expert splits)
#   falls on tile edges and every such box holds whole tiles;
# - tiles are cut towards ``UNIT_BYTES`` by factors of that extent (leading dims first: the splits stay on
#   edges), and where they are too small, grown back by doubling to at least ``_TILE_FLOOR`` bytes and
#   ``1 / _MAX_UNITS`` of the array (the dim with the most tiles first, dim 0 keeping 8x the splits of the
#   others: it is what EP and ZeRO/FSDP cut 64 ways; each doubling gives up that dim's largest split), so
#   small arrays are a few units and huge ones never more than about ``_MAX_UNITS``;
# - a unit's digest is xxh3-128 over its elements in C order (a tile is not contiguous in the array: it is
#   gathered first); the hash is xxh3-128 over ``"<dtype>:<shape>;"`` and every unit's digest, in C order of
#   the tile grid. A 0-d array is one unit (its element).
#
# A writer holding the whole tensor hashes it in one pass (``ContentHasher``: blocks of whole tiles, in
# stream order); a writer holding a box (a ZeRO fragment, a DTensor shard, a shard file) digests the tiles that
# lie wholly inside it from memory (``box_unit_digests``); only tiles that no single writer held whole are
# read back (``missing_units``, ``read_missing_units``): none for aligned splits, the tiles an uneven split
# cuts otherwise. Arrays saved before this scheme keep their hashes: ``WHOLE_HASH_PREFIX`` (xxh3-128 over the
# whole byte stream) and ``CHUNK_HASH_PREFIX`` (per storage chunk); ``verify_array`` recomputes either, and
# ``diff`` compares the data when two hashes are of different schemes. (``xxh3-128-units:``, contiguous units
# of whole rows, was never released: it was replaced by tiles the day it landed, and no store holds it.)

#: bytes a tile of the content hash is cut towards; part of the scheme's definition, like every constant below
#: (changing one changes hashes)
UNIT_BYTES = 256 << 10
_TILE_FLOOR = 16 << 10  # tiles grow back to at least this many bytes (or the whole array)
_MAX_UNITS = 1 << 14  # ... and to at least 1/_MAX_UNITS of the array: huge tensors get few, larger tiles
_MAX_SPLIT_LOG2 = 6  # every even power-of-two split up to 2**6 = 64 of each dim falls on tile edges
_MIN_RUN = 256  # ... but of the last dim only those that leave a tile row of this many bytes: below it, gathering
                # a tile costs several times more per byte (tools/bench_hash.py --shape 4194304,16)
_MAX_BLOCK = 64 << 20  # the stream's block (``_Tiles``) is cut below this where the floors allow
_GATHER_BYTES = 4 << 20  # tiles are gathered (copied contiguous) at most this many bytes at a time
_COPY_BYTES = 128 << 10  # ... in copies of about this many bytes of the source (tools/bench_hash.py)
WHOLE_HASH_PREFIX = "xxh3-128:"
CHUNK_HASH_PREFIX = "xxh3-128-chunks:"
LEGACY_HASH_PREFIXES = (WHOLE_HASH_PREFIX, CHUNK_HASH_PREFIX)


def hash_scheme(h: str | None) -> str:
    """The scheme prefix of a content hash (``HASH_PREFIX`` or one of ``LEGACY_HASH_PREFIXES``), or ``""``."""
    for prefix in (HASH_PREFIX, CHUNK_HASH_PREFIX, WHOLE_HASH_PREFIX):  # the longer prefixes first
        if (h or "").startswith(prefix):
            return prefix
    return ""


def _smallest_factor(n: int) -> int:
    for p in range(2, math.isqrt(n) + 1):
        if n % p == 0:
            return p
    return n


def tile_shape(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """The tile (unit) shape of the content hash of an array of ``shape`` and ``itemsize`` (see "content
    hashes"); a 0-d array is tiled as shape ``(1,)``."""
    return _tile_shape(tuple(int(s) for s in shape), int(itemsize))


@functools.lru_cache(maxsize=4096)
def _tile_shape(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    n = list(shape) or [1]
    if 0 in n:
        return tuple(max(s, 1) for s in n)
    m = len(n)
    nbytes = math.prod(n) * itemsize
    lo = max(_TILE_FLOOR, -(-nbytes // _MAX_UNITS))
    hi = max(UNIT_BYTES, 4 * lo)
    even = []  # per dim the k of its largest even split 2**k <= 64 kept on tile edges (0: an odd dim)
    for d, s in enumerate(n):
        run = _MIN_RUN if d == m - 1 and m > 1 else 0
        k = 0
        while k < _MAX_SPLIT_LOG2 and s % (2 << k) == 0 and (s >> k + 1) * itemsize >= run:
            k += 1
        even.append(k)
    t = [s >> k for s, k in zip(n, even)]

    def size() -> int:
        return math.prod(t) * itemsize

    lead = True  # every dim before d has tile extent 1: d is the stream's block dim (``_Tiles``)
    for d in range(m):  # cut towards hi, leading dims first; and the block (a few MiB of the stream) to its cap
        while t[d] > 1 and (size() > hi or lead and t[d] * math.prod(n[d + 1:]) * itemsize > _MAX_BLOCK):
            if not even[d]:  # a dim with no even split to keep: cut straight to what fits (the block: to
                t[d] = max(1, hi // (size() // t[d])) if size() > hi else 1  # 1; tiles grow back on other dims)
                continue
            p = _smallest_factor(t[d])
            if size() // p < lo:  # only a large prime factor left: cutting it would make tiny tiles
                break
            t[d] //= p
        lead = lead and t[d] == 1
    for d in range(m):  # only large prime factors left anywhere: cut evenly (that dim's splits cut tiles)
        if size() > hi and t[d] > 1:
            t[d] = max(1, hi // (size() // t[d]))
    while size() < lo:  # grow back the dim with the most tiles, dim 0 (EP, ZeRO/FSDP rows) keeping 8x more;
        grow = [d for d in range(m) if t[d] < n[d]]  # on a tie the middle dims first, then the last, dim 0 last
        if not grow:
            break
        d = max(grow, key=lambda i: (-(-n[i] // t[i]) >> (3 if i == 0 and m > 1 else 0),
                                     0 if i == 0 else 2 if i < m - 1 else 1, i))
        t[d] = t[d] * 2 if n[d] % (2 * t[d]) == 0 else n[d]
    return tuple(t)


@dataclass(frozen=True)
class _Tiles:
    """The tile grid of one (dtype, shape): ``tile`` (elements per dim; a 0-d array as shape ``(1,)``),
    ``grid`` (tiles per dim), ``count`` units (0 for an empty array), and the stream's blocks: a block is
    ``tile[j]`` indices of dim ``j`` (the first dim whose tile extent is not 1) with every later dim whole,
    so every tile of a block lies wholly in it and the blocks are the whole-tile pieces of the C-order stream."""

    shape: tuple[int, ...]
    itemsize: int
    tile: tuple[int, ...]
    grid: tuple[int, ...]
    count: int
    j: int

    @classmethod
    def of(cls, dtype: str, shape: Sequence[int]) -> "_Tiles":
        return _tiles_of(dtypes.itemsize(dtype), tuple(int(s) for s in shape) or (1,))

    @property
    def total(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        """C-order strides of the tile grid (unit index = sum of tile index * stride)."""
        return tuple(math.prod(self.grid[d + 1:]) for d in range(len(self.grid)))

    def box(self, u: int) -> tuple[tuple[int, int], ...]:
        """Unit ``u``'s box, ``(start, stop)`` per dim of the tiled shape."""
        out = []
        for s, t, st, g in zip(self.shape, self.tile, self.strides, self.grid):
            i = u // st % g
            out.append((i * t, min((i + 1) * t, s)))
        return tuple(out)

    @property
    def row_bytes(self) -> int:
        """Bytes of one index of the block dim (every later dim whole)."""
        return math.prod(self.shape[self.j + 1:]) * self.itemsize

    def byte_shape(self, rows: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(shape, tile)`` in bytes (the last dim times the itemsize) of a block of ``rows`` indices."""
        shape = (rows,) + self.shape[self.j + 1:]
        tile = self.tile[self.j:]
        return shape[:-1] + (shape[-1] * self.itemsize,), tile[:-1] + (tile[-1] * self.itemsize,)


@functools.lru_cache(maxsize=4096)
def _tiles_of(itemsize: int, shape: tuple[int, ...]) -> _Tiles:
    tile = tile_shape(shape, itemsize)
    grid = tuple(-(-s // t) for s, t in zip(shape, tile))
    count = 0 if 0 in shape else math.prod(grid)
    j = next((d for d, t in enumerate(tile) if t > 1), len(shape) - 1)
    return _Tiles(shape, itemsize, tile, grid, count, j)


def _header(dtype: str, shape: Sequence[int]) -> bytes:
    return f"{dtype}:{','.join(map(str, shape))};".encode()


def _bytes_of(array: np.ndarray) -> memoryview:
    # ``.data`` is the same bytes as a memoryview (numpy's stubs give ndarray ``__buffer__`` only on 3.12+)
    return np.require(array, requirements="C").reshape(-1).view(np.uint8).data


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """``array`` as uint8, its last dim in bytes (a view when the last dim is contiguous, else a copy)."""
    a = array.reshape(1) if array.ndim == 0 else array
    if a.strides[-1] != a.itemsize:
        a = np.ascontiguousarray(a)
    return a.view(np.uint8)


_scratch = threading.local()  # each thread's gather buffer (the write pool digests shard files in parallel)


def _gather_buffer(nbytes: int) -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _scratch.buf = np.empty(max(nbytes, 1 << 16), np.uint8)
    return buf


def _digest_tiles(v: np.ndarray, tb: Sequence[int], out: Any, first: Sequence[int], strides: Sequence[int]) -> None:
    """Digest every tile of ``v`` (uint8, its last dim in bytes) cut by tile ``tb`` (bytes on the last dim) from
    its origin; ``v`` ends at tile edges or at the array's end. The digest of ``v``'s tile ``i`` goes to
    ``out[sum((first[d] + i[d]) * strides[d])]``."""
    s, m = v.shape, v.ndim
    k = next((d for d in range(m) if tb[d] > 1 and s[d] > 1), m - 1)  # dims before: a tile per index
    if v.flags.c_contiguous and all(tb[d] >= s[d] for d in range(k + 1, m)):
        # tiles are contiguous runs of the buffer: digest them in place
        b, inner, per = v.reshape(-1).data, math.prod(s[k + 1:]), tb[k]
        rest = sum(f * st for f, st in zip(first[k + 1:], strides[k + 1:]))  # one tile along each later dim
        for o, idx in enumerate(itertools.product(*(range(x) for x in s[:k]))):
            base = rest + sum((f + i) * st for f, i, st in zip(first, idx, strides))
            row = o * s[k] * inner
            for i in range(-(-s[k] // per)):
                lo, hi = row + i * per * inner, row + min((i + 1) * per, s[k]) * inner
                out[base + (first[k] + i) * strides[k]] = xxhash.xxh3_128_digest(b[lo:hi])
        return
    runs = []  # per dim: (first tile, tiles, extent) of the whole tiles, then of the edge tile if shorter
    for x, t in zip(s, tb):
        runs.append([r for r in ((0, x // t, t), (x // t, 1, x % t)) if r[1] and r[2]])
    for combo in itertools.product(*runs):
        _digest_regular(v, tb, combo, out, [f + c[0] for f, c in zip(first, combo)], strides)


def _digest_regular(v: np.ndarray, tb: Sequence[int], combo, out: Any, first: Sequence[int],
                    strides: Sequence[int]) -> None:
    """Digest a regular grid of equal tiles of ``v``: per dim ``(first tile, tiles, extent)`` in ``combo``;
    ``first`` is the grid index of the region's first tile. Gathers a group of tiles at a time."""
    m = v.ndim
    nt, ext = [c[1] for c in combo], [c[2] for c in combo]
    region = v[tuple(slice(c[0] * t, c[0] * t + c[1] * c[2]) for c, t in zip(combo, tb))]
    # the source's order: (tiles of dim 0, extent of dim 0, tiles of dim 1, ...); the tiles' order puts every
    # extent last, so that each tile is contiguous once gathered
    split = np.lib.stride_tricks.as_strided(
        region, shape=[x for d in range(m) for x in (nt[d], ext[d])],
        strides=[x for d in range(m) for x in (ext[d] * region.strides[d], region.strides[d])], writeable=False)
    to_tiles = [2 * d for d in range(m)] + [2 * d + 1 for d in range(m)]
    to_source = sorted(range(2 * m), key=to_tiles.__getitem__)
    tile_bytes = math.prod(ext)
    a = next((d for d in range(m) if math.prod(nt[d + 1:]) * tile_bytes <= _GATHER_BYTES), m - 1)
    group = max(1, _GATHER_BYTES // (math.prod(nt[a + 1:]) * tile_bytes))
    inner = [sum(i * st for i, st in zip(idx, strides[a + 1:]))
             for idx in itertools.product(*(range(x) for x in nt[a + 1:]))]
    rest = sum(f * st for f, st in zip(first[a + 1:], strides[a + 1:]))
    for outer in itertools.product(*(range(x) for x in nt[:a])):
        base = rest + sum((f + i) * st for f, i, st in zip(first, outer, strides))
        for i0 in range(0, nt[a], group):
            at: list = [slice(None)] * 2 * m
            for d, o in enumerate(outer):
                at[2 * d] = slice(o, o + 1)
            at[2 * a] = slice(i0, i0 + group)
            src = split[tuple(at)]
            buf = _gather_buffer(src.size)
            # copied in the source's order (the destination seen through the inverse transpose), a few rows at a
            # time: sequential reads, and the scattered writes stay in cache (about twice one strided copyto)
            _copy_in_chunks(buf[:src.size].reshape(src.transpose(to_tiles).shape).transpose(to_source), src)
            b = buf.data
            q = 0
            for ia in range(i0, i0 + src.shape[2 * a]):
                at0 = base + (first[a] + ia) * strides[a]
                for off in inner:
                    out[at0 + off] = xxhash.xxh3_128_digest(b[q:q + tile_bytes])
                    q += tile_bytes


def _copy_in_chunks(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` in pieces of about ``_COPY_BYTES`` along the leading axes."""
    shape = src.shape
    b = next((d for d in range(len(shape)) if math.prod(shape[d + 1:]) <= _COPY_BYTES), len(shape) - 1)
    g = max(1, _COPY_BYTES // max(1, math.prod(shape[b + 1:])))
    for outer in itertools.product(*(range(x) for x in shape[:b])):
        for i in range(0, shape[b], g):
            at = outer + (slice(i, i + g),)
            np.copyto(dst[at], src[at])


class ContentHasher:
    """The content hash (``HASH_PREFIX``) of an array fed in C order, in pieces of any size (slab by slab).

    Whole blocks of tiles (``_Tiles``) in a piece are digested in place; a block split across pieces is
    gathered in a buffer of one block (``piece`` gives piece sizes that never split one)."""

    def __init__(self, dtype: str, shape: Sequence[int]):
        self._t = _Tiles.of(dtype, shape)
        self._h = xxhash.xxh3_128(_header(dtype, shape))
        self._pos = 0  # bytes fed
        self._block = 0  # the current block's index along dim j
        self._buf: np.ndarray | None = None
        self._fill = 0

    def piece(self, hint: int) -> int:
        """A piece size in elements near ``hint`` that is a whole number of blocks (so nothing is buffered)."""
        t = self._t
        block = t.tile[t.j] * t.row_bytes // t.itemsize
        return max(block, hint // block * block)

    def _block_bytes(self) -> int:
        t = self._t
        return min(t.tile[t.j], t.shape[t.j] - self._block * t.tile[t.j]) * t.row_bytes

    def _whole_blocks(self, avail: int) -> int:
        """Bytes of the whole blocks, from the current one on, in ``avail`` bytes (up to the end of dim j)."""
        t = self._t
        left = t.shape[t.j] - self._block * t.tile[t.j]  # rows of dim j left
        rows = min(avail // t.row_bytes, left)
        return (rows if rows == left else rows // t.tile[t.j] * t.tile[t.j]) * t.row_bytes

    def _digest_blocks(self, raw: np.ndarray) -> None:
        """Digest consecutive whole blocks in one pass (fewer calls: a block may be a fraction of a MiB)."""
        t = self._t
        rows = raw.size // t.row_bytes
        shape, tb = t.byte_shape(rows)
        out: list = [None] * math.prod(-(-x // y) for x, y in zip(shape, tb))
        strides = [math.prod(-(-x // y) for x, y in zip(shape[d + 1:], tb[d + 1:])) for d in range(len(shape))]
        _digest_tiles(raw.reshape(shape), tb, out, (0,) * len(shape), strides)
        self._h.update(b"".join(out))
        self._block = (self._block + -(-rows // t.tile[t.j])) % t.grid[t.j]

    def update(self, array: np.ndarray) -> None:
        if not self._t.count:
            self._pos += array.nbytes
            return
        b = np.frombuffer(_bytes_of(array), np.uint8)
        i, n = 0, b.size
        while i < n:
            size = self._block_bytes()
            if self._fill or n - i < size:
                if self._buf is None:
                    self._buf = np.empty(self._t.tile[self._t.j] * self._t.row_bytes, np.uint8)
                take = min(size - self._fill, n - i)
                self._buf[self._fill:self._fill + take] = b[i:i + take]
                self._fill += take
                if self._fill == size:
                    self._digest_blocks(self._buf[:size])
                    self._fill = 0
            else:
                take = self._whole_blocks(n - i)
                self._digest_blocks(b[i:i + take])
            i += take
        self._pos += n

    def hexdigest(self) -> str:
        if self._pos != self._t.total or self._fill:
            raise ValueError(f"content hash fed {self._pos} of {self._t.total} bytes")
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
    for k in range(_Tiles.of(dtype, shape).count):
        d = digests.get(k)
        if d is None:
            return None
        h.update(d)
    return HASH_PREFIX + h.hexdigest()


def missing_units(dtype: str, shape: Sequence[int], digests: dict) -> list[tuple[int, Box]]:
    """``(unit, box)`` of every unit without a digest, in C order (a 0-d array's one unit has box ``()``)."""
    t = _Tiles.of(dtype, shape)
    return [(k, t.box(k) if len(shape) else ()) for k in range(t.count) if k not in digests]


def read_missing_units(dtype: str, shape: Sequence[int], digests: dict, read) -> int:
    """Digest into ``digests`` every unit without one, reading ``read(box) -> ndarray`` once per run of missing
    units along the grid's last dim; returns how many units were read."""
    t = _Tiles.of(dtype, shape)
    missing = [k for k in range(t.count) if k not in digests]
    last = t.grid[-1]
    i = 0
    while i < len(missing):
        k = missing[i]
        r = i + 1  # a run: consecutive units of one row of the grid
        while r < len(missing) and missing[r] == missing[r - 1] + 1 and missing[r] % last:
            r += 1
        if not len(shape):
            digests[0] = xxhash.xxh3_128_digest(_bytes_of(read(())))
        else:
            lo, hi = t.box(k), t.box(missing[r - 1])
            box = tuple(lo[:-1]) + ((lo[-1][0], hi[-1][1]),)
            box_unit_digests(dtype, shape, tuple(a for a, _ in box), read(box), digests)
        i = r
    return len(missing)


def unit_grid(dtype: str, shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The content hash's tile shape and the strides of its unit index over the tile grid (a unit's index is
    the sum of its tile index times these, C order), for a writer that digests units itself."""
    t = _Tiles.of(dtype, shape)
    return t.tile, t.strides


def box_unit_digests(dtype: str, shape: Sequence[int], offset: Sequence[int], data: np.ndarray, out: dict) -> None:
    """Digest into ``out`` (unit -> digest) every unit of the content hash that lies wholly inside the box
    ``data`` at ``offset`` of an array of ``shape``; units the box cuts are left to other writers (or to a
    read-back). ``data`` is read, never kept."""
    t = _Tiles.of(dtype, shape)
    if not t.count or not data.size:
        return
    if not len(shape):
        out[0] = xxhash.xxh3_128_digest(_bytes_of(data))
        return
    first, sl = [], []
    for s, tl, g, o, e in zip(t.shape, t.tile, t.grid, offset, data.shape):
        f, stop = -(-int(o) // tl), int(o) + int(e)
        last = g if stop == s else stop // tl
        if f >= last:
            return
        first.append(f)
        sl.append(slice(f * tl - int(o), min(last * tl, s) - int(o)))
    v = data[tuple(sl)]
    tb = t.tile[:-1] + (t.tile[-1] * t.itemsize,)
    if v.strides[-1] == v.itemsize:  # gathered straight from the box, a group of tiles at a time
        _digest_tiles(v.view(np.uint8), tb, out, first, t.strides)
        return
    for r in range(0, v.shape[0], t.tile[0]):  # a box not contiguous in its last dim: copied a tile-row at a time
        first0 = [first[0] + r // t.tile[0]] + first[1:]
        _digest_tiles(_as_bytes(v[r:r + t.tile[0]]), tb, out, first0, t.strides)


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
    digest is missing. The name stays for callers that combine every rank's digests (``ucp_store.distributed``)."""
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
