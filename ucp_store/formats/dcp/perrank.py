"""DCP's per-rank entries in and out of a store (``ucp import dcp`` / ``ucp export dcp``, issue 28).

DCP keeps state per rank only under keys that name the rank: its save planner keeps ONE copy of every
key that several ranks write (``dedup_save_plans``: whichever rank has the least to write), so a value that
differs across ranks under one name is collapsed by DCP itself before any file exists. Jobs that need
per-rank state therefore invent a key per rank -- torchtitan's ``dataloader.dp_rank_<i>`` -- which only
that rank writes, into its own ``__<rank>_<n>.distcp`` file.

Import: a non-tensor-state entry (a ``BYTE_IO`` value or blob, or a tensor that is not a model or
optimizer state) is per-rank when a component of its key names a rank (``dp_rank_3``, ``rank_1``,
``rank0``, ``tp_rank_2``) or matches a ``per_rank`` pattern the caller gives. Its entry is kept under its
key as before, and recorded in the version's per-rank record (:mod:`ucp_store.catalog.rank_record`, the same JSON
``ucp_store.distributed`` keeps: the saving topology -- the ranks that wrote data files -- and, per key, the rank
whose file holds it). A replicated key is not per-rank even though DCP stores it in one rank's file (DCP
chose that rank to balance the write, it says nothing about the state).

Export: the entries are written back under their own keys, so ``dcp.load`` on rank ``i`` asking for
``dataloader.dp_rank_<i>`` gets rank ``i``'s bytes. A version from elsewhere (``ucp_store.distributed.save``, a
DeepSpeed import) whose per-rank keys have no DCP name gets one entry per saving rank under
``<key>.rank_<r>``, DCP's per-rank convention, instead of being dropped.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterable
from typing import Any

from ucp_store.catalog.rank_record import RECORD_OBJECT
from ucp_store.errors import SourceFormatError
from ucp_store.formats.dcp.index import path_of

__all__ = ["RANK_NAME", "export_entries", "file_rank", "per_rank_keys", "record"]

#: a key component that names a rank: dp_rank_3, rank_1, rank0, tp_rank_2, global_rank_7
RANK_NAME = re.compile(r"^(?:[A-Za-z0-9]+_)*rank_?(\d+)$", re.IGNORECASE)
_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def file_rank(relative_path: str) -> int | None:
    """The saving rank of a FileSystemWriter data file ``__<rank>_<n>.distcp`` (None for another name)."""
    m = _DATA_FILE.match(os.path.basename(relative_path))
    return int(m.group(1)) if m else None


def _named_rank(path: list) -> int | None:
    for p in reversed(path):
        m = RANK_NAME.match(str(p))
        if m:
            return int(m.group(1))
    return None


def per_rank_keys(source: Any, patterns: Iterable[str] | None = None) -> dict[str, tuple[int, str]]:
    """Key -> (saving rank, data file) of every per-rank entry of a ``DcpSource``: a non-tensor-state entry
    whose key names a rank or matches one of ``patterns`` (fnmatch over the dotted key)."""
    pats = [str(p) for p in (patterns or ())]
    out: dict[str, tuple[int, str]] = {}
    for key, e in source.entries.items():
        if e.kind == "tensor":
            continue  # model and optimizer states: sharded or replicated tensors, never per-rank
        path = path_of(source.md, key)
        if _named_rank(path) is None and not any(fnmatch.fnmatchcase(key, p) for p in pats):
            continue
        if e.kind == "array":
            files = sorted(info.relative_path for (k, _), info in source._storage.items() if k == key)
        else:
            info = source._bytes_info.get(key)
            files = [info.relative_path] if info is not None else []
        found = {file_rank(f) for f in files}
        ranks = {r for r in found if r is not None}
        if not files or None in found or len(ranks) != 1:
            # the rank in the name is all that is left (the data files were renamed or several ranks wrote it)
            named = _named_rank(path)
            if named is None:
                raise SourceFormatError(f"{source.folder}: per-rank entry {key!r} lies in {files or 'no file'}, "
                                        "not in one rank's __<rank>_<n>.distcp file, and its key names no rank")
            out[key] = (named, files[0] if files else "")
        else:
            out[key] = (ranks.pop(), files[0])
    return out


def _world(source: Any, found: dict[str, tuple[int, str]]) -> int:
    """The ranks of the save: every rank wrote a data file (an empty one when it had nothing to write)."""
    names = [getattr(i, "relative_path", "") for i in source.md.storage_data.values()]
    try:
        names += os.listdir(source.folder)
    except OSError:
        pass
    ranks = {r for r in map(file_rank, names) if r is not None} | {r for r, _ in found.values()}
    return max(ranks) + 1 if ranks else 1


def record(source: Any, index: dict[str, dict], found: dict[str, tuple[int, str]]) -> dict | None:
    """The per-rank record of an import (``PerRankManifest`` JSON plus ``source``), and each per-rank key's
    saving rank and file noted in the ``_dcp`` index; None when the folder has no per-rank entry."""
    from ucp_store.distributed.rankstate import PerRankEntry, PerRankKey, PerRankManifest, RankTopology, key_order

    if not found:
        return None
    keys = []
    for key, (rank, rel) in found.items():
        entry = index[key]
        kind = {"array": "tensor", "value": "value"}.get(entry["kind"], "opaque")
        # the object is the DCP key's own (the import stores every entry under its key)
        keys.append(PerRankKey(tuple(entry["path"]), (PerRankEntry(rank, kind, key),)))
        entry["per_rank"] = {"rank": rank, "file": rel}
    keys.sort(key=lambda k: key_order(k.path))
    manifest = PerRankManifest(RankTopology.flat(_world(source, found)), tuple(keys))
    return {"source": "dcp", **manifest.to_json()}


def check_names(source: Any) -> None:
    """A DCP key that would clash with the per-rank record's object names is refused before anything runs."""
    for key in source.entries:
        if key == RECORD_OBJECT or key.startswith(RECORD_OBJECT + "/"):
            raise SourceFormatError(f"{source.folder}: a DCP key is named {key!r}, a name ucp keeps its per-rank "
                                    "record under")


def export_entries(checkpoint, taken: set[tuple]) -> list[tuple[tuple, Any]]:
    """(DCP path, value) of every per-rank entry of a version that has no DCP key index (a
    ``ucp_store.distributed`` save, a DeepSpeed import): ``<key>.rank_<r>`` for each saving rank ``r``."""
    from ucp_store.catalog.rank_record import read_record
    from ucp_store.distributed.perrank import read_entries

    rec = read_record(checkpoint)
    if rec is None:
        return []
    wanted = {e["object"] for k in rec["keys"] for e in k["entries"]}
    values = read_entries(checkpoint, wanted)
    out = []
    for k in rec["keys"]:
        for e in k["entries"]:
            path = (*k["path"], f"rank_{e['rank']}")
            if path in taken:
                raise SourceFormatError(f"checkpoint {checkpoint.run}@{checkpoint.step}: per-rank key "
                                        f"{'.'.join(map(str, path))} clashes with a key of the export")
            out.append((path, values[e["object"]]))
    return out
