"""Per-rank client state of DeepSpeed checkpoints (issue 28): recorded per rank with DeepSpeed's coordinates,
restored by rank on the saving topology and by a declared policy on another.

``engine.save_checkpoint(client_state=...)`` puts the client state into the model-states file(s): one per
model-parallel rank from DP rank 0 at ZeRO-1/2 (``mp_rank_XX_model_states.pt``), one per rank at ZeRO-3
(``zero_pp_rank_D_mp_rank_XX_model_states.pt``). A key whose value is equal in every saved copy stays in
the ``client_state`` object as before. A key whose value differs across ranks -- an RNG state, a sampler
position -- is per-rank: each distinct value is stored once (``rank_record.object_name``) and the per-rank
record (:mod:`ucp_store.catalog.rank_record`, the JSON ``ucp_store.distributed`` keeps) lists every saving rank's entry
under the path ``("client_state", key)``, with the topology as a ``pp x dp x tp`` mesh over the global
ranks in Megatron's order (tp fastest). The ucp DeepSpeed engine records every rank's client state (it
sees the ``client_state`` argument on each rank); a folder holds only the ranks DeepSpeed wrote files for
(ZeRO-1/2: DP rank 0 only, so other DP ranks' client state never reaches the folder).

``ds_load.load`` then returns each rank its own client state on the saving topology, and on another one
follows ``per_rank`` (the policies of ``ucp_store.distributed.load``: ``by-coordinate:dp``, ``rank0``,
``fresh``, a reshard callable) or raises naming the keys and both topologies.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ucp_store.catalog.rank_record import RECORD_OBJECT, object_name
from ucp_store.errors import ConfigurationError

__all__ = ["file_ranks", "restore_client", "split_client", "topology"]

_ROOT = "client_state"


def topology(tp: int, pp: int, dp: int):
    """DeepSpeed's ranks as a ``pp x dp x tp`` mesh (Megatron's order: global rank = (pp*dp + d)*tp + t)."""
    from ucp_store.distributed.rankstate import RankTopology

    world = tp * pp * dp
    return RankTopology.from_mesh(("pp", "dp", "tp"), (pp, dp, tp), tuple(range(world)))


def file_ranks(reader) -> dict[str, int]:
    """Model-states file -> the global rank that wrote it (a ``DeepSpeedReader``'s files)."""
    tp, dp = int(reader.tp), int(reader.dp)

    def rank(mp: int, d: int) -> int:
        return ((mp // tp) * dp + d) * tp + mp % tp

    if getattr(reader, "zero3_model_files", None) and reader.zero_stage >= 3:
        return {f: rank(mp, d) for (mp, d), f in reader.zero3_model_files.items()}
    if not hasattr(reader, "model_files"):  # the engine's in-memory reader: rank 0's file only
        return {f: 0 for f in reader.model_states}
    return {f: rank(mp, 0) for mp, f in reader.model_files.items()}


def split_client(clients: Mapping[int, Mapping[str, Any]], topo) -> tuple[dict, dict[str, Any]]:
    """From every saving rank's client state (JSON form, by global rank): the ``client_state`` object (keys
    equal on every saving rank) and the objects of the per-rank keys plus their record (``RECORD_OBJECT``;
    absent when no key differs)."""
    from ucp_store.distributed.rankstate import PerRankEntry, PerRankKey, PerRankManifest, key_order

    ranks = sorted(clients)
    keys = sorted({k for r in ranks for k in clients[r]}, key=str)
    common: dict[str, Any] = {}
    per_rank = []
    for k in keys:
        texts = {json.dumps(clients[r][k], sort_keys=True) if k in clients[r] else None for r in ranks}
        if len(texts) == 1 and None not in texts:
            common[k] = clients[ranks[0]][k]
        else:
            per_rank.append(k)
    objects: dict[str, Any] = {}
    records = []
    for i, k in enumerate(sorted(per_rank, key=lambda k: key_order((_ROOT, k)))):
        owners: dict[str, int] = {}
        entries = []
        for r in ranks:
            if k not in clients[r]:
                continue
            text = json.dumps(clients[r][k], sort_keys=True)
            owner = owners.setdefault(text, r)
            if owner == r:
                objects[object_name(owner, i)] = clients[r][k]
            entries.append(PerRankEntry(r, "value", object_name(owner, i)))
        records.append(PerRankKey((_ROOT, k), tuple(entries)))
    if records:
        objects[RECORD_OBJECT] = {"source": "deepspeed", **PerRankManifest(topo, tuple(records)).to_json()}
    return common, objects


def _policies(per_rank: Mapping[str, Any] | None) -> dict:
    from ucp_store.distributed.perrank import parse_policies

    return parse_policies(per_rank)


def restore_client(objs: Mapping[str, Any], live, rank: int, per_rank: Mapping[str, Any] | None,
                   *, what: str) -> dict:
    """The client state (JSON form) loading rank ``rank`` of topology ``live`` gets: the common keys plus
    each per-rank key's entry its policy picks (``same`` on the saving topology). Raises
    ``ConfigurationError`` naming every key without a fitting policy and both topologies."""
    from ucp_store.distributed.rankstate import (
        PerRankManifest,
        RankTarget,
        SavedRankState,
        choose_source,
        parse_policy,
        policy_for,
    )

    client = dict(objs.get(_ROOT) or {})
    rec = objs.get(RECORD_OBJECT)
    if not isinstance(rec, dict) or rec.get("source") != "deepspeed":
        return client
    manifest = PerRankManifest.from_json(rec)
    saved = manifest.topology
    policies = _policies(per_rank)
    unfit = []
    for key in manifest.keys:
        found = policy_for(key.path, policies)
        policy = found[1] if found is not None else parse_policy("same")
        name = key.path[-1]
        if policy.kind == "fresh":
            continue  # deliberately not restored: the caller keeps its own
        if policy.kind == "reshard":
            assert policy.fn is not None
            states = [SavedRankState(e.rank, saved.coords(e.rank), key.path, objs[e.object]) for e in key.entries]
            client[name] = policy.fn(states, RankTarget(rank, live.coords(rank), key.path, live.world, live, saved))
            continue
        try:
            src = choose_source(policy, key, saved, live, rank)
        except ConfigurationError as exc:
            unfit.append(f"{key.text} ({exc})" if found is not None else key.text)
            continue
        entry = key.entry(src)
        assert entry is not None
        client[name] = objs[entry.object]
    if unfit:
        raise ConfigurationError(f"{what}: per-rank client state saved on {saved.describe()} cannot be restored on "
                                 f"{live.describe()} (rank {rank}) without a policy for key(s) {', '.join(unfit)}; "
                                 "pass per_rank={pattern: 'by-coordinate:<dims>' | 'rank0' | 'fresh' | fn}")
    return client
