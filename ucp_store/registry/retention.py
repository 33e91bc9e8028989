"""Retention policies and garbage collection: which versions go, and which array files nothing needs.

A :class:`RetentionPolicy` is data (stored per run in ``runs.retention``) with one pure method,
:meth:`RetentionPolicy.keep`, that picks the versions to keep from a run's committed (id, step) list.
:func:`gc` applies the policies, drops pending saves whose owner died (or that outlived the pending
timeout), then :func:`sweep_arrays` deletes every array no tensor or object row references and every
file under ``arrays/`` that no row knows about (a save killed before its rows were flushed).

Reference counts are derived from the catalog rows, never stored, so a sweep can never free an array
that a committed version still reads. Files are listed and deleted through :class:`~ucp_store.io.location.Location`
(folders or a bucket alike); nothing here imports torch or TensorStore, so ``ucp gc --dry-run`` and
``ucp retention`` run on the catalog alone. The functions take the store's
:class:`~ucp_store.registry.context.StoreContext` (``Store.store_context``: location, catalog, settings),
never the :class:`~ucp_store.store.Store` itself.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sqlalchemy import exists, func, select, update
from sqlalchemy.exc import IntegrityError

from ucp_store._killpoints import killpoint
from ucp_store.catalog import models as m
from ucp_store.errors import CatalogError, ConfigurationError, ReferenceNotFound
from ucp_store.io.location import (
    ARRAYS_DIR,
    array_checkpoint,
    array_path,
    checkpoint_dir,
    is_array_folder,
    is_version_folder,
)
from ucp_store.registry.context import StoreContext, did_you_mean, run_names
from ucp_store.registry.identity import IDENTITY_FILE, ensure_owned

__all__ = ["DEFAULT_PENDING_TIMEOUT", "GcReport", "RetentionPolicy", "set_retention", "retention_victims", "gc",
           "sweep_arrays"]

DEFAULT_PENDING_TIMEOUT = _dt.timedelta(hours=24)


@dataclass
class GcReport:
    """What a gc removed (or with ``dry_run`` would remove)."""

    removed_checkpoints: list[str] = field(default_factory=list)
    removed_pending: list[str] = field(default_factory=list)
    removed_arrays: int = 0
    freed_bytes: int = 0
    dry_run: bool = False
    #: entries under ``arrays/`` that gc cannot tie to this catalog (a nested store, a foreign folder or file,
    #: a link): reported, never deleted (relative to the store root)
    left: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return self.__dict__.copy()


#: the largest count a policy takes (steps are 64-bit integers in the catalog)
_MAX_COUNT = 2**63 - 1


def _check_count(what: str, value: object, where: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or not 1 <= value <= _MAX_COUNT):
        raise ConfigurationError(f"{where}{what} must be an integer from 1 to 2^63-1 or None (no such rule), "
                                 f"got {value!r}")


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the last ``keep_last`` versions, every step divisible by ``keep_every``, and (``keep_tagged``)
    every tagged version. A run's newest version is always kept. No rule set: keep everything.

    ``keep_last`` and ``keep_every`` are None or integers >= 1 (0 or a negative count would make gc remove
    nearly every version), ``keep_tagged`` a bool; anything else is refused, here and when a policy stored
    in the catalog is read back (:meth:`from_json`)."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_tagged: bool = True

    def __post_init__(self) -> None:
        _check_count("keep_last", self.keep_last, "retention: ")
        _check_count("keep_every", self.keep_every, "retention: ")
        if not isinstance(self.keep_tagged, bool):
            raise ConfigurationError(f"retention: keep_tagged must be true or false, got {self.keep_tagged!r}")

    @classmethod
    def from_json(cls, record: dict | None, *, where: str = "stored retention policy") -> "RetentionPolicy":
        """The policy of a stored record (None: keep everything). A record that is not one (a bad value, an
        unknown key, not an object) is refused with a CatalogError naming ``where``."""
        if record is None:
            return cls()
        if not isinstance(record, dict):
            raise CatalogError(f"{where}: expected a JSON object {{keep_last, keep_every, keep_tagged}}, got "
                               f"{record!r}; set it again with `ucp retention`")
        unknown = sorted(set(record) - {"keep_last", "keep_every", "keep_tagged"})
        if unknown:
            raise CatalogError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} in {record!r}; set it "
                               "again with `ucp retention`")
        try:
            return cls(record.get("keep_last"), record.get("keep_every"), record.get("keep_tagged", True))
        except ConfigurationError as exc:
            raise CatalogError(f"{where} {record!r} is refused: {str(exc).removeprefix('retention: ')}; set it "
                               "again with `ucp retention`") from None

    def to_json(self) -> dict | None:
        if not self.active:
            return None
        return {"keep_last": self.keep_last, "keep_every": self.keep_every, "keep_tagged": self.keep_tagged}

    @property
    def active(self) -> bool:
        return self.keep_last is not None or self.keep_every is not None

    def keep(self, versions: Sequence[tuple[str, int]], tagged: Iterable[str] = ()) -> set[str]:
        """Ids to keep among ``versions`` ((id, step), ascending step)."""
        if not self.active:
            return {cid for cid, _ in versions}
        keep: set[str] = set()
        if self.keep_last:
            keep |= {cid for cid, _ in versions[-self.keep_last:]}
        if self.keep_every:
            keep |= {cid for cid, st in versions if st % self.keep_every == 0}
        if self.keep_tagged:
            keep |= set(tagged)
        if versions:
            keep.add(versions[-1][0])  # never remove a run's newest version by policy
        return keep


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.UTC)


def set_retention(ctx: StoreContext, run: str, policy: RetentionPolicy) -> dict | None:
    """Store ``policy`` as the run's retention (an inactive policy clears it); returns its record."""
    record = policy.to_json()
    with ctx.catalog.write_session() as s:
        row = s.scalar(select(m.Run).where(m.Run.name == run))
        if row is None:
            raise ReferenceNotFound(f"run {run!r} not found{did_you_mean(run, run_names(s))}")
        row.retention = record
    return record


