"""Pull planning (pure): what a holder of version M reads to move to version N, chunk by chunk.

A puller holds some tensor-states of version M in its own layout: for each, one box of the logical tensor (the
whole tensor in one process, a TP rank's slice, a DTensor's local shard, an HF-named piece of a fused tensor).
Version N's array of a tensor-state is ``plain`` or ``xor`` (the bitwise XOR of its bits with its base array's,
catalog ``arrays.encoding`` / ``base_array_id``). Two questions are answered here, without I/O:

- ``route``: walking N's array down its chain of bases, either M's own array is reached (then N = M XOR every
  delta on the way, and only those deltas are read: ``delta``), or the same array (``same``: nothing to read),
  or a plain array that is not M's (a keyframe or a full save between M and N: ``full``, N's values are read).
- ``chunk_cuts``: which inner chunks of an array a box intersects, and for each the part in the chunk's own
  coordinates and in the box's (so a decoded chunk is XORed or copied into the holder's tensor), with the shard
  file and the slot of the shard index that locates it.

Both are property-tested (tests/test_pull.py, hypothesis). The I/O that executes a pull is ``registry/pull.py``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ucp_store.errors import PlanError
from ucp_store.geometry import Box

__all__ = ["ChunkCut", "Route", "chunk_cuts", "route", "MAX_CHAIN", "box_in", "shard_slot"]

#: the longest chain of bases a route follows (the writer's keyframes keep chains far shorter)
MAX_CHAIN = 4096


@dataclass(frozen=True, slots=True)
class ChunkCut:
    """One inner chunk a box intersects: ``index`` in the chunk grid, the shard file's ``shard`` index and the
    chunk's ``slot`` in that shard's index (C order), the part as ``src`` (in the chunk's own coordinates)
    and ``dst`` (in the box's coordinates), and ``chunk_shape`` (the chunk's full shape: edge chunks are
    stored whole, padded with the fill value)."""

    index: tuple[int, ...]
    shard: tuple[int, ...]
    slot: int
    src: Box
    dst: Box

    @property
    def numel(self) -> int:
        return self.src.numel


def shard_slot(index: Sequence[int], chunk_shape: Sequence[int], shard_shape: Sequence[int]
               ) -> tuple[tuple[int, ...], int]:
    """The shard file (its index in the shard grid) holding inner chunk ``index`` and the chunk's slot in that
    shard's index (row-major over the shard's chunks)."""
    per = [sh // c for sh, c in zip(shard_shape, chunk_shape)]
    shard = tuple(i // p for i, p in zip(index, per))
    slot = 0
    for i, p in zip(index, per):
        slot = slot * p + i % p
    return shard, slot


def box_in(box: Box, shape: Sequence[int], what: str) -> Box:
    """``box`` checked to lie within an array of ``shape`` (a ``PlanError`` naming ``what`` otherwise)."""
    if box.ndim != len(shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box.ranges, shape)):
        raise PlanError(f"{what}: box {box.to_json()} is not within the tensor's shape {list(shape)}")
    return box


def chunk_cuts(shape: Sequence[int], chunk_shape: Sequence[int], shard_shape: Sequence[int], box: Box
               ) -> Iterator[ChunkCut]:
    """Every inner chunk of an array of ``shape`` (inner chunks ``chunk_shape``, shard files ``shard_shape``) that
    ``box`` intersects, in C order of the chunk grid, with the intersection in both coordinate systems. The
    cuts' ``dst`` boxes tile ``box`` exactly (no overlap, no gap). Each dim is cut once and the cuts are the
    product of the dims' pieces (a box of thousands of chunks costs no per-chunk box arithmetic)."""
    if len(shape) == 0:  # a 0-d array is one chunk
        yield ChunkCut((), (), 0, Box(()), Box(()))
        return
    if any(c <= 0 for c in chunk_shape) or any(s % c for s, c in zip(shard_shape, chunk_shape)):
        raise PlanError(f"chunk shape {list(chunk_shape)} does not divide shard shape {list(shard_shape)}")
    per = [sh // c for sh, c in zip(shard_shape, chunk_shape)]
    strides = [math.prod(per[d + 1:]) for d in range(len(per))]
    dims = []  # per dim: (chunk index, shard index, slot term, src range, dst range) of each touched chunk
    for (lo, hi), c, n, p, k in zip(box.ranges, chunk_shape, shape, per, strides):
        if hi <= lo:
            return
        pieces = []
        for i in range(lo // c, (hi - 1) // c + 1):
            a, b = max(lo, i * c), min(hi, (i + 1) * c, n)
            pieces.append((i, i // p, (i % p) * k, (a - i * c, b - i * c), (a - lo, b - lo)))
        dims.append(pieces)
    for combo in itertools.product(*dims):
        yield ChunkCut(tuple(d[0] for d in combo), tuple(d[1] for d in combo), sum(d[2] for d in combo),
                       Box(tuple(d[3] for d in combo)), Box(tuple(d[4] for d in combo)))


@dataclass(frozen=True)
class Route:
    """How a holder of array ``have`` gets to array ``want``: ``kind`` ``same`` (nothing to read), ``delta``
    (XOR ``deltas`` into what it holds, newest first) or ``full`` (read ``want``'s values; ``reason`` says why
    the chain does not lead to ``have``)."""

    kind: str
    deltas: tuple[str, ...] = ()
    reason: str = ""


def _chain(start: str, arrays: Mapping[str, tuple[str, str | None]], max_chain: int) -> list[str]:
    """``start`` and its bases while they are ``xor`` arrays, ending with the first array that is not."""
    out = [start]
    at = start
    while True:
        encoding, base = arrays.get(at, ("plain", None))
        if encoding != "xor" or base is None:
            return out
        if base in out or len(out) > max_chain:
            raise PlanError(f"array {start}: its chain of bases loops or is longer than {max_chain} (at {base})")
        out.append(base)
        at = base


def route(have: str | None, want: str, arrays: Mapping[str, tuple[str, str | None]], *,
          max_chain: int = MAX_CHAIN) -> Route:
    """The route from array ``have`` (None: the holder has nothing) to array ``want``; ``arrays`` maps an array
    id to its ``(encoding, base_array_id)`` for every array on both chains (an id missing from it ends a walk as
    if plain). The two chains of bases are walked to their first common array ``X``: then ``want = have XOR``
    every delta from ``want`` down to ``X`` and from ``have`` down to ``X`` (so a pull backwards, or between two
    deltas of one base, works too); no common array means a full array lies between them (``full``)."""
    if have == want:
        return Route("same")
    if have is None:
        return Route("full", reason="nothing held")
    mine = _chain(have, arrays, max_chain)
    where = {a: i for i, a in enumerate(mine)}
    theirs = _chain(want, arrays, max_chain)
    for j, a in enumerate(theirs):
        i = where.get(a)
        if i is not None:
            return Route("delta", tuple(theirs[:j]) + tuple(mine[:i]))
    return Route("full", reason=f"a full array (keyframe) between them: {theirs[-1]} is stored full")


def chunk_count(shape: Sequence[int], chunk_shape: Sequence[int], box: Box) -> int:
    """How many inner chunks ``box`` intersects."""
    if not shape:
        return 1
    return math.prod(len(range(a // c, (b - 1) // c + 1)) if b > a else 0
                     for (a, b), c in zip(box.ranges, chunk_shape))
