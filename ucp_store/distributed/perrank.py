"""Per-rank state of ``ucp_store.distributed``: content digests and the save decision, the load restore by policy,
and the per-rank part of ``verify`` (the pure model is ``rankstate.py``).

Save: every rank digests its plain tensors and non-tensor leaves; the digests travel in ``save``'s one
planning gather. A leaf whose digest differs across ranks, or that some rank lacks, is per-rank: the
lowest rank of each group of equal contents stores it as a catalog object (``rankstate.object_name``) and
the manifest records every holder's entry and the saving ``RankTopology``.

Load: each live leaf at a saved per-rank path takes the entry its policy picks (``same`` by default, only
on the saving topology); ``reshard`` and ``fresh`` apply to whole units (the highest node the pattern
matches). Only the objects a rank needs are read.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from ucp_store import typed_json
from ucp_store.distributed.layout import mesh_facts
from ucp_store.distributed.rankstate import (
    PerRankEntry,
    PerRankKey,
    PerRankManifest,
    Policy,
    RankTarget,
    RankTopology,
    SavedRankState,
    choose_source,
    key_order,
    object_name,
    parse_policy,
    policy_for,
    unit_of,
)
from ucp_store.distributed.statedict import Leaf, from_json, path_text, set_leaf
from ucp_store.errors import ConfigurationError, TopologyError

__all__ = ["Decision", "RestorePlan", "decide", "digest_tensor", "digest_value", "live_topology", "plan_restore",
           "read_entries"]

#: the content check at save (``tools/bench_perrank.py`` turns it off to measure what it costs)
CONTENT_CHECK = True


# ----------------------------------------------------------------------------------------- digests
def digest_tensor(t: torch.Tensor) -> bytes:
    """xxh3-128 over a plain tensor's dtype, shape and bytes (device tensors are copied to the host)."""
    if not CONTENT_CHECK:
        return b""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    h = xxhash.xxh3_128(_header(t.dtype, tuple(t.shape)))
    if t.numel():
        try:  # the C-order bytes; numpy's view is the cheap way for the dtypes it has
            h.update(np.ascontiguousarray(t.numpy()).data)
        except (TypeError, RuntimeError):  # bfloat16 and kin
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


@functools.lru_cache(maxsize=1024)
def _header(dtype: torch.dtype, shape: tuple) -> bytes:
    return f"t:{dtype}:{shape};".encode()


def digest_value(value: Any) -> bytes:
    """xxh3-128 over a JSON leaf's canonical text."""
    if not CONTENT_CHECK:
        return b""
    return xxhash.xxh3_128_digest(b"v:" + json.dumps(value, sort_keys=True, allow_nan=True).encode())


# ----------------------------------------------------------------------------------------- topology
def _group_ranks(ctx) -> tuple[int, ...]:
    if ctx.dist is None:
        return (0,)
    return tuple(int(g) for g in ctx.dist.get_process_group_ranks(ctx.group))


def _mesh_topology(mesh, ranks: tuple[int, ...], *, what: str) -> RankTopology:
    if isinstance(mesh, RankTopology):
        topo = mesh
        if topo.world != len(ranks):
            raise ConfigurationError(f"{what}: topology of {topo.world} ranks given, but {len(ranks)} ranks take part")
        return topo
    try:
        facts = mesh_facts(mesh)
        dims = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(len(facts.shape))))
    except AttributeError:
        raise ConfigurationError(f"{what}: mesh must be a torch DeviceMesh or a RankTopology, got "
                                 f"{type(mesh).__name__}") from None
    flat = facts.flat
    if sorted(flat) != sorted(ranks):
        raise ConfigurationError(f"{what}: mesh {dict(zip(dims, facts.shape))} over global ranks {list(flat)} does "
                                 f"not cover the {len(ranks)} ranks taking part ({list(ranks)})")
    return RankTopology(len(ranks), ranks, dims, facts.shape, flat)


def live_topology(leaves: Iterable[Leaf], mesh, ctx, *, what: str) -> RankTopology:
    """The ranks' topology: ``mesh`` (a DeviceMesh or RankTopology) if given, else the DeviceMesh of the
    state dict's DTensors that covers every rank taking part (most dims first), else the ranks alone."""
    ranks = _group_ranks(ctx)
    if mesh is not None:
        return _mesh_topology(mesh, ranks, what=f"{what}: mesh")
    mod = sys.modules.get("torch.distributed.tensor")
    best = None
    if mod is not None:
        for leaf in leaves:
            if isinstance(leaf.value, mod.DTensor):
                m = leaf.value.device_mesh
                covers = sorted(mesh_facts(m).flat) == sorted(ranks)
                if covers and (best is None or m.ndim > best.ndim):
                    best = m
    if best is not None:
        return _mesh_topology(best, ranks, what=what)
    return RankTopology.flat(len(ranks), ranks)


