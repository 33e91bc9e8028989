"""What a DCP import records in the catalog, readable without torch (``ucp show`` lists opaque entries).

``INDEX_OBJECT`` is the JSON object an import (``adapter``) or the storage backend (``storage``) writes:
every DCP key with its kind and, for opaque entries, their size, sha256 and why they were kept as bytes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["INDEX_OBJECT", "opaque_entries", "path_of", "read_index"]

INDEX_OBJECT = "_dcp"


def read_index(checkpoint: Any) -> dict | None:
    """The version's ``INDEX_OBJECT`` (a JSON dict), or None when it has none."""
    from sqlalchemy import select

    from ucp_store.catalog import models as m

    with checkpoint.store.catalog.session() as s:
        row = s.scalars(select(m.StoredObject).where(m.StoredObject.checkpoint_id == checkpoint.id,
                                                     m.StoredObject.name == INDEX_OBJECT)).first()
        if row is None or row.kind != "json" or not isinstance(row.value, dict):
            return None
        return row.value


def opaque_entries(checkpoint: Any) -> list[dict]:
    """The opaque (never unpickled) non-tensor entries of a DCP import: key, bytes, sha256, why."""
    objs = read_index(checkpoint)
    if objs is None:
        return []
    return [{"key": k, **{f: v[f] for f in ("nbytes", "sha256", "why") if f in v}}
            for k, v in objs["keys"].items() if v.get("kind") == "opaque"]


def path_of(md: Any, key: str) -> list:
    """The key's path of nested containers, from DCP metadata's ``planner_data`` (else the key itself)."""
    pd = md.planner_data if isinstance(md.planner_data, dict) else {}
    p = pd.get(key)
    if isinstance(p, (tuple, list)) and p and all(isinstance(x, (str, int)) for x in p):
        return list(p)
    return [key]
