"""Retention per tier (issue 38): which fast copies go, and the rule that no version loses its last copy.

The durable tier keeps its own policy (``registry/retention.py``: ``keep_last``, ``keep_every``, tags), applied
by ``gc`` as before. The fast tier keeps the newest ``keep`` versions of a run; an older version's fast copies
are evicted only once it is ``durable`` (:func:`evict_fast`). :func:`evict` removes one node's copies of one
version and refuses when that would leave an object of a version without a complete copy.
Rows change first (``evicted``), in the caller's transaction; the files go after it commits, so the catalog
never names a copy that is gone (a crash in between leaves files no row ties, which ``gc`` reports).
"""

from __future__ import annotations

from sqlalchemy import select

from ucp_store.catalog import models as m
from ucp_store.errors import ConflictError
from ucp_store.tiers import placement as tplace

__all__ = ["evict_fast", "evict", "fast_holders"]


def fast_holders(session, run: str) -> list[tuple[str, int]]:
    """(version id, step) of the run's committed versions with a fast copy not evicted, newest step first."""
    q = (select(m.Checkpoint.id, m.Checkpoint.step).join(m.Run, m.Run.id == m.Checkpoint.run_id)
         .where(m.Run.name == run, m.Checkpoint.status == "committed")
         .where(m.Checkpoint.id.in_(select(m.Placement.checkpoint_id).where(
             m.Placement.tier == tplace.FAST, m.Placement.state != "evicted")))
         .order_by(m.Checkpoint.step.desc()))
    return [(ck, int(step)) for ck, step in session.execute(q)]


def evict_fast(session, *, run: str, keep: int) -> list[str]:
    """Evict the fast copies of the run's versions older than its newest ``keep`` that hold fast copies, where
    the version is durable (every object complete on the durable tier); the others stay. Returns the versions
    evicted (their folders may now be deleted on every node)."""
    out = []
    for ck, _ in fast_holders(session, run)[keep:]:
        if tplace.compute_safety(session, ck) != "durable":
            continue  # never the last copy of a version that is not durable
        nodes = set(session.scalars(select(m.Placement.node).where(
            m.Placement.checkpoint_id == ck, m.Placement.tier == tplace.FAST, m.Placement.state != "evicted")))
        for node in sorted(nodes):
            tplace.set_state(session, ck, tplace.FAST, node, "evicted", refresh=False)
        tplace.refresh_safety(session, ck)
        out.append(ck)
    return out


def evict(session, checkpoint_id: str, node: str) -> int:
    """Evict ``node``'s fast copies of a version; ConflictError (nothing changed) when an object would be left
    without a complete copy on any tier. Returns the rows evicted; the safety is refreshed."""
    left = {k: [c for c in cs if not (c.tier == tplace.FAST and c.node == node)]
            for k, cs in tplace.copies(session, checkpoint_id).items()}
    last = sorted(k for k, cs in left.items() if not cs)
    if last:
        raise ConflictError(f"version {checkpoint_id}: node {node!r} holds the last copy of {len(last)} object(s) "
                            f"(first: {last[0]}); not evicted (drain it to the durable tier first)")
    return tplace.set_state(session, checkpoint_id, tplace.FAST, node, "evicted")