# ----------------------------------------------------------------------------------------- save
@dataclass
class Decision:
    """What the gather decided for the plain tensors and values of this rank."""

    replicated: set[tuple]  # paths stored once (as before)
    manifest: PerRankManifest
    writes: list[tuple[str, tuple]]  # (object name, path) of the per-rank contents this rank stores
    index: dict[tuple, int] = field(default_factory=dict)  # per-rank path -> key index


def decide(everyone: Sequence[Sequence[tuple]], topology: RankTopology, rank: int) -> Decision:
    """From every rank's ``(path, kind, digest)`` list (kind ``"tensor"`` or ``"value"``): the paths all ranks
    hold with equal content (replicated), the per-rank keys with each holder's entry (one stored object
    per distinct content, owned by its lowest rank), and what this rank writes. Pure and the same on every
    rank."""
    holders: dict[tuple, dict[int, tuple[str, bytes]]] = {}
    for r, leaves in enumerate(everyone):
        for path, kind, digest in leaves:
            holders.setdefault(tuple(path), {})[r] = (kind, digest)
    world = len(everyone)
    replicated: set[tuple] = set()
    per_rank = []
    for path, by_rank in holders.items():
        if len(by_rank) == world and len(set(by_rank.values())) == 1:
            replicated.add(path)
        else:
            per_rank.append(path)
    per_rank.sort(key=key_order)
    keys: list[PerRankKey] = []
    writes: list[tuple[str, tuple]] = []
    for i, path in enumerate(per_rank):
        owners: dict[tuple[str, bytes], int] = {}
        entries = []
        for r in sorted(holders[path]):
            content = holders[path][r]
            owner = owners.setdefault(content, r)
            entries.append(PerRankEntry(r, content[0], object_name(owner, i)))
            if owner == r == rank:
                writes.append((object_name(owner, i), path))
        keys.append(PerRankKey(path, tuple(entries)))
    manifest = PerRankManifest(topology, tuple(keys))
    return Decision(replicated, manifest, writes, {k.path: i for i, k in enumerate(keys)})


# ----------------------------------------------------------------------------------------- reading
def read_entries(ck, names: Iterable[str], *, required: bool = True) -> dict[str, Any]:
    """The stored objects ``names`` of checkpoint ``ck`` (JSON values, or tensors for array objects); only
    those are read. ``required``: a name the catalog lacks is an error (else left out)."""


    wanted = sorted(set(names))
    out: dict[str, Any] = {}
    if not wanted:
        return out
    if getattr(ck, "prefetched_objects", None) is not None:  # a non-coordinator rank: rows came by broadcast
        from ucp_store.distributed.coord import read_prefetched

        out = read_prefetched(ck, wanted)
    else:
        out = _read_catalog_entries(ck, wanted)
    lost = [n for n in wanted if n not in out]
    if lost and required:
        raise TopologyError(f"checkpoint {ck.id}: per-rank object(s) {lost[:5]} named by its manifest are missing")
    return out


def _read_catalog_entries(ck, wanted: list[str]) -> dict[str, Any]:
    from sqlalchemy import select

    from ucp_store import dtypes
    from ucp_store.catalog import models as m
    from ucp_store.io import format as fmt
    from ucp_store.io import localread

    out: dict[str, Any] = {}
    store = ck.store
    with store.catalog.session() as s:
        rows = s.scalars(select(m.StoredObject).where(m.StoredObject.checkpoint_id == ck.id,
                                                      m.StoredObject.name.in_(wanted)))
        for o in rows:
            if o.kind == "json":
                out[o.name] = typed_json.decode(o.value)
                continue
            a = o.array
            layout = fmt.ArrayLayout.from_catalog(a.dtype, a.shape, a.chunk_shape, a.shard_shape, a.codecs)
            h = localread.open_reader(store.location, a.path, layout, store.context, codecs=a.codecs)
            data = fmt.read_box(h, layout, tuple((0, n) for n in a.shape), what=f"object {o.name!r}",
                                array_url=store.array_url(a.path))
            out[o.name] = dtypes.to_torch(np.asarray(data))
    return out


# ----------------------------------------------------------------------------------------- load
@dataclass
class _Unit:
    """A reshard or fresh unit of the live state dict."""

    path: tuple
    pattern: str
    policy: Policy


