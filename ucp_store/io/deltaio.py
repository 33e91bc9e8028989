"""Writing and reading delta arrays (issue 39): ``value = base XOR delta``, recursively, in one chunk plan.

Writing (:func:`encode_delta`, :func:`write_delta`): the XOR of a tensor with its base (``delta.xor``) is cut
into the base's inner chunks; a chunk with a non-zero bit is encoded with the array's codec chain
(``bytes`` little-endian, ``zstd`` or ``blosc`` (zstd after a byte shuffle), ``crc32c``) and a chunk of
zeros is left out of its shard's index (the sharding codec's "missing": the fill value, 0). Every shard
file is written, one of only missing chunks as an index alone, so a lost file is an error on read. The
files are standard Zarr v3 (TensorStore and zarr-python read them: tests/test_delta.py). Encoding stops as
soon as the files pass ``limit`` bytes: the auto policy then stores the tensor in full, having written
nothing. Files go through TensorStore's kvstore with the writer's context, so they are durable exactly as
the writer's other arrays (fsynced at once, or in its deferred pass).

Reading (:class:`DeltaArray`): the keyframe's box through its own reader (``localread.open_reader``: the
local path where it applies), then for each delta above it only its stored chunks within the box (found
from the shard indexes, ``delta.stored_entries``), read through TensorStore (crc32c checked) and XORed in
place. It offers the TensorStore-like surface the read paths use (``handle[box].read().result()``, ``read``,
``dtype``, ``layout``), so ``io/read.py``, ``Checkpoint`` reads, ``verify`` and every export reconstruct
full tensors without knowing about deltas: :func:`open_any` is where a reader is chosen for a
:class:`~ucp_store.records.TensorInfo`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from ucp_store import dtypes
from ucp_store.io import delta as dl
from ucp_store.io import format as fmt
from ucp_store.io.crc import value as crc32c
from ucp_store.io.localread import open_reader
from ucp_store.io.location import Location
from ucp_store.io.pools import LazyPool
from ucp_store.records import ArrayRef, TensorInfo

__all__ = ["DELTA_CODECS", "EncodedDelta", "encode_delta", "write_delta", "DeltaArray", "open_any", "open_kvstore",
           "delta_layout", "delta_spec", "stored_bytes"]

DELTA_CODECS = ("zstd", "blosc")

_POOL = LazyPool("ucp-delta-read", "read_threads", lambda cpus: max(4, min(16, 2 * cpus)))


def delta_layout(base: fmt.ArrayLayout, codec: str) -> fmt.ArrayLayout:
    """The layout of a delta of ``base``: the base's dtype, shape, chunk and shard grid; ``codec``'s chain."""
    if codec not in DELTA_CODECS:
        raise ValueError(f"delta codec {codec!r} is unknown; expected one of {', '.join(DELTA_CODECS)}")
    return fmt.ArrayLayout(base.dtype, base.shape, base.chunk_shape, base.shard_shape, codec)


def delta_spec(location: Location, rel: str, layout: fmt.ArrayLayout) -> dict:
    """TensorStore's spec of a delta array: a chunk the index does not list reads as the fill value (0, "no
    change"); a missing shard file is caught by :class:`DeltaArray` before TensorStore reads."""
    return {"driver": "zarr3", "kvstore": location.kvstore(rel), "metadata": layout.metadata(),
            "fill_missing_data_reads": True, "store_data_equal_to_fill_value": False}


def _encoder(layout: fmt.ArrayLayout):
    import numcodecs

    if layout.compression == "zstd":
        return numcodecs.Zstd(level=3)  # the chain's configuration: level 3, no checksum (format._compression_codecs)
    if layout.compression == "blosc":
        return numcodecs.Blosc(cname="zstd", clevel=3, shuffle=numcodecs.Blosc.SHUFFLE, blocksize=0)
    return None


@dataclass
class EncodedDelta:
    """Every shard file of one delta array (key -> bytes), their total, and how many chunks are stored."""

    files: dict[str, bytes]
    nbytes: int
    chunks: int
    total_chunks: int


