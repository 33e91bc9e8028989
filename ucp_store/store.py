"""The store: a versioned checkpoint registry (runs, versions, references, tags) over arrays and a catalog.

``open_store`` opens a :class:`Store` (a :class:`~ucp_store.io.location.Location` for the arrays plus a SQL
catalog). The registry answers what exists and by which name: ``runs``, ``list_checkpoints``, ``resolve``
(``RUN@STEP``, ``RUN@latest``, ``RUN:TAG``, an id or an unambiguous id prefix), ``tag``/``untag`` and
``rm``. The rest lives beside it, loaded on first use:

- writing: ``begin``/``join``/``save`` hand out a :class:`~ucp_store.save.writer.CheckpointWriter`
  (``ucp_store/save/writer.py``: the commit protocol);
- retention and gc: ``ucp_store/registry/retention.py``;
- read-only SQL: ``ucp_store/catalog/query.py``;
- reading a version: :class:`~ucp_store.registry.checkpoint.Checkpoint`.

This module imports no torch, TensorStore, zarr or numpy, so the catalog-only commands (``ucp ls``,
``show``, ``log``, ``tag``, ``query``, ``rm``, ``gc --dry-run``) start at once. The array context
(TensorStore) is made on first use.
"""

from __future__ import annotations

import datetime as _dt
import difflib
import functools
import numbers
import os
import re
import socket
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.exc import IntegrityError

from ucp_store import config, names
from ucp_store._killpoints import killpoint
from ucp_store.catalog import models as m
from ucp_store.catalog.chains import stored_bytes
from ucp_store.catalog.db import open_catalog, open_catalog_read_only
from ucp_store.catalog.query import DEFAULT_QUERY_TIMEOUT_S, read_only_query
from ucp_store.errors import (
    CatalogError,
    ConfigurationError,
    ReferenceNotFound,
    StepCommittedError,
    TaggedCheckpointError,
    TagInUseError,
    ValidationError,
    WriterClosedError,
)
from ucp_store.io.location import ARRAYS_DIR, Location
from ucp_store.registry import identity
from ucp_store.registry.context import ArrayContexts, StoreContext, did_you_mean, run_names

if TYPE_CHECKING:  # pragma: no cover
    from ucp_store.registry.checkpoint import Checkpoint
    from ucp_store.registry.retention import GcReport
    from ucp_store.save.writer import CheckpointWriter

__all__ = ["FORMAT_VERSION", "DEFAULT_STORE", "DEFAULT_PENDING_TIMEOUT", "Store", "open_store", "read_only_query"]

FORMAT_VERSION = 1
DEFAULT_STORE = "./ucp-store"
DEFAULT_PENDING_TIMEOUT = _dt.timedelta(hours=24)

def _check_delta_mode(mode: Any) -> None:
    if mode is not None and mode not in ("auto", "off"):
        raise ConfigurationError(f"delta={mode!r}: expected 'auto', 'off' or None (the run's setting)")


def _tool_version() -> str:
    from ucp_store import __version__

    return __version__


def _library_versions() -> dict[str, str]:
    """The versions of the libraries a save records (a fresh dict: the caller may add to it)."""
    return dict(_installed_versions())


