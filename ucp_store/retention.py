"""Retention policies and garbage collection: which versions go, and which array files nothing needs.

A :class:`RetentionPolicy` is data (stored per run in ``runs.retention``) with one pure method,
:meth:`RetentionPolicy.keep`, that picks the versions to keep from a run's committed (id, step) list.
:func:`gc` applies the policies, drops pending saves whose owner died (or that outlived the pending
timeout), then :func:`sweep_arrays` deletes every array no tensor or object row references and every
file under ``arrays/`` that no row knows about (a save killed before its rows were flushed).

Reference counts are derived from the catalog rows, never stored, so a sweep can never free an array
that a committed version still reads. Files are listed and deleted through :class:`~ucp_store.location.Location`
(folders or a bucket alike); nothing here imports torch or TensorStore, so ``ucp gc --dry-run`` and
``ucp retention`` run on the catalog alone.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import exists, func, select, update
from sqlalchemy.exc import IntegrityError

from ._killpoints import killpoint
from .catalog import models as m
from .errors import ReferenceNotFound
from .location import ARRAYS_DIR, array_checkpoint, array_path, checkpoint_dir

if TYPE_CHECKING:  # pragma: no cover
    from .store import Store

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

    def to_json(self) -> dict:
        return self.__dict__.copy()


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the last ``keep_last`` versions, every step divisible by ``keep_every``, and (``keep_tagged``)
    every tagged version. A run's newest version is always kept. No rule set: keep everything."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_tagged: bool = True

    @classmethod
    def from_json(cls, record: dict | None) -> "RetentionPolicy":
        record = record or {}
        return cls(record.get("keep_last"), record.get("keep_every"), record.get("keep_tagged", True))

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


def set_retention(store: "Store", run: str, policy: RetentionPolicy) -> dict | None:
    """Store ``policy`` as the run's retention (an inactive policy clears it); returns its record."""
    record = policy.to_json()
    with store.catalog.write_session() as s:
        row = s.scalar(select(m.Run).where(m.Run.name == run))
        if row is None:
            raise ReferenceNotFound(f"run {run!r} not found{store._near(run, store._run_names(s))}")
        row.retention = record
    return record


def retention_victims(store: "Store", run: str | None = None, override: RetentionPolicy | None = None) -> list[str]:
    """Committed versions the runs' policies (or ``override``, when active) would remove."""
    victims: list[str] = []
    with store.catalog.session() as s:
        q = select(m.Run)
        if run is not None:
            q = q.where(m.Run.name == run)
        for r in s.scalars(q):
            policy = override if override is not None and override.active else RetentionPolicy.from_json(r.retention)
            if not policy.active:
                continue
            cks = [(cid, st) for cid, st in s.execute(select(m.Checkpoint.id, m.Checkpoint.step).where(
                m.Checkpoint.run_id == r.id, m.Checkpoint.status == "committed").order_by(m.Checkpoint.step))]
            tagged = set(s.scalars(select(m.Tag.checkpoint_id).where(m.Tag.run_id == r.id)))
            keep = policy.keep(cks, tagged)
            victims += [cid for cid, _ in cks if cid not in keep]
    return victims


def gc(store: "Store", *, run: str | None = None, override: RetentionPolicy | None = None, dry_run: bool = False,
       pending_timeout: _dt.timedelta = DEFAULT_PENDING_TIMEOUT) -> GcReport:
    """Apply retention, drop dead pending saves, then delete arrays nothing committed references."""
    report = GcReport(dry_run=dry_run)
    victims = retention_victims(store, run, override)
    host = socket.gethostname()
    now = _utcnow()
    with store.catalog.write_session() as s:
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
    n, freed = sweep_arrays(store, dry_run=dry_run, also=set(report.removed_pending))
    report.removed_arrays, report.freed_bytes = n, freed
    return report


def sweep_arrays(store: "Store", *, dry_run: bool, also: Iterable[str] = frozenset()) -> tuple[int, int]:
    """Delete arrays with no referencing tensor/object row and files no row knows about; returns
    (arrays removed, bytes freed). ``also``: checkpoint ids whose folders go even if still listed."""
    also = set(also)
    location = store.location
    removed, freed = 0, 0
    doomed: list[str] = []
    for attempt in range(3):
        removed, freed, doomed = 0, 0, []
        try:
            with store.catalog.write_session() as s:
                referenced = exists().where(m.Tensor.array_id == m.Array.id)
                referenced_obj = exists().where(m.StoredObject.array_id == m.Array.id)
                orphans = list(s.scalars(select(m.Array).where(~referenced, ~referenced_obj)))
                # arrays of live pending saves have no rows yet or are referenced by pending rows: keep them
                live_pending = set(s.scalars(select(m.Checkpoint.id).where(m.Checkpoint.status == "pending")))
                for a in orphans:
                    if array_checkpoint(a.path) in live_pending:
                        continue
                    removed += 1
                    freed += a.nbytes
                    if not dry_run:
                        s.delete(a)
                        doomed.append(a.path)
            break
        except IntegrityError:
            # PostgreSQL: a save's rows began referencing an "orphan" meanwhile (the foreign key refused
            # the delete). Nothing was deleted; look again.
            if attempt == 2:
                raise
    # Files go only once the rows' deletion has committed: a save that references one of these arrays
    # meanwhile fails on the foreign key (and aborts) instead of committing rows whose files are gone.
    for path in doomed:
        location.delete_tree(path)
        killpoint("sweep.mid")
    # files without any row (a killed save before its rows were flushed). List the folders first: a
    # checkpoint row is inserted before its folder exists, so a folder seen here whose row is absent
    # afterwards belongs to a save that is gone, never to one that just started.
    folders = location.list_dirs(ARRAYS_DIR)
    with store.catalog.session() as s:
        live_ids = set(s.scalars(select(m.Checkpoint.id)))
        known_paths = set(s.scalars(select(m.Array.path)))
    for folder in folders:
        if folder in live_ids and folder not in also:
            continue
        for entry in location.list_dirs(checkpoint_dir(folder)):
            # an array folder, or a stray entry (never an array of ours) that goes the same way
            rel = (array_path(folder, entry[:-len(".zarr")]) if entry.endswith(".zarr")
                   else f"{checkpoint_dir(folder)}/{entry}")
            if rel in known_paths:
                continue
            removed += 1
            if not dry_run:
                location.delete_tree(rel)
                killpoint("sweep.mid")
        if not dry_run:
            location.remove_empty_dir(checkpoint_dir(folder))
    return removed, freed