def encode_delta(layout: fmt.ArrayLayout, bits: np.ndarray, limit: int | None = None) -> EncodedDelta | None:
    """The shard files of the delta array ``bits`` (``delta.xor`` of a tensor and its base, the layout's
    shape) in ``layout`` (sharded, from :func:`delta_layout`); None as soon as they pass ``limit`` bytes."""
    if not layout.sharded:
        raise ValueError("encode_delta: a delta array is sharded (a 0-d tensor is stored plain)")
    bits = np.ascontiguousarray(dl.bits(bits))
    enc = _encoder(layout)
    per = dl.chunks_per_shard(layout)
    grid = layout.chunk_grid()
    chunk_shape = layout.chunk_shape
    files: dict[str, bytes] = {}
    total = stored = count = 0
    scratch = np.zeros(chunk_shape, bits.dtype)
    shard_grid = [-(-g // p) for g, p in zip(grid, per)]
    for shard in itertools.product(*(range(n) for n in shard_grid)):
        entries = np.full((math.prod(per), 2), dl.MISSING, dtype=np.uint64)
        parts: list[bytes] = []
        off = 0
        for slot, local in enumerate(itertools.product(*(range(p) for p in per))):
            idx = tuple(s * p + i for s, p, i in zip(shard, per, local))
            if any(i >= g for i, g in zip(idx, grid)):
                continue
            count += 1
            region = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(idx, chunk_shape, layout.shape))
            block = bits[region]
            if not block.any():
                continue
            if block.shape != tuple(chunk_shape):  # an edge chunk is stored whole, padded with the fill value
                scratch[...] = 0
                scratch[tuple(slice(0, n) for n in block.shape)] = block
                block = scratch
            raw = np.ascontiguousarray(block).astype(block.dtype.newbyteorder("<"), copy=False)
            body = bytes(enc.encode(raw)) if enc is not None else raw.tobytes()
            parts += [body, crc32c(body).to_bytes(4, "little")]
            entries[slot] = (off, len(body) + 4)
            off += len(body) + 4
            stored += 1
            total += len(body) + 4
            if limit is not None and total > limit:
                return None
        index = dl.encode_index(entries)
        total += len(index)
        if limit is not None and total > limit:
            return None
        files[layout.shard_file_key(shard)] = b"".join(parts) + index
    return EncodedDelta(files, total, stored, count)


def open_kvstore(location: Location, rel: str, context: Any = None) -> Any:
    """The TensorStore kvstore of one array's folder (or bucket prefix)."""
    kw = {} if context is None else {"context": context}
    return ts.KvStore.open(location.kvstore(rel), **kw).result()


def write_delta(location: Location, rel: str, layout: fmt.ArrayLayout, encoded: EncodedDelta, context: Any
                ) -> list[Any]:
    """Create the delta array at ``rel`` (its zarr.json) and start writing every shard file; returns the
    write futures (each file is written whole, durable as ``context`` makes TensorStore's writes)."""
    fmt.create_array(location, rel, layout, context, what="delta array")
    kv = open_kvstore(location, rel, context)
    return [kv.write(key, data) for key, data in encoded.files.items()]


def stored_bytes(layout: fmt.ArrayLayout) -> int | None:
    """The bytes a plain array's shard files take, where the layout fixes them (uncompressed), else None."""
    if layout.compression != "none":
        return None
    if not layout.sharded:
        return layout.nbytes + 4
    per = dl.chunks_per_shard(layout)
    grid = layout.chunk_grid()
    shards = math.prod(-(-g // p) for g, p in zip(grid, per))
    chunk = math.prod(layout.chunk_shape) * layout.itemsize + 4
    return math.prod(grid) * chunk + shards * dl.index_nbytes(layout)


# --- reading -----------------------------------------------------------------------------------------------

class _Delta:
    """One delta level of a chain: its layout, TensorStore handle and kvstore, opened on first use."""

    def __init__(self, location: Location, ref: ArrayRef, layout: fmt.ArrayLayout, context: Any):
        self.location, self.ref, self.context = location, ref, context
        self.layout = fmt.ArrayLayout.from_catalog(layout.dtype, layout.shape, layout.chunk_shape,
                                                   layout.shard_shape, ref.codecs)
        self._handle: Any = None
        self._kv: Any = None

    @property
    def handle(self) -> Any:
        if self._handle is None:
            self._handle = ts.open(delta_spec(self.location, self.ref.array, self.layout), open=True,
                                   assume_metadata=True, context=self.context).result()
        return self._handle

    @property
    def kv(self) -> Any:
        if self._kv is None:
            self._kv = open_kvstore(self.location, self.ref.array, self.context)
        return self._kv

    def apply(self, out: np.ndarray, box: Sequence[tuple[int, int]]) -> None:
        """``out`` (the box's values so far) ^= this delta's stored chunks within ``box``."""
        where = f"delta array {self.location.display(self.ref.array)}"
        entries = dl.stored_entries(self.kv, self.layout, box, where)
        reads = []
        for e in entries:
            cb = self.layout.chunk_box(e.chunk)
            part = tuple((max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(cb, box))
            reads.append((part, self.handle[fmt.box_index(part)].read()))
        for part, fut in reads:
            data = fut.result()
            dst = out[tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(part, box))]
            dl.xor_into(dst, data)


class _PendingRead:
    __slots__ = ("_array", "_box")

    def __init__(self, array: DeltaArray, box):
        self._array, self._box = array, box

    def read(self) -> Future:
        return _POOL.get().submit(self._array.read, self._box)

    def result(self) -> np.ndarray:
        return self._array.read(self._box)


class DeltaArray:
    """A reader of an ``xor`` tensor-state: its values are the keyframe's XOR every delta above it."""

    def __init__(self, location: Location, info: TensorInfo, layout: fmt.ArrayLayout, context: Any):
        refs = [ArrayRef(info.array, info.array_id, info.codecs, info.encoding), *info.bases]
        if refs[-1].encoding != dl.PLAIN or any(r.encoding != dl.XOR for r in refs[:-1]):
            raise ValueError(f"tensor {info.name!r} state {info.state!r}: the chain of array {info.array} does not "
                             "end in one plain array (the catalog's base links are broken)")
        key = refs[-1]
        self.layout = fmt.ArrayLayout.from_catalog(layout.dtype, layout.shape, layout.chunk_shape,
                                                   layout.shard_shape, key.codecs)
        self.dtype = dtypes.numpy_dtype(layout.dtype)
        self.shape = tuple(layout.shape)
        self.keyframe = open_reader(location, key.array, self.layout, context, codecs=key.codecs)
        self.keyframe_url = location.display(key.array)
        self.deltas = [_Delta(location, r, layout, context) for r in refs[:-1]]

    @property
    def depth(self) -> int:
        return len(self.deltas)

    def __getitem__(self, index) -> _PendingRead:
        if not isinstance(index, tuple):
            index = (index,)
        box = []
        for s, n in zip(index, self.shape):
            if not isinstance(s, slice) or s.step not in (None, 1):
                raise TypeError(f"DeltaArray reads boxes (slices with step 1), got {index!r}")
            lo, hi, _ = s.indices(n)
            box.append((lo, max(lo, hi)))
        box += [(0, n) for n in self.shape[len(index):]]
        return _PendingRead(self, tuple(box))

    def read(self, box: fmt.Box) -> np.ndarray:
        """The box's values (fresh, C order): the keyframe's, with each delta's stored chunks XORed in."""
        box = tuple((int(a), int(b)) for a, b in box)
        try:
            out = np.asarray(self.keyframe[fmt.box_index(box)].read().result())
        except ValueError as exc:  # name the array of the chain that failed (fmt.read_box reports it)
            raise dl.DeltaReadError(f"[in delta base {self.keyframe_url}] {exc}") from None
        if not out.flags.writeable or not out.flags.c_contiguous:
            out = np.array(out, order="C")
        for i, d in enumerate(self.deltas):
            try:
                d.apply(out, box)
            except ValueError as exc:
                if i == 0:
                    raise
                raise dl.DeltaReadError(f"[in delta base {d.location.display(d.ref.array)}] {exc}") from None
        return out


def open_any(location: Location, info: TensorInfo, layout: fmt.ArrayLayout, context: Any) -> Any:
    """The reader of one tensor-state: a :class:`DeltaArray` for an ``xor`` array, else
    ``localread.open_reader``'s choice."""
    if info.encoding == dl.XOR:
        return DeltaArray(location, info, layout, context)
    return open_reader(location, info.array, layout, context, codecs=info.codecs)