@functools.lru_cache(maxsize=1)
def _installed_versions() -> dict[str, str]:
    # read once per process: parsing the packages' metadata cost half of every begin()
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "tensorstore", "numpy", "zarr", "numcodecs", "sqlalchemy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def open_store(url: str | None = None, *, create: bool = False, catalog: str | None = None,
               compression: str | None = None, chunk_target_bytes: int | None = None,
               sqlite_journal: str = "auto", read_only: bool = False) -> "Store":
    """Open (or with ``create`` make) a store. ``url`` defaults to ``$UCP_STORE`` or ``./ucp-store``.

    ``read_only``: open the catalog for reading only (``catalog.db.open_catalog_read_only``): nothing is
    written, so a read-only mount or a full disk can be listed and read; every write is refused.

    ``sqlite_journal`` (a SQLite catalog): ``'auto'`` runs WAL, or the rollback journal (DELETE) when the
    catalog is on a network or cluster filesystem (NFS, Lustre, GPFS, CephFS, SMB, FUSE, ...: WAL needs every
    process on one host); ``'wal'`` / ``'delete'`` force that mode (``ucp --sqlite-journal``)."""
    url = url or config.store_url() or DEFAULT_STORE
    location = Location.parse(url, catalog)
    db = _sqlite_file(location.catalog_url)
    if not create and db is not None and not os.path.exists(db):
        # opening must not conjure an empty SQLite catalog out of a typo'd path
        raise CatalogError(f"no store at {location.root} (no catalog {db}); create one with `ucp init` "
                           "or create=True")
    if create and db is not None and not os.path.exists(db) and location.exists():
        identity.refuse_new_catalog(location, location.catalog_url)  # before the new catalog file is made
    fresh_root = create and location.kind == "file" and not os.path.exists(location.root)
    if create:
        location.ensure_root()
    if read_only and create:
        raise ConfigurationError("open_store: create=True and read_only=True exclude each other")
    try:
        catalog_db = open_catalog_read_only(location.catalog_url) if read_only else \
            open_catalog(location.catalog_url, create=create, sqlite_journal=sqlite_journal)
    except BaseException:
        if fresh_root:  # an unreachable or refused catalog leaves no empty store folder behind
            for folder in (os.path.join(location.root, ARRAYS_DIR), location.root):
                try:
                    os.rmdir(folder)
                except OSError:
                    pass
        raise
    store = Store(location, catalog_db)
    if create:
        store.created = store._init_settings(compression, chunk_target_bytes)
    return store


def _sqlite_file(url: str) -> str | None:
    """The file of a SQLite catalog URL (None: another database, in memory, or a URL that does not parse,
    which opening the catalog then refuses with its own message)."""
    if not url.startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url

    try:
        db = make_url(url).database or ""
    except Exception:  # noqa: BLE001 (catalog.db refuses it, naming the URL with its credentials masked)
        return None
    return None if db in ("", ":memory:") else db


def _step_number(ref: str, step: str) -> int:
    """The step a reference ``RUN@STEP`` names: ASCII digits only, written canonically (no sign, no
    underscore, no other script's digits, no leading zero), so one step has one spelling."""
    if not re.fullmatch(r"0|[1-9][0-9]*", step):
        hint = ""
        if re.fullmatch(r"0[0-9]+", step):
            hint = f" (write {step.lstrip('0') or '0'})"
        raise ReferenceNotFound(f"reference {ref!r}: step {step!r} is not 'latest' or an integer in ASCII digits "
                                f"(no sign, underscore or leading zero){hint}")
    return int(step)


# what a setting a store's catalog does not record means: a store created before the chunk target was
# recorded at creation wrote 1 MiB inner chunks
_UNRECORDED: dict[str, Any] = {"compression": "none", "chunk_target_bytes": 1 << 20, "format_version": FORMAT_VERSION}


