"""DTensor placements -> boxes: the pure math lives in ``ucp_store.patterns.mesh`` (the planner uses it
too, torch-free); this module adds ``placement_json``, which turns live torch placements into its JSON."""

from __future__ import annotations

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

__all__ = ["Region", "all_coords", "dim_indices", "dim_runs", "is_writer_coord", "local_regions", "local_shape",
           "placement_json", "runs", "split_points"]


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