def retention_victims(ctx: StoreContext, run: str | None = None,
                      override: RetentionPolicy | None = None) -> list[str]:
    """Committed versions the runs' policies (or ``override``, when active) would remove."""
    victims: list[str] = []
    with ctx.catalog.session() as s:
        q = select(m.Run)
        if run is not None:
            q = q.where(m.Run.name == run)
        for r in s.scalars(q):
            policy = override if override is not None and override.active else RetentionPolicy.from_json(
                r.retention, where=f"run {r.name!r}: stored retention policy")
            if not policy.active:
                continue
            cks = [(cid, st) for cid, st in s.execute(select(m.Checkpoint.id, m.Checkpoint.step).where(
                m.Checkpoint.run_id == r.id, m.Checkpoint.status == "committed").order_by(m.Checkpoint.step))]
            tagged = set(s.scalars(select(m.Tag.checkpoint_id).where(m.Tag.run_id == r.id)))
            keep = policy.keep(cks, tagged)
            victims += [cid for cid, _ in cks if cid not in keep]
    return victims


def gc(ctx: StoreContext, *, run: str | None = None, override: RetentionPolicy | None = None, dry_run: bool = False,
       pending_timeout: _dt.timedelta = DEFAULT_PENDING_TIMEOUT) -> GcReport:
    """Apply retention, drop dead pending saves, then delete arrays nothing committed references.
    ``pending_timeout``: a pending save older than this is dead even if its owner may live (>= 0)."""
    if not isinstance(pending_timeout, _dt.timedelta) or pending_timeout < _dt.timedelta(0):
        raise ConfigurationError(f"gc: pending_timeout must be a datetime.timedelta >= 0, got {pending_timeout!r}")
    report = GcReport(dry_run=dry_run)
    _owned(ctx, dry_run)
    ctx.location.check_walkable(ARRAYS_DIR)  # before any row goes: a sweep through a link is refused
    victims = retention_victims(ctx, run, override)
    host = socket.gethostname()
    now = _utcnow()
    with ctx.catalog.write_session() as s:
        for cid in victims:
            report.removed_checkpoints.append(cid)
            if not dry_run:
                s.execute(update(m.Checkpoint).where(m.Checkpoint.parent_id == cid).values(parent_id=None))
                s.delete(s.get(m.Checkpoint, cid))
        dead_runs: set[int] = set()
        for ck in s.scalars(select(m.Checkpoint).where(m.Checkpoint.status == "pending")):
            dead = (ck.owner_host == host and not _pid_alive(ck.owner_pid)) or (now - ck.created_at) > pending_timeout
            if dead:
                report.removed_pending.append(ck.id)
                if not dry_run:
                    dead_runs.add(ck.run_id)
                    s.delete(ck)
        if dead_runs:
            # a run that a dead save's begin() created goes too, as abort() does: nothing of it is left
            s.flush()
            for run_id in sorted(dead_runs):
                row = s.get(m.Run, run_id)
                if row is not None and row.retention is None and not s.scalar(
                        select(func.count()).select_from(m.Checkpoint).where(m.Checkpoint.run_id == run_id)) \
                        and not s.scalar(select(func.count()).select_from(m.Tag).where(m.Tag.run_id == run_id)):
                    try:
                        with s.begin_nested():  # a save that began in this run meanwhile keeps it
                            s.delete(row)
                    except IntegrityError:
                        pass
    if not dry_run:
        killpoint("gc.after_rows")
    n, freed = sweep_arrays(ctx, dry_run=dry_run, also=set(report.removed_pending),
                            gone=report.removed_checkpoints + report.removed_pending, left=report.left)
    report.removed_arrays, report.freed_bytes = n, freed
    return report


