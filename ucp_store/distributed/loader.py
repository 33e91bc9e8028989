"""``load`` of a version into live DTensor / FSDP2 / TP state dicts on every rank, into any mesh (DCP's
``state_dict_loader``).

One catalog client per job: the coordinator resolves the reference and reads the rows and the manifest, one
broadcast hands them to the other ranks (``view_everywhere``). Each rank then reads only the chunks that
intersect the boxes of its live DTensors (from their own placements and mesh, whatever the saving mesh was)
and copies them in place; per-rank state is restored by policy (``perrank.py``). One collective at the end
makes every rank raise if any rank failed, so no rank trains on while another stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ucp_store.distributed.commit import collective_errors
from ucp_store.distributed.context import Ctx, raise_failures, resolve_store
from ucp_store.distributed.inflight import wait
from ucp_store.distributed.statedict import STATE_DICT_OBJECT, flatten, from_json, set_leaf
from ucp_store.distributed.tensors import describe_leaf
from ucp_store.errors import ConfigurationError, ReferenceNotFound, ShapeMismatch

__all__ = ["CatalogView", "LoadResult", "hydrate_view", "load", "relocated", "restores_from_tiers", "view_everywhere"]


@dataclass
class LoadResult:
    """What ``load`` did: the version loaded, keys skipped (``strict=False``), bytes read by this rank, and
    how this rank's per-rank state was restored (``"path: policy <- saved rank r"`` lines)."""

    checkpoint_id: str
    missing: list[str] = field(default_factory=list)  # in the state dict, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the state dict
    bytes_read: int = 0
    per_rank: list[str] = field(default_factory=list)
    #: a version on the fast tiers (issue 38): bytes of the objects this rank's plan needed, by where they came
    #: from (``local``: this node's fast tier; ``peer``: another node's, received; ``durable``), or None
    tier_bytes: dict[str, int] | None = None
    job_tier_bytes: dict[str, int] | None = None  # the same, summed over every rank of the load
    bad_copies: list[str] = field(default_factory=list)  # one line per bad copy this rank found
    tier_seconds: dict[str, float] | None = None  # this rank's time checking local copies, with peers, durable


@dataclass
class CatalogView:
    """A version's state-dict manifest: tensor rows, replicated values and tensors by path, per-rank keys."""

    ck: Any
    infos: dict
    values: dict[tuple, Any]
    tensor_paths: dict[tuple, tuple[str, str]]
    manifest: Any  # rankstate.PerRankManifest | None (format-1 manifests have none)
    tiers: Any = None  # restore.TierCopies: the version's copies per tier (a tiered save), or None
    payload: dict | None = None  # the coordinator's answer the view was built from (a tiered version's)

    def replicated(self) -> dict[tuple, Any]:
        """Path -> JSON value, or a callable reading a replicated tensor (for reshard callbacks)."""
        out: dict[tuple, Any] = dict(self.values)
        for path, key in self.tensor_paths.items():
            if key in self.infos:
                out[path] = (lambda k=key: self.ck.tensor(*k).read())
        return out


def _catalog_view(store, ref: str) -> CatalogView:
    return _catalog_view_of(store.checkpoint(ref))


def _catalog_view_of(ck) -> CatalogView:
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
    return CatalogView(ck, infos, values, tensor_paths, manifest)


def view_everywhere(store, ref: str, ctx: Ctx, what: str) -> CatalogView:
    """The version's view on every rank, with ONE catalog client: the coordinator (group rank 0) opens the
    store, resolves ``ref`` and reads the rows, the manifest and every per-rank object it names; one broadcast
    (JSON bytes) hands them to the other ranks, which read arrays through a store without a catalog. A failure
    on the coordinator raises on every rank. Call first (before anything that may fail on one rank alone)."""
    from ucp_store.distributed import coord, restore

    if ctx.dist is None:
        alone = _catalog_view(resolve_store(store, create=False), ref)
        tiers = restore.tier_copies(alone.ck)
        if tiers is not None:
            alone.tiers, alone.payload = tiers, _payload(alone)
        return alone
    view: CatalogView | None = None
    error, payload = None, None
    if ctx.rank == 0:
        try:
            view = _catalog_view(resolve_store(store, create=False), ref)
            view.payload = _payload(view)
            tiers = restore.tier_copies(view.ck)
            if tiers is not None:
                view.tiers = tiers
                view.payload["tiers"] = tiers.to_json()
            payload = coord.encode(view.payload)
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
        if "tiers" in answer:
            view.tiers, view.payload = restore.TierCopies.from_json(answer["tiers"]), answer
    return view


