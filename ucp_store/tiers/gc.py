"""gc of a node's fast tier (issue 38): copies the catalog says were evicted go; anything else it cannot tie
to its own rows is reported, never deleted.

A fast-tier folder holds ``arrays/<version>/...`` objects. For each file: a ``complete`` or ``writing`` row of
(that version, ``fast``, this node, its key) keeps it; an ``evicted`` row (eviction changed the row first, and a
crash left the file) lets gc delete it; no row at all (a version the catalog does not know, a temporary of a
killed write, a copy whose row went with its version) is reported and left, as ``ucp gc`` does with what it
cannot tie to its catalog on the durable tier.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select

from ucp_store.catalog import models as m
from ucp_store.io.location import ARRAYS_DIR
from ucp_store.tiers import objects as tobj
from ucp_store.tiers.placement import FAST

__all__ = ["FastReport", "sweep_fast"]


@dataclass
class FastReport:
    """What :func:`sweep_fast` did on one node's fast tier."""

    root: str
    node: str
    deleted: list[str] = field(default_factory=list)  # evicted copies removed (or, dry run, to remove)
    kept: int = 0  # objects a complete or writing row keeps
    untied: list[str] = field(default_factory=list)  # reported, never deleted
    freed_bytes: int = 0

    def to_json(self) -> dict:
        return {"root": self.root, "node": self.node, "deleted": self.deleted, "kept": self.kept,
                "untied": self.untied, "freed_bytes": self.freed_bytes}


def sweep_fast(catalog, root: str | os.PathLike, node: str, *, dry_run: bool = False) -> FastReport:
    """Remove the evicted copies under ``root`` (node ``node``'s fast tier) and report what no row ties."""
    report = FastReport(str(root), node)
    keys = list(tobj.walk_objects(root, ARRAYS_DIR))
    versions = sorted({k.split("/")[1] for k in keys if k.count("/") >= 2})
    states: dict[tuple[str, str], str] = {}
    with catalog.session() as s:
        for i in range(0, len(versions), 500):
            part = versions[i:i + 500]
            q = select(m.Placement.checkpoint_id, m.Placement.object, m.Placement.state).where(
                m.Placement.checkpoint_id.in_(part), m.Placement.tier == FAST, m.Placement.node == node)
            for ck, obj, state in s.execute(q):
                states[(ck, obj)] = state
    for key in keys:
        parts = key.split("/")
        state = states.get((parts[1], key)) if len(parts) > 2 else None
        if state in ("complete", "writing"):
            report.kept += 1
        elif state == "evicted":
            path = tobj.object_path(root, key)
            report.freed_bytes += path.stat().st_size
            report.deleted.append(key)
            if not dry_run:
                path.unlink()
        else:
            report.untied.append(key)
    if not dry_run:  # the folders emptied here (only versions gc deleted from: a save may be making others)
        for ck in sorted({k.split("/")[1] for k in report.deleted}):
            _remove_empty(Path(root) / ARRAYS_DIR / ck)
    return report


def _remove_empty(top: Path) -> None:
    for dirpath, _, _ in os.walk(top, topdown=False):
        if not os.listdir(dirpath):
            os.rmdir(dirpath)