@dataclass
class RestorePlan:
    """What one rank's load does with per-rank state (computed before any read)."""

    manifest: PerRankManifest | None
    live: RankTopology
    rank: int
    handled: set[tuple] = field(default_factory=set)  # live leaf paths not loaded the usual way
    picks: list[tuple[Leaf, int, int]] = field(default_factory=list)  # (live leaf, key index, saved rank)
    units: list[_Unit] = field(default_factory=list)
    consumed: set[int] = field(default_factory=set)  # saved per-rank key indices this rank used or dropped
    applied: list[str] = field(default_factory=list)  # "path: policy" lines for LoadResult

    def objects(self) -> set[str]:
        assert self.manifest is not None
        out = set()
        for _leaf, i, r in self.picks:
            e = self.manifest.keys[i].entry(r)
            assert e is not None
            out.add(e.object)
        return out


def parse_policies(per_rank: Mapping[str, Any] | None) -> dict[str, Policy]:
    if per_rank is None:
        return {}
    if not isinstance(per_rank, Mapping):
        raise ConfigurationError(f"per_rank must map key patterns (fnmatch over dotted paths) to policies, got "
                                 f"{type(per_rank).__name__}")
    out = {}
    for pattern, policy in per_rank.items():
        if not isinstance(pattern, str) or not pattern:
            raise ConfigurationError(f"per_rank: pattern {pattern!r} must be a non-empty string (fnmatch over paths "
                                     "such as 'dataloader.*')")
        out[pattern] = parse_policy(policy, what=f"per_rank[{pattern!r}]")
    return out


def plan_restore(leaves: Sequence[Leaf], manifest: PerRankManifest | None, live: RankTopology, rank: int,
                 policies: Mapping[str, Policy], *, what: str) -> RestorePlan:
    """Decide, per live leaf, how per-rank state is restored; raises ``ConfigurationError`` naming every
    per-rank key without a fitting policy and both topologies."""
    plan = RestorePlan(manifest, live, rank)
    unit_kinds = {p: pol for p, pol in policies.items() if pol.kind in ("reshard", "fresh")}
    seen_units: dict[tuple, _Unit] = {}
    for leaf in leaves:
        found = policy_for(leaf.path, unit_kinds)
        if found is not None:
            pattern, policy, unit = found
            plan.handled.add(leaf.path)
            if unit not in seen_units:
                seen_units[unit] = _Unit(unit, pattern, policy)
                plan.units.append(seen_units[unit])
    if manifest is None:
        return plan
    for u in plan.units:  # every saved key under the unit's pattern is used (reshard) or dropped on purpose
        plan.consumed |= {i for i, k in enumerate(manifest.keys) if unit_of(k.path, [u.pattern]) is not None}
    index = manifest.by_path()
    unfit: list[str] = []
    for leaf in leaves:
        i = index.get(leaf.path)
        if i is None or leaf.path in plan.handled:
            continue
        plan.handled.add(leaf.path)
        found = policy_for(leaf.path, policies)
        policy = found[1] if found is not None else parse_policy("same")
        try:
            src = choose_source(policy, manifest.keys[i], manifest.topology, live, rank)
        except ConfigurationError as exc:
            unfit.append(f"{path_text(leaf.path)} ({exc})" if found is not None else path_text(leaf.path))
            continue
        plan.picks.append((leaf, i, src))
        plan.consumed.add(i)
        plan.applied.append(f"{path_text(leaf.path)}: {policy.describe()} <- saved rank {src}")
    if unfit:
        raise ConfigurationError(f"{what}: per-rank state saved on {manifest.topology.describe()} cannot be restored "
                                 f"on {live.describe()} (rank {rank}) without a policy for key(s) "
                                 f"{', '.join(unfit[:8])}{' ...' if len(unfit) > 8 else ''}; pass per_rank={{pattern: "
                                 "'by-coordinate:<dims>' | 'rank0' | 'fresh' | reshard(fn)}")
    return plan


def assign(root: Any, path: tuple, value: Any, current: Any) -> None:
    """Put ``value`` at ``path``: tensors copied in place when shape and dtype match, dicts and lists merged
    key by key, anything else replaced (JSON values back in the live type)."""
    if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
        if current.shape == value.shape and current.dtype == value.dtype and not current.requires_grad:
            with torch.no_grad():
                current.copy_(value)
            return
        set_leaf(root, path, value.to(current.device) if current.device != value.device else value)
        return
    if isinstance(current, dict) and isinstance(value, Mapping):
        for k, v in value.items():
            if k in current:
                assign(root, path + (k,), v, current[k])
            else:
                current[k] = v
        return
    if isinstance(current, list) and isinstance(value, (list, tuple)) and len(current) == len(value):
        for k, v in enumerate(value):
            assign(root, path + (k,), v, current[k])
        return
    if not path:
        raise ConfigurationError("per_rank: a policy cannot replace the whole state dict; match a key inside it")
    set_leaf(root, path, from_json(value, current) if not isinstance(value, torch.Tensor) else value)


