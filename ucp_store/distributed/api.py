"""``save`` / ``load`` / ``verify`` of live DTensor / FSDP2 / TP state dicts, on every rank, into any mesh.

The calls mirror ``torch.distributed.checkpoint``: every rank passes the nested dict that
``get_state_dict(model, optimizer)`` returns. Each tensor becomes one logical Zarr array (its global
shape, whatever mesh holds it); the DTensor's mesh and placements go into the catalog as a ``dtensor``
pattern.

Save, on every rank:
1. flatten the dict (``statedict.py``) and, per tensor, compute the boxes its local shard covers
   (``layout.py``: ``Shard``, uneven ``Shard``, ``_StridedShard``, ``Replicate``, 2-D meshes);
2. planning, on a gloo group with a bounded timeout: every rank's (key, shape, dtype, boxes) of its
   DTensors and a content digest of every plain tensor and value go to the coordinator (JSON bytes), which
   checks the ranks hold the same DTensors, spreads every box over the ranks holding it by bytes (replicas:
   ``Replicate`` mesh dims, the same DTensor on sibling sub-meshes, plain tensors equal on every rank),
   and scatters to each rank only its share; plain tensors and values that differ across ranks are
   per-rank state (``perrank.py``: stored per distinct content, keyed by rank and mesh coordinates,
   restored on load by policy). The plan is cached per layout: a save of the same layout runs no planning
   collective (its digests are checked at the commit's digest gather);
3. stage the boxes it writes to host memory (device tensors are copied to host, pinned buffers when
   asynchronous) and write them with ``CheckpointWriter.write_region`` into the pending version;
4. rank 0 commits after every rank's arrays are durable (``ucp_store.distributed.commit``); on an error
   anywhere, every rank raises and nothing is listed.

Load, on every rank: each rank reads only the chunks that intersect the boxes of its live DTensors
(from their own placements and mesh, whatever the saving mesh was) and copies them in place. Then one
collective makes every rank raise if any rank failed, so no rank trains on while another stopped.

Without a process group (or with a world of one) everything runs locally with no collective.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ucp_store import dtypes
from ucp_store._killpoints import killpoint
from ucp_store.distributed import layout as lay
from ucp_store.distributed.commit import collective_errors
from ucp_store.distributed.inflight import wait
from ucp_store.distributed.statedict import Leaf, flatten, from_json, json_value, path_text, set_leaf
from ucp_store.errors import (
    ConfigurationError,
    ReferenceNotFound,
    ShapeMismatch,
    StalePlanError,
    TopologyError,
    UcpError,
)

__all__ = ["STATE_DICT_OBJECT", "LoadResult", "Mismatch", "VerifyReport", "load", "save", "verify"]

#: name of the JSON object holding the state dict's structure (tensor keys and non-tensor values by path)
STATE_DICT_OBJECT = "dist.state_dict"


# ----------------------------------------------------------------------------------------- context
class Ctx:
    """Process-group facts for one call: rank, world size and the bounded-timeout gloo group."""

    def __init__(self, group=None, *, tag: str = "control", timeout: float | None = None):
        import torch.distributed as dist

        self.dist = None
        self.rank, self.world, self.group = 0, 1, None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            from ucp_store.distributed.commit import control_group

            self.dist = dist
            self.group = control_group(group, timeout=timeout, tag=tag)
            self.rank = dist.get_rank(self.group)
            self.world = dist.get_world_size(self.group)

    def gather(self, obj: Any, what: str = "collective") -> list:
        """Every rank's ``obj`` (a JSON value: tuples come back as lists), by rank, on every rank: for small
        values alone (each rank receives all of them); :meth:`agree` and :meth:`settle` send the coordinator's
        decision instead. JSON bytes, never a pickle."""
        return self.agree(obj, lambda everyone: everyone, what)

    def agree(self, obj: Any, decide, what: str = "collective") -> Any:
        """``decide(every rank's obj)``, run by the coordinator, on every rank (``commit.agree``: one gather of
        JSON bytes, one broadcast of the answer, on the bounded-timeout control group)."""
        if self.dist is None:
            return decide([obj])
        from ucp_store.distributed.commit import agree

        with collective_errors(what):
            return agree(obj, decide, self.group)

    def settle(self, obj: Any, decide, what: str = "collective") -> Any:
        """``decide(every rank's obj)[rank]``: the coordinator decides one answer per rank and each rank
        receives only its own (``commit.settle``: one gather, one scatter of JSON bytes)."""
        if self.dist is None:
            return decide([obj])[0]
        from ucp_store.distributed.commit import settle

        with collective_errors(what):
            return settle(obj, decide, self.group)

    def raise_if_any_failed(self, error: BaseException | None, what: str) -> None:
        """A collective: every rank raises when any rank failed (naming each failing rank)."""
        if self.dist is None:
            if error is not None:
                raise error
            return
        from ucp_store.distributed.commit import gather_errors

        with collective_errors(what):
            failures = gather_errors(error, self.group)
        raise_failures(failures, error, what)


def raise_failures(failures: list, error: BaseException | None, what: str) -> None:
    """Raise when ``failures`` (``(rank, message)`` of every failed rank, the same on every rank) is not empty:
    this rank's own ``error`` in its own class, else an error naming each failing rank."""
    if not failures:
        return
    if error is not None:
        raise error
    detail = "; ".join(f"rank {r}: {msg}" for r, msg in failures)
    raise UcpError(f"{what} failed on {len(failures)} rank(s): {detail}")


# ----------------------------------------------------------------------------------------- tensors
@dataclass
class _Tensor:
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


def _is_dtensor(t: Any) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists (and importing it
    return mod is not None and isinstance(t, mod.DTensor)  # costs seconds on the caller's clock)


def _describe(leaf: Leaf) -> _Tensor:
    t = leaf.value
    what = f"state dict entry {path_text(leaf.path)!r}"
    if _is_dtensor(t):
        mesh = t.device_mesh
        coord = mesh.get_coordinate()
        placements = [lay.placement_json(p) for p in t.placements]
        shape = tuple(int(s) for s in t.shape)
        local = t.to_local()
        mesh_shape = lay.mesh_facts(mesh).shape
        if coord is None:  # this rank is not part of the DTensor's mesh: it holds nothing
            return _Tensor(leaf, shape, dtypes.zarr_name(local.dtype, what=what), local, [], False)
        regions, expected, writer, points = _geometry(shape, mesh_shape, placements, tuple(coord), what)
        if tuple(local.shape) != expected:
            raise TopologyError(f"{what}: the local shard has shape {tuple(local.shape)} but placements "
                                f"{list(t.placements)} on mesh {list(mesh_shape)} at {tuple(coord)} give {expected}; "
                                "this placement layout is not supported")
        pattern: dict[str, Any] = {"kind": "dtensor", "mesh": {"shape": list(mesh_shape)}, "placements": placements}
        if mesh.mesh_dim_names:
            pattern["mesh"]["dims"] = list(mesh.mesh_dim_names)
        return _Tensor(leaf, shape, dtypes.zarr_name(local.dtype, what=what), local, list(regions), writer, pattern,
                       points)
    shape = tuple(int(s) for s in t.shape)
    full = lay.Region(tuple((0, n) for n in shape), tuple((0, n) for n in shape))
    return _Tensor(leaf, shape, dtypes.zarr_name(t.dtype, what=what), t, [full] if t.numel() or not shape else [],
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


def _host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy-or-view of ``t`` (device tensors are copied to CPU)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


# ----------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class WriteItem:
    """One box this rank writes (plain data: it crosses to a background writer process)."""

    name: str
    state: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    pattern: dict | None
    boundaries: dict
    origin: bool


@dataclass
class SavePlan:
    items: list[WriteItem]
    sources: list[tuple[torch.Tensor, tuple]]  # per item: (local tensor, local box slices); () for 0-d
    objects: list[dict]
    provenance: dict
    #: the per-rank manifest (``rankstate.PerRankManifest`` JSON: saving topology and per-rank keys)
    per_rank: dict | None = None
    #: (object name, value) of the per-rank contents this rank stores (tensors as host copies)
    rank_objects: list[tuple[str, Any]] = field(default_factory=list)
    #: a cached plan's check (this rank's layout held, its digests), sent with the commit's digest gather
    check: dict | None = None
    #: the identity of the state dict's tensors this cached plan was built over (``_identity``), or None
    ident: tuple | None = None

    def signature(self) -> tuple:
        """What the staging buffers depend on: the items and their dtypes."""
        return tuple((it, src.dtype, str(src.device)) for it, (src, _) in zip(self.items, self.sources))


def _describe_leaves(leaves, ctx: Ctx, mesh) -> tuple[list[_Tensor], dict, dict, list, dict]:
    """This rank's DTensors (with their meshes), plain tensors and JSON values (each with its content digest)."""
    from ucp_store.distributed import perrank

    dtensors: list[_Tensor] = []
    meshes: dict[str, dict] = {}
    plain: dict[tuple, _Tensor] = {}
    for leaf in leaves:
        if leaf.is_tensor and _is_dtensor(leaf.value):
            t = _describe(leaf)
            dtensors.append(t)
            if t.pattern is not None:
                m = t.leaf.value.device_mesh
                ranks = lay.mesh_facts(m).ranks
                meshes.setdefault(repr(ranks), {"shape": t.pattern["mesh"]["shape"],
                                                "dims": list(m.mesh_dim_names or ()), "ranks": ranks})
        elif leaf.is_tensor:
            plain[leaf.path] = _describe(leaf)
    digests, values = _contents(leaves, ctx)
    topology = perrank.live_topology(leaves, mesh, ctx, what="save")
    return dtensors, meshes, plain, digests, {"values": values, "topology": topology}


def _contents(leaves, ctx: Ctx) -> tuple[list[tuple[tuple, str, bytes]], dict[tuple, Any]]:
    """The content digest of every plain tensor and JSON value (in leaf order), and the values."""
    from ucp_store.distributed import perrank

    values: dict[tuple, Any] = {}
    digests: list[tuple[tuple, str, bytes]] = []
    for leaf in leaves:
        if leaf.is_tensor:
            if not _is_dtensor(leaf.value):  # one rank alone has nothing to compare: no digest
                digests.append((leaf.path, "tensor", perrank.digest_tensor(leaf.value) if ctx.world > 1 else b""))
        else:
            values[leaf.path] = json_value(leaf)
            digests.append((leaf.path, "value", perrank.digest_value(values[leaf.path]) if ctx.world > 1 else b""))
    return digests, values


def plan_save(state_dict: Any, ctx: Ctx, mesh=None, *, cache: bool = False) -> SavePlan:
    """Flatten, describe, and decide who writes what.

    First save of a layout (or after any change of it): every rank sends its proposal (the boxes of its
    DTensors, its plain tensors and a content digest of every plain tensor and value: JSON bytes) to the
    coordinator, which checks them, decides (a leaf whose digest differs across ranks, or that some rank
    lacks, is stored per rank: ``perrank.decide``), spreads every box over the ranks holding it by bytes,
    and scatters to each rank only its share. The plan is cached per layout (``_layout_key``): a later save
    of the same layout runs no planning collective; its digests ride the commit's digest gather, where a
    changed decision (or a rank whose layout changed) makes every rank abort and plan afresh
    (``StalePlanError`` on every rank, retried by ``save``; ``async_save``, which commits where it cannot
    retry, settles the check before it begins: in its writer thread, ``settle_cached_plan``, or in the call,
    ``confirm_cached_plan``). ``cache=False`` always plans, and leaves the plan cached."""
    error: BaseException | None = None
    proposal: dict = {"error": None}
    leaves: list[Leaf] = []
    dtensors: list[_Tensor] = []
    plain: dict[tuple, _Tensor] = {}
    meshes: dict = {}
    extra: dict = {"values": {}}
    digests: list = []
    key = ""
    ident = None
    try:
        leaves = flatten(state_dict)
        ident = _identity(leaves, mesh) if cache and ctx.dist is not None else None
        memo = _DESCRIBED.get(_group_key(ctx)) if ident is not None else None
        if memo is not None and memo["ident"] == ident:
            # the same tensor objects over the same storage as the last call: their description stands, only
            # the contents (plain tensors' digests, values) are this call's
            dtensors, meshes, plain, key = memo["dtensors"], memo["meshes"], memo["plain"], memo["key"]
            digests, values = _contents(leaves, ctx)
            extra = {"values": values, "topology": memo["topology"]}
        else:
            dtensors, meshes, plain, digests, extra = _describe_leaves(leaves, ctx, mesh)
            key = _layout_key(leaves, dtensors, plain, extra["topology"].to_json(), ctx.world)
            if ident is not None:
                _DESCRIBED[_group_key(ctx)] = {"ident": ident, "dtensors": dtensors, "meshes": meshes, "plain": plain,
                                               "key": key, "topology": extra["topology"]}
    except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
        error = exc
    cached = _PLANS.get(_group_key(ctx)) if ctx.dist is not None and cache else None
    if cached is not None:  # every rank of the group holds one: the same collectives on every rank
        hex_digests = [[list(p), k, d.hex()] for p, k, d in digests]
        if error is not None or cached["key"] != key:  # every rank aborts; the fresh planning reports errors
            return SavePlan([], [], [], {}, None, [], check={"key_ok": False, "digests": hex_digests,
                                                                  "cache": cached})
        plan = _build_plan(leaves, dtensors, plain, extra, meshes, cached["share"], cached.get("coord"), ctx)
        plan.check = {"key_ok": True, "digests": hex_digests, "cache": cached}
        plan.ident = ident
        return plan
    if error is None:
        proposal = {"error": None, "topology": extra["topology"].to_json(),
                    "dtensors": [[list(t.key), list(t.shape), t.dtype, t.local.element_size(),
                                  [[list(b) for b in r.global_box] for r in t.regions]] for t in dtensors],
                    "plain": [[list(p), list(t.key), list(t.shape), t.local.element_size()] for p, t in plain.items()],
                    "digests": [[list(p), k, d.hex()] for p, k, d in digests]}
    else:
        proposal = {"error": f"{type(error).__name__}: {error}"}
    share, coord_info = _exchange(proposal, ctx)
    if error is not None:
        raise error
    if "error" in share:
        from ucp_store.distributed.coord import raise_remote

        raise_remote(share["error"], "save (planning)")
    plan = _build_plan(leaves, dtensors, plain, extra, meshes, share, coord_info, ctx)
    if ctx.dist is not None:
        _PLANS[_group_key(ctx)] = {"key": key, "share": share, "coord": coord_info,
                                   "topology": extra["topology"].to_json()}
    return plan


#: the last plan per control group (issue 27 2b), reused while the state dict's layout holds
_PLANS: dict[Any, dict] = {}
#: per control group, the last cached-plan call's description of the state dict's tensors (``_identity``)
_DESCRIBED: dict[Any, dict] = {}


def _identity(leaves, mesh) -> tuple:
    """When a description of the state dict's tensors can be reused: every leaf's path, and per tensor where
    its (local shard's) data lives, its shape, strides, dtype and device, and for a DTensor its mesh, placements
    and global shape. ``get_state_dict`` hands out new tensor objects over the same storage each call, so
    storage, not the object, is what must match; a swap (``p.data = x``, a reload that assigns) describes
    afresh. The description holds views of the storage it describes, so no other tensor can take its address
    while it is kept."""
    out: list = [id(mesh)]
    for leaf in leaves:
        v = leaf.value
        if not leaf.is_tensor:
            out.append(leaf.path)
            continue
        local = getattr(v, "_local_tensor", None)  # a DTensor's shard without to_local()'s autograd call
        dt = (id(v.device_mesh), tuple(v.placements), tuple(v.shape)) if local is not None else None
        t = v if local is None else local
        out.append((leaf.path, leaf.key, dt, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device))
    return tuple(out)


def _group_key(ctx: Ctx) -> Any:
    """The plan cache's key: the group's ranks, so that the caller's control group and an async save's own
    group (the same ranks, another tag) share one plan."""
    import torch.distributed as dist

    try:
        return ("ranks", tuple(dist.get_process_group_ranks(ctx.group)))
    except Exception:  # noqa: BLE001 - a group torch cannot list: the group itself
        try:
            hash(ctx.group)
            return ctx.group
        except TypeError:
            return id(ctx.group)


def forget_plan(ctx: Ctx, *, plan: bool = True, description: bool = False) -> None:
    """Drop the plan cached for ``ctx``'s ranks (every rank does, so the next save plans afresh on all), and
    with ``description`` the description of the last state dict (it holds that state's tensors)."""
    if plan:
        _PLANS.pop(_group_key(ctx), None)
    if description:
        _DESCRIBED.pop(_group_key(ctx), None)


def _layout_key(leaves, dtensors: list[_Tensor], plain: dict, topology: dict, world: int) -> str:
    """What a plan depends on besides contents: keys, paths, shapes, dtypes, placements, meshes, world."""
    import hashlib
    import json

    by_path = {t.leaf.path: t for t in dtensors}
    parts: list = [world, topology]
    for leaf in leaves:
        t = by_path.get(leaf.path) or plain.get(leaf.path)
        if t is None:
            parts.append([list(leaf.path)])
            continue
        mesh_ranks = lay.mesh_facts(t.leaf.value.device_mesh).ranks if t.pattern is not None else None
        parts.append([list(leaf.path), list(t.key), list(t.shape), t.dtype, t.pattern, mesh_ranks,
                      [[list(b) for b in r.global_box] for r in t.regions]])
    return hashlib.blake2b(json.dumps(parts, default=str).encode(), digest_size=16).hexdigest()


def _exchange(proposal: dict, ctx: Ctx) -> tuple[dict, dict | None]:
    """Proposals to the coordinator, each rank's share back (JSON bytes, length first; no pickle)."""
    if ctx.dist is None:
        shares, info = _coordinate([proposal], ctx.world)
        return shares[0], info
    from ucp_store.distributed import coord

    with collective_errors("save (planning)"):
        parts = coord.gather_bytes(coord.encode(proposal), ctx.group)
        encoded: list[bytes] | None = None
        info = None
        if parts is not None:
            decided, info = _coordinate([coord.decode(p) for p in parts], ctx.world)
            encoded = [coord.encode(s) for s in decided]
        mine = coord.decode(coord.scatter_bytes(encoded, ctx.group))
    return mine, info


def _coordinate(everyone: list[dict], world: int) -> tuple[list[dict], dict | None]:
    """The coordinator's decision from every rank's proposal: each rank's share (its boxes, the empty arrays
    it records, the per-rank objects it stores) and, for itself, the manifest. A failure on any rank, or
    a check that fails here, becomes an error share for every rank."""
    from ucp_store.distributed.coord import error_payload

    failed = [(r, p["error"]) for r, p in enumerate(everyone) if p.get("error")]
    if failed:
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        err = {"error": f"save (planning) failed on {len(failed)} rank(s): {detail}", "kind": "UcpError",
               "message": f"save (planning) failed on {len(failed)} rank(s): {detail}"}
        return [{"error": err} for _ in everyone], None
    try:
        return _decide_all(everyone, world)
    except UcpError as exc:
        if world == 1:
            raise
        return [{"error": error_payload(exc)} for _ in everyone], None


def _decide_all(everyone: list[dict], world: int) -> tuple[list[dict], dict]:
    """Check every rank's proposal, decide per-rank state, and spread every box over its holders by bytes."""
    from ucp_store.distributed import perrank
    from ucp_store.distributed.rankstate import RankTopology, object_name

    topos = [p["topology"] for p in everyone]
    if any(t != topos[0] for t in topos):
        raise TopologyError(f"save: the ranks see different topologies ({', '.join(map(str, topos[:4]))}); pass the "
                            "same mesh= on every rank")
    holders, sizes, empty = _dtensor_holders(everyone)
    decision = perrank.decide([[(tuple(p), k, bytes.fromhex(d)) for p, k, d in part["digests"]] for part in everyone],
                              RankTopology.from_json(topos[0]), 0)
    dkeys = {tuple(d[0]) for d in everyone[0]["dtensors"]}
    for part in everyone:
        for path, key, _, _ in part["plain"]:
            if tuple(path) in decision.index and tuple(key) in dkeys:
                raise ConfigurationError(f"save: state dict entry {path_text(tuple(path))!r} (tensor {key[0]!r} state "
                                         f"{key[1]!r}) collides with a DTensor's catalog key on another rank")
    for path, key, shape, itemsize in everyone[0]["plain"]:
        if tuple(path) not in decision.replicated:
            continue
        numel = int(np.prod(shape)) if shape else 1
        if not numel:
            empty.setdefault(tuple(key), 0)
            continue
        kb = (tuple(key), tuple((0, int(n)) for n in shape))
        holders[kb] = list(range(world))  # equal on every rank: any of them may write it
        sizes[kb] = numel * int(itemsize)
    shares: list[dict] = [{"boxes": [], "empty": [], "writes": []} for _ in range(world)]
    load = [0] * world
    for kb in sorted(holders, key=lambda kb: (-sizes[kb], repr(kb))):  # largest first, onto the least-loaded
        r = min(holders[kb], key=lambda h: (load[h], h))
        load[r] += sizes[kb]
        shares[r]["boxes"].append([list(kb[0]), [list(b) for b in kb[1]]])
    for key, r in empty.items():
        shares[r]["empty"].append(list(key))
    for i, k in enumerate(decision.manifest.keys):
        for e in k.entries:
            if e.object == object_name(e.rank, i):  # the lowest holder of each distinct content stores it
                shares[e.rank]["writes"].append([e.object, list(k.path)])
    sig = _decision_sig(decision.replicated, decision.manifest.to_json())
    for s in shares:
        s["sig"] = sig
    return shares, {"index": [[list(p), i] for p, i in decision.index.items()],
                    "manifest": decision.manifest.to_json()}


def _decision_sig(replicated, manifest: dict) -> str:
    import hashlib
    import json

    text = json.dumps([sorted(json.dumps(list(p)) for p in replicated), manifest], sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _dtensor_holders(everyone: list[dict]) -> tuple[dict, dict, dict]:
    """Every rank holds the same DTensors with the same shapes; the ranks holding each box (rank order),
    each box's bytes, and the first holder of each empty DTensor."""
    ref = {tuple(d[0]): d for d in everyone[0]["dtensors"]}
    holders: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    empty: dict[tuple, int] = {}
    for r, part in enumerate(everyone):
        keys = {tuple(d[0]) for d in part["dtensors"]}
        if keys != set(ref):
            missing, extra = sorted(set(ref) - keys)[:5], sorted(keys - set(ref))[:5]
            raise ConfigurationError(f"save: rank {r} holds different DTensors than rank 0 (rank {r} lacks "
                                     f"{missing or 'none'}, has extra {extra or 'none'}); every rank must pass the "
                                     "same DTensors (plain tensors and values may differ: they are stored per rank)")
        for key, shape, dtype, itemsize, boxes in part["dtensors"]:
            key = tuple(key)
            _, ref_shape, ref_dtype, _, _ = ref[key]
            if list(shape) != list(ref_shape) or dtype != ref_dtype:
                raise ShapeMismatch(f"save: tensor {key[0]!r} state {key[1]!r} is {dtype}{list(shape)} on rank {r} "
                                    f"but {ref_dtype}{list(ref_shape)} on rank 0")
            numel = int(np.prod(shape)) if shape else 1
            if not numel:
                empty.setdefault(key, r)
                continue
            for box in boxes:
                kb = (key, tuple(tuple(b) for b in box))
                holders.setdefault(kb, []).append(r)
                sizes[kb] = int(np.prod([hi - lo for lo, hi in kb[1]])) * int(itemsize)
    covered: dict[tuple, int] = {}
    for key, box in holders:
        covered[key] = covered.get(key, 0) + int(np.prod([hi - lo for lo, hi in box]))
    for key, (_, shape, _, _, _) in ref.items():
        numel = int(np.prod(shape)) if shape else 1
        if numel and covered.get(key, 0) != numel:
            raise TopologyError(f"save: tensor {key[0]!r} state {key[1]!r}: the ranks' shards cover "
                                f"{covered.get(key, 0)} of {numel} elements of shape {list(shape)}; the placements "
                                "do not tile the tensor")
    return holders, sizes, empty


def _boxes(leaves, dtensors: list[_Tensor], plain: dict, share: dict) -> tuple[list[WriteItem], list[tuple]]:
    """The boxes this rank writes (in the state dict's order) and where each comes from. A function of the
    tensors' description and the share alone: a call over the same tensors and plan reuses the last answer."""
    memo = _BOXES.get(id(share))
    if memo is not None and memo[0] is share and memo[1] is dtensors and memo[2] is plain:
        return memo[3], memo[4]
    mine = {(tuple(k), tuple(tuple(b) for b in box)) for k, box in share["boxes"]}
    empty = {tuple(k) for k in share["empty"]}
    items: list[WriteItem] = []
    sources: list[tuple[torch.Tensor, tuple]] = []
    by_path = {t.leaf.path: t for t in dtensors}
    by_path.update(plain)
    for leaf in leaves:
        t = by_path.get(leaf.path)
        if t is None:
            continue
        if t.key in empty:
            items.append(WriteItem(*t.key, t.shape, (0,) * len(t.shape), t.pattern, t.boundaries, True))
            sources.append((t.local, tuple(slice(0, 0) for _ in t.shape)))
            empty.discard(t.key)
            continue
        for region in t.regions:
            if (t.key, region.global_box) in mine:
                origin = all(lo == 0 for lo, _ in region.global_box)
                items.append(WriteItem(*t.key, t.shape, region.offset, t.pattern, t.boundaries, origin))
                sources.append((t.local, region.local_slices()))
    _BOXES.clear()  # the last one only: it holds views of the tensors it describes
    _BOXES[id(share)] = (share, dtensors, plain, items, sources)
    return items, sources


#: the last ``_boxes`` answer, by its share's id (the entry holds the share, so the id stays its own)
_BOXES: dict[int, tuple] = {}


def _build_plan(leaves, dtensors: list[_Tensor], plain: dict, extra: dict, meshes: dict, share: dict,
                coord_info: dict | None, ctx: Ctx) -> SavePlan:
    """This rank's plan from its share: the boxes it writes (in the state dict's order), the empty arrays it
    records, its per-rank objects; on the coordinator also the manifest (values are this save's)."""
    from ucp_store.distributed.rankstate import PerRankManifest

    items, sources = _boxes(leaves, dtensors, plain, share)
    rank_objects = []
    for name, path in share["writes"]:
        path = tuple(path)
        rank_objects.append((name, _host(plain[path].local).clone() if path in plain else extra["values"][path]))
    objects: list[dict] = []
    per_rank: dict | None = None
    provenance: dict = {}
    # elsewhere than on the coordinator (which writes the manifest) no per-rank index is known: the entries
    # then only name each tensor's path (async_save's eager patterns match them)
    index = {tuple(p): i for p, i in coord_info["index"]} if coord_info is not None else {}
    for leaf in leaves:
        i = index.get(leaf.path)
        if i is not None:
            objects.append({"path": list(leaf.path), "per_rank": i})
        elif leaf.is_tensor:
            objects.append({"path": list(leaf.path), "tensor": list(leaf.key)})  # type: ignore[arg-type]
        else:
            objects.append({"path": list(leaf.path), "value": extra["values"][leaf.path]})
    if coord_info is not None:
        per_rank = PerRankManifest.from_json(coord_info["manifest"]).to_json()
        provenance = {"source_kind": "dist", "source_path": None,
                      "extra": {"dist": {"world_size": ctx.world, "meshes": list(meshes.values()),
                                         "topology": per_rank["topology"],
                                         "per_rank_keys": [k["text"] for k in per_rank["keys"]]}}}
    return SavePlan(items, sources, objects, provenance, per_rank, rank_objects)


def confirm_cached_plan(plan: SavePlan, state_dict: Any, ctx: Ctx, mesh=None) -> SavePlan:
    """``plan`` with its cache check settled now, before anything is written: every rank's check (did its
    layout hold, its content digests: JSON bytes) goes to the coordinator, which decides with
    ``_plan_still_holds`` and broadcasts one byte. When the plan no longer holds, every rank drops the cache
    and plans afresh. For ``async_save``: a save that commits in the background cannot retry, and four small
    collectives (no per-box proposals) are what its call then waits for."""
    if settle_cached_plan(plan, ctx, "async save (the cached plan's check)") == "holds":
        plan.check = None  # settled: the commit carries no second check
        return plan
    _PLANS.pop(_group_key(ctx), None)
    return plan_save(state_dict, ctx, mesh, cache=True)  # no plan cached on any rank: plans afresh


def settle_cached_plan(plan: SavePlan, ctx: Ctx, what: str = "async save (the cached plan's check)") -> str:
    """The verdict on a cached plan, the same on every rank, from one round on ``ctx`` (in an async save's
    writer thread on its own group, or in the call: ``confirm_cached_plan``): ``"holds"``, ``"replan"``
    (every rank's layout changed: each can plan afresh from what it took at the call) or ``"stale"`` (the
    layout changed on some ranks only, or which entries are equal on every rank changed). Four small
    collectives; a plan made afresh (no check) holds without any."""
    if plan.check is None or ctx.dist is None:
        return "holds"
    from ucp_store.distributed import coord

    mine = coord.encode({k: plan.check[k] for k in ("key_ok", "digests")})
    with collective_errors(what):
        parts = coord.gather_bytes(mine, ctx.group)
        verdict = None
        if parts is not None:
            checks = [coord.decode(p) for p in parts]
            verdict = (b"r" if not any(c["key_ok"] for c in checks) else
                       b"h" if _plan_still_holds(plan.check, checks) else b"s")
        answer = coord.broadcast_bytes(verdict, ctx.group)
    return {b"h": "holds", b"r": "replan", b"s": "stale"}[answer]


def _plan_still_holds(check: dict, checks: list[dict]) -> bool:
    """After a cached plan's writes, from every rank's check: did every rank's layout hold, and does this
    save's content decision (which leaves are equal on every rank, and which ranks share contents) equal
    the cached one? The same answer on every rank (the same inputs)."""
    from ucp_store.distributed import perrank
    from ucp_store.distributed.rankstate import RankTopology

    if not all(c["key_ok"] for c in checks):
        return False
    cached = check["cache"]
    decision = perrank.decide([[(tuple(p), k, bytes.fromhex(d)) for p, k, d in c["digests"]] for c in checks],
                              RankTopology.from_json(cached["topology"]), 0)
    return _decision_sig(decision.replicated, decision.manifest.to_json()) == cached["share"]["sig"]


# ----------------------------------------------------------------------------------------- save
def resolve_store(store, *, create: bool):
    from ucp_store.store import Store, open_store

    if isinstance(store, Store):
        return store
    if store is None or isinstance(store, (str, os.PathLike)):
        return open_store(None if store is None else os.fspath(store), create=create)
    raise ConfigurationError(f"store must be a URL, a path or a Store, got {type(store).__name__}")


def write_plan(store, plan: SavePlan, staged: list[torch.Tensor], ctx: Ctx, *, run: str, step: int,
                message: str | None, parent: str | None, progress: bool) -> str:
    """Begin/join, write every staged box, rank 0 writes the objects, commit (all ranks or none)."""
    from ucp_store.progress import track

    msg = message or f"ucp_store.distributed.save from {ctx.world} rank(s)"
    if ctx.dist is None and callable(store):
        store = store()
    if ctx.dist is None:
        writer = store.begin(run, step, parent=parent, message=msg, provenance=plan.provenance)
    else:
        from ucp_store.distributed.commit import distributed_begin

        # distributed_begin raises on every rank when rank 0 cannot begin or a rank cannot join
        with collective_errors(f"save of {run}@{step} (begin)"):
            writer = distributed_begin(store, run, step, group=ctx.group, parent=parent, message=msg,
                                       provenance=plan.provenance, straddling=False)  # boxes of whole files
    error = None
    try:
        pairs = list(zip(plan.items, staged))
        writer.open_regions([(it.name, it.state, dtypes.zarr_name(data.dtype, what=it.name), it.shape, it.pattern,
                              it.boundaries) for it, data in pairs])  # every array at once
        for it, data in track(pairs, f"save {run}@{step}", enabled=progress and ctx.rank == 0,
                              weight=lambda pair: pair[1].numel() * pair[1].element_size()):
            writer.write_region(it.name, it.state, data, shape=it.shape, offset=it.offset, pattern=it.pattern,
                                boundaries=it.boundaries, origin=it.origin)
            killpoint("dist.mid_write")
        for name, value in plan.rank_objects:  # the per-rank contents this rank owns
            writer.write_object(name, value)
        if ctx.rank == 0:
            manifest: dict[str, Any] = {"format": 1, "leaves": plan.objects}
            if plan.per_rank is not None:
                manifest.update(format=2, per_rank=plan.per_rank)
            writer.write_object(STATE_DICT_OBJECT, manifest)
        writer.drain()  # a failed write is this rank's error before the vote below (never a hang in a gather)
    except BaseException as exc:  # noqa: BLE001
        error = exc
    if ctx.dist is None:
        if error is not None:
            writer.abort()
            raise error
        try:
            set_region_hashes(writer, [writer.region_digests()])
        except BaseException:
            writer.abort()
            raise
        return writer.commit().id
    from ucp_store.distributed.commit import distributed_commit

    mine = _CommitPart.of(writer, plan, error)
    if mine.error is not None and error is None:
        error = mine.error_exc
    try:  # one round to the coordinator: every rank's outcome, digests and cached-plan check; its answer back
        answer = ctx.settle(mine.to_json(), lambda parts: _decide_commit(plan.check, parts),
                            f"save of {run}@{step} (commit)")
    except BaseException:  # a failed round, or the coordinator's own failure to decide (raised on every rank)
        writer.abort()
        raise
    if answer["failed"]:
        writer.abort()
        if error is not None:
            raise error
        raise UcpError(f"save of {run}@{step} failed on another rank; aborted (nothing listed)")
    if answer["stale"]:
        writer.abort()
        _PLANS.pop(_group_key(ctx), None)
        raise StalePlanError(f"save of {run}@{step}: the state dict's layout or which entries are equal "
                             "on every rank changed since the cached plan; aborted to plan afresh")
    try:
        _apply_hashes(writer, answer)
        with collective_errors(f"save of {run}@{step} (commit)"):
            return distributed_commit(writer, group=ctx.group)
    except UcpError:
        writer.abort()
        raise


@dataclass
class _CommitPart:
    """What one rank sends the coordinator at a multi-rank save's commit (one gather, JSON): its error, the unit
    digests of every array it wrote boxes of, the dtype and shape of the arrays it is origin of (element 0:
    it records their hash), and a cached plan's check."""

    error: str | None
    digests: list  # [name, state, {unit: hex digest} | None]
    origin: list  # [name, state, dtype, shape]
    check: dict | None
    error_exc: BaseException | None = None

    @classmethod
    def of(cls, writer, plan: SavePlan, error: BaseException | None) -> _CommitPart:
        check = None if plan.check is None else {k: plan.check[k] for k in ("key_ok", "digests")}
        if error is not None:
            return cls(f"{type(error).__name__}: {error}", [], [], check)
        try:
            digests = [[k[0], k[1], None if d is None else {str(u): v.hex() for u, v in d.items()}]
                       for k, d in writer.region_digests().items()]
            origin = [[k[0], k[1], writer.shards.sharded[k][2].dtype, list(writer.shards.sharded[k][2].shape)]
                      for k in sorted(writer.shards.origin)]
        except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
            return cls(f"{type(exc).__name__}: {exc}", [], [], check, exc)
        return cls(None, digests, origin, check)

    def to_json(self) -> dict:
        return {"error": self.error, "digests": self.digests, "origin": self.origin, "check": self.check}


def _decide_commit(check: dict | None, parts: list[dict]) -> list[dict]:
    """The coordinator's answer to every rank's :class:`_CommitPart`: whether any rank failed, whether a cached
    plan still holds (``_plan_still_holds``), and to each origin rank the content hashes of its arrays
    (``fmt.chunk_tree_hash``: ``units_hash`` of every rank's unit digests, merged) or, where some unit is
    missing, the merged digests (the origin reads back only the rest). An array that some rank could not
    digest (None) gets neither: its origin reads it back."""
    from ucp_store.io import format as fmt

    world = len(parts)
    if any(p["error"] is not None for p in parts):
        return [{"failed": True, "stale": False}] * world
    if check is not None and not _plan_still_holds(check, [p["check"] or {"key_ok": False} for p in parts]):
        return [{"failed": False, "stale": True}] * world
    merged: dict[tuple[str, str], dict | None] = {}
    for p in parts:
        for name, state, digests in p["digests"]:
            key = (name, state)
            so_far = merged.get(key, {})
            if digests is None or so_far is None:
                merged[key] = None
            elif key in merged:
                so_far.update(digests)
            else:
                merged[key] = dict(digests)
    answers: list[dict] = [{"failed": False, "stale": False, "hashes": [], "digests": []} for _ in parts]
    for rank, p in enumerate(parts):
        for name, state, dtype, shape in p["origin"]:
            hexes = merged.get((name, state))
            if not hexes:
                continue
            digests = {int(u): bytes.fromhex(d) for u, d in hexes.items()}
            h = fmt.units_hash(dtype, tuple(shape), digests)  # fmt.chunk_tree_hash of the array's layout
            if h is not None:
                answers[rank]["hashes"].append([name, state, h])
            else:  # the origin reads back only the units of the content hash that no box held whole
                answers[rank]["digests"].append([name, state, hexes])
    return answers


def _apply_hashes(writer, answer: dict) -> None:
    """The coordinator's hashes (or merged digests) of the arrays this rank is origin of, for ``finish_shards``."""
    for name, state, h in answer["hashes"]:
        writer.set_region_hash(name, state, h)
    for name, state, hexes in answer["digests"]:
        writer.set_chunk_digests(name, state, {int(u): bytes.fromhex(d) for u, d in hexes.items()})


def set_region_hashes(writer, parts: list[dict]) -> None:
    """Combine every rank's chunk digests into each array's content hash (no read-back of what was written).

    An array whose boxes did not fall on whole chunks on some rank (None) keeps the read-back hash."""
    from ucp_store.io import format as fmt

    merged: dict = {}
    for part in parts:
        for key, digests in part.items():
            if digests is None or merged.get(key, {}) is None:
                merged[key] = None
            else:
                merged.setdefault(key, {}).update(digests)
    for key, (_, _, layout, _) in writer.shards.sharded.items():
        digests = merged.get(key)
        if digests:
            h = fmt.chunk_tree_hash(layout, digests)
            if h is not None:
                writer.set_region_hash(key[0], key[1], h)
            else:  # the origin reads back only the units of the content hash that no box held whole
                writer.set_chunk_digests(key[0], key[1], digests)


def open_everywhere(store, create: bool, ctx: Ctx):
    """The store a save writes to. One rank: the opened store. Several: an opener that only the coordinator
    (group rank 0) calls, inside ``distributed_begin``; the other ranks never touch the catalog (they get
    the store's location and settings in begin's one broadcast)."""
    if ctx.dist is None:
        return resolve_store(store, create=create)
    return lambda: resolve_store(store, create=create)


def _stale_opener():
    raise StalePlanError("save: the state dict's layout changed on the coordinator since the cached plan; "
                         "planning afresh")


def save(state_dict: dict, *, store: Any = None, run: str, step: int, message: str | None = None,
         parent: str | None = "auto", group=None, progress: bool = True, create: bool = True, mesh=None) -> str:
    """Save a (sharded) training state dict as ``run@step``; call on every rank. Returns the version id.

    ``state_dict`` is what ``get_state_dict(model, optimizer)`` returns (or any nested dict of DTensors,
    tensors and JSON values). Each rank writes only the boxes it owns; replicated data is written once.
    The version is committed only after every rank's arrays are durable; on an error anywhere every rank
    raises and nothing is listed. ``store`` is a URL, a folder or a ``Store`` (created if missing).

    Per-rank state: a plain tensor or value whose content differs across ranks (RNG states, dataloader
    positions), or that only some ranks hold, is stored per rank (once per distinct content), keyed by the
    rank and its coordinates in ``mesh`` (a ``DeviceMesh``; default: the mesh of the state dict's DTensors
    that spans every rank). Equal contents are stored once. ``load`` restores it by policy."""
    wait()  # an async save in flight commits first
    ctx = Ctx(group)
    for _ in range(2):  # a cached plan that no longer holds is dropped on every rank: the second plans afresh
        plan = plan_save(state_dict, ctx, mesh, cache=True)
        st = open_everywhere(store, create, ctx)
        if plan.check is not None and not plan.check["key_ok"] and ctx.rank == 0:
            st = _stale_opener  # begin's broadcast tells every rank, before anyone writes
        staged = [_host(src[sl] if sl else src) for src, sl in plan.sources]
        try:
            return write_plan(st, plan, staged, ctx, run=run, step=step, message=message, parent=parent,
                               progress=progress)
        except StalePlanError:  # every rank raised it (the commit's check, or begin's broadcast)
            _PLANS.pop(_group_key(ctx), None)
            continue
    raise UcpError(f"save of {run}@{step}: planning did not settle")  # unreachable: a fresh plan is never checked


# ----------------------------------------------------------------------------------------- load
@dataclass
class LoadResult:
    """What ``load`` did: the version loaded, keys skipped (``strict=False``), bytes read by this rank, and
    how this rank's per-rank state was restored (``"path: policy <- saved rank r"`` lines)."""

    checkpoint_id: str
    missing: list[str] = field(default_factory=list)  # in the state dict, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the state dict
    bytes_read: int = 0
    per_rank: list[str] = field(default_factory=list)


@dataclass
class _View:
    """A version's state-dict manifest: tensor rows, replicated values and tensors by path, per-rank keys."""

    ck: Any
    infos: dict
    values: dict[tuple, Any]
    tensor_paths: dict[tuple, tuple[str, str]]
    manifest: Any  # rankstate.PerRankManifest | None (format-1 manifests have none)

    def replicated(self) -> dict[tuple, Any]:
        """Path -> JSON value, or a callable reading a replicated tensor (for reshard callbacks)."""
        out: dict[tuple, Any] = dict(self.values)
        for path, key in self.tensor_paths.items():
            if key in self.infos:
                out[path] = (lambda k=key: self.ck.tensor(*k).read())
        return out


def _catalog_view(store, ref: str) -> _View:
    return _catalog_view_of(store.checkpoint(ref))


def _catalog_view_of(ck) -> _View:
    from ucp_store.distributed.rankstate import PerRankManifest

    infos = {(i.name, i.state): i for i in ck.tensors()}
    objs = _manifest_object(ck)
    values, tensor_paths, manifest = {}, {}, None
    if isinstance(objs, dict):
        for leaf in objs.get("leaves", ()):
            if "value" in leaf:
                values[tuple(leaf["path"])] = leaf["value"]
            elif "tensor" in leaf:
                tensor_paths[tuple(leaf["path"])] = tuple(leaf["tensor"])
        if isinstance(objs.get("per_rank"), dict):
            manifest = PerRankManifest.from_json(objs["per_rank"])
    return _View(ck, infos, values, tensor_paths, manifest)


def _view_everywhere(store, ref: str, ctx: Ctx, what: str) -> _View:
    """The version's view on every rank, with ONE catalog client: the coordinator (group rank 0) opens the
    store, resolves ``ref`` and reads the rows, the manifest and every per-rank object it names; one broadcast
    (JSON bytes) hands them to the other ranks, which read arrays through a store without a catalog. A failure
    on the coordinator raises on every rank. Call first (before anything that may fail on one rank alone)."""
    from ucp_store.distributed import coord

    if ctx.dist is None:
        return _catalog_view(resolve_store(store, create=False), ref)
    view, error, payload = None, None, None
    if ctx.rank == 0:
        try:
            view = _catalog_view(resolve_store(store, create=False), ref)
            names = {STATE_DICT_OBJECT}
            if view.manifest is not None:
                names.update(e.object for k in view.manifest.keys for e in k.entries)
            payload = coord.encode({"store": coord.store_facts(view.ck.store), "id": view.ck.id, "run": view.ck.run,
                                    "step": view.ck.step, "infos": [coord.info_to_json(i) for i in view.infos.values()],
                                    "objects": coord.object_rows(view.ck, names)})
        except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
            error = exc
            payload = coord.encode(coord.error_payload(exc))
    with collective_errors(f"{what} (catalog broadcast)"):
        answer = coord.decode(coord.broadcast_bytes(payload, ctx.group))
    if error is not None:
        raise error
    if "error" in answer:
        coord.raise_remote(answer, what)
    if view is None:
        view = _catalog_view_of(coord.detached_checkpoint(coord.detached_store(answer["store"]), answer))
    return view


def _manifest_object(ck) -> Any:
    """The state-dict manifest object alone (not every per-rank object of the version)."""
    from ucp_store.distributed.perrank import read_entries

    # None: a version not saved by ucp_store.distributed (tensors only)
    return read_entries(ck, [STATE_DICT_OBJECT], required=False).get(STATE_DICT_OBJECT)


def _key_text(key: tuple[str, str]) -> str:
    return f"{key[0]} [{key[1]}]"


def load(state_dict: dict, *, store: Any = None, ref: str, strict: bool = True, group=None,
         progress: bool = True, per_rank: dict | None = None, mesh=None) -> LoadResult:
    """Load version ``ref`` into ``state_dict`` in place, on any mesh; call on every rank.

    Each rank reads only the chunks intersecting its local boxes (from its live DTensors' placements).
    A key or shape mismatch raises an error naming the key and both shapes; ``strict=False`` loads the
    keys both have and reports the rest in the result. Non-tensor values (learning rates, ...) are
    restored too. If any rank fails, every rank raises.

    Per-rank state (what ``save`` stored per rank) is restored by policy. On the saving topology (the same
    ranks and ``mesh``; default: the mesh of the live DTensors that spans every rank) each rank gets its own
    state, bit for bit, with no policy. On another topology, ``per_rank`` maps key patterns (fnmatch over
    dotted paths such as ``"dataloader.*"``; the first that matches a key or one of its parents wins) to:

    - ``"by-coordinate:dp"`` / ``by_coordinate("dp")``: the state of the saved rank with the same
      coordinates on the named mesh dims (ranks of one DP coordinate share a dataloader position);
    - ``"rank0"`` / ``rank0()``: saved rank 0's state on every rank;
    - ``reshard(fn)`` (or a callable): ``fn(saved, target)`` gets every saved rank's state of the matched
      node (``SavedRankState``: rank, coords, path, value) and this rank (``RankTarget``) and returns the
      node's new state (e.g. a sampler position re-split over the new DP size);
    - ``"fresh"`` / ``fresh()``: left as the caller built it;
    - ``"same"``: the default (the saving topology only).

    A per-rank key without a fitting policy raises ``ConfigurationError`` naming the keys and both
    topologies; with ``strict``, so does a saved per-rank key that no rank loaded (nothing is silently
    dropped; ``strict=False`` lists them in ``unexpected``)."""
    wait()  # an async save in flight commits first
    ctx = Ctx(group)
    error: BaseException | None = None
    result = LoadResult("")
    consumed: set[int] = set()
    view = None
    try:
        view = _view_everywhere(store, ref, ctx, f"load of {ref}")
        view, consumed = _load_here(state_dict, ctx, view, ref, strict, progress, per_rank, mesh, result)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
        error = exc
    if ctx.dist is None:
        if error is not None:
            raise error
        parts = [consumed]
    else:  # one round: every rank's error and the per-rank keys it used to the coordinator; the failures and
        # the keys any rank used back (all raise alike)
        failures, used = ctx.agree([None if error is None else f"{type(error).__name__}: {error}", sorted(consumed)],
                                   _load_outcome, f"load of {ref}")
        raise_failures(failures, error, f"load of {ref}")
        parts = [set(used)]
    if view is not None and view.manifest is not None:
        _check_consumed(view, set().union(*parts), strict, ref, result)
    return result


def _load_outcome(parts: list[list]) -> list:
    """The coordinator's answer to every rank's ``[error message | None, per-rank key indices used]``: the
    ``[rank, message]`` of each failure and the indices some rank used."""
    return [[[r, m] for r, (m, _) in enumerate(parts) if m is not None], sorted({i for _, used in parts for i in used})]


def _check_consumed(view: _View, used: set[int], strict: bool, ref: str, result: LoadResult) -> None:
    """A saved per-rank key that no rank loaded is an error under ``strict`` (the same on every rank)."""
    left = [k.text for i, k in enumerate(view.manifest.keys) if i not in used]
    if not left:
        return
    if strict:
        raise ConfigurationError(f"load {ref}: per-rank key(s) {', '.join(left[:8])} saved on "
                                 f"{view.manifest.topology.describe()} were loaded by no rank (the live state dicts "
                                 "lack them); declare per_rank={pattern: reshard(fn) | 'fresh'} for them, or "
                                 "strict=False to skip them")
    result.unexpected += [f"{t} [per-rank]" for t in left]


def _load_here(state_dict, ctx: Ctx, view: _View, ref: str, strict: bool, progress: bool, per_rank, mesh,
               result: LoadResult) -> tuple[_View, set[int]]:
    """This rank's part of ``load``: plan the per-rank restore, read its boxes, put everything in place."""
    from ucp_store.distributed import perrank
    from ucp_store.io.read import Reader, box_sink
    from ucp_store.patterns import Box
    from ucp_store.progress import track

    policies = perrank.parse_policies(per_rank)
    ck, infos, values = view.ck, view.infos, view.values
    result.checkpoint_id = ck.id
    leaves = flatten(state_dict)
    live = perrank.live_topology(leaves, mesh, ctx, what=f"load {ref}")
    plan = perrank.plan_restore(leaves, view.manifest, live, ctx.rank, policies, what=f"load {ref}")
    tensors = [_describe(leaf) for leaf in leaves if leaf.is_tensor and leaf.path not in plan.handled]
    wanted = {t.key for t in tensors}
    result.missing = sorted(_key_text(t.key) for t in tensors if t.key not in infos)
    result.unexpected = sorted(_key_text(k) for k in infos if k not in wanted)
    if strict and result.missing:
        near = sorted(_key_text(k) for k in infos)[:5]
        raise ReferenceNotFound(f"load {ref}: {len(result.missing)} state dict tensor(s) are not in checkpoint "
                                f"{ck.id}: {', '.join(result.missing[:5])}; it has e.g. {', '.join(near)} "
                                "(strict=False loads the intersection)")
    for t in tensors:
        info = infos.get(t.key)
        if info is not None and tuple(info.shape) != t.shape:
            raise ShapeMismatch(f"load {ref}: {t.what} has shape {list(t.shape)} in the state dict but "
                                f"{list(info.shape)} in checkpoint {ck.id}")
    reader = Reader(ck, infos=infos)
    for t in track([t for t in tensors if t.key in infos], f"load {ref}", enabled=progress and ctx.rank == 0):
        info = infos[t.key]
        for region in t.regions:
            reader.submit(info, Box(region.global_box), box_sink(t.local, Box(region.local_box)))
    reader.drain()
    result.bytes_read = reader.bytes_copied
    for leaf in leaves:
        if not leaf.is_tensor and leaf.path in values and leaf.path not in plan.handled:
            set_leaf(state_dict, leaf.path, from_json(values[leaf.path], leaf.value))
    if plan.picks:
        perrank.apply_picks(state_dict, plan, perrank.read_entries(ck, plan.objects()))
    if plan.units:
        cache: dict[str, Any] = {}

        def read_object(name: str) -> Any:
            if name not in cache:
                cache.update(perrank.read_entries(ck, [name]))
            return cache[name]

        perrank.apply_units(state_dict, plan, view.replicated(), read_object)
    result.per_rank = plan.applied
    if any(t.local.device.type == "cuda" for t in tensors):
        torch.cuda.synchronize()
    return view, plan.consumed


# ----------------------------------------------------------------------------------------- verify
@dataclass
class Mismatch:
    """One box of one tensor that differs from the checkpoint (or a key/shape problem when ``box`` is None)."""

    name: str
    state: str
    path: str
    rank: int
    box: list | None
    differing: int
    first: list | None = None
    reason: str = "values differ"

    def __str__(self) -> str:
        where = f" box {self.box}" if self.box is not None else ""
        first = f", first at {self.first}" if self.first is not None else ""
        return (f"tensor {self.name!r} state {self.state!r} ({self.path}) on rank {self.rank}{where}: {self.reason}"
                f" ({self.differing} element(s){first})")


@dataclass
class VerifyReport:
    """``verify``'s answer, the same on every rank: ``ok`` and every differing tensor and box."""

    checkpoint_id: str
    mismatches: list[Mismatch]
    checked_elements: int

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def __str__(self) -> str:
        if self.ok:
            return f"checkpoint {self.checkpoint_id}: every box matches ({self.checked_elements} elements)"
        lines = [f"checkpoint {self.checkpoint_id}: {len(self.mismatches)} mismatch(es)"]
        lines += [f"  {m}" for m in self.mismatches]
        return "\n".join(lines)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.itemsize in (1, 2, 4, 8) else a.view(np.uint8)


def verify(state_dict: dict, ref: str, *, store: Any = None, group=None, progress: bool = True,
           per_rank: dict | None = None, mesh=None) -> VerifyReport:
    """Compare a live (sharded) state dict with version ``ref``, bit for bit; call on every rank.

    Each rank checks its own boxes and its per-rank state (against its own stored entry on the saving
    topology, or the entry ``per_rank``'s policies pick, as in ``load``; ``reshard`` and ``fresh`` keys are
    not compared). The report (gathered, the same on every rank) names every tensor, box and per-rank key
    that differs, and keys or shapes that do not match."""
    from ucp_store.distributed import perrank
    from ucp_store.progress import track

    ctx = Ctx(group)
    error: BaseException | None = None
    mine: list[Mismatch] = []
    checked = 0
    ck_id = ""
    try:
        view = _view_everywhere(store, ref, ctx, f"verify of {ref}")
        ck, infos = view.ck, view.infos
        ck_id = ck.id
        leaves = flatten(state_dict)
        live = perrank.live_topology(leaves, mesh, ctx, what=f"verify {ref}")
        handled = _verify_per_rank(view, leaves, live, ctx.rank, perrank.parse_policies(per_rank), mine)
        for leaf in leaves:  # replicated values (a learning rate, a position all ranks share)
            if not leaf.is_tensor and leaf.path not in handled and leaf.path in view.values:
                why = perrank.compare(leaf.value, view.values[leaf.path])
                if why is not None:
                    text = path_text(leaf.path)
                    mine.append(Mismatch(text, "value", text, ctx.rank, None, 0, reason=why))
        tensors = [_describe(leaf) for leaf in leaves if leaf.is_tensor and leaf.path not in handled]
        for t in track(tensors, f"verify {ref}", enabled=progress and ctx.rank == 0):
            checked += _verify_tensor(ck, infos, t, ctx.rank, mine)
    except BaseException as exc:  # noqa: BLE001
        error = exc
    # one round: every rank's error, mismatches and count to the coordinator; the failures and the report back
    failures, everything, total = ctx.agree(
        [None if error is None else f"{type(error).__name__}: {error}", [m.__dict__ for m in mine], checked],
        _verify_outcome, f"verify of {ref}")
    raise_failures(failures, error, f"verify of {ref}")
    return VerifyReport(ck_id, [Mismatch(**d) for d in everything], total)


def _verify_outcome(parts: list[list]) -> list:
    """The coordinator's answer to every rank's ``[error message | None, mismatches, elements checked]``: the
    ``[rank, message]`` of each failure, every rank's mismatches (in rank order) and the elements checked."""
    return [[[r, m] for r, (m, _, _) in enumerate(parts) if m is not None], [d for _, ms, _ in parts for d in ms],
            sum(c for _, _, c in parts)]


def _verify_tensor(ck, infos: dict, t: _Tensor, rank: int, mine: list[Mismatch]) -> int:
    """Compare one live tensor's boxes with the stored array; returns the elements checked."""
    path = path_text(t.leaf.path)
    info = infos.get(t.key)
    if info is None:
        mine.append(Mismatch(t.key[0], t.key[1], path, rank, None, 0, reason="not in the checkpoint"))
        return 0
    if tuple(info.shape) != t.shape or info.dtype != t.dtype:
        mine.append(Mismatch(t.key[0], t.key[1], path, rank, None, 0,
                             reason=f"is {t.dtype}{list(t.shape)} live but {info.dtype}{list(info.shape)} stored"))
        return 0
    checked = 0
    handle = ck.tensor(*t.key)
    for region in t.regions:
        stored = handle.read_numpy(region.global_slices()) if region.global_box else handle.read_numpy(())
        live = dtypes.to_numpy(_host(t.local[region.local_slices()] if region.local_box else t.local), what=t.what)
        diff = _bits(stored) != _bits(live)
        checked += int(live.size)
        n = int(diff.sum())
        if n:
            first = np.unravel_index(int(np.argmax(diff.reshape(-1))), diff.shape) if diff.ndim else ()
            mine.append(Mismatch(t.key[0], t.key[1], path, rank, [list(b) for b in region.global_box], n,
                                 [int(lo + i) for (lo, _), i in zip(region.global_box, first)]))
    return checked


def _verify_per_rank(view: _View, leaves: list[Leaf], live, rank: int, policies: dict,
                     mine: list[Mismatch]) -> set[tuple]:
    """Compare this rank's live per-rank leaves with the stored entries their policy picks; returns their paths."""
    from ucp_store.distributed import perrank
    from ucp_store.distributed.rankstate import choose_source, parse_policy, policy_for

    if view.manifest is None:
        return set()
    index = view.manifest.by_path()
    todo: list[tuple[Leaf, str]] = []
    handled: set[tuple] = set()
    for leaf in leaves:
        i = index.get(leaf.path)
        if i is None:
            continue
        handled.add(leaf.path)
        found = policy_for(leaf.path, policies)
        policy = found[1] if found is not None else parse_policy("same")
        if policy.kind in ("reshard", "fresh"):
            continue  # computed or left as built on purpose: nothing stored to compare with
        key = view.manifest.keys[i]
        try:
            src = choose_source(policy, key, view.manifest.topology, live, rank)
        except ConfigurationError as exc:
            mine.append(Mismatch(key.text, "per-rank", key.text, rank, None, 0, reason=str(exc)))
            continue
        todo.append((leaf, key.entry(src).object))  # type: ignore[union-attr]
    got = perrank.read_entries(view.ck, {name for _, name in todo})
    for leaf, name in todo:
        why = perrank.compare(leaf.value, got[name])
        if why is not None:
            text = path_text(leaf.path)
            mine.append(Mismatch(text, "per-rank", text, rank, None, 0 if leaf.is_tensor is False else 1,
                                 reason=f"per-rank state differs from stored {name}: {why}"))
    return handled


def _iter_tensors(state_dict) -> Iterable[_Tensor]:
    return (_describe(leaf) for leaf in flatten(state_dict) if leaf.is_tensor)
