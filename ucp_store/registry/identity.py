"""A store's identity: which catalog and which location (folder or bucket prefix) belong together.

A store has an id, recorded on both sides: in the catalog (the ``settings`` row ``store_id``) and in the
location (the small file ``ucp-store.json`` at its root, an object of the same name on a bucket). Every
command and API call that writes or deletes (save, import, tag, untag, rm, retention, gc, ...) first asks
:func:`ensure_owned`, which refuses a catalog and a location that do not belong together, naming both (with
their credentials masked): a stale ``UCP_CATALOG`` or ``--catalog`` pointing at another store's catalog
would otherwise make gc delete every array the wrong catalog does not know.

The rules (README "Store identity"):

- both sides carry an id: they must be equal;
- a side without an id (a store made before ids existed, or a crash between the two writes of ``ucp init``)
  is given the other side's id, or a new one when neither has any, only when the pair is plausibly one
  store: a folder location holds no other SQLite catalog (``catalog.db`` at its root that is not this
  catalog), and the location holds no version folder under ``arrays/`` or at least one of them is a version
  of this catalog. Anything else is refused; a dry run and the read paths never write an id.

So a catalog serves one location: a second location is accepted only when it carries the same id (a copy
or a move of the same store, folder and catalog together). Reading commands do not check (they never
delete, and what they read is named by the catalog's rows).
"""

from __future__ import annotations

import json
import os
import weakref
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from ucp_store.catalog import models as m
from ucp_store.errors import CatalogError, ReadError
from ucp_store.io.location import ARRAYS_DIR, Location, is_version_folder

__all__ = ["IDENTITY_FILE", "SETTING_KEY", "MismatchedStoreError", "catalog_id", "ensure_owned", "location_id",
           "new_store_id", "record_new", "refuse_new_catalog"]

#: the file (object) at the location's root that holds the store's id
IDENTITY_FILE = "ucp-store.json"
#: the ``settings`` key that holds the store's id in the catalog
SETTING_KEY = "store_id"

#: catalogs already checked against a location in this process: catalog -> {location url}
_BOUND: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()


class MismatchedStoreError(CatalogError):
    """The catalog and the location are not one store's (refused before anything is written or deleted)."""


def new_store_id() -> str:
    return m.new_id(32)


def location_id(location: Location) -> str | None:
    """The id recorded at the location (None: no identity file)."""
    raw = location.read_root_file(IDENTITY_FILE)
    if raw is None:
        return None
    try:
        record = json.loads(raw.decode("utf-8"))
        sid = record["store_id"]
        if not isinstance(sid, str) or not sid or len(sid) > 64:
            raise ValueError
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise ReadError(f"{location.display(IDENTITY_FILE)} is not a ucp store identity file (expected JSON "
                        '{"store_id": "..."}); refusing to write or delete in this store') from None
    return sid


def catalog_id(session: Any) -> str | None:
    value = session.scalar(select(m.Setting.value).where(m.Setting.key == SETTING_KEY))
    return value if isinstance(value, str) and value else None


def _write_location(location: Location, sid: str) -> None:
    location.write_root_file(IDENTITY_FILE, (json.dumps({"store_id": sid, "format": 1}) + "\n").encode())


def _names(location: Location, catalog: Any) -> str:
    return f"catalog {catalog.display_url} and location {location.display(IDENTITY_FILE).rsplit('/', 1)[0]}"


def _foreign_sqlite(location: Location, catalog: Any) -> str | None:
    """The path of a SQLite catalog at a folder location's root that is not ``catalog`` (None: none)."""
    if location.kind != "file":
        return None
    own = os.path.join(location.root, "catalog.db")
    if not os.path.lexists(own):
        return None
    if catalog.dialect == "sqlite":
        from sqlalchemy.engine import make_url

        db = make_url(catalog.url).database or ""
        try:
            if db and os.path.samefile(db, own):
                return None
        except OSError:
            pass
    return own


def _unknown_folders(location: Location, session: Any) -> tuple[int, int]:
    """(version folders under arrays/, how many of them are versions of this catalog)."""
    folders = [f for f in location.list_dirs(ARRAYS_DIR) if is_version_folder(f)]
    if not folders:
        return 0, 0
    known = set(session.scalars(select(m.Checkpoint.id).where(m.Checkpoint.id.in_(folders[:1000]))))
    return len(folders), len(known)


