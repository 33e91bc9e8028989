"""Pipeline placement and stage-local names: which stages hold a tensor, and what each stage calls it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ucp_store.errors import PatternError, TopologyError
from ucp_store.patterns.kinds import ExpertMember, Placement
from ucp_store.patterns.parse import parse_pattern, who
from ucp_store.topology import Topology

__all__ = ["placement_stages", "stages_of_placement", "holds", "expert_held", "stage_local_name", "canonical_names"]


def placement_stages(pattern: Any, topology: Topology, *, name: str | None = None) -> tuple[int, ...]:
    """The pipeline stages holding the tensor, ascending (tied tensors: first and last; pp=1: (0,))."""
    p = parse_pattern(pattern, name=name)
    return stages_of_placement(p.placement, topology, name)


def stages_of_placement(pl: Placement | None, topology: Topology, name: str | None = None) -> tuple[int, ...]:
    """The stages a ``Placement`` (or ``None``: every stage) resolves to in ``topology``, ascending."""
    if pl is None:
        return tuple(range(topology.pp))
    if pl.layer is not None:
        if topology.pp == 1:
            return (0,)  # one stage holds every layer, whatever ``layers`` says
        if pl.layer >= topology.layers:
            raise TopologyError(f"{who(name)} is placed on layer {pl.layer} but the topology has "
                                f"layers={topology.layers}; set 'layers' to the model's number of layers")
        return (topology.stage_of_layer(pl.layer),)
    return tuple(sorted({0 if s == "first" else topology.pp - 1 for s in pl.stages}))


def holds(pattern: Any, topology: Topology, rank: int, *, name: str | None = None) -> bool:
    """Does ``rank`` hold the tensor: its pipeline stage does, and for a separate expert tensor
    (``expert_member``) its ep rank owns that expert?"""
    p = parse_pattern(pattern, name=name)
    c = topology.coords(rank)
    if isinstance(p, ExpertMember) and not expert_held(p, topology.ep, c["ep"], name):
        return False
    return c["pp"] in stages_of_placement(p.placement, topology, name)


def expert_held(p: ExpertMember, ep: int, ep_rank: int, name: str | None = None) -> bool:
    """Does ep rank ``ep_rank`` of ``ep`` hold expert ``p.expert``? ``TopologyError`` when ep does not
    divide the experts."""
    if p.num_experts % ep:
        raise TopologyError(f"{who(name)}: {p.num_experts} experts cannot be split over ep={ep}")
    return p.owner(ep) == ep_rank


def stage_local_name(name: str, pattern: Any, topology: Topology, stage: int | None = None) -> str:
    """The name stage ``stage`` uses for canonical tensor ``name``.

    ``placement.local_name`` wins (``{local}``, ``{layer}``, ``{stage}`` filled in); otherwise the
    topology's ``layer_names`` rule; otherwise the canonical name (global layer indices, as in
    Megatron-DeepSpeed pipe models)."""
    p = parse_pattern(pattern, name=name)
    pl = p.placement
    stages = stages_of_placement(pl, topology, name)
    if stage is None:
        stage = stages[0]
    elif stage not in stages:
        raise TopologyError(f"{who(name)} is not held by stage {stage} (held by {list(stages)})")
    template = None
    if pl is not None:
        template = pl.local_name
        if template is None and pl.local_names:
            wanted = {"first": 0, "last": topology.pp - 1}
            for stage_name, t in pl.local_names:
                if wanted[stage_name] == stage:
                    template = t
                    break
    if template is None:
        return topology.local_name(name)
    layer = pl.layer if pl is not None and pl.layer is not None else None
    local = layer - topology.stage_starts[stage] if layer is not None else ""
    try:
        return template.format(local=local, layer=layer if layer is not None else "", stage=stage)
    except (KeyError, IndexError, ValueError) as e:
        raise PatternError(f"{who(name)}: placement.local_name {template!r} is not a valid template "
                           f"(fields: {{local}}, {{layer}}, {{stage}}): {e}") from None


def canonical_names(tensors: Iterable[tuple[str, Any]], topology: Topology, stage: int) -> dict[str, str]:
    """Map stage-local names to canonical names for every ``(name, pattern)`` held by ``stage``.

    The inverse of ``stage_local_name``; raises ``PatternError`` if two tensors share a local name."""
    out: dict[str, str] = {}
    for name, pattern in tensors:
        p = parse_pattern(pattern, name=name)
        if stage not in stages_of_placement(p.placement, topology, name):
            continue
        local = stage_local_name(name, p, topology, stage)
        if out.get(local, name) != name:
            raise PatternError(f"tensors {out[local]!r} and {name!r} both have the local name {local!r} "
                               f"on stage {stage}")
        out[local] = name
    return out
