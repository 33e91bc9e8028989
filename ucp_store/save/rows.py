"""The catalog side of a save: its rows as plain data, their insertion, the commit's status flip, the abort.

A pending checkpoint's rows (arrays, tensors, objects) are inserted in batches by ``flush`` and for the rest
in the commit's one transaction (:meth:`CatalogRecorder.record`), which flips the status to ``committed``
(:meth:`CatalogRecorder.flip_status`). A joined rank of a distributed save hands its rows over as plain
dicts (:func:`row_to_dict`), which the owner checks (:func:`check_row_dict`) and records with its own.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Container
from typing import Any

from sqlalchemy import func, insert, select

from ucp_store._killpoints import killpoint
from ucp_store.catalog import models as m
from ucp_store.errors import CommitRaceError, ValidationError
from ucp_store.registry.context import StoreContext

__all__ = ["ROW_KINDS", "CatalogRecorder", "Swept", "check_row_dict", "existing_arrays", "insert_params",
           "row_to_dict", "take", "utcnow"]

ROW_KINDS: dict[str, Any] = {"array": m.Array, "tensor": m.Tensor, "object": m.StoredObject}


def utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.UTC)


def take(rows: list) -> list:
    """The rows of ``rows``, which is left empty (the list itself is shared by the writer's collaborators,
    so it is emptied in place, never replaced)."""
    out = rows[:]
    rows.clear()
    return out


class Swept(Exception):
    """Arrays a pending save deduplicated against that a concurrent sweep removed (``record`` retries)."""

    def __init__(self, gone: set[str]):
        super().__init__(", ".join(sorted(gone)))
        self.gone = gone


def row_to_dict(row: Any) -> dict:
    """A pending catalog row as plain data (the columns that are set), for another rank's commit."""
    kind = next(k for k, cls in ROW_KINDS.items() if isinstance(row, cls))
    out: dict[str, Any] = {"_table": kind}
    for col in row.__table__.columns:
        value = getattr(row, col.key, None)
        if value is not None:
            out[col.key] = value
    return out


def insert_params(cls: Any, dicts: list[dict]) -> list[dict]:
    """Parameters of one executemany INSERT into ``cls``'s table: every row with the same keys (the columns
    any row sets, None where another does not), the autoincrement id left out, ``created_at`` filled in."""
    skip = {"_table"} if cls is m.Array else {"_table", "id"}
    keys: list[str] = []
    for d in dicts:
        for k in d:
            if k not in skip and k not in keys:
                keys.append(k)
    if cls is m.Array and "created_at" not in keys:
        keys.append("created_at")
    now = utcnow()
    out = []
    for d in dicts:
        p = {k: d.get(k) for k in keys}
        if cls is m.Array and p["created_at"] is None:
            p["created_at"] = now
        out.append(p)
    return out


def check_row_dict(d: Any) -> dict:
    """``d`` if it is a row as :func:`row_to_dict` describes one (a known kind, only that table's columns)."""
    if not isinstance(d, dict) or d.get("_table") not in ROW_KINDS:
        raise ValidationError("a joined rank's catalog row must be a dict with _table array/tensor/object, "
                              f"got {str(d)[:200]}")
    cols = {c.key for c in ROW_KINDS[d["_table"]].__table__.columns}
    extra = set(d) - cols - {"_table"}
    if extra:
        raise ValidationError(f"a joined rank's {d['_table']} row has unknown columns {sorted(extra)}")
    return d


def existing_arrays(ctx: StoreContext, s: Any, ids: set[str], *, lock: bool = False) -> set[str]:
    """The arrays among ``ids`` the catalog lists (session ``s``). ``lock``: inside a write transaction, also
    keep a concurrent sweep from deleting them until it ends: PostgreSQL takes ``FOR KEY SHARE`` row locks
    (a sweep's DELETE waits, then fails on the foreign key of the rows this transaction inserts and looks
    again); SQLite's write transaction (``BEGIN IMMEDIATE``) already keeps every other writer out."""
    found: set[str] = set()
    ordered = sorted(ids)
    for i in range(0, len(ordered), 500):
        q = select(m.Array.id).where(m.Array.id.in_(ordered[i:i + 500]))
        if lock and ctx.catalog.dialect == "postgresql":
            q = q.with_for_update(key_share=True)
        found.update(s.scalars(q))
    return found


