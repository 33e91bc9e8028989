"""Save planning of ``ucp_store.distributed`` (DCP's ``default_planner``): who writes which box.

Every rank's (key, shape, dtype, boxes) of its DTensors and a content digest of every plain tensor and value
go to the coordinator (JSON bytes, on the bounded-timeout gloo group), which checks the ranks hold the same
DTensors, spreads every box over the ranks holding it by bytes (replicas: ``Replicate`` mesh dims, the same
DTensor on sibling sub-meshes, plain tensors equal on every rank), and scatters to each rank only its share;
plain tensors and values that differ across ranks are per-rank state (``perrank.py``). The plan is cached per
layout: a save of the same layout runs no planning collective (its digests are checked at the commit's digest
gather, ``saver.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ucp_store.distributed import layout as lay
from ucp_store.distributed.commit import collective_errors
from ucp_store.distributed.context import Ctx
from ucp_store.distributed.statedict import Leaf, flatten, json_value, path_text
from ucp_store.distributed.tensors import LocalTensor, describe_leaf, host_copy, is_dtensor
from ucp_store.errors import ConfigurationError, ShapeMismatch, TopologyError, UcpError

__all__ = ["SavePlan", "WriteItem", "confirm_cached_plan", "forget_plan", "plan_save", "plan_still_holds",
           "settle_cached_plan"]


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


def _describe_leaves(leaves, ctx: Ctx, mesh) -> tuple[list[LocalTensor], dict, dict, list, dict]:
    """This rank's DTensors (with their meshes), plain tensors and JSON values (each with its content digest)."""
    from ucp_store.distributed import perrank

    dtensors: list[LocalTensor] = []
    meshes: dict[str, dict] = {}
    plain: dict[tuple, LocalTensor] = {}
    for leaf in leaves:
        if leaf.is_tensor and is_dtensor(leaf.value):
            t = describe_leaf(leaf)
            dtensors.append(t)
            if t.pattern is not None:
                m = t.leaf.value.device_mesh
                ranks = lay.mesh_facts(m).ranks
                meshes.setdefault(repr(ranks), {"shape": t.pattern["mesh"]["shape"],
                                                "dims": list(m.mesh_dim_names or ()), "ranks": ranks})
        elif leaf.is_tensor:
            plain[leaf.path] = describe_leaf(leaf)
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
            if not is_dtensor(leaf.value):  # one rank alone has nothing to compare: no digest
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
    dtensors: list[LocalTensor] = []
    plain: dict[tuple, LocalTensor] = {}
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


def _layout_key(leaves, dtensors: list[LocalTensor], plain: dict, topology: dict, world: int) -> str:
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


def _boxes(leaves, dtensors: list[LocalTensor], plain: dict, share: dict) -> tuple[list[WriteItem], list[tuple]]:
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


def _build_plan(leaves, dtensors: list[LocalTensor], plain: dict, extra: dict, meshes: dict, share: dict,
                coord_info: dict | None, ctx: Ctx) -> SavePlan:
    """This rank's plan from its share: the boxes it writes (in the state dict's order), the empty arrays it
    records, its per-rank objects; on the coordinator also the manifest (values are this save's)."""
    from ucp_store.distributed.rankstate import PerRankManifest

    items, sources = _boxes(leaves, dtensors, plain, share)
    rank_objects = []
    for name, path in share["writes"]:
        path = tuple(path)
        rank_objects.append((name, host_copy(plain[path].local).clone() if path in plain else extra["values"][path]))
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
    ``plan_still_holds`` and broadcasts one byte. When the plan no longer holds, every rank drops the cache
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
                       b"h" if plan_still_holds(plan.check, checks) else b"s")
        answer = coord.broadcast_bytes(verdict, ctx.group)
    return {b"h": "holds", b"r": "replan", b"s": "stale"}[answer]


def plan_still_holds(check: dict, checks: list[dict]) -> bool:
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
