"""Box and range geometry (pure): the coordinates every layer of the store speaks.

A ``Box`` is an axis-aligned box of an N-d array, one half-open ``(start, stop)`` per dim (``()`` for a
0-d array); ``FlatRange`` is a half-open range of a flat (1-d) buffer. Row-major flattening links the
two: ``flat_range_to_boxes`` cuts a flat range of an array into the few boxes it covers, and
``split_contiguous`` cuts a box into runs that are contiguous in that flattening (what a ZeRO fragment
or a ``buffer[range] = logical[box].ravel()`` copy needs). Chunk grids are boxes too
(``Box.chunk_indices``, ``Box.of_chunk``).

Why a module of its own: the pattern algebra, the planner, the array format and the reader all cut
boxes; keeping one ``Box`` type here (frozen, tiny pure methods, no tensors, no I/O) means none of
them needs its own tuple-of-ranges conventions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from ucp_store.errors import PatternError

__all__ = ["Ranges", "Box", "FlatRange", "flat_range_to_boxes", "row_major_strides", "split_contiguous", "uncovered"]

Ranges = tuple[tuple[int, int], ...]
"""The raw form of a box: one half-open ``(start, stop)`` per dim."""


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned box of an N-d array: half-open ``(start, stop)`` per dim (``()`` for a 0-d array)."""

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Box":
        return cls(tuple((0, int(n)) for n in shape))

    @property
    def ndim(self) -> int:
        return len(self.ranges)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.ranges)

    @property
    def start(self) -> tuple[int, ...]:
        return tuple(a for a, _ in self.ranges)

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(b for _, b in self.ranges)

    @property
    def numel(self) -> int:
        n = 1
        for a, b in self.ranges:
            n *= b - a
        return n

    @property
    def empty(self) -> bool:
        return any(b <= a for a, b in self.ranges)

    def intersect(self, other: "Box") -> "Box | None":
        """The common part, or None when it is empty."""
        out = []
        for (a, b), (c, d) in zip(self.ranges, other.ranges):
            lo, hi = (a if a > c else c), (b if b < d else d)
            if hi <= lo:
                return None
            out.append((lo, hi))
        return Box(tuple(out))

    def translate(self, delta: Sequence[int]) -> "Box":
        return Box(tuple((a + t, b + t) for (a, b), t in zip(self.ranges, delta)))

    def with_dim(self, dim: int, start: int, stop: int) -> "Box":
        r = list(self.ranges)
        r[dim] = (start, stop)
        return Box(tuple(r))

    def insert_dim(self, dim: int, start: int, stop: int) -> "Box":
        return Box(self.ranges[:dim] + ((start, stop),) + self.ranges[dim:])

    def slices(self) -> tuple[slice, ...]:
        """Index an array with ``array[box.slices()]``."""
        return tuple(slice(a, b) for a, b in self.ranges)

    def to_json(self) -> list[list[int]]:
        return [[a, b] for a, b in self.ranges]

    def chunk_indices(self, chunk_shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
        """Grid indices of the chunks of shape ``chunk_shape`` this box touches, in C order (none if empty)."""
        ranges = [range(lo // c, (hi - 1) // c + 1) if hi > lo else range(0)
                  for (lo, hi), c in zip(self.ranges, chunk_shape)]
        return itertools.product(*ranges)

    @classmethod
    def of_chunk(cls, index: Sequence[int], chunk_shape: Sequence[int], shape: Sequence[int]) -> Box:
        """The box of chunk ``index`` of an array of ``shape`` cut in ``chunk_shape`` (edge chunks clipped)."""
        return cls(tuple((i * c, min((i + 1) * c, s)) for i, c, s in zip(index, chunk_shape, shape)))

    @classmethod
    def from_json(cls, value: Iterable[Sequence[int]]) -> "Box":
        return cls(tuple((int(a), int(b)) for a, b in value))


@dataclass(frozen=True, slots=True)
class FlatRange:
    """Half-open range ``[start, stop)`` of a flat (1-d) buffer."""

    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def shift(self, by: int) -> "FlatRange":
        return FlatRange(self.start + by, self.stop + by)

    def to_json(self) -> list[int]:
        return [self.start, self.stop]


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Decompose ``[start, stop)`` of the row-major flattening of ``shape`` into boxes, in flat order.

    Each box is contiguous in the flattening (fixed leading indices, a range on one dim, full trailing
    dims); there are at most ``2 * ndim - 1``."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise PatternError(f"flat range [{start}, {stop}) is outside a tensor of shape {list(shape)} "
                           f"({numel} elements)")
    if start == stop:
        return []
    if not shape:
        return [Box(())]
    out: list[Box] = []
    _decompose(shape, start, stop, (), out)
    return out


def _decompose(shape: tuple[int, ...], a: int, b: int, prefix: tuple[tuple[int, int], ...], out: list[Box]) -> None:
    # [a, b) is non-empty and lies within one block of shape ``shape`` whose leading indices are ``prefix``
    rest = shape[1:]
    inner = math.prod(rest)
    full_rest = tuple((0, n) for n in rest)
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(b, inner)
    if not rest or (r0 == 0 and r1 == 0):
        out.append(Box(prefix + ((i0, i1),) + full_rest))
        return
    if i0 == i1:
        _decompose(rest, r0, r1, prefix + ((i0, i0 + 1),), out)
        return
    if r0:
        _decompose(rest, r0, inner, prefix + ((i0, i0 + 1),), out)
        i0 += 1
    if i1 > i0:
        out.append(Box(prefix + ((i0, i1),) + full_rest))
    if r1:
        _decompose(rest, 0, r1, prefix + ((i1, i1 + 1),), out)


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def split_contiguous(box: Box, shape: Sequence[int]) -> list[Box]:
    """Split ``box`` of an array of ``shape`` into the fewest boxes each contiguous in row-major order."""
    ranges = box.ranges
    j = len(ranges) - 1
    while j >= 0 and ranges[j] == (0, shape[j]):
        j -= 1
    if j <= 0 or all(b - a == 1 for a, b in ranges[:j]):
        return [box]
    # every index combination of the dims before the last partial one is its own contiguous run
    heads = itertools.product(*(range(a, b) for a, b in ranges[:j]))
    return [Box(tuple((i, i + 1) for i in head) + ranges[j:]) for head in heads]


def uncovered(spans: Iterable[tuple[int, int]], length: int) -> tuple[FlatRange, ...]:
    """The ranges of ``[0, length)`` outside every half-open span (spans may overlap, in any order)."""
    out, at = [], 0
    for a, b in sorted(spans):
        if a > at:
            out.append(FlatRange(at, a))
        at = max(at, b)
    if length > at:
        out.append(FlatRange(at, length))
    return tuple(out)