def _why_not_one_store(location: Location, catalog: Any, session: Any) -> str | None:
    """Why the pair is not plausibly one store (None: it is)."""
    other = _foreign_sqlite(location, catalog)
    if other is not None:
        return f"the location holds its own catalog {other}"
    n, known = _unknown_folders(location, session)
    if n and not known:
        return f"none of the {n} version folder(s) under {ARRAYS_DIR}/ is a version of this catalog"
    if not n and session.scalar(select(m.Array.id).limit(1)) is not None:
        return f"the catalog names arrays, and the location has no version folder under {ARRAYS_DIR}/"
    return None


def refuse_new_catalog(location: Location, catalog_url: str) -> None:
    """Before a new SQLite catalog file is created for ``location`` (``ucp init --catalog NEW``): refuse when
    the location already belongs to a store (it has an id), so that the refusal leaves no empty catalog."""
    loc = location_id(location)
    if loc is not None:
        from ucp_store.redact import redact

        raise MismatchedStoreError(
            f"catalog {redact(catalog_url)} and location {location.url} are not one store: the location is store "
            f"{loc} ({location.display(IDENTITY_FILE)}) and the catalog is new; refusing to create a second catalog "
            "for it (open it with its own catalog)")


def ensure_owned(location: Location, catalog: Any, *, adopt: bool = True) -> str | None:
    """Check that ``catalog`` and ``location`` are one store's; with ``adopt``, write a missing id (see the
    module docstring). Returns the store's id (None: a dry run of a store without ids). Raises
    :class:`MismatchedStoreError` naming both sides. Checked once per catalog and location in a process."""
    if location.url in _BOUND.get(catalog, ()):
        return None
    loc = location_id(location)
    with catalog.session() as s:
        cat = catalog_id(s)
        if loc is not None and cat is not None:
            if loc != cat:
                raise MismatchedStoreError(
                    f"{_names(location, catalog)} are not one store: the catalog is store {cat}, the location is "
                    f"store {loc} ({location.display(IDENTITY_FILE)}); refusing to write or delete (check "
                    "--store/--catalog and UCP_STORE/UCP_CATALOG)")
            _BOUND.setdefault(catalog, set()).add(location.url)
            return cat
        why = _why_not_one_store(location, catalog, s)
    if why is not None:
        side = ("the catalog is store " + cat if cat else "the catalog records no store id") + ", " + (
            "the location is store " + loc if loc else "the location has no " + IDENTITY_FILE)
        raise MismatchedStoreError(
            f"{_names(location, catalog)} are not one store: {why} ({side}); refusing to write or delete (check "
            "--store/--catalog and UCP_STORE/UCP_CATALOG)")
    if not adopt:
        return cat or loc
    sid = _record_catalog(catalog, cat or loc or new_store_id())
    if loc is None:
        _write_location(location, sid)
    elif loc != sid:  # another process adopted the catalog meanwhile with its own id
        return ensure_owned(location, catalog, adopt=False)
    _BOUND.setdefault(catalog, set()).add(location.url)
    return sid


def _record_catalog(catalog: Any, sid: str) -> str:
    """Record ``sid`` in the catalog unless it records one already; the id it records afterwards."""
    try:
        with catalog.write_session() as s:
            have = catalog_id(s)
            if have is not None:
                return have
            s.add(m.Setting(key=SETTING_KEY, value=sid))
        return sid
    except IntegrityError:  # another process recorded one first
        with catalog.session() as s:
            have = catalog_id(s)
        if have is None:
            raise
        return have


def record_new(location: Location, catalog: Any, session: Any) -> str:
    """A new store's id, written at the location first and then (in ``session``, the creating transaction)
    in the catalog; a location that already has an id (another store's) is refused."""
    loc = location_id(location)
    if loc is not None:
        raise MismatchedStoreError(
            f"{_names(location, catalog)} are not one store: the location is store {loc} "
            f"({location.display(IDENTITY_FILE)}) and the catalog is new; refusing to create a second catalog for "
            "it (open it with its own catalog)")
    why = _why_not_one_store(location, catalog, session)
    if why is not None:
        raise MismatchedStoreError(f"{_names(location, catalog)} are not one store: {why} (the catalog is new, the "
                                   f"location has no {IDENTITY_FILE}); refusing to create a catalog for it")
    sid = new_store_id()
    _write_location(location, sid)
    session.add(m.Setting(key=SETTING_KEY, value=sid))
    _BOUND.setdefault(catalog, set()).add(location.url)
    return sid