class CatalogRecorder:
    """The catalog transactions of one pending checkpoint: its rows, the commit's status flip, the abort."""

    def __init__(self, ctx: StoreContext, checkpoint_id: str):
        self.ctx = ctx
        self.id = checkpoint_id

    def insert_rows(self, s: Any, rows: list, lost: str, borrowed: Container[str]) -> set[str]:
        """Insert ``rows`` (ORM rows or :func:`row_to_dict` dicts) in session ``s`` (one transaction), after
        checking the checkpoint is still pending and that the committed arrays they deduplicated against
        still exist, locked until the transaction ends (:func:`existing_arrays`). One multi-row INSERT per
        table (no ORM unit of work: a save has hundreds of rows). Returns, inserting nothing, the arrays this
        writer deduplicated against (``borrowed``) that a concurrent rm/gc removed (the caller writes them
        again and retries); an array another rank's rows deduplicated against is a CommitRaceError (that
        rank no longer holds the data)."""
        killpoint("flush.before_rows")
        ck = s.get(m.Checkpoint, self.id)
        if ck is None or ck.status != "pending":
            raise CommitRaceError(f"checkpoint {self.id} is no longer pending (removed by gc?); {lost}")
        by_kind: dict[str, list[dict]] = {"array": [], "tensor": [], "object": []}
        for r in rows:
            d = r if isinstance(r, dict) else row_to_dict(r)
            by_kind[d["_table"]].append(d)
        # arrays deduplicated against must still exist: a concurrent rm/gc may have swept them
        new_ids = {a["id"] for a in by_kind["array"]}
        wanted = {d["array_id"] for k in ("tensor", "object") for d in by_kind[k] if d.get("array_id")} - new_ids
        wanted |= {a["base_array_id"] for a in by_kind["array"] if a.get("base_array_id")} - new_ids  # delta bases
        gone = wanted - existing_arrays(self.ctx, s, wanted, lock=True) if wanted else set()
        if gone and all(g in borrowed for g in gone):
            return gone
        if gone:
            names_ = ", ".join(sorted(g for g in gone if g not in borrowed))[:200]
            raise CommitRaceError(f"checkpoint {self.id}: array(s) {names_} that another rank of this save "
                                  "deduplicated against (or stored a delta of) were removed by a concurrent rm/gc "
                                  "after that rank handed its rows over; the save is aborted (nothing is listed), "
                                  "retry it")
        if by_kind["array"]:
            s.execute(insert(m.Array), insert_params(m.Array, by_kind["array"]))
        killpoint("flush.mid_rows")
        for kind, cls in (("tensor", m.Tensor), ("object", m.StoredObject)):
            if by_kind[kind]:
                s.execute(insert(cls), insert_params(cls, by_kind[kind]))
        return set()

    def record(self, rows: list, lost: str, insert_rows: Callable[[Any, list, str], set[str]],
               rewrite: Callable[[set[str], list], None], then: Callable[[Any], Any] | None = None) -> Any:
        """Insert ``rows`` in one write transaction (``insert_rows(session, rows, lost)``), and run
        ``then(session)`` in it (commit's status flip); returns what ``then`` returns. A committed array the
        rows deduplicated against that a concurrent rm/gc swept before this transaction locked it is written
        again from the data in hand (``rewrite(gone, rows)``, which adds the new arrays' rows to ``rows``) and
        the transaction retried, so the save still commits; each retry restores at least one array, so this
        ends."""
        while True:
            try:
                with self.ctx.catalog.write_session() as s:
                    gone = insert_rows(s, rows, lost) if rows else set()
                    if gone:
                        raise Swept(gone)  # rolls this transaction back
                    return then(s) if then is not None else None
            except Swept as swept:
                rewrite(swept.gone, rows)

    def flip_status(self, s: Any, labels: list[str]) -> None:
        """In commit's transaction, after the rows: the checkpoint becomes ``committed`` (the step still free).
        ``labels`` receives the run and step, for the message of a lost race."""
        ck = s.get(m.Checkpoint, self.id)
        if ck is None or ck.status != "pending":
            raise CommitRaceError(f"checkpoint {self.id} is no longer pending (removed by gc?); cannot commit")
        taken = s.scalar(select(m.Checkpoint.id).where(
            m.Checkpoint.run_id == ck.run_id, m.Checkpoint.step == ck.step,
            m.Checkpoint.status == "committed"))
        label = f"run {ck.run.name!r} step {ck.step}"
        labels.append(label)
        if taken:
            raise CommitRaceError(f"checkpoint {self.id}: {label} was committed meanwhile by {taken}; "
                                  "nothing of this save is listed")
        total = s.scalar(select(func.coalesce(func.sum(m.Tensor.nbytes), 0)).where(
            m.Tensor.checkpoint_id == self.id))
        ck.nbytes = int(total)
        ck.status = "committed"
        ck.committed_at = utcnow()
        s.flush()
        killpoint("commit.in_txn")

    def drop_pending(self) -> None:
        """Delete the pending checkpoint's row (and a run that ``begin`` made for it alone), then sweep what
        it wrote. Best effort: gc reclaims whatever is left; the checkpoint is not listed either way."""
        from ucp_store.registry.retention import sweep_arrays

        try:
            with self.ctx.catalog.write_session() as s:
                ck = s.get(m.Checkpoint, self.id)
                if ck is not None and ck.status == "pending":
                    run_id = ck.run_id
                    s.delete(ck)
                    s.flush()
                    # a run that begin() created for this save alone goes too (nothing listed, nothing left)
                    run = s.get(m.Run, run_id)
                    if run is not None and run.retention is None and not s.scalar(
                            select(func.count()).select_from(m.Checkpoint).where(m.Checkpoint.run_id == run_id)) \
                            and not s.scalar(select(func.count()).select_from(m.Tag).where(m.Tag.run_id == run_id)):
                        s.delete(run)
            killpoint("abort.after_row")
            sweep_arrays(self.ctx, dry_run=False, also={self.id})
        except Exception:
            pass  # gc will reclaim what is left; the checkpoint is not listed either way

