"""The store: a versioned checkpoint registry over chunked arrays and a SQL catalog.

Commit protocol (why a crashed save is never listed):
1. ``begin`` inserts a ``pending`` checkpoint row naming its owner (host, pid).
2. Each tensor-state is hashed, then either references an existing ready array with the same
   content (dedup) or is written to a fresh array at ``arrays/<checkpoint>/<array>.zarr``.
   TensorStore's file kvstore writes by atomic rename, so an array is durable when its write returns.
3. Rows (arrays, tensors, objects) are inserted under the pending checkpoint in batches.
4. ``commit`` waits for every write, then flips the status to ``committed`` in one transaction.
A pending checkpoint whose owner died (or that is older than the pending timeout) is removed by
``gc`` with everything it wrote. Reference counts are derived from tensor/object rows, never stored.
"""

from __future__ import annotations

import datetime as _dt
import difflib
import math
import os
import socket
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np
import torch
from sqlalchemy import and_, exists, func, select, text, update
from sqlalchemy.exc import IntegrityError

from . import dtypes, format as fmt, names
from .catalog import models as m
from .catalog.db import open_catalog
from .errors import CatalogError, InvalidNameError, ReferenceNotFound, ShapeMismatch, UcpError
from .location import Location
from .records import TensorInfo

FORMAT_VERSION = 1
DEFAULT_STORE = "./ucp-store"
_ROW_BATCH = 512
_MAX_INFLIGHT_BYTES = 1 << 30
DEFAULT_PENDING_TIMEOUT = _dt.timedelta(hours=24)


def _tool_version() -> str:
    from . import __version__

    return __version__


def _library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "tensorstore", "numpy", "zarr", "numcodecs", "sqlalchemy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


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


def open_store(url: str | None = None, *, create: bool = False, catalog: str | None = None,
               compression: str | None = None, chunk_target_bytes: int | None = None) -> "Store":
    """Open (or with ``create`` make) a store. ``url`` defaults to ``$UCP_STORE`` or ``./ucp-store``."""
    url = url or os.environ.get("UCP_STORE") or DEFAULT_STORE
    location = Location.parse(url, catalog)
    if not create and location.catalog_url.startswith("sqlite"):
        # opening must not conjure an empty SQLite catalog out of a typo'd path
        from sqlalchemy.engine import make_url

        db = make_url(location.catalog_url).database or ""
        if db not in ("", ":memory:") and not os.path.exists(db):
            raise CatalogError(f"no store at {location.root} (no catalog {db}); create one with `ucp init` "
                               "or create=True")
    if create:
        location.ensure_root()
    catalog_db = open_catalog(location.catalog_url, create=create)
    store = Store(location, catalog_db)
    if create:
        store._init_settings(compression, chunk_target_bytes)
    return store


def _layer_of(pattern: dict | None) -> int | None:
    """The catalog's ``tensors.layer``: the pattern's placement layer, or None."""
    if pattern is None:
        return None
    from .patterns import parse_pattern

    placement = parse_pattern(pattern).placement
    return None if placement is None else placement.layer


@dataclass
class GcReport:
    removed_checkpoints: list[str] = field(default_factory=list)
    removed_pending: list[str] = field(default_factory=list)
    removed_arrays: int = 0
    freed_bytes: int = 0
    dry_run: bool = False

    def to_json(self) -> dict:
        return self.__dict__.copy()


