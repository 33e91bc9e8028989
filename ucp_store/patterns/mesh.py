"""Where a DTensor's local shard sits in its logical tensor (pure: no torch, no process group, no I/O).

A DTensor on a DeviceMesh is described by its global shape, the mesh shape and one placement per mesh
dim: ``Shard(d)`` (``torch.chunk`` semantics, so uneven splits leave the last ranks shorter or empty),
``_StridedShard(d, split_factor)`` (what FSDP2 over TP produces: the dim is first cut into
``split_factor`` pieces and the rank takes its chunk of each piece, so its rows are not contiguous) and
``Replicate()``. ``Partial`` is a pending reduction, not a state, and is refused.

Placements are applied left to right, as DTensor does. For every tensor dim that yields the list of
global indices a mesh coordinate holds, in local order; the local shard is the Cartesian product of
those lists, so it is a handful of boxes (one per contiguous run of every dim). From the same lists:
which coordinate writes a box (the one with index 0 on every mesh dim that does not shard the tensor,
so replicated data is written once), and the split points of all coordinates (chunk boundaries that
let every writer own whole chunks).

Placements travel as JSON: ``{"type": "shard", "dim": d}``, ``{"type": "strided_shard", "dim": d,
"split_factor": k}``, ``{"type": "replicate"}``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ucp_store.errors import TopologyError

__all__ = [
    "Region",
    "all_coords",
    "coord_of",
    "dim_indices",
    "dim_runs",
    "is_writer_coord",
    "local_regions",
    "local_shape",
    "runs",
    "split_points",
    "target_placements",
]


def _norm_dim(dim: int, ndim: int, what: str) -> int:
    d = dim + ndim if dim < 0 else dim
    if not 0 <= d < ndim:
        raise TopologyError(f"{what}: placement shards dim {dim} of a {ndim}-d tensor")
    return d


Runs = list[tuple[int, int]]  # one dim's global indices in local order, as (global_start, length) runs


def _take(rs: Runs, lo: int, hi: int) -> Runs:
    """The runs covering local positions ``[lo, hi)`` of the concatenation of ``rs``."""
    out: Runs = []
    pos = 0
    for g, n in rs:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append((g + a - pos, b - a))
        pos += n
        if pos >= hi:
            break
    return out


def _chunk_runs(rs: Runs, n: int, c: int) -> Runs:
    """Piece ``c`` of ``torch.chunk(.., n)`` over the runs: pieces of ceil(len/n), the last ones short or empty."""
    total = sum(m for _, m in rs)
    if not total:
        return []
    size = -(-total // n)
    return _take(rs, c * size, min((c + 1) * size, total))


def _merge(rs: Runs) -> Runs:
    out: Runs = []
    for g, n in rs:
        if out and out[-1][0] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((g, n))
    return out


def dim_runs(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[dict[str, Any]],
             coord: Sequence[int], *, what: str = "tensor") -> list[Runs]:
    """Per tensor dim, the global indices that mesh coordinate ``coord`` holds, in local order, as
    ``(global_start, length)`` runs (cost grows with the number of runs, not with the dim's size)."""
    ndim = len(shape)
    if len(placements) != len(mesh_shape) or len(coord) != len(mesh_shape):
        raise TopologyError(f"{what}: {len(placements)} placements for a {len(mesh_shape)}-d mesh")
    out: list[Runs] = [[(0, int(s))] if int(s) else [] for s in shape]
    for mesh_dim, p in enumerate(placements):
        kind = p["type"]
        if kind == "replicate":
            continue
        d = _norm_dim(p["dim"], ndim, what)
        n, c = int(mesh_shape[mesh_dim]), int(coord[mesh_dim])
        if kind == "shard":
            out[d] = _chunk_runs(out[d], n, c)
        else:
            sf = int(p["split_factor"])
            out[d] = _merge([r for k in range(sf) for r in _chunk_runs(_chunk_runs(out[d], sf, k), n, c)])
    return [_merge(r) for r in out]


def dim_indices(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[dict[str, Any]],
                coord: Sequence[int], *, what: str = "tensor") -> list[list[int]]:
    """Per tensor dim, the global indices that mesh coordinate ``coord`` holds, in local order."""
    return [[i for g, n in rs for i in range(g, g + n)]
            for rs in dim_runs(shape, mesh_shape, placements, coord, what=what)]


def local_shape(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[dict[str, Any]],
                coord: Sequence[int]) -> tuple[int, ...]:
    """The shape of the local shard at ``coord``."""
    return tuple(sum(n for _, n in rs) for rs in dim_runs(shape, mesh_shape, placements, coord))


def runs(indices: Sequence[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs of a local index list: ``(global_start, local_start, length)``."""
    out: list[tuple[int, int, int]] = []
    for local, g in enumerate(indices):
        if out and out[-1][0] + out[-1][2] == g:
            gs, ls, n = out[-1]
            out[-1] = (gs, ls, n + 1)
        else:
            out.append((g, local, 1))
    return out


def _with_local(rs: Runs) -> list[tuple[int, int, int]]:
    out, pos = [], 0
    for g, n in rs:
        out.append((g, pos, n))
        pos += n
    return out


@dataclass(frozen=True)
class Region:
    """One box of a local shard: ``global_box`` in the logical tensor, ``local_box`` in the local tensor."""

    global_box: tuple[tuple[int, int], ...]
    local_box: tuple[tuple[int, int], ...]

    @property
    def offset(self) -> tuple[int, ...]:
        return tuple(lo for lo, _ in self.global_box)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.global_box)

    def local_slices(self) -> tuple[slice, ...]:
        return tuple(slice(lo, hi) for lo, hi in self.local_box)

    def global_slices(self) -> tuple[slice, ...]:
        return tuple(slice(lo, hi) for lo, hi in self.global_box)


def local_regions(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[dict[str, Any]],
                  coord: Sequence[int], *, what: str = "tensor") -> list[Region]:
    """The boxes of the local shard at ``coord`` (empty if it holds nothing); a 0-d tensor is one empty box."""
    per_dim = [_with_local(rs) for rs in dim_runs(shape, mesh_shape, placements, coord, what=what)]
    if any(not r for r in per_dim):
        return []
    out = []
    for combo in itertools.product(*per_dim):
        out.append(Region(tuple((g, g + n) for g, _, n in combo), tuple((ls, ls + n) for _, ls, n in combo)))
    return out


def is_writer_coord(placements: Sequence[dict[str, Any]], coord: Sequence[int]) -> bool:
    """Whether ``coord`` writes its shard: index 0 on every mesh dim that replicates the tensor."""
    return all(c == 0 for p, c in zip(placements, coord) if p["type"] == "replicate")


def split_points(shape: Sequence[int], mesh_shape: Sequence[int],
                 placements: Sequence[dict[str, Any]]) -> dict[int, list[int]]:
    """Per tensor dim, every global coordinate where some rank's run starts or ends (chunk boundaries)."""
    sharding = [i for i, p in enumerate(placements) if p["type"] != "replicate"]
    points: dict[int, set[int]] = {}
    ranges = [range(int(mesh_shape[i])) if i in sharding else range(1) for i in range(len(mesh_shape))]
    for coord in itertools.product(*ranges):
        for d, rs in enumerate(dim_runs(shape, mesh_shape, placements, coord)):
            for g, n in rs:
                for p in (g, g + n):
                    if 0 < p < shape[d]:
                        points.setdefault(d, set()).add(p)
    return {d: sorted(v) for d, v in points.items()}


def all_coords(mesh_shape: Iterable[int]) -> Iterable[tuple[int, ...]]:
    """Every coordinate of a mesh, row-major (the order of its ranks)."""
    return itertools.product(*(range(int(n)) for n in mesh_shape))


def target_placements(saved: dict[str, Any] | None, mesh_shape: Sequence[int], mesh_dims: Sequence[str],
                      *, what: str = "tensor") -> list[dict[str, Any]]:
    """The placements a tensor saved with ``saved`` (a ``dtensor`` pattern, or None for a plain tensor)
    gets on another mesh when the job keeps its parallelism recipe and changes the degrees (the usual
    resume: FSDP 4 -> 2, TP x FSDP 2x2 -> 1x2): each target mesh dim takes the saved placement of the
    mesh dim with the same name (matched by position when neither mesh names its dims), a dim the saving
    mesh lacks replicates, and a ``strided_shard``'s split factor becomes the product of the target sizes
    of the later mesh dims that shard the same tensor dim (1: a plain ``shard``). A plain tensor (or any
    other pattern) is replicated: every rank holds it whole."""
    n = len(mesh_shape)
    if saved is None or saved.get("kind") != "dtensor":
        return [{"type": "replicate"}] * n
    placements = list(saved.get("placements", ()))
    src_dims = list(saved.get("mesh", {}).get("dims") or ())
    if src_dims and mesh_dims:
        by_name = dict(zip(src_dims, placements))
        chosen = [dict(by_name.get(d, {"type": "replicate"})) for d in mesh_dims]
    elif not src_dims and not mesh_dims and len(placements) == n:
        chosen = [dict(p) for p in placements]
    else:
        raise TopologyError(f"{what}: saved on mesh dims {src_dims or 'unnamed'} ({len(placements)} dims); the target "
                            f"mesh {list(mesh_dims) or 'unnamed'} ({n} dims) must name its dims like the saving mesh "
                            "(or both leave them unnamed with the same number of dims)")
    out = []
    for i, p in enumerate(chosen):
        if p["type"] == "strided_shard":
            sf = 1
            for j in range(i + 1, n):
                if chosen[j]["type"] in ("shard", "strided_shard") and chosen[j]["dim"] == p["dim"]:
                    sf *= int(mesh_shape[j])
            p = {"type": "shard", "dim": p["dim"]} if sf == 1 else {**p, "split_factor": sf}
        out.append(p)
    return out


def coord_of(rank: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The mesh coordinate of ``rank`` (row-major, as ``init_device_mesh`` lays ranks out)."""
    out = []
    for n in reversed([int(x) for x in mesh_shape]):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))