class Store:
    """A store opened by :func:`open_store`: the registry of runs and versions, and the door to writing
    (``begin``, ``save``), reading (``checkpoint``), retention and gc."""

    #: no longer read (the TensorStore contexts live in :attr:`store_context`); ``distributed.coord`` still sets it
    _context: Any = None

    def __init__(self, location: Location, catalog):
        self.location = location
        self.catalog = catalog
        #: whether ``open_store(create=True)`` made this store (False: it existed, its settings unchanged)
        self.created = False
        with self.catalog.session() as s:
            rows = {r.key: r.value for r in s.scalars(select(m.Setting))}
        self.settings: dict[str, Any] = {**_UNRECORDED, **rows}

    def __repr__(self) -> str:
        return f"Store({self.location.url!r})"

    @property
    def store_context(self) -> StoreContext:
        """What the writer and retention use of this store (location, catalog, settings): built once, and
        again only when one of those attributes was replaced (``open_store`` records a new store's
        settings after opening it; ``distributed.coord.detached_store`` fills a store in without
        ``__init__``). Every context of one store shares its TensorStore contexts."""
        ctx = self.__dict__.get("_store_context")
        if (ctx is None or ctx.location is not self.location or ctx.catalog is not self.catalog
                or ctx.settings is not self.settings or ctx.detached != bool(getattr(self, "detached", False))):
            arrays = ctx.arrays if ctx is not None else ArrayContexts()
            ctx = StoreContext(self.location, self.catalog, self.settings,
                               detached=bool(getattr(self, "detached", False)), arrays=arrays)
            self._store_context = ctx
        return ctx

    @property
    def context(self) -> Any:
        """The TensorStore context every array of this store opens with (made on first use)."""
        return self.store_context.context

    @property
    def unsynced_context(self) -> Any:
        """The context of a writer that defers durability (``CheckpointWriter.defer_durability``): local files
        are not fsynced one by one; that writer fsyncs them all at once before it records their rows."""
        return self.store_context.unsynced_context

    def _init_settings(self, compression: str | None, chunk_target_bytes: int | None) -> bool:
        """Record a new store's settings; True when the store is new. An existing store's settings never
        change: a requested value equal to the stored one is a no-op, another one is refused (naming the
        setting, the stored and the requested value) before anything is written."""
        from ucp_store.io.chunking import DEFAULT_TARGET, MAX_TARGET, MIN_TARGET

        wanted: dict[str, Any] = {"format_version": FORMAT_VERSION}
        if compression is not None:
            from ucp_store.io.format import check_compression

            check_compression(compression)
            wanted["compression"] = compression
        if chunk_target_bytes is not None:
            if not MIN_TARGET <= chunk_target_bytes <= MAX_TARGET:
                raise ConfigurationError(f"chunk target {chunk_target_bytes} bytes: expected "
                                         f"{MIN_TARGET >> 10} KiB to {MAX_TARGET >> 20} MiB")
            wanted["chunk_target_bytes"] = int(chunk_target_bytes)
        with self.catalog.write_session() as s:
            rows = {r.key: r.value for r in s.scalars(select(m.Setting))}
            new = not rows and s.scalar(select(func.count()).select_from(m.Run)) == 0
            stored = {**_UNRECORDED, **rows}
            if new:
                wanted.setdefault("chunk_target_bytes", DEFAULT_TARGET)  # recorded: later defaults may change
                # the store's identity: at the location first, then in this transaction (registry/identity.py)
                stored[identity.SETTING_KEY] = identity.record_new(self.location, self.catalog, s)
            else:
                for key, value in wanted.items():
                    if key != "format_version" and stored[key] != value:
                        raise ConfigurationError(self._setting_conflict(key, stored[key], value))
            for key, value in wanted.items():
                if key not in rows:
                    s.add(m.Setting(key=key, value=value))
        self.settings = {**stored, **wanted} if new else stored
        if not new:
            self._owned()  # an existing store: its catalog and location must be one store's (ids adopted)
        return new

    def _owned(self, *, adopt: bool = True) -> None:
        """Refuse a catalog and a location that are not one store's, before anything is written or deleted
        (``registry/identity.py``); ``adopt``: record a missing id. A detached rank has no catalog to ask."""
        if not getattr(self, "detached", False):
            identity.ensure_owned(self.location, self.catalog, adopt=adopt)

    def _setting_conflict(self, key: str, stored: Any, requested: Any) -> str:
        option = {"compression": "--compression", "chunk_target_bytes": "--chunk-mib"}.get(key, key)
        if key == "chunk_target_bytes":
            stored, requested = (f"{v} bytes ({v / (1 << 20):g} MiB)" for v in (stored, requested))
        else:
            stored, requested = repr(stored), repr(requested)
        return (f"store {self.location.url} already exists with {key} = {stored}; creating it again asked for "
                f"{key} = {requested} (`ucp init {option}`): a store's settings do not change once it is made "
                f"(omit the setting to open it as it is, or create another store)")

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
                            "message": ck.message, "nbytes": ck.nbytes, "tags": tags.get(ck.id, []),
                            "safety": ck.safety or "durable"})
            stored = stored_bytes(s, [r["id"] for r in out])  # what each version wrote (deltas: their size)
            for r in out:
                r["stored_nbytes"] = stored[r["id"]]
            if run is not None and not out and s.scalar(select(m.Run.id).where(m.Run.name == run)) is None:
                raise ReferenceNotFound(f"run {run!r} not found{self._near(run, self._run_names(s))}")
            return out

    @staticmethod
    def _tags_by_checkpoint(s) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for cid, name in s.execute(select(m.Tag.checkpoint_id, m.Tag.name).order_by(m.Tag.name)):
            out.setdefault(cid, []).append(name)
        return out

    _run_names = staticmethod(run_names)
    _near = staticmethod(did_you_mean)

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
                    number = _step_number(ref, step)
                    if not 0 <= number < 2**63:  # a step the catalog's 64-bit column cannot hold names nothing
                        raise ReferenceNotFound(f"reference {ref!r}: step {step} is out of range (0 to 2^63-1)")
                    cid = s.scalar(q.where(m.Checkpoint.step == number))
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
            # an id prefix is matched literally: '%' and '_' are no wildcards (autoescape)
            ids = list(s.scalars(select(m.Checkpoint.id).where(committed).where(
                m.Checkpoint.id.startswith(ref, autoescape=True)).order_by(m.Checkpoint.id).limit(6)))
            if len(ids) == 1:
                return ids[0]
            if len(ids) > 1:
                more = ", ..." if len(ids) > 5 else ""
                raise ReferenceNotFound(f"reference {ref!r} is an ambiguous id prefix of {len(ids)}"
                                        f"{'+' if more else ''} versions: {', '.join(ids[:5])}{more}; give more of "
                                        "the id")
            candidates = [f"{r}@{st}" for r, st in s.execute(
                select(m.Run.name, m.Checkpoint.step).join(m.Checkpoint.run).where(committed))]
            candidates += self._run_names(s)
            raise ReferenceNotFound(f"reference {ref!r} matches no committed checkpoint (expected RUN@STEP, "
                                    f"RUN@latest, RUN:TAG or a version id){self._near(ref, candidates)}")

    def checkpoint(self, ref: str) -> "Checkpoint":
        """The committed version ``ref`` names (see :meth:`resolve`), opened for reading."""
        from ucp_store.registry.checkpoint import Checkpoint

        return Checkpoint(self, self.resolve(ref))

    # --- writing ------------------------------------------------------------------------------
    def begin(self, run: str, step: int, *, parent: str | None = "auto", message: str | None = None,
              provenance: Mapping[str, Any] | None = None, delta: str | None = None) -> "CheckpointWriter":
        """Start a checkpoint. ``parent="auto"`` links the run's latest committed version. ``delta``: ``"auto"``
        stores tensor-states as deltas of the parent's where small enough (``save/delta.py``), ``"off"`` never,
        None as the run's setting (:meth:`run_delta`)."""
        names.run_name(run)
        _check_delta_mode(delta)
        self._owned()
        if not isinstance(step, numbers.Integral) or isinstance(step, bool) or not 0 <= step < 2**63:
            raise ValidationError(f"step must be an integer from 0 to 2^63-1, got {step!r}")
        prov = self._provenance_record(provenance)
        # the pending row need not reach the disk before the save writes: an OS crash that loses it kills the
        # save too (gc sweeps its files, which no row names); the commit's durable transaction makes it durable
        with self.catalog.write_session(durable=False) as s:
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
                raise StepCommittedError(f"run {run!r} already has a committed checkpoint at step {step} ({taken}); "
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
        killpoint("save.after_begin")
        if parent not in ("auto", None):
            pid = self.resolve(parent)
            with self.catalog.write_session() as s:
                s.execute(update(m.Checkpoint).where(m.Checkpoint.id == cid).values(parent_id=pid))
        from ucp_store.save.writer import CheckpointWriter

        return CheckpointWriter(self, cid, owner=True, delta=delta)

    def run_delta(self, run: str, mode: Any = ...) -> str:
        """The run's delta policy for saves that pass no ``delta=``: ``"auto"`` or ``"off"``. With ``mode``
        (``"auto"``, ``"off"`` or None, which is off) it is set first."""
        if mode is not ...:
            _check_delta_mode(mode)
        with self.catalog.write_session() if mode is not ... else self.catalog.session() as s:
            row = s.scalar(select(m.Run).where(m.Run.name == run))
            if row is None:
                raise ReferenceNotFound(f"run {run!r} not found{did_you_mean(run, run_names(s))}")
            if mode is not ...:
                row.delta = "auto" if mode == "auto" else None
            return row.delta or "off"

    def join(self, checkpoint_id: str) -> "CheckpointWriter":
        """Attach another process (e.g. a torch.distributed rank) to a pending checkpoint."""
        self._owned()
        with self.catalog.session() as s:
            ck = s.get(m.Checkpoint, checkpoint_id)
            if ck is None or ck.status != "pending":
                raise WriterClosedError(f"checkpoint {checkpoint_id!r} is not a pending save; cannot join it")
        from ucp_store.save.writer import CheckpointWriter

        return CheckpointWriter(self, checkpoint_id, owner=False)

    def save(self, run: str, step: int, tensors: Mapping[str, Any], *, patterns: Mapping[str, dict] | None = None,
             objects: Mapping[str, Any] | None = None, provenance: Mapping[str, Any] | None = None,
             message: str | None = None, parent: str | None = "auto", state: str = "weight",
             delta: str | None = None):
        """Save a dict of tensors (``name -> tensor`` or ``name -> {state: tensor}``) as one version
        (``delta``: see :meth:`begin`)."""
        patterns = patterns or {}
        with self.begin(run, step, parent=parent, message=message, provenance=provenance, delta=delta) as w:
            for name, value in tensors.items():
                states = value if isinstance(value, Mapping) else {state: value}
                for st, tensor in states.items():
                    w.write(name, st, tensor, pattern=patterns.get(name))
            for name, value in (objects or {}).items():
                w.write_object(name, value)
        return w.checkpoint

    def _provenance_record(self, provenance: Mapping[str, Any] | None) -> dict:
        from ucp_store.schema import validate

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
        self._owned()
        # Two writers may tag the same name at once: on PostgreSQL both see no row and the second
        # insert hits the unique (run, name) constraint. One more pass then sees the winner's row
        # and answers as if it had been there (same checkpoint: done; another: TagInUseError).
        for attempt in (0, 1):
            try:
                with self.catalog.write_session() as s:
                    ck = s.get(m.Checkpoint, cid)
                    row = s.scalar(select(m.Tag).where(m.Tag.run_id == ck.run_id, m.Tag.name == tag))
                    if row is not None:
                        if not force and row.checkpoint_id != cid:
                            raise TagInUseError(f"tag {tag!r} already names checkpoint {row.checkpoint_id}; "
                                                "use --force to move it")
                        row.checkpoint_id = cid
                    else:
                        s.add(m.Tag(run_id=ck.run_id, name=tag, checkpoint_id=cid))
                return cid
            except IntegrityError:
                if attempt:
                    raise
        return cid

    def untag(self, run: str, tag: str) -> None:
        self._owned()
        with self.catalog.write_session() as s:
            row = s.scalar(select(m.Tag).join(m.Run).where(m.Run.name == run, m.Tag.name == tag))
            if row is None:
                raise ReferenceNotFound(f"tag {run}:{tag} not found")
            s.delete(row)

    def rm(self, ref: str, *, force: bool = False) -> str:
        """Remove a committed version from the catalog; its arrays go when nothing else needs them."""
        cid = self.resolve(ref)
        self._owned()
        self.location.check_walkable(ARRAYS_DIR)  # before the row goes: a sweep through a link is refused
        with self.catalog.write_session() as s:
            tags = list(s.scalars(select(m.Tag.name).where(m.Tag.checkpoint_id == cid)))
            if tags and not force:
                raise TaggedCheckpointError(f"checkpoint {ref} ({cid}) is tagged {', '.join(tags)}; "
                                            "untag it or use --force")
            s.execute(update(m.Checkpoint).where(m.Checkpoint.parent_id == cid).values(parent_id=None))
            s.delete(s.get(m.Checkpoint, cid))
        killpoint("rm.after_row")
        self._sweep_arrays(dry_run=False)
        return cid

    def set_retention(self, run: str, *, keep_last: int | None = None, keep_every: int | None = None,
                      keep_tagged: bool = True) -> dict | None:
        """Store the run's retention policy (no ``keep_*``: clear it); returns the stored record."""
        from ucp_store.registry.retention import RetentionPolicy, set_retention

        self._owned()
        return set_retention(self.store_context, run, RetentionPolicy(keep_last, keep_every, keep_tagged))

    def retention_victims(self, run: str | None = None, *, keep_last: int | None = None,
                          keep_every: int | None = None, keep_tagged: bool = True) -> list[str]:
        """Committed versions a retention policy would remove (explicit arguments beat stored policies)."""
        from ucp_store.registry.retention import RetentionPolicy, retention_victims

        return retention_victims(self.store_context, run, RetentionPolicy(keep_last, keep_every, keep_tagged))

    def gc(self, *, run: str | None = None, keep_last: int | None = None, keep_every: int | None = None,
           keep_tagged: bool = True, dry_run: bool = False,
           pending_timeout: _dt.timedelta = DEFAULT_PENDING_TIMEOUT) -> "GcReport":
        """Apply retention, drop dead pending saves, then delete arrays nothing committed references."""
        from ucp_store.registry.retention import RetentionPolicy, gc

        return gc(self.store_context, run=run, override=RetentionPolicy(keep_last, keep_every, keep_tagged),
                  dry_run=dry_run, pending_timeout=pending_timeout)

    def _sweep_arrays(self, *, dry_run: bool, also: Iterable[str] = frozenset()) -> tuple[int, int]:
        from ucp_store.registry.retention import sweep_arrays

        return sweep_arrays(self.store_context, dry_run=dry_run, also=also)

    # --- queries ----------------------------------------------------------------------------------
    def query(self, sql: str, *, timeout: float = DEFAULT_QUERY_TIMEOUT_S) -> tuple[list[str], list[tuple]]:
        """Run one read-only SQL statement against the catalog (SQLite: query_only and an authorizer;
        PostgreSQL: a READ ONLY transaction the text cannot leave), stopped after ``timeout`` seconds."""
        return read_only_query(self.catalog.engine, sql, timeout=timeout)

    def safety(self, ref: str, *, wait: str | None = None, timeout: float | None = None, poll: float = 0.2) -> str:
        """A version's safety level (issue 38, ``ucp_store.tiers``): ``local`` (on the saving nodes' fast tiers),
        ``replicated`` (on two nodes' fast tiers, or durable) or ``durable`` (on the store's location; every
        version saved straight there is). ``wait``: first wait until it reaches that level (the catalog polled
        every ``poll`` s; TimeoutError after ``timeout`` s, naming the level it has)."""
        from ucp_store.tiers import placement as tplace

        cid = self.resolve(ref)
        return tplace.wait_for(self.catalog, cid, wait or "local", timeout=timeout, poll=poll)

    def resolve_many(self, refs: Iterable[str]) -> list[str]:
        return [self.resolve(r) for r in refs]
