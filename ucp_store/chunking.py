"""Chunk policy: where inner-chunk and shard boundaries fall.

Why: a target topology reads whole chunks, so the chunk grid must contain the boundaries of every
likely split. Along each *split dimension* (the partition dim of a pattern, the boundaries of fused
sub-parameters, dim 0 when no pattern is known), inner chunks divide evenly every
power-of-two split up to 64 where the dimension allows (chunk extent divides ``n / 2**k`` for the
largest ``k <= 6`` with ``2**k | n``), and every extra boundary the caller names (uneven widths,
sub-parameter sizes, declared source/target topologies). The other dimensions are cut only to reach
the target chunk size (1 to 8 MiB, default 1 MiB). Shards (one file each, via ``sharding_indexed``)
group whole inner chunks up to ``shard_target_bytes`` so that one tensor-state is a few files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

MIB = 1 << 20
MIN_TARGET = MIB // 8  # 128 KiB: with the local read path a row read costs about its chunk (tools/bench_store.py)
MAX_TARGET = 8 * MIB
DEFAULT_TARGET = 1 * MIB
DEFAULT_SHARD_TARGET = 512 * MIB
MAX_POW2_SPLIT = 64
MIN_CHUNK_BYTES = 64 << 10  # alignment never cuts chunks below this
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


def split_dims_for_pattern(pattern: dict | None, ndim: int) -> dict[int, set[int]]:
    """Which dims a pattern splits, with the extra boundaries it implies (fused sub-parameter edges)."""
    if ndim == 0:
        return {}
    if not pattern:
        # unknown layout: rows are what column-parallel TP and ZeRO flattening cut
        return {0: set()}
    kind = pattern.get("kind")
    if kind in ("replicated", "averaged"):
        return {}
    if kind in ("partitioned", "vocab"):
        return {int(pattern.get("dim", 0)): set()}
    if kind == "fused":
        edges = set(itertools_accumulate(pattern.get("sizes", [])))
        return {int(pattern.get("dim", 0)): edges}
    if kind == "expert":
        e_dim = int(pattern.get("dim", 0))
        inner = split_dims_for_pattern(pattern.get("inner"), max(ndim - 1, 0))
        out = {e_dim: set()}
        for d, edges in inner.items():
            out[d + 1 if d >= e_dim else d] = edges
        return out
    return {0: set()}


def itertools_accumulate(sizes: Iterable[int]) -> list[int]:
    total, out = 0, []
    for s in sizes:
        total += int(s)
        out.append(total)
    return out


def choose_chunking(
    shape: Sequence[int],
    itemsize: int,
    *,
    pattern: dict | None = None,
    boundaries: dict[int, Iterable[int]] | None = None,
    target_bytes: int = DEFAULT_TARGET,
    shard_target_bytes: int = DEFAULT_SHARD_TARGET,
    units: dict[int, int] | None = None,
) -> Chunking:
    """Pick inner-chunk and shard shapes for one tensor-state.

    ``boundaries`` adds logical coordinates per dim that must fall on chunk edges. ``units`` sets the
    aligned extent of a dim outright: the planner's ``chunk_alignment`` for declared source and target
    topologies (it already trades alignment against a minimum chunk size).
    """
    if not MIN_TARGET <= target_bytes <= MAX_TARGET:
        raise ValueError(f"chunk target must be between {MIN_TARGET >> 10} KiB and {MAX_TARGET >> 20} MiB, "
                         f"got {target_bytes} bytes")
    shape = tuple(int(s) for s in shape)
    if not shape:
        return Chunking((), ())
    if any(s == 0 for s in shape):
        return Chunking(tuple(max(s, 1) for s in shape), tuple(max(s, 1) for s in shape))

    split = split_dims_for_pattern(pattern, len(shape))
    for d, edges in (boundaries or {}).items():
        split.setdefault(int(d), set()).update(int(e) for e in edges)

    chunk = list(shape)
    for d, edges in split.items():
        if d >= len(shape):
            continue
        row_bytes = math.prod(shape[:d] + shape[d + 1:]) * itemsize
        unit = _pow2_unit(shape[d], row_bytes, MIN_CHUNK_BYTES)
        if pattern and pattern.get("kind") == "vocab" and d == int(pattern.get("dim", 0)):
            # padded TP splits fall on multiples of the padding multiple, not on splits of n
            unit = min(shape[d], int(pattern.get("multiple", VOCAB_ROW_UNIT)))
        for e in edges:
            if 0 < e < shape[d]:
                unit = math.gcd(unit, e)
        chunk[d] = unit
    # Several split dims each cut to their 64-way unit can make a chunk tiny (an [E, out, in] expert
    # tensor): give back factors of two, innermost split dim first, until the chunk reaches the floor.
    grown = True
    while grown and math.prod(chunk) * itemsize < MIN_CHUNK_BYTES:
        grown = False
        for d in sorted(split, reverse=True):
            if d < len(shape) and chunk[d] * 2 <= shape[d] and shape[d] % (chunk[d] * 2) == 0:
                chunk[d] *= 2
                grown = True
                break
    for d, unit in (units or {}).items():
        split.setdefault(int(d), set())
        chunk[int(d)] = max(1, min(int(unit), shape[int(d)]))

    # Cut until the chunk fits the target: leading dims first, the last dim last, always by a prime
    # factor so aligned extents keep their boundaries. Whole rows stay in one chunk as long as they
    # fit, so a row read (inspection) or a row-major ZeRO fragment touches few chunks.
    order = list(range(len(shape)))
    def nbytes() -> int:
        return math.prod(chunk) * itemsize
    for d in order:
        while nbytes() > target_bytes and chunk[d] > 1:
            p = _smallest_prime_factor(chunk[d])
            # prefer a halving-like cut; a huge prime extent is cut to a ceil-divided size instead
            if p == chunk[d] and chunk[d] > 64 and d not in split:
                need = math.ceil(nbytes() / target_bytes)
                chunk[d] = math.ceil(chunk[d] / need)
            else:
                chunk[d] //= p
        if nbytes() <= target_bytes:
            break

    # Shards: whole array when small enough, else multiples of the chunk along dim 0 (then 1, ...).
    shard = list(shape)
    for d in range(len(shape)):
        if math.prod(shard) * itemsize <= shard_target_bytes:
            break
        per_chunk_row = math.prod(shard[:d] + [chunk[d]] + shard[d + 1:]) * itemsize
        n_chunks = max(1, shard_target_bytes // max(per_chunk_row, 1))
        shard[d] = min(shape[d], n_chunks * chunk[d])
    # sharding_indexed needs a shard to be a whole number of inner chunks (the edge shard may overhang)
    shard = [math.ceil(s / c) * c for s, c in zip(shard, chunk)]
    return Chunking(tuple(chunk), tuple(shard))