def _payload(view: CatalogView) -> dict:
    """What the coordinator broadcasts for a version: its store's facts, rows and the objects a load reads."""
    from ucp_store.distributed import coord

    names = {STATE_DICT_OBJECT}
    if view.manifest is not None:
        names.update(e.object for k in view.manifest.keys for e in k.entries)
    return {"store": coord.store_facts(view.ck.store), "id": view.ck.id, "run": view.ck.run, "step": view.ck.step,
            "infos": [coord.info_to_json(i) for i in view.infos.values()],
            "objects": coord.object_rows(view.ck, names)}


def relocated(view: CatalogView, root) -> CatalogView:
    """``view`` reading from a node's fast-tier folder ``root`` (the same keys as the store's location): a
    detached checkpoint from the coordinator's payload, on every rank alike (the catalog is not needed)."""
    from ucp_store.distributed import coord, restore

    assert view.payload is not None
    facts = dict(view.payload["store"])
    loc = restore.fast_location(root)
    facts["location"] = {**facts["location"], **{k: getattr(loc, k) for k in ("url", "kind", "root")},
                         "bucket": None, "endpoint": None, "region": None, "catalog_url": ""}
    moved = _catalog_view_of(coord.detached_checkpoint(coord.detached_store(facts), view.payload))
    moved.tiers, moved.payload = view.tiers, view.payload
    return moved


def _manifest_object(ck) -> Any:
    """The state-dict manifest object alone (not every per-rank object of the version)."""
    from ucp_store.distributed.perrank import read_entries

    # None: a version not saved by ucp_store.distributed (tensors only)
    return read_entries(ck, [STATE_DICT_OBJECT], required=False).get(STATE_DICT_OBJECT)


def _key_text(key: tuple[str, str]) -> str:
    return f"{key[0]} [{key[1]}]"


