"""TP/EP layouts and writer choice: the forward map (logical -> a rank's TP-local tensor) and its inverse.

``tp_layout`` / ``local_layout`` give a rank's TP-local tensor (before ZeRO) as its shape, the ``Copy``
records that fill it from logical boxes, and the boxes that must be zero (vocab padding). ``is_writer``
picks the one replica of every element that writes it on save (the rule in the package docstring);
``shard_copies`` / ``writer_copies`` are the inverse map a saving rank follows. Layouts are cached on
the placement-less pattern, so every layer of a model shares one entry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ucp_store.errors import PatternError, TopologyError
from ucp_store.geometry import Box
from ucp_store.patterns.kinds import (
    Averaged,
    Expert,
    ExpertMember,
    Fused,
    Partitioned,
    Pattern,
    Replicated,
    Vocab,
    is_expert,
)
from ucp_store.patterns.parse import check_shape, parse_pattern, who, without_placement
from ucp_store.patterns.placement import holds, stages_of_placement
from ucp_store.topology import Topology

__all__ = ["Copy", "LocalLayout", "tp_layout", "local_layout", "is_writer", "shard_copies", "writer_copies",
           "clear_layout_caches"]


@dataclass(frozen=True, slots=True)
class Copy:
    """Logical box <-> box of the TP-local tensor (same shape)."""

    logical: Box
    local: Box

    def to_json(self) -> dict[str, Any]:
        return {"logical": self.logical.to_json(), "local": self.local.to_json()}


@dataclass(frozen=True, slots=True)
class LocalLayout:
    """A rank's TP-local tensor: its shape, where its data comes from, and what must be zero."""

    shape: tuple[int, ...]
    copies: tuple[Copy, ...]
    padding: tuple[Box, ...]


def _divisors(n: int, limit: int = 8) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return "{" + ", ".join(map(str, ds[:limit])) + (", ...}" if len(ds) > limit else "}")