def _owned(ctx: StoreContext, dry_run: bool) -> None:
    """gc and sweeps delete: the catalog and the location must be one store's (``registry/identity.py``)."""
    if not ctx.detached:
        ensure_owned(ctx.location, ctx.catalog, adopt=not dry_run)


def sweep_arrays(ctx: StoreContext, *, dry_run: bool, also: Iterable[str] = frozenset(),
                 gone: Iterable[str] = (), left: list[str] | None = None) -> tuple[int, int]:
    """Delete arrays with no referencing tensor/object row and files no row knows about; returns
    (arrays removed, bytes freed). ``also``: checkpoint ids whose folders go even if still listed.
    ``gone`` (``dry_run`` only): checkpoints whose rows the run being previewed would delete first; their
    references do not count, so a dry run counts the arrays the real one removes.

    Bytes freed are the deleted files' sizes on disk in a folder store (with ``dry_run``, what would be
    deleted); on a bucket, which is not listed with sizes, the arrays rows' ``nbytes`` (files no row knows
    count 0 there).

    Only what can be tied to this catalog is deleted: arrays its rows name, and the array folders
    (``<hex id>.zarr`` holding only ``zarr.json`` and ``c/``) of version folders (``<hex id>/``) of this
    store that no live version owns (a version removed or a save killed before its rows existed). Anything
    else under ``arrays/`` (a nested store, a foreign folder or file, a link) is appended to ``left`` and
    never deleted or followed."""
    _owned(ctx, dry_run)
    left = [] if left is None else left
    also = set(also)
    gone = sorted(set(gone)) if dry_run else []
    location = ctx.location
    removed, freed = 0, 0
    doomed: list[tuple[str, int]] = []
    for attempt in range(3):
        removed, doomed = 0, []
        try:
            with ctx.catalog.write_session() as s:
                referenced = exists().where(m.Tensor.array_id == m.Array.id)
                referenced_obj = exists().where(m.StoredObject.array_id == m.Array.id)
                if gone:
                    referenced = referenced.where(m.Tensor.checkpoint_id.notin_(gone))
                    referenced_obj = referenced_obj.where(m.StoredObject.checkpoint_id.notin_(gone))
                orphans = list(s.scalars(select(m.Array).where(~referenced, ~referenced_obj)))
                # arrays of live pending saves have no rows yet or are referenced by pending rows: keep them
                live_pending = set(s.scalars(select(m.Checkpoint.id).where(m.Checkpoint.status == "pending")))
                live_pending -= set(gone)
                # a row naming anything but an array folder (a catalog edited by hand) is reported, never followed
                left.extend(a.path for a in orphans if not _is_array_path(a.path) and a.path not in left)
                victims = [a for a in orphans
                           if _is_array_path(a.path) and array_checkpoint(a.path) not in live_pending]
                for layer in _unneeded_bases_last(s, victims):
                    for a in layer:
                        removed += 1
                        doomed.append((a.path, a.nbytes))
                        if not dry_run:
                            s.delete(a)
                    if not dry_run:
                        s.flush()  # a delta's row goes before its base's (the base_array_id key)
            break
        except IntegrityError:
            # PostgreSQL: a save's rows began referencing an "orphan" meanwhile (the foreign key refused
            # the delete). Nothing was deleted; look again.
            if attempt == 2:
                raise
    # Files go only once the rows' deletion has committed: a save that references one of these arrays
    # meanwhile fails on the foreign key (and aborts) instead of committing rows whose files are gone.
    for path, nbytes in doomed:
        if _holds_a_store(location, path):  # a store made inside an array folder: never ours to delete
            left.append(path)
            continue
        freed += _remove(location, path, dry_run, default=nbytes)
    # files without any row (a killed save before its rows were flushed). List the folders first: a
    # checkpoint row is inserted before its folder exists, so a folder seen here whose row is absent
    # afterwards belongs to a save that is gone, never to one that just started.
    folders = location.list_dirs(ARRAYS_DIR)
    with ctx.catalog.session() as s:
        live_ids = set(s.scalars(select(m.Checkpoint.id)))
        known_paths = set(s.scalars(select(m.Array.path)))
    for folder in folders:
        if folder in live_ids and folder not in also:
            continue
        if not is_version_folder(folder) or not location.is_dir(checkpoint_dir(folder)):
            left.append(checkpoint_dir(folder))  # not a version folder of ours: reported, left alone
            continue
        entries = location.list_dirs(checkpoint_dir(folder))
        foreign = [f"{checkpoint_dir(folder)}/{e}" for e in entries
                   if f"{checkpoint_dir(folder)}/{e}" not in known_paths and not _is_our_array(location, folder, e)]
        # a folder holding nothing of ours (a nested store, say) is reported as one entry
        left.extend(foreign if len(foreign) < len(entries) else [checkpoint_dir(folder)])
        for entry in entries:
            rel = f"{checkpoint_dir(folder)}/{entry}"
            if rel in known_paths or rel in foreign:
                continue
            removed += 1
            freed += _remove(location, rel, dry_run)
        if not dry_run:
            location.remove_empty_dir(checkpoint_dir(folder))
    return removed, freed