def _lookup(root: Any, path: tuple) -> Any:
    for p in path:
        root = root[p]
    return root


def _nest(items: list[tuple[tuple, Any]]) -> Any:
    """Leaves (relative path, value) as a nested structure (dicts whose keys are 0..n-1 become lists)."""
    if len(items) == 1 and items[0][0] == ():
        return items[0][1]
    out: dict = {}
    for rel, v in items:
        node = out
        for p in rel[:-1]:
            node = node.setdefault(p, {})
        node[rel[-1]] = v

    def fix(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        node = {k: fix(v) for k, v in node.items()}
        if node and all(type(k) is int for k in node) and set(node) == set(range(len(node))):
            return [node[i] for i in range(len(node))]
        return node

    return fix(out)


def saved_states(unit: _Unit, manifest: PerRankManifest | None, replicated: Mapping[tuple, Any],
                 read_object) -> list[SavedRankState]:
    """Every saved rank's state of every saved unit under ``unit.pattern`` (per-rank leaves from their
    entries, replicated leaves from ``replicated``: path -> value, or a callable reading a tensor)."""
    pattern = [unit.pattern]
    topo = manifest.topology if manifest is not None else RankTopology.flat(1)
    units: dict[tuple, list[tuple[tuple, Any]]] = {}  # saved unit path -> [(leaf path, None=per-rank | value)]
    for path, value in replicated.items():
        found = unit_of(path, pattern)
        if found is not None:
            units.setdefault(found[1], []).append((path, value))
    keys = manifest.keys if manifest is not None else ()
    for k in keys:
        found = unit_of(k.path, pattern)
        if found is not None:
            units.setdefault(found[1], []).append((k.path, k))
    out = []
    for upath in sorted(units, key=key_order):
        leaves = units[upath]
        for r in range(topo.world):
            items = []
            for path, v in leaves:
                if isinstance(v, PerRankKey):
                    e = v.entry(r)
                    if e is None:
                        continue
                    v = read_object(e.object)
                elif callable(v):
                    v = v()
                items.append((path[len(upath):], v))
            if items:
                out.append(SavedRankState(r, topo.coords(r), upath, _nest(items)))
    return out


def apply_units(state_dict: dict, plan: RestorePlan, replicated: Mapping[tuple, Any], read_object) -> None:
    """Run each reshard unit's callback and put its result in place (fresh units stay as built)."""
    saved_topo = plan.manifest.topology if plan.manifest is not None else RankTopology.flat(1)
    for u in plan.units:
        if u.policy.kind == "fresh":
            plan.applied.append(f"{path_text(u.path)}: fresh (left as built)")
            continue
        assert u.policy.fn is not None
        saved = saved_states(u, plan.manifest, replicated, read_object)
        target = RankTarget(plan.rank, plan.live.coords(plan.rank), u.path, plan.live.world, plan.live, saved_topo)
        value = u.policy.fn(saved, target)
        assign(state_dict, u.path, value, _lookup(state_dict, u.path))
        plan.applied.append(f"{path_text(u.path)}: {u.policy.describe()} from {len(saved)} saved state(s)")


def apply_picks(state_dict: dict, plan: RestorePlan, got: Mapping[str, Any]) -> None:
    """Put each picked saved entry into its live leaf."""
    assert plan.manifest is not None
    for leaf, i, r in plan.picks:
        e = plan.manifest.keys[i].entry(r)
        assert e is not None
        assign(state_dict, leaf.path, got[e.object], leaf.value)


def compare(live: Any, stored: Any) -> str | None:
    """None when a live per-rank leaf equals its stored entry bit for bit, else why not."""
    if isinstance(live, torch.Tensor) != isinstance(stored, torch.Tensor):
        return f"is a {type(live).__name__} live but a {type(stored).__name__} stored"
    if isinstance(live, torch.Tensor):
        a, b = live.detach().cpu().contiguous(), stored.contiguous()
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"is {a.dtype}{list(a.shape)} live but {b.dtype}{list(b.shape)} stored"
        diff = a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)
        n = int(diff.sum())
        return f"{n} byte(s) differ" if n else None
    if json.dumps(from_json(stored, live), sort_keys=True, default=repr) != json.dumps(live, sort_keys=True,
                                                                                        default=repr):
        return f"live {live!r} but stored {stored!r}"
    return None