def _even_widths(n: int, tp: int, name: str | None, what: str) -> tuple[int, ...]:
    if n % tp:
        raise TopologyError(f"{who(name)} {what} of size {n} cannot be split {tp} ways: give widths for tp={tp} "
                            f"or use tp in {_divisors(n)}")
    return (n // tp,) * tp


def _full_copy(shape: tuple[int, ...]) -> LocalLayout:
    box = Box.full(shape)
    return LocalLayout(shape, () if box.empty else (Copy(box, box),), ())


_LAYOUT_CACHE: dict[tuple[Any, ...], LocalLayout] = {}
LAYOUT_CACHE_MAX = 200_000


def tp_layout(pattern: Any, shape: Sequence[int], tp: int, tp_rank: int, *, ep: int = 1, ep_rank: int = 0,
              vocab_multiple: int = 1, name: str | None = None) -> LocalLayout:
    """The TP/EP-local layout of ``rank`` given its coordinates directly (see ``local_layout``)."""
    p = without_placement(parse_pattern(pattern, name=name))
    shape = tuple(shape)
    key = (p, shape, tp, tp_rank, ep, ep_rank, vocab_multiple)
    hit = _LAYOUT_CACHE.get(key)
    if hit is not None:
        return hit
    check_shape(p, shape, name)
    out = _layout(p, shape, tp, tp_rank, ep, ep_rank, vocab_multiple, name)
    if len(_LAYOUT_CACHE) >= LAYOUT_CACHE_MAX:
        _LAYOUT_CACHE.clear()
    _LAYOUT_CACHE[key] = out
    return out


def local_layout(pattern: Any, shape: Sequence[int], topology: Topology, rank: int, *,
                 name: str | None = None) -> LocalLayout:
    """Forward map: the TP-local tensor of ``rank`` (before ZeRO) as shape, copies and zero padding.

    Pipeline placement is not checked here (see ``holds``): the layout is the one the rank would hold.
    Experts are whole under ``ep_over="stage"`` (``Topology.tp_for``)."""
    c = topology.coords(rank)
    tp = topology.tp_for(is_expert(parse_pattern(pattern, name=name)))
    return tp_layout(pattern, shape, tp, c["tp"] if tp > 1 else 0, ep=topology.ep, ep_rank=c["ep"],
                     vocab_multiple=topology.vocab_multiple, name=name)


def _layout(p: Pattern, shape: tuple[int, ...], tp: int, r: int, ep: int, ep_rank: int, vmult: int,
            name: str | None) -> LocalLayout:
    if isinstance(p, (Replicated, Averaged)):
        return _full_copy(shape)
    if isinstance(p, Partitioned):
        d = p.dim
        widths = p.widths_for(tp) or _even_widths(shape[d], tp, name, f"dim {d}")
        off, w = sum(widths[:r]), widths[r]
        local_shape = shape[:d] + (w,) + shape[d + 1:]
        local = Box.full(local_shape)
        if local.empty:
            return LocalLayout(local_shape, (), ())
        return LocalLayout(local_shape, (Copy(local.with_dim(d, off, off + w), local),), ())
    if isinstance(p, Vocab):
        d, n = p.dim, p.original_size
        multiple = vmult * tp
        per = -(-n // multiple) * multiple // tp  # padded rows per rank
        lo, hi = min(r * per, n), min((r + 1) * per, n)
        local_shape = shape[:d] + (per,) + shape[d + 1:]
        full = Box.full(local_shape)
        if full.empty:
            return LocalLayout(local_shape, (), ())
        copies: tuple[Copy, ...] = ()
        padding: tuple[Box, ...] = ()
        if hi > lo:
            copies = (Copy(full.with_dim(d, lo, hi), full.with_dim(d, 0, hi - lo)),)
        if per > hi - lo:
            padding = (full.with_dim(d, hi - lo, per),)
        return LocalLayout(local_shape, copies, padding)
    if isinstance(p, Fused):
        d = p.dim
        sub_widths: Any = p.widths_for(tp)
        if sub_widths is None:
            sub_widths = []
            for j, s in enumerate(p.sizes):
                if s % tp:
                    common = math.gcd(*p.sizes)
                    raise TopologyError(
                        f"{who(name)} dim {d}: fused sub-parameter {j} of size {s} (sizes {list(p.sizes)}) cannot "
                        f"be split {tp} ways: give widths for tp={tp} or use tp in {_divisors(common)}")
                sub_widths.append((s // tp,) * tp)
        extent = sum(wj[r] for wj in sub_widths)
        local_shape = shape[:d] + (extent,) + shape[d + 1:]
        full = Box.full(local_shape)
        fused: list[Copy] = []
        sub_start = local_at = 0
        for s, wj in zip(p.sizes, sub_widths):
            w = wj[r]
            if w:
                src = sub_start + sum(wj[:r])
                fused.append(Copy(full.with_dim(d, src, src + w), full.with_dim(d, local_at, local_at + w)))
            sub_start += s
            local_at += w
        return LocalLayout(local_shape, () if full.empty else tuple(fused), ())
    if isinstance(p, Expert):
        e, n = p.dim, p.num_experts
        if n % ep:
            raise TopologyError(f"{who(name)}: {n} experts cannot be split over ep={ep}; use ep in {_divisors(n)}")
        per = n // ep
        e0 = ep_rank * per
        inner = _layout(p.inner, shape[:e] + shape[e + 1:], tp, r, 1, 0, vmult, name)
        local_shape = inner.shape[:e] + (per,) + inner.shape[e:]
        return LocalLayout(local_shape,
                           tuple(Copy(c.logical.insert_dim(e, e0, e0 + per), c.local.insert_dim(e, 0, per))
                                 for c in inner.copies),
                           tuple(b.insert_dim(e, 0, per) for b in inner.padding))
    if isinstance(p, ExpertMember):
        # one expert's whole tensor, laid out over TP by ``inner``; only its owner ep rank holds it
        # (``holds``), which this layout does not check
        if p.num_experts % ep:
            raise TopologyError(f"{who(name)}: {p.num_experts} experts cannot be split over ep={ep}; "
                                f"use ep in {_divisors(p.num_experts)}")
        return _layout(p.inner, shape, tp, r, 1, 0, vmult, name)
    raise PatternError(f"{who(name)}: unknown pattern kind {p.kind!r}")


def is_writer(pattern: Any, topology: Topology, rank: int, *, flat: bool = False, name: str | None = None) -> bool:
    """Is ``rank`` the one rank that writes its copy of the tensor (see the module docstring)?

    ``flat``: the state is a ZeRO flat fragment (``zero_stage >= 1``), whose fragments are already disjoint
    across the ZeRO group (``sp`` x ``dp``, or ``sp`` x ``edp`` for experts)."""
    p = parse_pattern(pattern, name=name)
    c = topology.coords(rank)
    stages = stages_of_placement(p.placement, topology, name)
    if c["pp"] != stages[0]:
        return False
    if is_expert(p) and topology.ep_over == "stage":
        # whole experts, replicated over the stage's ranks of one ep rank (tp and sp included): the ZeRO group
        # (flat fragments are disjoint over it) or its first rank writes
        if isinstance(p, ExpertMember) and p.owner(topology.ep) != c["ep"]:
            return False
        return (flat and topology.zero_stage > 0) or c["edp"] == 0
    if p.tp_replicated and c["tp"] != 0:
        return False
    if flat and topology.zero_stage > 0:
        return True
    if c["sp"] != 0:
        return False
    if isinstance(p, ExpertMember) and p.owner(topology.ep) != c["ep"]:
        return False
    return (c["edp"] if is_expert(p) else c["dp"]) == 0


def shard_copies(pattern: Any, shape: Sequence[int], topology: Topology, rank: int, *,
                 name: str | None = None) -> tuple[Copy, ...]:
    """Inverse map: where ``rank``'s TP-local tensor lands in the logical tensor (every copy, writer or not).

    ``logical[c.logical.slices()] = local[c.local.slices()]`` for each copy rebuilds the logical tensor."""
    return local_layout(pattern, shape, topology, rank, name=name).copies


def writer_copies(pattern: Any, shape: Sequence[int], topology: Topology, rank: int, *,
                  name: str | None = None) -> tuple[Copy, ...]:
    """The copies ``rank`` must write when saving: ``shard_copies`` if it is the writer, else nothing."""
    if not holds(pattern, topology, rank, name=name) or not is_writer(pattern, topology, rank, name=name):
        return ()
    return shard_copies(pattern, shape, topology, rank, name=name)


def clear_layout_caches() -> None:
    """Forget memoised layouts (results never depend on the caches)."""
    _LAYOUT_CACHE.clear()
