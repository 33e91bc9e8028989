"""ZeRO group layout: how a parameter group's flat buffer is cut over a ZeRO group, and what each fragment holds.

ZeRO stages 1-3 cut the *flattened* (row-major) TP-local tensor into fragments. ``ZeroGroupLayout``
(from ``zero_group_layout``) computes each rank's ``Fragment`` of each parameter and the buffer gaps
between them; ``fragment_layout`` / ``flat_layout`` turn a fragment into ``FlatCopy`` records (logical
box -> contiguous range of the fragment), each logical box contiguous in the local tensor so that
``buffer[range] = logical[box].ravel()`` is exact.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ucp_store.errors import TopologyError
from ucp_store.geometry import Box, FlatRange, flat_range_to_boxes, row_major_strides, split_contiguous, uncovered
from ucp_store.patterns.layout import LAYOUT_CACHE_MAX, LocalLayout, is_writer, local_layout
from ucp_store.patterns.placement import holds
from ucp_store.topology import Topology

__all__ = ["FlatCopy", "Fragment", "FlatLayout", "ZeroGroupLayout", "zero_group_layout", "fragment_layout",
           "flat_layout", "fragment_writer_copies", "clear_flat_caches"]


@dataclass(frozen=True, slots=True)
class FlatCopy:
    """Logical box <-> contiguous range of a flat fragment: ``flat_buffer[flat] == logical[box].ravel()``."""

    logical: Box
    flat: FlatRange

    def to_json(self) -> dict[str, Any]:
        return {"logical": self.logical.to_json(), "flat": self.flat.to_json()}


class Fragment(NamedTuple):
    """A rank's ZeRO fragment of one parameter (a named tuple: a ZeRO-3 plan makes one per parameter).

    Elements ``[start, stop)`` of the flattened TP-local tensor land at ``buffer_start`` of the rank's
    flat buffer; ``slot`` buffer elements are reserved there (``slot > stop - start`` only for the ZeRO-3
    partition of the last ranks, whose tail is padding).

    An importer holding DeepSpeed's exact addresses builds it directly: for ZeRO-1/2
    ``param_slice_mappings[name] = (start=s, numel=n)`` on DP rank ``d`` gives
    ``Fragment(k, k + n, s, n)`` with ``k`` the elements of the parameter held by DP ranks ``< d``; for
    ZeRO-3 rank ``d`` of ``p = ceil(numel / dp)``: ``Fragment(min(d*p, numel), min((d+1)*p, numel), offset, p)``."""

    start: int
    stop: int
    buffer_start: int
    slot: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """A fragment's contents: ``copies`` and zero ``padding``, both as ranges of the fragment's slot."""

    slot: int
    copies: tuple[FlatCopy, ...]
    padding: tuple[FlatRange, ...]


def fragment_layout(pattern: Any, shape: Sequence[int], topology: Topology, rank: int, fragment: Fragment, *,
                    name: str | None = None) -> FlatLayout:
    """Forward map for a ZeRO fragment: logical boxes -> ranges of the fragment's slot, and zero padding.

    Ranges are relative to the slot (``buffer[fragment.buffer_start + r.start : ...]``)."""
    layout = local_layout(pattern, shape, topology, rank, name=name)
    return flat_layout(layout, fragment)


_FLAT_CACHE: dict[tuple[Any, ...], FlatLayout] = {}


def flat_layout(layout: LocalLayout, fragment: Fragment) -> FlatLayout:
    """``fragment_layout`` from an already computed ``LocalLayout`` (cached on the fragment's extent)."""
    key = (layout, fragment.start, fragment.stop, fragment.slot)
    hit = _FLAT_CACHE.get(key)
    if hit is not None:
        return hit
    shape = layout.shape
    strides = row_major_strides(shape)
    copies: list[FlatCopy] = []
    for piece in flat_range_to_boxes(shape, fragment.start, fragment.stop):
        for c in layout.copies:
            inter = piece.intersect(c.local)
            if inter is None:
                continue
            delta = tuple(lg - lc for (lg, _), (lc, _) in zip(c.logical.ranges, c.local.ranges))
            for run in split_contiguous(inter, shape):
                at = sum(a * s for (a, _), s in zip(run.ranges, strides)) - fragment.start
                copies.append(FlatCopy(run.translate(delta), FlatRange(at, at + run.numel)))
    copies.sort(key=lambda fc: fc.flat.start)
    padding = uncovered(((fc.flat.start, fc.flat.stop) for fc in copies), fragment.slot)
    out = FlatLayout(fragment.slot, tuple(copies), padding)
    if len(_FLAT_CACHE) >= LAYOUT_CACHE_MAX:
        _FLAT_CACHE.clear()
    _FLAT_CACHE[key] = out
    return out


def fragment_writer_copies(pattern: Any, shape: Sequence[int], topology: Topology, rank: int,
                           fragment: Fragment, *, name: str | None = None) -> tuple[FlatCopy, ...]:
    """The flat copies a ZeRO rank must write from its fragment (ranges relative to the fragment's slot)."""
    if not holds(pattern, topology, rank, name=name) or not is_writer(pattern, topology, rank, flat=True, name=name):
        return ()
    return fragment_layout(pattern, shape, topology, rank, fragment, name=name).copies


@dataclass(frozen=True, slots=True)
class ZeroGroupLayout:
    """How one parameter group's flat buffer is partitioned over a ZeRO group of ``world`` ranks.

    Stage 1/2 (DeepSpeed ``stage_1_and_2.py``): the TP-local parameters are flattened and concatenated
    in order, each but the last followed by padding to a multiple of ``param_alignment``; the whole is
    padded to a multiple of ``alignment * world``, and rank ``z`` owns ``[z * P, (z+1) * P)`` with
    ``P = total / world``. A parameter may straddle ranks. ``offsets[i]`` is parameter ``i``'s start in
    the unpartitioned flat group.

    Stage 3 (``partition_parameters.py``): every parameter is split on its own into
    ``p_i = ceil(numel_i / world)`` pieces, the last rank(s) clipped and padded; a rank's buffer holds
    its piece of every parameter back to back, ``offsets[i]`` being where piece ``i`` starts in it."""

    zero_stage: int
    world: int
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    partition_numel: int  # each rank's buffer length
    total_numel: int      # stage 1/2: the padded flat group; stage 3: world * partition_numel

    def fragment(self, index: int, zero_rank: int) -> Fragment | None:
        """Rank ``zero_rank``'s part of parameter ``index``, or None if it holds none of it (stage 1/2)."""
        n, off = self.numels[index], self.offsets[index]
        if self.zero_stage == 3:
            piece = -(-n // self.world)
            start = min(zero_rank * piece, n)
            return Fragment(start, min(start + piece, n), off, piece)
        lo = zero_rank * self.partition_numel
        a, b = max(off, lo), min(off + n, lo + self.partition_numel)
        if b <= a:
            return None
        return Fragment(a - off, b - off, a - lo, b - a)

    def fragments(self, zero_rank: int) -> list[tuple[int, Fragment]]:
        """``(parameter index, fragment)`` for every parameter rank ``zero_rank`` holds a slot of.

        The arithmetic of ``fragment`` inlined (a ZeRO-3 group of a 1000-layer model has 25k members),
        and for stage 1/2 only over the members overlapping the rank; a property test holds the two equal."""
        numels, offsets = self.numels, self.offsets
        if self.zero_stage == 3:  # every parameter has a piece on every rank (empty for tiny ones)
            world = self.world
            out = []
            for i, n in enumerate(numels):
                piece = -(-n // world)
                if piece:
                    start = min(zero_rank * piece, n)
                    out.append((i, Fragment(start, min(start + piece, n), offsets[i], piece)))
            return out
        # stage 1/2: only the parameters overlapping [lo, hi) of the flat group; offsets ascend
        lo = zero_rank * self.partition_numel
        hi = lo + self.partition_numel
        first = max(bisect.bisect_right(offsets, lo) - 1, 0)
        out = []
        for i in range(first, len(numels)):
            off = offsets[i]
            if off >= hi:
                break
            a, b = max(off, lo), min(off + numels[i], hi)
            if b > a:
                out.append((i, Fragment(a - off, b - off, a - lo, b - a)))
        return out

    def gaps(self, zero_rank: int) -> tuple[FlatRange, ...]:
        """Buffer ranges of ``zero_rank`` outside every parameter's slot (alignment and tail padding)."""
        return uncovered(((f.buffer_start, f.buffer_start + f.slot) for _, f in self.fragments(zero_rank)),
                         self.partition_numel)


def zero_group_layout(numels: Sequence[int], world: int, zero_stage: int, *, alignment: int = 2,
                      param_alignment: int = 1) -> ZeroGroupLayout:
    """Partition a parameter group (TP-local numels in group order) over ``world`` ZeRO ranks.

    ``alignment`` is DeepSpeed's ``nccl_start_alignment_factor`` (2); ``param_alignment`` is 1 unless
    ``zero_optimization.parameter_alignment`` is on (then ``16 // element_size``). Both are ignored by
    stage 3, which partitions each parameter separately."""
    if zero_stage not in (1, 2, 3):
        raise TopologyError(f"ZeRO partitions exist for zero_stage 1, 2 or 3, not {zero_stage!r}")
    if world < 1 or alignment < 1 or param_alignment < 1:
        raise TopologyError(f"ZeRO world {world}, alignment {alignment} and param_alignment {param_alignment} "
                            f"must be >= 1")
    numels = tuple(int(n) for n in numels)
    offsets = []
    if zero_stage == 3:
        at = 0
        for n in numels:
            offsets.append(at)
            at += -(-n // world)
        return ZeroGroupLayout(3, world, numels, tuple(offsets), at, at * world)
    at = 0
    for i, n in enumerate(numels):
        offsets.append(at)
        at += n
        if i < len(numels) - 1:
            at += (-at) % param_alignment
    unit = alignment * world
    total = -(-at // unit) * unit
    return ZeroGroupLayout(zero_stage, world, numels, tuple(offsets), total // world, total)


def clear_flat_caches() -> None:
    """Forget memoised fragment layouts (results never depend on the caches)."""
    _FLAT_CACHE.clear()
