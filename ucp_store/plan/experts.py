"""Expert placement of a checkpoint, for ``ucp show`` and ``ucp plan --ep N`` (pure, torch-free).

``expert_groups(infos)`` collects the MoE expert groups of a version from its catalog rows: separate
per-expert tensors (``expert_member``, grouped by their ``group``) and fused ``[E, ...]`` tensors
(``expert``, one group per tensor). ``placement_rows(groups, topology)`` says which experts each ep rank
holds and on which global ranks, by ``Topology.coords`` (the one home of the ep rule: ``ep_over="dp"``, the
dp ranks with ``dp % ep == ep_rank``, or DeepSpeed's ``ep_over="stage"``, the ranks with ``rank % ep ==
ep_rank``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ucp_store.patterns import Expert, ExpertMember, parse_pattern
from ucp_store.topology import Topology

__all__ = ["ExpertGroup", "expert_groups", "placement_rows", "ranges"]


@dataclass
class ExpertGroup:
    """One MoE layer's experts as stored: ``form`` is ``separate`` (``expert_member``) or ``fused``."""

    name: str
    num_experts: int
    form: str
    tensors: list[str] = field(default_factory=list)  # parameter names (one state each)
    experts: set[int] = field(default_factory=set)


def expert_groups(infos: Iterable[Any]) -> list[ExpertGroup]:
    """The expert groups of a version's rows, in row order."""
    out: dict[str, ExpertGroup] = {}
    seen: set[str] = set()
    for i in infos:
        if not i.pattern or i.name in seen:
            continue
        p = parse_pattern(i.pattern, name=i.name)
        if isinstance(p, ExpertMember):
            key = p.group or i.name.rsplit(f".{p.expert}.", 1)[0]
            g = out.setdefault(key, ExpertGroup(key, p.num_experts, "separate"))
            g.experts.add(p.expert)
        elif isinstance(p, Expert):
            key = i.name
            g = out.setdefault(key, ExpertGroup(key, p.num_experts, "fused"))
            g.experts.update(range(p.num_experts))
        else:
            continue
        seen.add(i.name)
        g.tensors.append(i.name)
    return list(out.values())


def ranges(ids: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    xs = sorted(ids)
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def placement_rows(groups: list[ExpertGroup], topology: Topology) -> list[list[str]]:
    """One row per (group, ep rank): ``[group, form, ep rank, experts, global ranks]`` in ``topology`` (the
    ranks of every pipeline stage)."""
    ep = topology.ep
    by_ep: dict[int, list[int]] = {}
    for r in range(topology.world_size):
        by_ep.setdefault(topology.coords(r)["ep"], []).append(r)
    rows = []
    for g in groups:
        if g.num_experts % ep:
            rows.append([g.name, g.form, "-", f"{g.num_experts} experts cannot be split over ep={ep}", "-"])
            continue
        per = g.num_experts // ep
        for r in range(ep):
            rows.append([g.name, g.form, str(r), ranges(range(r * per, (r + 1) * per)), ranges(by_ep.get(r, []))])
    return rows