class Store:
    def __init__(self, location: Location, catalog):
        self.location = location
        self.catalog = catalog
        self.context = fmt.make_context()
        with self.catalog.session() as s:
            rows = {r.key: r.value for r in s.scalars(select(m.Setting))}
        self.settings: dict[str, Any] = {"compression": "none", "chunk_target_bytes": 1 << 20,
                                         "format_version": FORMAT_VERSION, **rows}

    def __repr__(self) -> str:
        return f"Store({self.location.url!r})"

    def _init_settings(self, compression: str | None, chunk_target_bytes: int | None) -> None:
        wanted = {"format_version": FORMAT_VERSION}
        if compression is not None:
            fmt._compression_codecs(compression, 4)  # validates the name
            wanted["compression"] = compression
        if chunk_target_bytes is not None:
            from .chunking import MAX_TARGET, MIN_TARGET

            if not MIN_TARGET <= chunk_target_bytes <= MAX_TARGET:
                raise UcpError(f"chunk target {chunk_target_bytes} bytes: expected 1 MiB to 8 MiB")
            wanted["chunk_target_bytes"] = int(chunk_target_bytes)
        with self.catalog.write_session() as s:
            for key, value in wanted.items():
                row = s.get(m.Setting, key)
                if row is None:
                    s.add(m.Setting(key=key, value=value))
                elif key != "format_version":
                    row.value = value
        self.settings.update(wanted)

    def array_url(self, rel: str) -> str:
        return self.location.display(rel)

    # --- runs and references ----------------------------------------------------------------
    def runs(self) -> list[dict]:
        with self.catalog.session() as s:
            q = (select(m.Run.name, func.count(m.Checkpoint.id), func.max(m.Checkpoint.step), m.Run.retention)
                 .outerjoin(m.Checkpoint, and_(m.Checkpoint.run_id == m.Run.id, m.Checkpoint.status == "committed"))
                 .group_by(m.Run.id).order_by(m.Run.name))
            return [{"run": n, "checkpoints": c, "latest_step": st, "retention": r} for n, c, st, r in s.execute(q)]

    def list_checkpoints(self, run: str | None = None, *, include_pending: bool = False) -> list[dict]:
        with self.catalog.session() as s:
            q = select(m.Checkpoint, m.Run.name).join(m.Run)
            if run is not None:
                q = q.where(m.Run.name == run)
            if not include_pending:
                q = q.where(m.Checkpoint.status == "committed")
            q = q.order_by(m.Run.name, m.Checkpoint.step, m.Checkpoint.created_at)
            out = []
            tags = self._tags_by_checkpoint(s)
            for ck, run_name in s.execute(q):
                out.append({"id": ck.id, "run": run_name, "step": ck.step, "status": ck.status,
                            "created_at": ck.created_at.isoformat(), "parent": ck.parent_id,
                            "message": ck.message, "nbytes": ck.nbytes, "tags": tags.get(ck.id, [])})
            if run is not None and not out and s.scalar(select(m.Run.id).where(m.Run.name == run)) is None:
                raise ReferenceNotFound(f"run {run!r} not found{self._near(run, self._run_names(s))}")
            return out

    @staticmethod
    def _tags_by_checkpoint(s) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for cid, name in s.execute(select(m.Tag.checkpoint_id, m.Tag.name).order_by(m.Tag.name)):
            out.setdefault(cid, []).append(name)
        return out

    @staticmethod
    def _run_names(s) -> list[str]:
        return list(s.scalars(select(m.Run.name)))

    @staticmethod
    def _near(word: str, candidates: Iterable[str]) -> str:
        near = difflib.get_close_matches(word, list(candidates), n=5, cutoff=0.5)
        return f"; did you mean: {', '.join(near)}?" if near else ""

    def resolve(self, ref: str) -> str:
        """Checkpoint id of a committed version: ``RUN@STEP``, ``RUN@latest``, ``RUN:TAG`` or an id."""
        if not isinstance(ref, str) or not ref:
            raise ReferenceNotFound(f"empty checkpoint reference {ref!r}")
        with self.catalog.session() as s:
            committed = m.Checkpoint.status == "committed"
            if "@" in ref:
                run, _, step = ref.rpartition("@")
                run_id = s.scalar(select(m.Run.id).where(m.Run.name == run))
                if run_id is None:
                    raise ReferenceNotFound(f"reference {ref!r}: run {run!r} not found"
                                            f"{self._near(run, self._run_names(s))}")
                q = select(m.Checkpoint.id).where(m.Checkpoint.run_id == run_id, committed)
                if step == "latest":
                    cid = s.scalar(q.order_by(m.Checkpoint.step.desc()).limit(1))
                else:
                    try:
                        cid = s.scalar(q.where(m.Checkpoint.step == int(step)))
                    except ValueError:
                        raise ReferenceNotFound(f"reference {ref!r}: step {step!r} is not an integer or 'latest'") \
                            from None
                if cid is None:
                    steps = [str(x) for x in s.scalars(select(m.Checkpoint.step).where(
                        m.Checkpoint.run_id == run_id, committed).order_by(m.Checkpoint.step))]
                    near = difflib.get_close_matches(step, steps, n=5, cutoff=0.3)
                    raise ReferenceNotFound(f"reference {ref!r}: run {run!r} has no committed step {step}; "
                                            f"steps: {', '.join(near or steps[-5:]) or 'none'}")
                return cid
            if ":" in ref:
                run, _, tag = ref.partition(":")
                cid = s.scalar(select(m.Tag.checkpoint_id).join(m.Run).where(m.Run.name == run, m.Tag.name == tag))
                if cid is None:
                    tags = [f"{r}:{t}" for r, t in s.execute(select(m.Run.name, m.Tag.name).join(m.Tag.run))]
                    raise ReferenceNotFound(f"reference {ref!r}: no such tag{self._near(ref, tags)}")
                return cid
            ck = s.get(m.Checkpoint, ref)
            if ck is not None and ck.status == "committed":
                return ck.id
            ids = list(s.scalars(select(m.Checkpoint.id).where(committed).where(m.Checkpoint.id.startswith(ref))))
            if len(ids) == 1:
                return ids[0]
            if len(ids) > 1:
                raise ReferenceNotFound(f"reference {ref!r} is an ambiguous id prefix: {', '.join(ids[:5])}")
            candidates = [f"{r}@{st}" for r, st in s.execute(
                select(m.Run.name, m.Checkpoint.step).join(m.Checkpoint.run).where(committed))]
            candidates += self._run_names(s)
            raise ReferenceNotFound(f"reference {ref!r} matches no committed checkpoint (expected RUN@STEP, "
                                    f"RUN@latest, RUN:TAG or a version id){self._near(ref, candidates)}")

    def checkpoint(self, ref: str):
        from .checkpoint import Checkpoint

        return Checkpoint(self, self.resolve(ref))

    # --- writing ------------------------------------------------------------------------------
    def begin(self, run: str, step: int, *, parent: str | None = "auto", message: str | None = None,
              provenance: Mapping[str, Any] | None = None) -> "CheckpointWriter":
        """Start a checkpoint. ``parent="auto"`` links the run's latest committed version."""
        names.run_name(run)
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise UcpError(f"step must be a non-negative integer, got {step!r}")
        prov = self._provenance_record(provenance)
        with self.catalog.write_session() as s:
            run_row = s.scalar(select(m.Run).where(m.Run.name == run))
            if run_row is None:
                # On PostgreSQL two first saves of a run can race (no database-wide write lock as on
                # SQLite): insert in a savepoint, and on the unique-name conflict take the winner's row.
                try:
                    with s.begin_nested():
                        run_row = m.Run(name=run)
                        s.add(run_row)
                except IntegrityError:
                    run_row = s.scalar(select(m.Run).where(m.Run.name == run))
                    if run_row is None:
                        raise
            taken = s.scalar(select(m.Checkpoint.id).where(m.Checkpoint.run_id == run_row.id,
                                                           m.Checkpoint.step == int(step),
                                                           m.Checkpoint.status == "committed"))
            if taken:
                raise UcpError(f"run {run!r} already has a committed checkpoint at step {step} ({taken}); "
                               f"remove it first (`ucp rm {run}@{step}`) or use another step")
            if parent == "auto":
                parent_id = s.scalar(select(m.Checkpoint.id).where(
                    m.Checkpoint.run_id == run_row.id, m.Checkpoint.status == "committed")
                    .order_by(m.Checkpoint.step.desc()).limit(1))
            elif parent is None:
                parent_id = None
            else:
                parent_id = None  # resolved below, outside this transaction's lock
            ck = m.Checkpoint(run_id=run_row.id, step=int(step), status="pending", message=message,
                              owner_host=socket.gethostname(), owner_pid=os.getpid(), parent_id=parent_id,
                              format_version=FORMAT_VERSION)
            s.add(ck)
            s.flush()
            s.add(m.Provenance(checkpoint_id=ck.id, **prov))
            cid = ck.id
        if parent not in ("auto", None):
            pid = self.resolve(parent)
            with self.catalog.write_session() as s:
                s.execute(update(m.Checkpoint).where(m.Checkpoint.id == cid).values(parent_id=pid))
        return CheckpointWriter(self, cid, owner=True)

    def join(self, checkpoint_id: str) -> "CheckpointWriter":
        """Attach another process (e.g. a torch.distributed rank) to a pending checkpoint."""
        with self.catalog.session() as s:
            ck = s.get(m.Checkpoint, checkpoint_id)
            if ck is None or ck.status != "pending":
                raise UcpError(f"checkpoint {checkpoint_id!r} is not a pending save; cannot join it")
        return CheckpointWriter(self, checkpoint_id, owner=False)

    def save(self, run: str, step: int, tensors: Mapping[str, Any], *, patterns: Mapping[str, dict] | None = None,
             objects: Mapping[str, Any] | None = None, provenance: Mapping[str, Any] | None = None,
             message: str | None = None, parent: str | None = "auto", state: str = "weight"):
        """Save a dict of tensors (``name -> tensor`` or ``name -> {state: tensor}``) as one version."""
        patterns = patterns or {}
        with self.begin(run, step, parent=parent, message=message, provenance=provenance) as w:
            for name, value in tensors.items():
                states = value if isinstance(value, Mapping) else {state: value}
                for st, tensor in states.items():
                    w.write(name, st, tensor, pattern=patterns.get(name))
            for name, value in (objects or {}).items():
                w.write_object(name, value)
        return w.checkpoint

    def _provenance_record(self, provenance: Mapping[str, Any] | None) -> dict:
        from .schema import validate

        prov = dict(provenance or {})
        prov.setdefault("source_kind", "api")
        prov.setdefault("tool_version", _tool_version())
        prov.setdefault("host", socket.gethostname())
        libs = _library_versions()
        libs.update(prov.get("library_versions") or {})
        prov["library_versions"] = libs
        prov.setdefault("source_hashes", {})
        prov.setdefault("extra", {})
        validate("provenance", prov)
        allowed = {"source_kind", "source_path", "source_topology", "tool_version", "library_versions", "host",
                   "source_hashes", "extra"}
        return {k: v for k, v in prov.items() if k in allowed}

    # --- tags, removal, retention, gc ---------------------------------------------------------------
    def tag(self, ref: str, tag: str, *, force: bool = False) -> str:
        names.tag_name(tag)
        cid = self.resolve(ref)
        with self.catalog.write_session() as s:
            ck = s.get(m.Checkpoint, cid)
            row = s.scalar(select(m.Tag).where(m.Tag.run_id == ck.run_id, m.Tag.name == tag))
            if row is not None:
                if not force and row.checkpoint_id != cid:
                    raise UcpError(f"tag {tag!r} already names checkpoint {row.checkpoint_id}; use --force to move it")
                row.checkpoint_id = cid
            else:
                s.add(m.Tag(run_id=ck.run_id, name=tag, checkpoint_id=cid))
        return cid

    def untag(self, run: str, tag: str) -> None:
        with self.catalog.write_session() as s:
            row = s.scalar(select(m.Tag).join(m.Run).where(m.Run.name == run, m.Tag.name == tag))
            if row is None:
                raise ReferenceNotFound(f"tag {run}:{tag} not found")
            s.delete(row)

    def rm(self, ref: str, *, force: bool = False) -> str:
        """Remove a committed version from the catalog; its arrays go when nothing else needs them."""
        cid = self.resolve(ref)
        with self.catalog.write_session() as s:
            tags = list(s.scalars(select(m.Tag.name).where(m.Tag.checkpoint_id == cid)))
            if tags and not force:
                raise UcpError(f"checkpoint {ref} ({cid}) is tagged {', '.join(tags)}; untag it or use --force")
            s.execute(update(m.Checkpoint).where(m.Checkpoint.parent_id == cid).values(parent_id=None))
            s.delete(s.get(m.Checkpoint, cid))
        self._sweep_arrays(dry_run=False)
        return cid

    def set_retention(self, run: str, *, keep_last: int | None = None, keep_every: int | None = None,
                      keep_tagged: bool = True) -> dict | None:
        policy = None
        if keep_last is not None or keep_every is not None:
            policy = {"keep_last": keep_last, "keep_every": keep_every, "keep_tagged": keep_tagged}
        with self.catalog.write_session() as s:
            row = s.scalar(select(m.Run).where(m.Run.name == run))
            if row is None:
                raise ReferenceNotFound(f"run {run!r} not found{self._near(run, self._run_names(s))}")
            row.retention = policy
        return policy

    def retention_victims(self, run: str | None = None, *, keep_last: int | None = None,
                          keep_every: int | None = None, keep_tagged: bool = True) -> list[str]:
        """Committed versions a retention policy would remove (explicit arguments beat stored policies)."""
        victims = []
        with self.catalog.session() as s:
            q = select(m.Run)
            if run is not None:
                q = q.where(m.Run.name == run)
            for r in s.scalars(q):
                policy = r.retention or {}
                kl = keep_last if keep_last is not None else policy.get("keep_last")
                ke = keep_every if keep_every is not None else policy.get("keep_every")
                kt = keep_tagged if (keep_last is not None or keep_every is not None) else policy.get("keep_tagged", True)
                if kl is None and ke is None:
                    continue
                cks = list(s.execute(select(m.Checkpoint.id, m.Checkpoint.step).where(
                    m.Checkpoint.run_id == r.id, m.Checkpoint.status == "committed").order_by(m.Checkpoint.step)))
                tagged = set(s.scalars(select(m.Tag.checkpoint_id).where(m.Tag.run_id == r.id)))
                keep = set()
                if kl:
                    keep |= {cid for cid, _ in cks[-kl:]}
                if ke:
                    keep |= {cid for cid, st in cks if st % ke == 0}
                if kt:
                    keep |= tagged
                if cks:
                    keep.add(cks[-1][0])  # never remove a run's newest version by policy
                victims += [cid for cid, _ in cks if cid not in keep]
        return victims

    def gc(self, *, run: str | None = None, keep_last: int | None = None, keep_every: int | None = None,
           keep_tagged: bool = True, dry_run: bool = False,
           pending_timeout: _dt.timedelta = DEFAULT_PENDING_TIMEOUT) -> GcReport:
        """Apply retention, drop dead pending saves, then delete arrays nothing committed references."""
        report = GcReport(dry_run=dry_run)
        victims = self.retention_victims(run, keep_last=keep_last, keep_every=keep_every, keep_tagged=keep_tagged)
        host = socket.gethostname()
        now = _utcnow()
        with self.catalog.write_session() as s:
            for cid in victims:
                report.removed_checkpoints.append(cid)
                if not dry_run:
                    s.execute(update(m.Checkpoint).where(m.Checkpoint.parent_id == cid).values(parent_id=None))
                    s.delete(s.get(m.Checkpoint, cid))
            for ck in s.scalars(select(m.Checkpoint).where(m.Checkpoint.status == "pending")):
                dead = (ck.owner_host == host and not _pid_alive(ck.owner_pid)) or (now - ck.created_at) > pending_timeout
                if dead:
                    report.removed_pending.append(ck.id)
                    if not dry_run:
                        s.delete(ck)
        n, freed = self._sweep_arrays(dry_run=dry_run, also=set(report.removed_pending))
        report.removed_arrays, report.freed_bytes = n, freed
        return report

    def _sweep_arrays(self, *, dry_run: bool, also: set[str] = frozenset()) -> tuple[int, int]:
        """Delete arrays with no referencing tensor/object row and files no row knows about."""
        removed, freed = 0, 0
        with self.catalog.write_session() as s:
            referenced = exists().where(m.Tensor.array_id == m.Array.id)
            referenced_obj = exists().where(m.StoredObject.array_id == m.Array.id)
            orphans = list(s.scalars(select(m.Array).where(~referenced, ~referenced_obj)))
            # arrays of live pending saves have no rows yet or are referenced by pending rows: keep them
            live_pending = set(s.scalars(select(m.Checkpoint.id).where(m.Checkpoint.status == "pending")))
            for a in orphans:
                if a.path.split("/")[1] in live_pending:
                    continue
                removed += 1
                freed += a.nbytes
                if not dry_run:
                    s.delete(a)
                    self.location.delete_tree(a.path)
        # files on disk without any row (a killed save before its rows were flushed). List the folders
        # first: a checkpoint row is inserted before its folder exists, so a folder seen here whose
        # row is absent afterwards belongs to a save that is gone, never to one that just started.
        folders = self.location.list_dirs("arrays")
        with self.catalog.session() as s:
            live_ids = set(s.scalars(select(m.Checkpoint.id)))
            known_paths = set(s.scalars(select(m.Array.path)))
        for folder in folders:
            if folder in live_ids and folder not in also:
                continue
            for entry in self.location.list_dirs(f"arrays/{folder}"):
                rel = f"arrays/{folder}/{entry}"
                if rel in known_paths:
                    continue
                removed += 1
                if not dry_run:
                    self.location.delete_tree(rel)
            if not dry_run and self.location.kind == "file":
                try:
                    os.rmdir(os.path.join(self.location.root, "arrays", folder))
                except OSError:
                    pass
        return removed, freed

    # --- queries ----------------------------------------------------------------------------------
    def query(self, sql: str) -> tuple[list[str], list[tuple]]:
        """Run read-only SQL against the catalog (SQLite: query_only; PostgreSQL: READ ONLY transaction)."""
        return read_only_query(self.catalog.engine, sql)

    def resolve_many(self, refs: Iterable[str]) -> list[str]:
        return [self.resolve(r) for r in refs]


