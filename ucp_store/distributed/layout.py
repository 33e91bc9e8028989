"""DTensor placements -> boxes: the pure math lives in ``ucp_store.patterns.mesh`` (the planner uses it
too, torch-free); this module adds ``placement_json``, which turns live torch placements into its JSON,
and ``mesh_facts``, a DeviceMesh's ranks read once per mesh."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from ucp_store.errors import TopologyError
from ucp_store.patterns.mesh import (
    Region,
    all_coords,
    dim_indices,
    dim_runs,
    is_writer_coord,
    local_regions,
    local_shape,
    runs,
    split_points,
)

__all__ = ["MeshFacts", "Region", "all_coords", "dim_indices", "dim_runs", "is_writer_coord", "local_regions",
           "local_shape", "mesh_facts", "placement_json", "runs", "split_points"]


@dataclass(frozen=True)
class MeshFacts:
    """A DeviceMesh's global ranks: nested as the mesh (``ranks``), its shape, and flattened in mesh order."""

    ranks: list
    shape: tuple[int, ...]
    flat: tuple[int, ...]


_MESHES: dict[int, tuple[Any, MeshFacts]] = {}


def mesh_facts(mesh: Any) -> MeshFacts:
    """``mesh``'s ranks, read once per mesh object: torch builds ``DeviceMesh.mesh`` from the mesh's layout on
    every access, and a state dict holds hundreds of DTensors on the same one or two meshes."""
    hit = _MESHES.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    t = mesh.mesh
    facts = MeshFacts(t.tolist(), tuple(int(n) for n in t.shape), tuple(int(g) for g in t.reshape(-1).tolist()))
    try:
        _MESHES[id(mesh)] = (weakref.ref(mesh), facts)
    except TypeError:  # a mesh-like object that takes no weak reference: read it each time
        pass
    return facts


def placement_json(p: Any) -> dict:
    """A DTensor placement (or its JSON form) as JSON; raises for ``Partial`` and unknown placements."""
    if isinstance(p, dict):
        kind = p.get("type")
        if kind == "replicate":
            return {"type": "replicate"}
        if kind == "shard":
            return {"type": "shard", "dim": int(p["dim"])}
        if kind == "strided_shard":
            return {"type": "strided_shard", "dim": int(p["dim"]), "split_factor": int(p["split_factor"])}
        raise TopologyError(f"placement {p!r}: expected type shard, strided_shard or replicate")
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return {"type": "strided_shard", "dim": int(p.dim), "split_factor": int(p.split_factor)}
    if isinstance(p, Shard):
        return {"type": "shard", "dim": int(p.dim)}
    if isinstance(p, Replicate):
        return {"type": "replicate"}
    raise TopologyError(f"placement {p!r} cannot be checkpointed: only Shard, _StridedShard and Replicate hold "
                        "state (a Partial DTensor is a pending reduction; redistribute it first)")
