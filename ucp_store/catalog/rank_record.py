"""The catalog record of a version's per-rank state, as every path writes it, and its ``ucp show`` view.

``ucp_store.distributed.save`` keeps its record (``rankstate.PerRankManifest``: the saving topology and, per
per-rank key, every holding rank's entry) inside its ``dist.state_dict`` object. The imports and engines
that have no such state-dict manifest -- ``ucp import dcp`` (DCP's per-rank ``BYTE_IO`` entries such as
torchtitan's ``dataloader.dp_rank_<i>``), ``ucp import deepspeed`` and the DeepSpeed checkpoint engine
(per-rank client state of the ``*model_states.pt`` files) -- write the same JSON under the object
``RECORD_OBJECT``, with a ``source`` naming the path. Per-rank contents they store themselves are named
``object_name(owner, index)``.

This module reads the catalog only (no torch, numpy or TensorStore): ``ucp show`` uses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["DIST_OBJECT", "RECORD_OBJECT", "describe_topology", "object_name", "read_record", "show_json",
           "show_lines"]

#: the object an import or engine writes its per-rank record under (PerRankManifest JSON plus "source")
RECORD_OBJECT = "ucp/per_rank"
#: ucp_store.distributed's state-dict manifest object (its "per_rank" section is the same record)
DIST_OBJECT = "dist.state_dict"


def object_name(owner: int, index: int) -> str:
    """The object holding per-rank key ``index``'s content first held by rank ``owner`` (imports, engines)."""
    return f"{RECORD_OBJECT}/r{int(owner)}/{int(index)}"


def _objects(checkpoint, names: list[str]) -> dict[str, Any]:
    from sqlalchemy import select

    from ucp_store.catalog import models as m

    with checkpoint.store.catalog.session() as s:
        rows = s.scalars(select(m.StoredObject).where(m.StoredObject.checkpoint_id == checkpoint.id,
                                                      m.StoredObject.name.in_(names)))
        return {o.name: o.value for o in rows if o.kind == "json"}


def read_record(checkpoint) -> dict | None:
    """The version's per-rank record: ``{"source", "topology", "keys"}`` (``keys``: path, text, entries of
    rank, kind, object), or None when it has no per-rank state."""
    objs = _objects(checkpoint, [DIST_OBJECT, RECORD_OBJECT])
    dist = objs.get(DIST_OBJECT)
    if isinstance(dist, dict) and isinstance(dist.get("per_rank"), dict):
        rec = dict(dist["per_rank"])
        rec.setdefault("source", "ucp_store.distributed")
    elif isinstance(objs.get(RECORD_OBJECT), dict):
        rec = dict(objs[RECORD_OBJECT])
    else:
        return None
    if not rec.get("keys"):
        return None
    return rec


def describe_topology(topo: Mapping[str, Any]) -> str:
    """``4 ranks, mesh dp=2 x tp=2`` / ``2 ranks, no mesh`` (``RankTopology.describe`` without torch)."""
    world = int(topo.get("world", 0))
    ranks = f"{world} rank{'s' if world != 1 else ''}"
    if topo.get("mesh") is None:
        return f"{ranks}, no mesh"
    mesh = " x ".join(f"{d}={s}" for d, s in zip(topo.get("dims", ()), topo.get("shape", ())))
    order = "" if list(topo["mesh"]) == sorted(topo.get("global_ranks", ())) else f" (global ranks {topo['mesh']})"
    return f"{ranks}, mesh {mesh}{order}"


def _coords(topo: Mapping[str, Any], rank: int) -> dict[str, int]:
    """Group rank ``rank``'s mesh coordinates (``RankTopology.coords`` without torch)."""
    mesh, dims, shape = topo.get("mesh"), list(topo.get("dims", ())), list(topo.get("shape", ()))
    ranks = list(topo.get("global_ranks", ()))
    if mesh is None or not 0 <= rank < len(ranks) or ranks[rank] not in mesh:
        return {}
    flat = list(mesh).index(ranks[rank])
    out: dict[str, int] = {}
    for dim, size in zip(reversed(dims), reversed(shape)):
        out[dim] = flat % int(size)
        flat //= int(size)
    return {d: out[d] for d in dims}


def show_json(record: Mapping[str, Any]) -> dict:
    """What ``ucp show --json`` prints under ``per_rank``: the record plus each entry's coordinates."""
    topo = record["topology"]
    keys = []
    for k in record["keys"]:
        entries = [{**e, "coords": _coords(topo, int(e["rank"]))} for e in k["entries"]]
        keys.append({**{f: v for f, v in k.items() if f != "entries"}, "entries": entries})
    return {"source": record.get("source"), "topology": topo, "saved_on": describe_topology(topo), "keys": keys}


def _who(topo: Mapping[str, Any], rank: int) -> str:
    c = _coords(topo, rank)
    return f"{rank}" + (f" ({', '.join(f'{d}={v}' for d, v in c.items())})" if c else "")


def show_lines(record: Mapping[str, Any] | None) -> list[str]:
    """``ucp show``'s per-rank section: the saving topology, then one line per per-rank key with the ranks
    that held it (and their coordinates) and how many distinct contents they hold."""
    if not record:
        return []
    topo = record["topology"]
    out = [f"per-rank keys: {len(record['keys'])}, saved on {describe_topology(topo)} (source "
           f"{record.get('source') or '-'})"]
    for k in record["keys"]:
        text = k.get("text") or ".".join(str(p) for p in k["path"])
        entries = k["entries"]
        kinds = sorted({e["kind"] for e in entries})
        distinct = len({e["object"] for e in entries})
        ranks = ", ".join(_who(topo, int(e["rank"])) for e in entries)
        out.append(f"  {text} [{'/'.join(kinds)}]: rank{'s' if len(entries) != 1 else ''} {ranks}; {distinct} distinct "
                   f"content{'s' if distinct != 1 else ''}")
    return out

