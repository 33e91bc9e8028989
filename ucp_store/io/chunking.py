"""Chunk policy: where inner-chunk and shard boundaries fall.

Why: a target topology reads whole chunks, so the chunk grid must contain the boundaries of every
likely split. Along each *split dimension* (the partition dim of a pattern, the boundaries of fused
sub-parameters, dim 0 when no pattern is known), inner chunks divide evenly every
power-of-two split up to 64 where the dimension allows (chunk extent divides ``n / 2**k`` for the
largest ``k <= 6`` with ``2**k | n``), and every extra boundary the caller names (uneven widths,
sub-parameter sizes, declared source/target topologies). The other dimensions are cut only to reach
the target chunk size (128 KiB to 8 MiB, default 256 KiB: see ``DEFAULT_TARGET``). Shards (one file
each, via ``sharding_indexed``) group whole inner chunks up to ``shard_target_bytes`` so that one
tensor-state is a few files.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ucp_store.patterns import Pattern, Vocab, parse_pattern

__all__ = ["MIB", "MIN_TARGET", "MAX_TARGET", "DEFAULT_TARGET", "DEFAULT_SHARD_TARGET", "MAX_POW2_SPLIT",
           "MIN_CHUNK_BYTES", "VOCAB_ROW_UNIT", "Chunking", "split_dims_for_pattern", "choose_chunking"]

MIB = 1 << 20
MIN_TARGET = MIB // 8  # 128 KiB: with the local read path a row read costs about its chunk (tools/bench_store.py)
MAX_TARGET = 8 * MIB
# 256 KiB: a large parameter's chunks hold whole rows ([8, 8192] for a 256 MiB fp32 one), so a held row
# read touches one chunk and checks its crc32c in place, and the chunk's crc is most of that read: a smaller
# chunk makes partial reads cheaper while whole reads and re-sharding loads stay level; below it whole reads
# start to pay (figures: docs/perf.md, "chunk policy"). Stores record their target at creation (store.py):
# older ones keep theirs.
DEFAULT_TARGET = MIB // 4
DEFAULT_SHARD_TARGET = 512 * MIB
MAX_POW2_SPLIT = 64
# Alignment never cuts chunks below this. 16 KiB (was 64 KiB): with the local read path a small read
# costs a few syscalls plus its chunk's bytes, so the floor is what a small fragment pays in amplification;
# a ZeRO-3 rank of dp=4 over a 64 KiB parameter read a whole 64 KiB chunk for its 16 KiB and now reads one
# 16 KiB chunk (tools/bench_perread_ab.py). Whole reads of such arrays stay one preadv (chunks adjacent).
MIN_CHUNK_BYTES = 16 << 10
VOCAB_ROW_UNIT = 64  # padded vocab splits land on multiples of the padding multiple (64/128 in practice)


@dataclass(frozen=True)
class Chunking:
    chunk_shape: tuple[int, ...]
    shard_shape: tuple[int, ...]


def _pow2_unit(n: int, slab_bytes_per_row: int = 0, min_bytes: int = 0) -> int:
    """Largest extent that divides every power-of-two split (<= 64) of a dimension of size n.

    Stops splitting early when a chunk would fall below ``min_bytes`` (``slab_bytes_per_row`` is the
    size of one index along this dim): a 16 KiB bias gains nothing from 64 tiny chunks.
    """
    k = 0
    while k < 6 and n % (2 << k) == 0 and (n >> (k + 1)) * slab_bytes_per_row >= min_bytes:
        k += 1
    return n >> k


def _smallest_prime_factor(n: int) -> int:
    for p in range(2, int(math.isqrt(n)) + 1):
        if n % p == 0:
            return p
    return n


def split_dims_for_pattern(pattern: Mapping[str, Any] | Pattern | None, ndim: int) -> dict[int, set[int]]:
    """Which dims a pattern splits, with the extra boundaries it implies (fused sub-parameter edges).

    No pattern (unknown layout) splits dim 0: rows are what column-parallel TP and ZeRO flattening cut.
    """
    if ndim == 0:
        return {}
    if not pattern:
        return {0: set()}
    p = pattern if isinstance(pattern, Pattern) else parse_pattern(pattern)
    return {d: set(edges) for d, edges in p.split_edges().items() if d < ndim}


@dataclass(slots=True)
class _Grid:
    """The chunk grid of one tensor-state while ``choose_chunking`` shapes it, phase by phase.

    ``split`` maps each split dim to the edges that must stay chunk edges (a dim may be split with no
    named edge: its power-of-two splits still count); ``chunk`` is the inner-chunk extent per dim, which
    each phase grows or cuts in place."""

    shape: tuple[int, ...]
    itemsize: int
    parsed: Pattern | None
    split: dict[int, set[int]]
    chunk: list[int]

    def nbytes(self) -> int:
        return math.prod(self.chunk) * self.itemsize


def _check_target(target_bytes: int) -> None:
    if not MIN_TARGET <= target_bytes <= MAX_TARGET:
        raise ValueError(f"chunk target must be between {MIN_TARGET >> 10} KiB and {MAX_TARGET >> 20} MiB, "
                         f"got {target_bytes} bytes")


def _aligned_grid(shape: tuple[int, ...], itemsize: int, pattern: Mapping[str, Any] | Pattern | None,
                  boundaries: dict[int, Iterable[int]] | None) -> _Grid:
    """The split dims (the pattern's and those of ``boundaries``), each cut to its 64-way power-of-two
    unit and to the gcd with its edges; the other dims whole."""
    parsed = None if not pattern else pattern if isinstance(pattern, Pattern) else parse_pattern(pattern)
    split = split_dims_for_pattern(parsed, len(shape))
    for d, edges in (boundaries or {}).items():
        split.setdefault(int(d), set()).update(int(e) for e in edges)
    chunk = list(shape)
    for d, edges in split.items():
        if d >= len(shape):
            continue
        row_bytes = math.prod(shape[:d] + shape[d + 1:]) * itemsize
        unit = _pow2_unit(shape[d], row_bytes, MIN_CHUNK_BYTES)
        if isinstance(parsed, Vocab) and d == parsed.dim:
            # padded TP splits fall on multiples of the padding multiple, not on splits of n
            unit = min(shape[d], VOCAB_ROW_UNIT)
        for e in edges:
            if 0 < e < shape[d]:
                unit = math.gcd(unit, e)
        chunk[d] = unit
    return _Grid(shape, itemsize, parsed, split, chunk)


def _grow_to_floor(grid: _Grid, boundaries: dict[int, Iterable[int]] | None) -> None:
    """Give back factors of two, innermost split dim first, until the chunk reaches ``MIN_CHUNK_BYTES``.

    Several split dims each cut to their 64-way unit can make a chunk tiny (an [E, out, in] expert tensor).
    The edges named in ``boundaries`` (the writers' box edges) stay chunk edges: a shard is a whole number
    of chunks, so only then can every shard file lie inside one writer's box (one writer per object)."""
    shape, chunk = grid.shape, grid.chunk
    named = {int(d): [int(e) for e in edges if 0 < int(e) < shape[int(d)]] for d, edges in (boundaries or {}).items()
             if int(d) < len(shape)}
    grown = True
    while grown and grid.nbytes() < MIN_CHUNK_BYTES:
        grown = False
        for d in sorted(grid.split, reverse=True):
            if d < len(shape) and chunk[d] * 2 <= shape[d] and shape[d] % (chunk[d] * 2) == 0 and all(
                    e % (chunk[d] * 2) == 0 for e in named.get(d, ())):
                chunk[d] *= 2
                grown = True
                break


def _grow_dtensor_tiles(grid: _Grid, target_bytes: int) -> None:
    """DTensor patterns, aligned on several dims, get small tiles from the 64-way units: grow them back
    towards the target, always the dim with the most chunks, keeping every edge of the split (the source
    split named in ``boundaries``)."""
    shape, chunk, split = grid.shape, grid.chunk, grid.split

    def can_double(d: int) -> bool:
        c = chunk[d] * 2
        return c <= shape[d] and shape[d] % c == 0 and all(e % c == 0 for e in split[d] if 0 < e < shape[d])
    while grid.nbytes() * 2 <= target_bytes:
        grow = [d for d in split if d < len(shape) and can_double(d)]
        if not grow:
            break
        d = max(grow, key=lambda i: (shape[i] // chunk[i], -i))
        chunk[d] *= 2


def _apply_units(grid: _Grid, units: dict[int, int]) -> None:
    """Set the aligned extent of each dim in ``units`` outright; those dims count as split dims."""
    for d, unit in units.items():
        grid.split.setdefault(int(d), set())
        grid.chunk[int(d)] = max(1, min(int(unit), grid.shape[int(d)]))


def _cut_to_target(grid: _Grid, target_bytes: int) -> None:
    """Cut until the chunk fits the target: leading dims first, the last dim last, always by a prime
    factor so aligned extents keep their boundaries. Whole rows stay in one chunk as long as they fit,
    so a row read (inspection) or a row-major ZeRO fragment touches few chunks."""
    chunk = grid.chunk
    for d in range(len(grid.shape)):
        while grid.nbytes() > target_bytes and chunk[d] > 1:
            p = _smallest_prime_factor(chunk[d])
            # prefer a halving-like cut; a huge prime extent is cut to a ceil-divided size instead
            if p == chunk[d] and chunk[d] > 64 and d not in grid.split:
                need = math.ceil(grid.nbytes() / target_bytes)
                chunk[d] = math.ceil(chunk[d] / need)
            else:
                chunk[d] //= p
        if grid.nbytes() <= target_bytes:
            break


def _shard_shape(shape: tuple[int, ...], chunk: Sequence[int], itemsize: int, shard_target_bytes: int,
                 ) -> tuple[int, ...]:
    """Shards: the whole array when small enough, else multiples of the chunk along dim 0 (then 1, ...)."""
    shard = list(shape)
    for d in range(len(shape)):
        if math.prod(shard) * itemsize <= shard_target_bytes:
            break
        per_chunk_row = math.prod(shard[:d] + [chunk[d]] + shard[d + 1:]) * itemsize
        n_chunks = max(1, shard_target_bytes // max(per_chunk_row, 1))
        shard[d] = min(shape[d], n_chunks * chunk[d])
    # sharding_indexed needs a shard to be a whole number of inner chunks (the edge shard may overhang)
    return tuple(math.ceil(s / c) * c for s, c in zip(shard, chunk))


def shard_shape(shape: Sequence[int], chunk: Sequence[int], itemsize: int, target_bytes: int) -> tuple[int, ...]:
    """Shard files of about ``target_bytes`` over inner chunks ``chunk`` (the rule ``choose_chunking`` uses)."""
    return _shard_shape(tuple(int(s) for s in shape), chunk, itemsize, target_bytes)


def choose_chunking(
    shape: Sequence[int],
    itemsize: int,
    *,
    pattern: Mapping[str, Any] | Pattern | None = None,
    boundaries: dict[int, Iterable[int]] | None = None,
    target_bytes: int = DEFAULT_TARGET,
    shard_target_bytes: int = DEFAULT_SHARD_TARGET,
    units: dict[int, int] | None = None,
) -> Chunking:
    """Pick inner-chunk and shard shapes for one tensor-state.

    ``boundaries`` adds logical coordinates per dim that must fall on chunk edges. ``units`` sets the
    aligned extent of a dim outright: the planner's ``chunk_alignment`` for declared source and target
    topologies (it already trades alignment against a minimum chunk size).

    The phases, in order: align the split dims (``_aligned_grid``), grow tiny chunks back to the floor,
    grow DTensor tiles towards the target, apply ``units``, cut to the target, then group chunks into
    shards.
    """
    _check_target(target_bytes)
    shape = tuple(int(s) for s in shape)
    if not shape:
        return Chunking((), ())
    if any(s == 0 for s in shape):
        return Chunking(tuple(max(s, 1) for s in shape), tuple(max(s, 1) for s in shape))
    grid = _aligned_grid(shape, itemsize, pattern, boundaries)
    _grow_to_floor(grid, boundaries)
    if grid.parsed is not None and grid.parsed.kind == "dtensor":
        _grow_dtensor_tiles(grid, target_bytes)
    _apply_units(grid, units or {})
    _cut_to_target(grid, target_bytes)
    return Chunking(tuple(grid.chunk), _shard_shape(shape, grid.chunk, itemsize, shard_target_bytes))