#: what the top of an array folder holds: its metadata, its chunks, and a temporary metadata file a killed
#: writer left (``zarr.json.<pid>-<thread>.part``, TensorStore's ``zarr.json.__lock``)
_ARRAY_ENTRIES = ("zarr.json", "c")


def _is_array_path(rel: str) -> bool:
    """Whether an arrays row's path has the one form the store writes (``arrays/<hex>/<hex>.zarr``): gc never
    deletes ``catalog.db``, ``ucp-store.json`` or another folder because a row names it."""
    parts = rel.split("/")
    return len(parts) == 3 and parts[0] == ARRAYS_DIR and is_version_folder(parts[1]) and is_array_folder(parts[2])


def _is_our_array(location, folder: str, entry: str) -> bool:
    """Whether ``arrays/<folder>/<entry>`` is an array folder as this store writes it (and nothing else:
    not a store, a link or a file), so that gc may tie it to the version folder it sits in."""
    if not is_array_folder(entry):
        return False
    rel = array_path(folder, entry[:-len(".zarr")])
    if not location.is_dir(rel):
        return False
    return all(name in _ARRAY_ENTRIES or name.startswith("zarr.json.") for name in location.list_dirs(rel)) \
        and not _holds_a_store(location, rel)


def _holds_a_store(location, rel: str) -> bool:
    """Whether a folder of a folder store holds, anywhere below it, another store's identity file or SQLite
    catalog (links not followed); a bucket's arrays are not walked (False)."""
    if location.kind != "file":
        return False
    for _dirpath, _dirs, files in os.walk(os.path.join(location.root, rel), followlinks=False):
        if IDENTITY_FILE in files or "catalog.db" in files:
            return True
    return False


def _unneeded_bases_last(s, victims: list) -> list[list]:
    """The ``victims`` (array rows no tensor or object row references) that no kept array needs as a delta
    base (issue 39), in layers: each layer's arrays are bases of none of the later layers' (deltas first, then
    their bases), so their rows can be deleted layer by layer under the ``base_array_id`` key. A victim that
    a kept array (a referenced one, a live pending save's, or a victim kept so) reads through is kept."""
    if not victims:
        return []
    links = dict(s.execute(select(m.Array.id, m.Array.base_array_id).where(m.Array.base_array_id.is_not(None))).all())
    by_id = {a.id: a for a in victims}
    # kept: every array that is not a victim; everything they read through is kept too
    keep: set[str] = set()
    frontier = [b for child, b in links.items() if child not in by_id]
    while frontier:
        b = frontier.pop()
        if b in keep:
            continue
        keep.add(b)
        nxt = links.get(b)
        if nxt is not None:
            frontier.append(nxt)
    left = {aid for aid in by_id if aid not in keep}
    layers = []
    while left:
        bases = {links[a] for a in left if links.get(a) in left}
        layer = sorted(left - bases)
        if not layer:  # a cycle (never written): delete what is left in one go rather than loop
            layer = sorted(left)
        layers.append([by_id[a] for a in layer])
        left -= set(layer)
    return layers


def _remove(location, rel: str, dry_run: bool, default: int = 0) -> int:
    """Delete ``rel`` (``dry_run``: only measure it); the bytes freed (``default`` where sizes are unknown)."""
    if dry_run:
        size = location.tree_bytes(rel)
    else:
        size = location.delete_tree(rel)
        killpoint("sweep.mid")
    return default if size is None else size
