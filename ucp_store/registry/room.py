"""Room on a full disk: ``rm`` and ``gc`` free space where the catalog cannot be written.

Every catalog write needs a little room beside the catalog (SQLite's WAL index and log, or its rollback
journal), so on a full disk the transaction that would delete a version's rows cannot even begin, and
without it nothing is freed. :func:`with_room` runs such an operation; when it fails because the disk is
full, it opens the store read-only (``open_store(read_only=True)``), finds the versions the operation
removes, deletes first the files of the arrays that only those versions use (no other version's tensor or
object row references them, no kept array reads through them as a delta base), and runs the operation
again with the room this made. Arrays shared with a kept version are never touched.

Until the second run commits, the removed versions are still listed with their files gone: a crash in
between leaves them so (``ucp verify`` names the missing files), and the same ``rm`` or ``gc`` run again
finishes the job. A folder store with a SQLite catalog only: elsewhere the first error stands.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from sqlalchemy import select

from ucp_store.catalog import models as m
from ucp_store.errors import CatalogError, TaggedCheckpointError, WriteError
from ucp_store.io import space

__all__ = ["ROOM_BYTES", "with_room", "own_arrays", "free_own_arrays", "disk_full", "rm_victims"]

T = TypeVar("T")

#: below this many free bytes on the catalog's filesystem, a failed catalog write is taken as the disk being
#: full (SQLite's WAL index alone is 32 KiB; a transaction's log or journal holds every page it changes)
ROOM_BYTES = 1 << 20
_FULL_TEXT = ("database or disk is full", "disk i/o error", "no space left", "unable to open database file")


def _catalog_file(store: Any) -> str | None:
    from sqlalchemy.engine import make_url

    url = make_url(store.location.catalog_url)
    return url.database if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:") else None


def disk_full(exc: BaseException, store: Any) -> bool:
    """Whether ``exc`` (a failed open or write of ``store``'s catalog) comes from a full disk: its text or
    errno says so and the catalog's filesystem has less than :data:`ROOM_BYTES` free."""
    db = _catalog_file(store)
    if db is None or store.location.kind != "file":
        return False
    text = str(exc).lower()
    if not (space.is_no_space(exc) or any(t in text for t in _FULL_TEXT)):
        return False
    free = space.free_bytes(os.path.dirname(db))
    return free is not None and free < ROOM_BYTES


def own_arrays(store: Any, victims: Iterable[str]) -> list[tuple[str, int]]:
    """``(path, nbytes)`` of the arrays only the versions ``victims`` use: referenced by their tensor or
    object rows and by no other version's, and no delta base of an array another version keeps."""
    victims = set(victims)
    if not victims:
        return []
    with store.catalog.session() as s:
        users: dict[str, set[str]] = {}
        for table in (m.Tensor, m.StoredObject):
            for aid, cid in s.execute(select(table.array_id, table.checkpoint_id).where(table.array_id.is_not(None))):
                users.setdefault(aid, set()).add(cid)
        arrays = {a.id: a for a in s.scalars(select(m.Array))}
    mine = {aid for aid, cids in users.items() if cids <= victims and aid in arrays}
    # a kept array (any other) may read through a chain of delta bases: keep every base of one
    kept = set(arrays) - mine
    frontier = [arrays[a].base_array_id for a in kept if arrays[a].base_array_id]
    while frontier:
        base = frontier.pop()
        if base in mine:
            mine.discard(base)
            if arrays[base].base_array_id:
                frontier.append(arrays[base].base_array_id)
    return sorted((arrays[a].path, arrays[a].nbytes) for a in mine)


def free_own_arrays(store: Any, victims: Iterable[str]) -> tuple[int, int]:
    """Delete the files of :func:`own_arrays` (their rows stay until the operation commits); returns
    (arrays, bytes freed)."""
    from ucp_store.registry.identity import ensure_owned

    ensure_owned(store.location, store.catalog, adopt=False)  # never delete through another store's catalog
    n, freed = 0, 0
    for path, nbytes in own_arrays(store, victims):
        size = store.location.delete_tree(path)
        n += 1
        freed += nbytes if size is None else size
    return n, freed


def rm_victims(refs: Iterable[str], force: bool) -> Callable[[Any], list[str]]:
    """The versions ``rm refs`` removes, refused as ``rm`` refuses them (a tagged one without ``force``)."""
    def victims(store: Any) -> list[str]:
        out = []
        for ref in refs:
            cid = store.resolve(ref)
            with store.catalog.session() as s:
                tags = list(s.scalars(select(m.Tag.name).where(m.Tag.checkpoint_id == cid)))
            if tags and not force:
                raise TaggedCheckpointError(f"checkpoint {ref} ({cid}) is tagged {', '.join(tags)}; untag it or use "
                                            "--force")
            out.append(cid)
        return out
    return victims


def with_room(open_rw: Callable[[], Any], open_ro: Callable[[], Any], victims_of: Callable[[Any], list[str]],
              op: Callable[[Any], T]) -> T:
    """``op(open_rw())``; when that fails on a full disk, the files only ``victims_of(read-only store)`` use
    are deleted first and ``op`` runs again on a fresh open (see the module's docstring)."""
    try:
        return op(open_rw())
    except (CatalogError, OSError) as first:
        failure: BaseException = first
    except Exception as first:  # noqa: BLE001 (sqlalchemy's OperationalError from a write on a full disk)
        if type(first).__module__.split(".")[0] != "sqlalchemy":
            raise
        failure = first
    try:
        ro = open_ro()
    except CatalogError:
        raise failure from None
    try:
        if not disk_full(failure, ro):
            raise failure
        victims = victims_of(ro)
        n, freed = free_own_arrays(ro, victims)
    finally:
        ro.catalog.close()
    if not n:
        raise WriteError(f"no space left on {ro.location.root}: the catalog cannot be written (it needs room for "
                         f"its journal) and the versions to remove have no files of their own to delete first; free "
                         f"space on that filesystem ({os.strerror(errno.ENOSPC)})") from None
    try:
        return op(open_rw())
    except (CatalogError, OSError) as again:
        if not disk_full(again, ro):
            raise
        raise WriteError(f"no space left on {ro.location.root}: {n} array(s) ({freed:,} bytes) of the versions to "
                         "remove were deleted first, and the catalog still cannot be written; free more space on that "
                         "filesystem, then run the same command again to finish") from None