def load(state_dict: dict, *, store: Any = None, ref: str, strict: bool = True, group=None,
         progress: bool = True, per_rank: dict | None = None, mesh=None, node: str | None = None,
         fast_tier: Any = None) -> LoadResult:
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
    dropped; ``strict=False`` lists them in ``unexpected``).

    A version saved to the fast tiers (``tier="fast"``) is restored from the nearest copies
    (``restore.py``): each node's fast-tier folder (``fast_tier=`` / ``UCP_FAST_TIER``; ``node=`` /
    ``UCP_NODE``) first gets every object its ranks need, from itself, another node of this job or the durable
    tier, and the ranks read from it; ``result.tier_bytes`` says how many bytes came from where."""
    wait()  # an async save in flight commits first
    ctx = Ctx(group)
    error: BaseException | None = None
    result = LoadResult("")
    consumed: set[int] = set()
    view = prep = None
    try:
        view = view_everywhere(store, ref, ctx, f"load of {ref}")
        prep = _prepare(state_dict, ctx, view, ref, strict, per_rank, mesh, result)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
        error = exc
    if view is not None and restores_from_tiers(view, fast_tier):  # the same on every rank (the broadcast)
        view, error, got = hydrate_view(ctx, view, None if prep is None else prep.tensors,
                                        prep is not None and bool(prep.plan.units), error, node, fast_tier,
                                        f"load of {ref}")
        if got is not None:
            result.tier_bytes, result.job_tier_bytes, result.bad_copies = got["bytes"], got["job"], got["bad"]
            result.tier_seconds = got["seconds"]
    if error is None and view is not None and prep is not None:
        try:
            consumed = _read_and_apply(state_dict, ctx, view, prep, ref, progress, result)
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


def _check_consumed(view: CatalogView, used: set[int], strict: bool, ref: str, result: LoadResult) -> None:
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


def restores_from_tiers(view: CatalogView, fast_tier: Any) -> bool:
    """A tiered version is restored through the fast tiers unless it is durable and no fast tier is named."""
    from ucp_store import config

    if view.tiers is None:
        return False
    durable_everywhere = all(any(c[0] == "durable" for c in cs) for cs in view.tiers.copies.values())
    return not durable_everywhere or fast_tier is not None or config.fast_tier() is not None


def hydrate_view(ctx: Ctx, view: CatalogView, tensors: list | None, whole_replicated: bool,
                 error: BaseException | None, node: str | None, fast_tier: Any,
                 what: str) -> tuple[CatalogView, BaseException | None, dict | None]:
    """Every object the reads of ``tensors`` (this rank's live tensors; None: this rank failed before) touch
    into its node's fast tier (``restore.hydrate``, a collective), then the view reading from there. Returns
    the view, this rank's error (a failure anywhere stops every rank's hydration alike) and what
    ``hydrate`` reported (None on failure)."""
    from ucp_store.distributed import restore

    needed: set[str] | None = None
    if error is None and tensors is not None:
        try:
            needed = _needed_keys(view, tensors, whole_replicated)
        except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
            error = exc
    try:
        got = restore.hydrate(ctx, view.tiers, needed, error, node=node, fast_tier=fast_tier, what=what)
    except BaseException as exc:  # noqa: BLE001 - raised alike on every rank
        return view, error or exc, None
    return relocated(view, got["root"]), error, got


def _needed_keys(view: CatalogView, tensors: list, whole_replicated: bool) -> set[str]:
    """The objects this rank's reads touch: the shard files its boxes intersect (and each array's zarr.json),
    the arrays of stored objects, and for reshard callbacks (``whole_replicated``) the replicated tensors'."""
    from ucp_store.distributed import restore

    keys: set[str] = set()
    for t in tensors:
        info = view.infos.get(t.key)
        if info is not None:
            keys |= restore.info_keys(info, [r.global_box for r in t.regions])
    keys |= restore.object_keys((view.payload or {}).get("objects", {}))
    if whole_replicated:
        for key in view.tensor_paths.values():
            if key in view.infos:
                keys |= restore.info_keys(view.infos[key], None)
    return keys


@dataclass
class _Prepared:
    """This rank's load before any byte is read: the leaves, the per-rank restore plan and the tensors."""

    leaves: list
    plan: Any  # perrank.RestorePlan
    tensors: list


def _prepare(state_dict, ctx: Ctx, view: CatalogView, ref: str, strict: bool, per_rank, mesh,
             result: LoadResult) -> _Prepared:
    """This rank's load plan: the per-rank restore, its tensors and their boxes, the key and shape checks."""
    from ucp_store.distributed import perrank

    policies = perrank.parse_policies(per_rank)
    ck, infos = view.ck, view.infos
    result.checkpoint_id = ck.id
    leaves = flatten(state_dict)
    live = perrank.live_topology(leaves, mesh, ctx, what=f"load {ref}")
    plan = perrank.plan_restore(leaves, view.manifest, live, ctx.rank, policies, what=f"load {ref}")
    tensors = [describe_leaf(leaf) for leaf in leaves if leaf.is_tensor and leaf.path not in plan.handled]
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
    return _Prepared(leaves, plan, tensors)


def _read_and_apply(state_dict, ctx: Ctx, view: CatalogView, prep: _Prepared, ref: str, progress: bool,
                    result: LoadResult) -> set[int]:
    """This rank's reads: its boxes into place, the replicated values, the per-rank state."""
    from ucp_store.distributed import perrank
    from ucp_store.io.read import Reader, box_sink
    from ucp_store.patterns import Box
    from ucp_store.progress import track

    ck, infos, values = view.ck, view.infos, view.values
    leaves, plan, tensors = prep.leaves, prep.plan, prep.tensors
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
    return plan.consumed
