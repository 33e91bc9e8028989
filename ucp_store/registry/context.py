"""What the save and retention sides need of a store: its location, its catalog and its settings.

A :class:`~ucp_store.store.Store` builds one :class:`StoreContext` and hands it to the checkpoint writer
(``ucp_store/save/``) and to retention and gc (``ucp_store/registry/retention.py``), which use nothing else
of the store: no private helper of the facade, no import of it. The context is also enough to read a
version (:class:`~ucp_store.registry.checkpoint.Checkpoint` uses the same names: ``location``, ``catalog``,
``context``, ``array_url``).

This module imports nothing heavy: the TensorStore contexts are made on first use.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from ucp_store.catalog import models as m

if TYPE_CHECKING:  # pragma: no cover
    from ucp_store.io.location import Location

__all__ = ["ArrayContexts", "StoreContext", "as_store_context", "did_you_mean", "run_names"]


class ArrayContexts:
    """The TensorStore contexts a store's arrays open with, made on first use (TensorStore is imported then).

    One per store, shared by every writer and reader of it (their cache pool and file handles), and kept
    when the store's :class:`StoreContext` is rebuilt."""

    def __init__(self) -> None:
        self._synced: Any = None
        self._unsynced: Any = None

    @property
    def synced(self) -> Any:
        """The default context: TensorStore makes each local file durable as it writes it."""
        if self._synced is None:
            from ucp_store.io.format import make_context

            self._synced = make_context()
        return self._synced

    @property
    def unsynced(self) -> Any:
        """The context of a writer that defers durability (``CheckpointWriter.defer_durability``): local files
        are not fsynced one by one; that writer fsyncs them all at once before it records their rows."""
        if self._unsynced is None:
            from ucp_store.io.format import make_context

            self._unsynced = make_context(sync=False)
        return self._unsynced


@dataclass(frozen=True, eq=False)
class StoreContext:
    """A store as the writer and retention see it (compared and hashed by identity: one per store).

    ``location``: where the arrays live; ``catalog``: the SQL catalog (a ``NoCatalog`` on a detached rank);
    ``settings``: the store's recorded settings (compression, chunk target, format version), read only;
    ``detached``: a non-coordinator rank of a distributed save, which never reads the catalog (the
    coordinator deduplicates and records its rows); ``arrays``: the store's TensorStore contexts."""

    location: "Location"
    catalog: Any
    settings: Mapping[str, Any]
    detached: bool = False
    arrays: ArrayContexts = field(default_factory=ArrayContexts, compare=False, repr=False)

    @property
    def context(self) -> Any:
        """The TensorStore context every array of the store opens with (the name ``Store.context`` has)."""
        return self.arrays.synced

    @property
    def unsynced_context(self) -> Any:
        """The context of a writer that defers durability (see :attr:`ArrayContexts.unsynced`)."""
        return self.arrays.unsynced

    def array_url(self, rel: str) -> str:
        """The address of the array at ``rel`` for messages (a path or a bucket URL)."""
        return self.location.display(rel)


def as_store_context(store: Any) -> StoreContext:
    """``store`` if it is a :class:`StoreContext`, else the context a store-like object hands out
    (``Store.store_context``): the writer's constructor takes either."""
    if isinstance(store, StoreContext):
        return store
    ctx = getattr(store, "store_context", None)
    if not isinstance(ctx, StoreContext):
        raise TypeError(f"expected a Store or a StoreContext, got {type(store).__name__}")
    return ctx


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``"; did you mean: a, b?"`` with the names among ``candidates`` close to ``word``, or ``""``."""
    near = difflib.get_close_matches(word, list(candidates), n=5, cutoff=0.5)
    return f"; did you mean: {', '.join(near)}?" if near else ""


def run_names(s) -> list[str]:
    """Every run's name, in session ``s`` (the candidates of a "run not found" message)."""
    return list(s.scalars(select(m.Run.name)))
