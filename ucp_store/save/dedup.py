"""Deduplication of a save's arrays: an array whose content a committed version already holds is not written
again; the new rows reference that array.

The first lookups of a writer ask the catalog for their hash alone (an indexed query; a save that writes few
whole arrays, or whose sharded arrays are looked up together by ``finish_shards``, never reads every committed
array's hash); past :data:`TARGETED_LOOKUPS` of them, the committed arrays' hashes are read once (one query
instead of one per write). An array swept meanwhile by a concurrent rm/gc is caught when the rows are
recorded (``rows.CatalogRecorder.insert_rows``).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import exists, select

from ucp_store.catalog import models as m
from ucp_store.registry.context import StoreContext

__all__ = ["TARGETED_LOOKUPS", "Deduplicator", "committed_arrays_query"]

TARGETED_LOOKUPS = 8  # a writer's catalog lookups of single content hashes before it reads them all at once


def committed_arrays_query(hashes: list[str] | None = None) -> Any:
    """(content hash, id, shape, dtype) of the ready arrays a committed version references; with ``hashes``,
    only those with one of these hashes."""
    q = (select(m.Array.content_hash, m.Array.id, m.Array.shape, m.Array.dtype)
         .where(m.Array.status == "ready", m.Array.content_hash.is_not(None))
         .where(exists().where(m.Tensor.array_id == m.Array.id, m.Tensor.checkpoint_id == m.Checkpoint.id,
                               m.Checkpoint.status == "committed")))
    return q if hashes is None else q.where(m.Array.content_hash.in_(hashes))


class Deduplicator:
    """The arrays one writer may reference instead of writing: those it wrote itself (``local_arrays``) and
    those of committed versions (looked up in the catalog, never on a detached rank: the coordinator
    deduplicates its rows)."""

    def __init__(self, ctx: StoreContext):
        self.ctx = ctx
        #: content hash -> array id written by this writer (or, on the coordinator, by a joined rank)
        self.local_arrays: dict[str, str] = {}
        self._committed_hashes: dict[str, list] | None = None
        self._hash_lookups: dict[str, list] = {}  # the targeted lookups: content hash -> committed arrays
        self._lookups = 0
        #: False: nothing is deduplicated (a tiered save: every object of its version is its own, so where its
        #: copies are is all in the version's placement rows, ``ucp_store.tiers``)
        self.enabled = True

    def find(self, h: str, dtype: str, shape: Any) -> str | None:
        """An existing ready array of this save or of a committed version with this content, or None."""
        if not self.enabled:
            return None
        if h in self.local_arrays:
            return self.local_arrays[h]
        for aid, ashape, adtype in self._committed_candidates(h):
            if adtype == dtype and ashape == list(shape):
                return aid
        return None

    def _committed_candidates(self, h: str) -> list:
        if self.ctx.detached:  # a non-coordinator rank: the coordinator dedups its rows
            return []
        if self._committed_hashes is not None:
            return self._committed_hashes.get(h, [])
        if h not in self._hash_lookups:
            if self._lookups >= TARGETED_LOOKUPS:
                with self.ctx.catalog.session() as s:
                    self._committed_hashes = {}
                    for ch, aid, ashape, adtype in s.execute(committed_arrays_query()):
                        self._committed_hashes.setdefault(ch, []).append((aid, list(ashape), adtype))
                return self._committed_hashes.get(h, [])
            self.lookup_hashes([h])
        return self._hash_lookups.get(h, [])

    def lookup_hashes(self, hashes: list[str]) -> None:
        """Look up the committed arrays with these content hashes, in one query (kept for :meth:`find`)."""
        if not self.enabled:
            return
        todo = sorted({h for h in hashes if h not in self._hash_lookups})
        if not todo or self._committed_hashes is not None or self.ctx.detached:
            return
        self._lookups += 1
        for i in range(0, len(todo), 500):
            part = todo[i:i + 500]
            for h in part:
                self._hash_lookups[h] = []
            with self.ctx.catalog.session() as s:
                for ch, aid, ashape, adtype in s.execute(committed_arrays_query(part)):
                    self._hash_lookups[ch].append((aid, list(ashape), adtype))

    def forget_committed(self) -> None:
        """Drop what was read of committed arrays (stale once a concurrent sweep removed one of them)."""
        self._committed_hashes = None
        self._hash_lookups.clear()
