"""Delta arrays: the bit math and the shard-index reading that every delta path shares (issue 39).

A tensor-state may be stored as the bitwise XOR of its bits with the same tensor-state of a *base* version
(same shape, dtype, chunk and shard grid): ``value = base XOR delta``, recursively down to a plain array
(a *keyframe*). XOR works on the raw bits, so any dtype (bf16, fp16, fp8 e4m3/e5m2, fp32, ints, bool,
complex) round-trips bit-exactly: an element is viewed as the unsigned integer of its item size
(:func:`bits`). An element that did not change is 0 in the delta; a chunk whose elements all did not change
is not stored (its shard-index entry is "missing", the zarr v3 sharding codec's way of saying "fill value",
and the fill value of a delta array is 0). Every shard file is written, even one whose chunks are all
missing (an index alone): so a lost shard file is an error on read, never "unchanged".

This module is the small shared part: viewing and XOR-ing bits (numpy and torch, in place, on any device),
which chunks of a delta are non-zero (:func:`nonzero_chunks`, for the writer), the shard index's bytes
(:func:`encode_index`, :func:`decode_index`) and which chunks of a stored delta lie in a box, reading only
the shard indexes (:func:`stored_chunks`, :func:`stored_entries`). Reading and writing whole delta arrays
is ``io/deltaio.py``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ucp_store.geometry import Box as _GeoBox
from ucp_store.io.crc import value as crc32c

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ucp_store.io.format import ArrayLayout

__all__ = ["ENCODINGS", "PLAIN", "XOR", "DeltaReadError", "bits", "xor", "xor_into", "xor_tensor_", "tensor_bits",
           "chunks_per_shard", "shard_of_chunk", "nonzero_chunks", "encode_index", "decode_index", "index_nbytes",
           "ChunkEntry", "stored_entries", "stored_chunks", "MISSING"]

PLAIN = "plain"
XOR = "xor"
ENCODINGS = (PLAIN, XOR)
MISSING = (1 << 64) - 1  # an index entry's offset and length for a chunk that is not stored

_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaReadError(ValueError):
    """A delta array's shard file is missing or its index fails its crc32c: corruption (a ValueError like
    TensorStore's, whose text the format's corruption check recognises)."""


# --- bits ---------------------------------------------------------------------------------------------

def bits(a: np.ndarray) -> np.ndarray:
    """``a`` viewed as unsigned integers of its item size (bf16/fp16 -> uint16, fp8 -> uint8, fp32 -> uint32,
    complex128 -> uint64 pairs); a view, no copy. Non-contiguous arrays are copied first."""
    a = np.ascontiguousarray(a)
    size = a.dtype.itemsize
    if size in _UINTS:
        return a.view(_UINTS[size])
    if size % 8 == 0:  # complex128, complex256: whole 64-bit words
        return a.view(np.uint64)
    return a.view(np.uint8)


def xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The bitwise XOR of two arrays of one shape and dtype, as unsigned integers of the item size."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"xor: shapes/dtypes differ ({a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)})")
    return np.bitwise_xor(bits(a), bits(b))


def xor_into(dst: np.ndarray, delta: np.ndarray) -> None:
    """``dst ^= delta`` in place on the bits; ``dst`` (any dtype, writable, may be a strided view) and
    ``delta`` (the same shape; any dtype of the same item size, e.g. the unsigned view) keep their types."""
    if dst.shape != delta.shape or dst.dtype.itemsize != delta.dtype.itemsize:
        raise ValueError(f"xor_into: {dst.dtype}{list(dst.shape)} and {delta.dtype}{list(delta.shape)} differ")
    if dst.dtype.itemsize in _UINTS:  # a same-size view works through any strides
        view = dst.view(_UINTS[dst.dtype.itemsize])
        np.bitwise_xor(view, bits(delta).reshape(view.shape), out=view)
        return
    tmp = np.ascontiguousarray(dst)  # complex: whole words of a contiguous copy
    np.bitwise_xor(bits(tmp), bits(delta).reshape(bits(tmp).shape), out=bits(tmp))
    dst[...] = tmp


_TORCH_INTS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def tensor_bits(t: torch.Tensor) -> torch.Tensor:
    """A torch tensor viewed as integers of its element size (signed where torch's bitwise ops need it:
    int16/int32/int64, uint8 for one-byte types), on its own device; a view, no copy."""
    import torch

    size = t.element_size()
    if size not in _TORCH_INTS:  # complex128: two int64 words per element
        return t.view(torch.int64) if size % 8 == 0 else t.view(torch.uint8)
    return t.view(getattr(torch, _TORCH_INTS[size]))


def xor_tensor_(dst: torch.Tensor, delta: Any) -> torch.Tensor:
    """``dst ^= delta`` in place on the bits of a torch tensor (CPU or GPU, any dtype; ``delta``: a tensor
    or numpy array of the same shape and item size, moved to ``dst``'s device). Returns ``dst``."""
    import torch

    if isinstance(delta, np.ndarray):
        delta = torch.from_numpy(np.ascontiguousarray(bits(delta)).view(
            {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}.get(delta.dtype.itemsize, np.uint8)))
    if tuple(delta.shape) != tuple(dst.shape) or delta.element_size() != dst.element_size():
        raise ValueError(f"xor_tensor_: {dst.dtype}{list(dst.shape)} and {delta.dtype}{list(delta.shape)} differ")
    view = tensor_bits(dst)
    view.bitwise_xor_(tensor_bits(delta).to(view.device, non_blocking=True))
    return dst


# --- the chunk and shard grid ----------------------------------------------------------------------------

def chunks_per_shard(layout: ArrayLayout) -> tuple[int, ...]:
    """Inner chunks per shard file along each dim."""
    return tuple(sh // c for sh, c in zip(layout.shard_shape, layout.chunk_shape))


def shard_of_chunk(layout: ArrayLayout, chunk: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """``(shard grid index, the chunk's position in that shard's index)``."""
    per = chunks_per_shard(layout)
    shard = tuple(int(i) // p for i, p in zip(chunk, per))
    local = tuple(int(i) % p for i, p in zip(chunk, per))
    return shard, int(np.ravel_multi_index(local, per)) if per else 0


def index_nbytes(layout: ArrayLayout) -> int:
    """Bytes of one shard file's index (``(offset, nbytes)`` uint64 pairs and the index's crc32c)."""
    return math.prod(chunks_per_shard(layout)) * 16 + 4


def nonzero_chunks(delta: np.ndarray, layout: ArrayLayout) -> list[tuple[int, ...]]:
    """The inner chunks (grid indices, C order) of a whole delta array that hold a non-zero bit."""
    b = bits(delta)
    out = []
    for idx in _GeoBox(tuple((0, n) for n in layout.shape)).chunk_indices(layout.chunk_shape):
        region = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(idx, layout.chunk_shape, layout.shape))
        if b[region].any():
            out.append(tuple(idx))
    return out


def encode_index(entries: np.ndarray) -> bytes:
    """A shard index's bytes: ``entries`` ((n, 2) uint64, ``MISSING`` for chunks not stored) then crc32c."""
    raw = np.ascontiguousarray(entries, dtype="<u8").tobytes()
    return raw + crc32c(raw).to_bytes(4, "little")


def decode_index(raw: bytes, n: int, where: str) -> np.ndarray:
    """The ``(n, 2)`` entries of a shard index read from the file's end; a wrong length or crc32c raises
    :class:`DeltaReadError` naming ``where``."""
    if len(raw) != n * 16 + 4:
        raise DeltaReadError(f"{where}: shard index is truncated ({len(raw)} bytes, expected {n * 16 + 4})")
    body, check = raw[:-4], int.from_bytes(raw[-4:], "little")
    if crc32c(body) != check:
        raise DeltaReadError(f"{where}: shard index failed its crc32c check")
    return np.frombuffer(body, dtype="<u8").reshape(n, 2)


# --- which chunks of a stored delta lie in a box -----------------------------------------------------------

@dataclass(frozen=True)
class ChunkEntry:
    """One stored (non-zero) inner chunk of a delta array: its grid index, its shard file's key and the
    byte range of its encoded bytes (crc32c included) in that file."""

    chunk: tuple[int, ...]
    key: str
    offset: int
    nbytes: int


def _shards_in(layout: ArrayLayout, box: Sequence[tuple[int, int]]) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(lo // sh, -(-hi // sh)) for (lo, hi), sh in zip(box, layout.shard_shape)))


def read_indexes(kv: Any, layout: ArrayLayout, shards: Iterable[tuple[int, ...]], where: str
                 ) -> dict[tuple[int, ...], np.ndarray]:
    """Each shard file's index (reading only its last :func:`index_nbytes` bytes, concurrently) through the
    TensorStore kvstore ``kv`` of the array; a missing file or a bad index raises :class:`DeltaReadError`."""
    n = math.prod(chunks_per_shard(layout))
    size = n * 16 + 4
    shards = list(shards)
    futures = [kv.read(layout.shard_file_key(s), byte_range=slice(-size, None)) for s in shards]
    out = {}
    for s, fut in zip(shards, futures):
        key = layout.shard_file_key(s)
        try:
            got = fut.result()
        except ValueError as exc:  # shorter than its index, unreadable
            raise DeltaReadError(f"{where}: shard file {key} is corrupt (its index cannot be read: "
                                 f"{str(exc).splitlines()[0][:160]})") from None
        if got.state != "value":
            raise DeltaReadError(f"{where}: shard file {key} is missing (every shard file of a delta array is "
                                 "written, its index at least)")
        out[s] = decode_index(bytes(got.value), n, f"{where} shard file {key}")
    return out


def stored_entries(kv: Any, layout: ArrayLayout, box: Sequence[tuple[int, int]], where: str = "delta array"
                   ) -> list[ChunkEntry]:
    """The stored (non-zero) inner chunks of a delta array that intersect ``box`` (``(start, stop)`` per
    dim), in shard then C order, with their byte ranges; reads only the shard indexes of the shards the box
    touches (``kv``: the array's TensorStore kvstore, ``ts.KvStore.open(location.kvstore(rel))``)."""
    box = tuple((int(a), int(b)) for a, b in box)
    if any(b <= a for a, b in box):
        return []
    per = chunks_per_shard(layout)
    indexes = read_indexes(kv, layout, _shards_in(layout, box), where)
    out = []
    lo_chunk = [a // c for (a, _), c in zip(box, layout.chunk_shape)]
    hi_chunk = [-(-b // c) for (_, b), c in zip(box, layout.chunk_shape)]
    for shard, entries in indexes.items():
        key = layout.shard_file_key(shard)
        ranges = [range(max(s * p, lo), min((s + 1) * p, hi)) for s, p, lo, hi in zip(shard, per, lo_chunk, hi_chunk)]
        for chunk in itertools.product(*ranges):
            local = tuple(i - s * p for i, s, p in zip(chunk, shard, per))
            off, nb = (int(v) for v in entries[int(np.ravel_multi_index(local, per))])
            if off != MISSING:
                out.append(ChunkEntry(tuple(chunk), key, off, nb))
    return out


def stored_chunks(kv: Any, layout: ArrayLayout, box: Sequence[tuple[int, int]]) -> list[tuple[int, ...]]:
    """The grid indices of the stored (changed) inner chunks of a delta array within ``box``, reading only
    the shard indexes (see :func:`stored_entries`)."""
    return [e.chunk for e in stored_entries(kv, layout, box)]