_SCHEMA_PRAGMAS = frozenset({"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
                             "foreign_key_list"})


def _sqlite_read_authorizer(action: int, arg1, arg2, *_rest) -> int:
    """SQLite authorizer for ``ucp query``: reading only. ``query_only`` alone still lets ATTACH create
    files anywhere and PRAGMA switch it off; this refuses every action but SELECT, reads, functions and
    the schema-inspection pragmas (their argument is a table or index name)."""
    import sqlite3

    allowed = (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE)
    if action in allowed:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_PRAGMA and str(arg1).lower() in _SCHEMA_PRAGMAS:
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def _result(res) -> tuple[list[str], list[tuple]]:
    if not res.returns_rows:
        return [], []
    return list(res.keys()), [tuple(r) for r in res.fetchall()]


def read_only_query(engine, sql: str) -> tuple[list[str], list[tuple]]:
    """Run one SQL statement with writes refused by the database itself, not by parsing the SQL."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql("PRAGMA query_only = ON")
            raw = conn.connection.dbapi_connection
            raw.set_authorizer(_sqlite_read_authorizer)
            try:
                cols, rows = _result(conn.exec_driver_sql(sql))
            except Exception as exc:
                raise UcpError(f"query failed: {exc.__class__.__name__}: {str(exc).splitlines()[0]}") from None
            finally:
                raw.set_authorizer(None)
                conn.exec_driver_sql("PRAGMA query_only = OFF")
                conn.rollback()
            return cols, rows
        with conn.begin():
            conn.exec_driver_sql("SET TRANSACTION READ ONLY")
            try:
                return _result(conn.exec_driver_sql(sql))
            except Exception as exc:
                raise UcpError(f"query failed: {exc.__class__.__name__}: {str(exc).splitlines()[0]}") from None


class CheckpointWriter:
    """Writes tensor-states and objects into one pending checkpoint; ``commit`` makes it visible."""

    def __init__(self, store: Store, checkpoint_id: str, *, owner: bool):
        self.store = store
        self.id = checkpoint_id
        self.owner = owner
        self._rows: list = []
        self._inflight: deque = deque()
        self._inflight_bytes = 0
        self._seen: set[tuple[str, str]] = set()
        self._objects: set[str] = set()
        self._local_arrays: dict[str, str] = {}  # content hash -> array id written by this writer
        self._position = 0
        self._closed = False
        self.checkpoint = None
        self.nbytes = 0
        self._sharded: dict[tuple[str, str], tuple] = {}  # (name, state) -> (array id, path, layout, pattern)
        self._handles: dict[tuple[str, str], Any] = {}
        self._origin: set[tuple[str, str]] = set()
        self._committed_hashes: dict[str, list] | None = None
        self._region_digests: dict[tuple[str, str], dict | None] = {}
        self._region_hashes: dict[tuple[str, str], str] = {}

    # context manager: commit on success (owner) / flush (joined rank); abort on error
    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self.owner:
            self.commit()
        else:
            self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise UcpError(f"checkpoint writer {self.id} is closed")

    def _layout(self, shape, dtype: str, pattern, boundaries=None, shard_shape=None, units=None) -> fmt.ArrayLayout:
        st = self.store.settings
        return fmt.plan_layout(shape, dtype, pattern=pattern, compression=st["compression"],
                               target_bytes=st["chunk_target_bytes"], boundaries=boundaries, shard_shape=shard_shape,
                               units=units)

    def _dedup(self, h: str, dtype: str, shape) -> str | None:
        """An existing ready array of a committed version with this content, or None.

        The committed arrays' hashes are read once per writer (one query instead of one per write); an
        array swept meanwhile by a concurrent rm/gc is caught when the rows are flushed."""
        if h in self._local_arrays:
            return self._local_arrays[h]
        if self._committed_hashes is None:
            with self.store.catalog.session() as s:
                q = (select(m.Array.content_hash, m.Array.id, m.Array.shape, m.Array.dtype)
                     .where(m.Array.status == "ready", m.Array.content_hash.is_not(None))
                     .where(exists().where(m.Tensor.array_id == m.Array.id, m.Tensor.checkpoint_id == m.Checkpoint.id,
                                           m.Checkpoint.status == "committed")))
                self._committed_hashes = {}
                for ch, aid, ashape, adtype in s.execute(q):
                    self._committed_hashes.setdefault(ch, []).append((aid, list(ashape), adtype))
        for aid, ashape, adtype in self._committed_hashes.get(h, ()):
            if adtype == dtype and ashape == list(shape):
                return aid
        return None

    def _put_array(self, array: np.ndarray, dtype: str, pattern, what: str) -> tuple[str, str, int]:
        """Write (or dedup) one array; returns (array id, content hash, stored bytes written)."""
        h = fmt.content_hash(array, dtype)
        aid = self._dedup(h, dtype, array.shape)
        if aid is not None:
            return aid, h, 0
        layout = self._layout(array.shape, dtype, pattern)
        aid = m.new_id(32)
        rel = f"arrays/{self.id}/{aid}.zarr"
        handle = fmt.create_array(self.store.location, rel, layout, self.store.context)
        future = handle.write(array)
        self._inflight.append((future, array, what))
        self._inflight_bytes += array.nbytes
        self._rows.append(m.Array(id=aid, path=rel, dtype=dtype, shape=list(layout.shape),
                                  chunk_shape=list(layout.chunk_shape), shard_shape=list(layout.shard_shape),
                                  codecs=layout.codecs(), nbytes=layout.nbytes, content_hash=h, status="ready"))
        self._local_arrays[h] = aid
        while self._inflight_bytes > _MAX_INFLIGHT_BYTES:
            self._wait_one()
        return aid, h, array.nbytes

    def _wait_one(self) -> None:
        future, array, what = self._inflight.popleft()
        self._inflight_bytes -= array.nbytes
        try:
            future.result()
        except Exception as exc:  # TensorStore raises ValueError with the kvstore's message
            raise UcpError(f"writing {what} into checkpoint {self.id} failed: {exc}") from None

    def _drain(self) -> None:
        while self._inflight:
            self._wait_one()

    def write(self, name: str, state: str, tensor: torch.Tensor | np.ndarray, *, pattern: dict | None = None,
              expect_shape=None, expect_dtype=None, position: int | None = None) -> TensorInfo | None:
        """Store one tensor-state (bit-exact, native dtype). ``pattern`` says how it maps onto ranks.

        ``position`` orders tensor-states in the checkpoint (the planner lays ZeRO groups out in this
        order); by default the order of writing. Distributed writers pass the global parameter order."""
        self._check_open()
        names.tensor_name(name)
        names.state_name(state)
        what = f"tensor {name!r} state {state!r}"
        if (name, state) in self._seen:
            raise UcpError(f"{what} was already written to checkpoint {self.id}")
        if isinstance(tensor, torch.Tensor):
            array = dtypes.to_numpy(tensor, what=what)
        elif isinstance(tensor, np.ndarray):
            dtypes.zarr_name(tensor.dtype, what=what)
            array = np.require(tensor, requirements="C")
        else:
            raise UcpError(f"{what}: expected a torch.Tensor or numpy array, got {type(tensor).__name__}")
        dtype = dtypes.zarr_name(array.dtype, what=what)
        if expect_shape is not None and tuple(expect_shape) != tuple(array.shape):
            raise ShapeMismatch(f"{what}: shape {tuple(array.shape)} does not match the declared {tuple(expect_shape)}")
        if expect_dtype is not None and dtypes.zarr_name(expect_dtype) != dtype:
            raise ShapeMismatch(f"{what}: dtype {dtype} does not match the declared {dtypes.zarr_name(expect_dtype)}")
        if pattern is not None:
            self._validate_pattern(name, pattern, array.shape)
        aid, h, _ = self._put_array(array, dtype, pattern, what)
        self._seen.add((name, state))
        self._rows.append(m.Tensor(checkpoint_id=self.id, name=name, state=state, array_id=aid, shape=list(array.shape),
                                   dtype=dtype, pattern=pattern, nbytes=array.nbytes, content_hash=h,
                                   position=self._next_position() if position is None else int(position),
                                   layer=_layer_of(pattern)))
        self.nbytes += array.nbytes
        if len(self._rows) >= _ROW_BATCH:
            self.flush()
        return None

    def _next_position(self) -> int:
        self._position += 1
        return self._position

    @staticmethod
    def _validate_pattern(name: str, pattern: dict, shape) -> None:
        """Schema first (clear field paths), then the algebra's own checks against the shape."""
        from . import patterns as pat
        from .schema import validate

        validate("pattern", pattern)
        pat.check_pattern(pattern, tuple(shape), name=name)

    # --- sharded writes: each rank writes its shards straight into the logical arrays ---------------
    def write_shard(self, name: str, state: str, local: torch.Tensor, *, shape, pattern: dict | None,
                    topology, rank: int, fragment=None, targets: Iterable = ()) -> int:
        """Write rank ``rank``'s shard of a tensor-state (its TP-local tensor, or with ``fragment`` its
        ZeRO flat fragment) into the logical array; returns the number of elements written.

        Every rank of the source topology calls this for the tensor-states it holds; only the one rank
        that ``patterns.is_writer`` picks for each element writes it. Inner-chunk boundaries follow the
        split points of the source and ``targets`` topologies, and shard files follow the source split so
        that two ranks never write one shard where the layout allows it; where they must (ZeRO flat
        fragments straddling rows), TensorStore's conditional read-modify-write merges them safely.
        After every rank has written, each calls ``finish_shards`` (after a barrier) and rank 0 commits.
        """
        from . import patterns as pat
        from .topology import as_topology

        self._check_open()
        names.tensor_name(name)
        names.state_name(state)
        what = f"tensor {name!r} state {state!r}"
        topology = as_topology(topology)
        shape = tuple(int(s) for s in shape)
        array = dtypes.to_numpy(local, what=what) if isinstance(local, torch.Tensor) else np.require(local, requirements="C")
        dtype = dtypes.zarr_name(array.dtype, what=what)
        if pattern is not None:
            self._validate_pattern(name, pattern, shape)
        handle, layout, rel, aid = self._sharded_array(name, state, shape, dtype, pattern, topology, targets)
        written = 0
        if fragment is None:
            expected = pat.local_layout(pattern, shape, topology, rank, name=name).shape
            if tuple(array.shape) != tuple(expected):
                raise ShapeMismatch(f"{what}: rank {rank} shard has shape {tuple(array.shape)}, its layout in "
                                    f"{topology.describe()} expects {tuple(expected)}")
            copies = [(c.logical, array[c.local.slices()]) for c in
                      pat.writer_copies(pattern, shape, topology, rank, name=name)]
        else:
            flat = array.reshape(-1)
            if flat.size < fragment.slot:
                raise ShapeMismatch(f"{what}: rank {rank} fragment has {flat.size} elements, expected {fragment.slot}")
            copies = [(fc.logical, flat[fc.flat.start:fc.flat.stop].reshape(fc.logical.shape)) for fc in
                      pat.fragment_writer_copies(pattern, shape, topology, rank, fragment, name=name)]
        for box, data in copies:
            future = handle[box.slices()].write(data)
            self._inflight.append((future, data, what))
            self._inflight_bytes += data.nbytes
            written += data.size
        while self._inflight_bytes > _MAX_INFLIGHT_BYTES:
            self._wait_one()
        self._sharded.setdefault((name, state), (aid, rel, layout, pattern))
        if any(all(lo == 0 for lo, _ in box.ranges) for box, _ in copies) or (not shape and copies):
            self._origin.add((name, state))  # this rank records the row (it wrote element 0)
        return written

    def write_region(self, name: str, state: str, local: torch.Tensor | np.ndarray, *, shape, offset,
                     pattern: dict | None, boundaries: Mapping[int, Iterable[int]] | None = None,
                     origin: bool = False) -> int:
        """Write one box of a tensor-state, ``local`` at ``offset`` of the logical ``shape``; returns elements.

        For sources that know each rank's boxes themselves (DTensor shards: ``ucp_store.dist``). Every
        rank that writes a box of the tensor-state passes the same ``shape``, dtype, ``pattern`` and
        ``boundaries`` (the split points of all writers), so all derive one array id and one layout;
        chunks and shard files are cut at ``boundaries`` so writers own whole files where they can.
        The caller guarantees one writer per element (replicas write once). Exactly one rank passes
        ``origin=True`` (the one writing element 0, or any one rank for an empty tensor): after the
        barrier it hashes the array and records the row in ``finish_shards``, deduplicating against
        committed arrays with the same content."""
        self._check_open()
        names.tensor_name(name)
        names.state_name(state)
        what = f"tensor {name!r} state {state!r}"
        shape = tuple(int(s) for s in shape)
        offset = tuple(int(o) for o in offset)
        array = dtypes.to_numpy(local, what=what) if isinstance(local, torch.Tensor) else np.require(local, requirements="C")
        dtype = dtypes.zarr_name(array.dtype, what=what)
        if len(offset) != len(shape) or array.ndim != len(shape) or any(
                o < 0 or o + n > s for o, n, s in zip(offset, array.shape, shape)):
            raise ShapeMismatch(f"{what}: a box of shape {tuple(array.shape)} at offset {offset} does not fit the "
                                f"logical shape {shape}")
        if pattern is not None:
            self._validate_pattern(name, pattern, shape)
        key = (name, state)
        if key in self._sharded:
            aid, rel, layout, _ = self._sharded[key]
            if layout.dtype != dtype or layout.shape != shape:
                raise ShapeMismatch(f"{what}: box declares {dtype}{list(shape)}, earlier boxes "
                                    f"{layout.dtype}{list(layout.shape)}")
            handle = self._handles[key]
        else:
            import tensorstore as ts
            import xxhash

            points = {int(d): [int(p) for p in v] for d, v in (boundaries or {}).items()}
            layout = self._layout(shape, dtype, pattern, boundaries=points or None)
            layout = fmt.ArrayLayout(layout.dtype, layout.shape, layout.chunk_shape,
                                     _writer_aligned_shards(layout, points), layout.compression)
            aid = xxhash.xxh3_128(f"{self.id}\0{name}\0{state}".encode()).hexdigest()
            rel = f"arrays/{self.id}/{aid}.zarr"
            handle = ts.open(fmt._spec(self.store.location, rel, layout), create=True, open=True,
                             context=self.store.context).result()
            self._handles[key] = handle
            self._sharded[key] = (aid, rel, layout, pattern)
        if array.size:
            box = tuple(slice(o, o + n) for o, n in zip(offset, array.shape))
            future = handle[box].write(array) if box else handle.write(array)
            self._inflight.append((future, array, what))
            self._inflight_bytes += array.nbytes
            self._digest_region(key, self._sharded[key][2], offset, array)
            while self._inflight_bytes > _MAX_INFLIGHT_BYTES:
                self._wait_one()
        if origin:
            self._origin.add(key)
        return int(array.size)

    def _digest_region(self, key, layout: fmt.ArrayLayout, offset, array: np.ndarray) -> None:
        """Digest every inner chunk of a chunk-aligned box (``fmt.chunk_tree_hash``), so that the origin rank
        can hash the array without reading it back; a box that cuts a chunk disables this for the array."""
        digests = self._region_digests.setdefault(key, {})
        if digests is None:
            return
        ranges = []
        for o, n, c, s in zip(offset, array.shape, layout.chunk_shape, layout.shape):
            if o % c or ((o + n) % c and o + n != s):
                self._region_digests[key] = None
                return
            ranges.append(range(o // c, -(-(o + n) // c)))
        import itertools

        for idx in itertools.product(*ranges):
            sl = tuple(slice(i * c - o, min((i + 1) * c, s) - o)
                       for i, c, s, o in zip(idx, layout.chunk_shape, layout.shape, offset))
            digests[idx] = fmt.chunk_digest(array[sl] if sl else array)

    def region_digests(self) -> dict:
        """``{(name, state): {chunk index: digest} | None}`` of the boxes this writer wrote (None: unaligned)."""
        return dict(self._region_digests)

    def set_region_hash(self, name: str, state: str, content_hash: str) -> None:
        """The content hash of a region-written array, computed from every rank's chunk digests; the origin
        rank's ``finish_shards`` then records it instead of reading the array back."""
        self._region_hashes[(name, state)] = content_hash

    def _sharded_array(self, name, state, shape, dtype, pattern, topology, targets):
        key = (name, state)
        if key in self._sharded:
            aid, rel, layout, _ = self._sharded[key]
            if layout.dtype != dtype or layout.shape != shape:
                raise ShapeMismatch(f"tensor {name!r} state {state!r}: shard declares {dtype}{list(shape)}, "
                                    f"earlier shards {layout.dtype}{list(layout.shape)}")
            return self._handles[key], layout, rel, aid
        import xxhash

        from .planner import chunk_alignment, split_points

        topologies = [topology, *targets]
        units = {}
        if shape:
            points = split_points(pattern, shape, topologies)
            align = chunk_alignment(pattern, shape, topologies, itemsize=dtypes.itemsize(dtype))
            units = {d: a for d, a in enumerate(align) if points[d]}
        layout = self._layout(shape, dtype, pattern, units=units)
        source_points = {d: p for d, p in enumerate(split_points(pattern, shape, [topology])) if p} if shape else {}
        layout = fmt.ArrayLayout(layout.dtype, layout.shape, layout.chunk_shape,
                                 _writer_aligned_shards(layout, source_points), layout.compression)
        # every rank derives the same array id, so all of them open one array
        aid = xxhash.xxh3_128(f"{self.id}\0{name}\0{state}".encode()).hexdigest()
        rel = f"arrays/{self.id}/{aid}.zarr"
        import tensorstore as ts

        spec = fmt._spec(self.store.location, rel, layout)
        handle = ts.open(spec, create=True, open=True, context=self.store.context).result()
        self._handles[key] = handle
        return handle, layout, rel, aid

    def finish_shards(self) -> None:
        """After all ranks wrote (barrier first): hash and record the arrays this rank is origin of."""
        self._drain()
        for key in sorted(self._origin):
            aid, rel, layout, pattern = self._sharded[key]
            handle = self._handles[key]
            h = self._region_hashes.get(key)
            if h is None:
                hasher = fmt.ContentHasher(layout.dtype, layout.shape)
                for box in fmt.slabs(layout):
                    hasher.update(fmt.read_box(handle, layout, box, what=f"tensor {key[0]!r} state {key[1]!r}",
                                               array_url=self.store.array_url(rel)))
                h = hasher.hexdigest()
            existing = self._dedup(h, layout.dtype, layout.shape)
            if existing is not None:
                self.store.location.delete_tree(rel)  # identical content is already stored
                array_id = existing
            else:
                self._rows.append(m.Array(id=aid, path=rel, dtype=layout.dtype, shape=list(layout.shape),
                                          chunk_shape=list(layout.chunk_shape), shard_shape=list(layout.shard_shape),
                                          codecs=layout.codecs(), nbytes=layout.nbytes, content_hash=h, status="ready"))
                array_id = aid
                self._local_arrays[h] = aid  # later identical arrays of this save reference it
            self._rows.append(m.Tensor(checkpoint_id=self.id, name=key[0], state=key[1], array_id=array_id,
                                       shape=list(layout.shape), dtype=layout.dtype, pattern=pattern,
                                       nbytes=layout.nbytes, content_hash=h, position=self._next_position(),
                                       layer=_layer_of(pattern)))
        self._origin.clear()
        self.flush()

    def write_object(self, name: str, value: Any) -> None:
        """Store non-tensor state: JSON (dicts, lists, numbers, strings) or a tensor/array. Never pickle."""
        self._check_open()
        names.object_name(name)
        if name in self._objects:
            raise UcpError(f"object {name!r} was already written to checkpoint {self.id}")
        if isinstance(value, (torch.Tensor, np.ndarray)):
            array = dtypes.to_numpy(value, what=f"object {name!r}") if isinstance(value, torch.Tensor) else value
            dtype = dtypes.zarr_name(array.dtype, what=f"object {name!r}")
            aid, _, _ = self._put_array(np.require(array, requirements="C"), dtype, None, f"object {name!r}")
            row = m.StoredObject(checkpoint_id=self.id, name=name, kind="array", array_id=aid)
        else:
            row = m.StoredObject(checkpoint_id=self.id, name=name, kind="json", value=_check_json(name, value))
        self._objects.add(name)
        self._rows.append(row)

    def flush(self) -> None:
        """Wait for in-flight writes, then record their rows under the pending checkpoint."""
        self._drain()
        if not self._rows:
            return
        rows, self._rows = self._rows, []
        arrays = [r for r in rows if isinstance(r, m.Array)]
        others = [r for r in rows if not isinstance(r, m.Array)]
        with self.store.catalog.write_session() as s:
            ck = s.get(m.Checkpoint, self.id)
            if ck is None or ck.status != "pending":
                raise UcpError(f"checkpoint {self.id} is no longer pending (removed by gc?); the save is lost")
            s.add_all(arrays)
            s.flush()
            # arrays deduplicated against must still exist: a concurrent rm/gc may have swept them
            new_ids = {a.id for a in arrays}
            wanted = {r.array_id for r in others if getattr(r, "array_id", None)} - new_ids
            if wanted:
                found = set(s.scalars(select(m.Array.id).where(m.Array.id.in_(wanted))))
                if wanted - found:
                    raise UcpError(f"checkpoint {self.id}: array(s) {', '.join(sorted(wanted - found))[:200]} this "
                                   "save deduplicated against were removed by a concurrent rm/gc; the save is "
                                   "aborted, retry it")
            s.add_all(others)

    def close(self) -> None:
        """For a joined writer: flush and detach (the owner commits)."""
        if not self._closed:
            if self._origin:
                self.finish_shards()
            self.flush()
            self._closed = True

    def commit(self):
        """Make the checkpoint visible: one transaction, after every array write has returned."""
        from .checkpoint import Checkpoint

        self._check_open()
        if not self.owner:
            raise UcpError(f"only the process that began checkpoint {self.id} can commit it")
        try:
            if self._origin:
                self.finish_shards()
            self.flush()
            with self.store.catalog.write_session() as s:
                ck = s.get(m.Checkpoint, self.id)
                if ck is None or ck.status != "pending":
                    raise UcpError(f"checkpoint {self.id} is no longer pending; cannot commit")
                taken = s.scalar(select(m.Checkpoint.id).where(
                    m.Checkpoint.run_id == ck.run_id, m.Checkpoint.step == ck.step,
                    m.Checkpoint.status == "committed"))
                if taken:
                    raise UcpError(f"step {ck.step} of this run was committed meanwhile by {taken}")
                total = s.scalar(select(func.coalesce(func.sum(m.Tensor.nbytes), 0)).where(
                    m.Tensor.checkpoint_id == self.id))
                ck.nbytes = int(total)
                ck.status = "committed"
                ck.committed_at = _utcnow()
        except IntegrityError as exc:  # the partial unique index: a concurrent commit of the same step won
            self.abort()
            raise UcpError(f"checkpoint {self.id}: its step was committed meanwhile by another save of the "
                           f"same run; nothing of this save is listed ({getattr(exc, 'orig', exc)})") from None
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self.checkpoint = Checkpoint(self.store, self.id)
        return self.checkpoint

    def abort(self) -> None:
        """Drop the pending checkpoint and every array it wrote (nothing is ever listed)."""
        if self._closed:
            return
        self._closed = True
        for future, _, _ in self._inflight:
            try:
                future.result()
            except Exception:
                pass
        self._inflight.clear()
        self._rows.clear()
        if not self.owner:
            return
        try:
            with self.store.catalog.write_session() as s:
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
            self.store._sweep_arrays(dry_run=False, also={self.id})
        except Exception:
            pass  # gc will reclaim what is left; the checkpoint is not listed either way


def _writer_aligned_shards(layout: fmt.ArrayLayout, source_points: dict[int, Iterable[int]]) -> tuple[int, ...]:
    """Shard extents that divide the source topology's split points (in whole inner chunks) where they can.

    Then each writer rank owns whole shard files; where a split point is not a multiple of the inner
    chunk, the shard stays as planned and concurrent writers merge through conditional writes."""
    import math as _math

    shard = list(layout.shard_shape)
    for d, points in source_points.items():
        pts = [p for p in points if 0 < p < layout.shape[d]]
        if not pts:
            continue
        g = 0
        for p in pts:
            g = _math.gcd(g, p)
        c = layout.chunk_shape[d]
        if g % c == 0:
            shard[d] = min(shard[d], g)
    return tuple(shard)


def _check_json(name: str, value: Any) -> Any:
    import json

    try:
        text_ = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise UcpError(f"object {name!r} is not JSON-serialisable ({exc}); store tensors as arrays, never pickle") \
            from None
    return json.loads(text_)
