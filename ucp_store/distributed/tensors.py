"""One tensor leaf of a live state dict on this rank (``LocalTensor``): its logical shape, local shard and the
boxes the shard covers (from a DTensor's mesh and placements, or the whole tensor for a plain one). What the
planner, the loader and the verifier all start from."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ucp_store import dtypes
from ucp_store.distributed import layout as lay
from ucp_store.distributed.statedict import Leaf, path_text
from ucp_store.errors import TopologyError

__all__ = ["LocalTensor", "describe_leaf", "host_copy", "is_dtensor"]


@dataclass
class LocalTensor:
    """One tensor leaf on this rank: its logical shape, local tensor and local boxes."""

    leaf: Leaf
    shape: tuple[int, ...]
    dtype: str
    local: torch.Tensor
    regions: list[lay.Region]
    candidate: bool  # this rank may write its boxes (index 0 on the mesh dims that replicate it)
    pattern: dict | None = None
    boundaries: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return self.leaf.key  # type: ignore[return-value]

    @property
    def what(self) -> str:
        return f"state dict entry {path_text(self.leaf.path)!r} (tensor {self.key[0]!r} state {self.key[1]!r})"


def is_dtensor(t: Any) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists (and importing it
    return mod is not None and isinstance(t, mod.DTensor)  # costs seconds on the caller's clock)


def describe_leaf(leaf: Leaf) -> LocalTensor:
    t = leaf.value
    what = f"state dict entry {path_text(leaf.path)!r}"
    if is_dtensor(t):
        mesh = t.device_mesh
        coord = mesh.get_coordinate()
        placements = [lay.placement_json(p) for p in t.placements]
        shape = tuple(int(s) for s in t.shape)
        local = t.to_local()
        mesh_shape = lay.mesh_facts(mesh).shape
        if coord is None:  # this rank is not part of the DTensor's mesh: it holds nothing
            return LocalTensor(leaf, shape, dtypes.zarr_name(local.dtype, what=what), local, [], False)
        regions, expected, writer, points = _geometry(shape, mesh_shape, placements, tuple(coord), what)
        if tuple(local.shape) != expected:
            raise TopologyError(f"{what}: the local shard has shape {tuple(local.shape)} but placements "
                                f"{list(t.placements)} on mesh {list(mesh_shape)} at {tuple(coord)} give {expected}; "
                                "this placement layout is not supported")
        pattern: dict[str, Any] = {"kind": "dtensor", "mesh": {"shape": list(mesh_shape)}, "placements": placements}
        if mesh.mesh_dim_names:
            pattern["mesh"]["dims"] = list(mesh.mesh_dim_names)
        return LocalTensor(leaf, shape, dtypes.zarr_name(local.dtype, what=what), local, list(regions), writer, pattern,
                       points)
    shape = tuple(int(s) for s in t.shape)
    full = lay.Region(tuple((0, n) for n in shape), tuple((0, n) for n in shape))
    return LocalTensor(leaf, shape, dtypes.zarr_name(t.dtype, what=what), t, [full] if t.numel() or not shape else [],
                   True)


#: (shape, mesh shape, placements, coordinate) -> this rank's regions, local shape, writer flag, split points:
#: the same few geometries recur across a state dict's DTensors and across saves (pure index math)
_GEOMETRY: dict[tuple, tuple] = {}


def _geometry(shape: tuple, mesh_shape: tuple, placements: list, coord: tuple, what: str) -> tuple:
    key = (shape, mesh_shape, repr(placements), coord)
    hit = _GEOMETRY.get(key)
    if hit is None:
        hit = (tuple(lay.local_regions(shape, mesh_shape, placements, coord, what=what)),
               lay.local_shape(shape, mesh_shape, placements, coord), lay.is_writer_coord(placements, coord),
               lay.split_points(shape, mesh_shape, placements))
        if len(_GEOMETRY) > 65536:  # a process that saves ever-new shapes: keep the memory bounded
            _GEOMETRY.clear()
        _GEOMETRY[key] = hit
    return hit


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy-or-view of ``t`` (device tensors are copied to CPU)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()
