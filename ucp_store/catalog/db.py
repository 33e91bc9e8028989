"""Engine set-up, sessions, write transactions and schema migrations of the SQL catalog.

One code path for SQLite and PostgreSQL:

- SQLite: every connection gets ``busy_timeout`` (30 s), ``journal_mode=WAL`` (``DELETE`` on a network or
  cluster filesystem, where WAL would be unsafe across hosts: ``catalog/fs.py``; ``sqlite_journal``
  overrides), ``synchronous=FULL`` and ``foreign_keys=ON``. pysqlite's own transaction handling is switched off
  (``isolation_level = None``) and SQLAlchemy emits ``BEGIN`` itself (the recipe of the SQLAlchemy
  SQLite dialect documentation): ``BEGIN`` for reads, ``BEGIN IMMEDIATE`` for writes, so a writer takes
  the write lock up front and several processes writing at once queue instead of deadlocking on a
  read-to-write lock upgrade.
- PostgreSQL: a plain pool with pre-ping, a 10 s connect timeout (an unreachable server is an error, never
  a hang; a ``connect_timeout`` in the URL wins); schema migrations serialise on an advisory lock.

Opening a catalog (``open_catalog``) brings its schema to the head revision through the Alembic
migrations shipped as ``ucp_store._migrations`` (the ``migrations/`` folder of a source checkout),
under the write lock, so processes opening a new catalog at once create it once.

Writing::

    with catalog.write_session() as session:      # BEGIN IMMEDIATE on SQLite
        session.add(Run(name="llama"))
    # committed here; rolled back if the block raised

    catalog.run_write(lambda s: ...)               # the same, re-running the whole function on
                                                   # transient conflicts (lock timeouts, deadlocks)
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import logging
import os
import random
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from sqlalchemy import create_engine, event, exc, inspect, text
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

from ucp_store import inputs as _inputs
from ucp_store.catalog import bulk as _bulk
from ucp_store.catalog import fs as _fs
from ucp_store.errors import CatalogError, SchemaVersionError
from ucp_store.redact import redact

if TYPE_CHECKING:  # pragma: no cover - alembic loads only when a schema is created or migrated
    from alembic.config import Config
    from alembic.script import ScriptDirectory

__all__ = [
    "Catalog",
    "open_catalog",
    "open_catalog_read_only",
    "unwritable_reason",
    "current_revision",
    "revision_at",
    "head_revision",
    "known_revisions",
    "upgrade",
    "downgrade_to",
    "migrations_dir",
    "sqlite_url",
    "display_url",
    "DEFAULT_BUSY_TIMEOUT_MS",
    "DEFAULT_WRITE_ATTEMPTS",
]

log = logging.getLogger("ucp_store.catalog")

T = TypeVar("T")

DEFAULT_BUSY_TIMEOUT_MS = 30_000
#: seconds a SQLite write waits for the catalog's write lock before it says so (once, on stderr via logging)
LOCK_NOTICE_S = 3.0
DEFAULT_WRITE_ATTEMPTS = 5
#: tables created by revision 0001; a database holding any of them but no alembic_version is refused
_OUR_TABLES = frozenset({"runs", "checkpoints", "arrays", "tensors", "provenance", "objects", "tags", "settings"})
#: seconds a PostgreSQL connection attempt may take (libpq ``connect_timeout``; the URL's own wins)
PG_CONNECT_TIMEOUT_S = 10

#: pg_advisory_xact_lock key serialising schema migrations ("ucpS")
_PG_MIGRATION_LOCK = 0x75637053
_WRITE_OPTION = "ucp_write"
_LAZY_OPTION = "ucp_write_not_durable"  # write_session(durable=False): no fsync at this transaction's commit
_VERSION_TABLE = "alembic_version"


# --------------------------------------------------------------------------------------------------
# URLs


def sqlite_url(path: str | os.PathLike) -> str:
    """The SQLAlchemy URL of a SQLite catalog file (absolute)."""
    return URL.create("sqlite", database=str(Path(path).expanduser().resolve())).render_as_string()


def display_url(url: str | URL) -> str:
    """``url`` with every credential masked (``user:***@``, ``?password=***``, ...), for messages and logs."""
    try:
        return redact(make_url(url).render_as_string(hide_password=True))
    except (exc.ArgumentError, ValueError, TypeError):
        return redact(url)


def _why(e: BaseException) -> str:
    """A driver's error on one line (libpq's spans several), credentials masked."""
    return " ".join(redact(getattr(e, "orig", e)).split())


def _parse_url(url: str | URL) -> URL:
    try:
        u = make_url(url)
        u.port  # noqa: B018 (a port that is no number raises here, not at connect)
    except exc.ArgumentError as e:
        raise CatalogError(
            f"catalog URL {redact(repr(str(url)))} is not a SQLAlchemy URL (expected e.g. "
            f"'sqlite:////abs/path/catalog.db' or 'postgresql+psycopg2://user:pass@host/db'): {redact(e)}"
        ) from None
    except (ValueError, TypeError) as e:
        raise CatalogError(
            f"catalog URL {redact(repr(str(url)))}: its port is not a number from 0 to 65535 ({redact(e)}); expected "
            "e.g. 'postgresql+psycopg2://user:pass@host:5432/db'"
        ) from None
    if u.port is not None and not 0 <= u.port <= 65535:
        raise CatalogError(f"catalog URL {display_url(u)}: port {u.port} is out of range (0 to 65535)")
    return u


def _sqlite_file(u: URL) -> Path | None:
    """The file of a file-backed SQLite URL; None for in-memory / URI-style databases."""
    if u.get_backend_name() != "sqlite":
        return None
    db = u.database
    if not db or db == ":memory:" or db.startswith("file:") or u.query.get("uri"):
        return None
    return Path(db)


# --------------------------------------------------------------------------------------------------
# Migrations (Alembic, programmatic)


def migrations_dir() -> Path:
    """The Alembic script directory: ``ucp_store._migrations`` if installed, else ``<checkout>/migrations``."""
    try:
        res = importlib.resources.files("ucp_store._migrations")
    except ModuleNotFoundError:
        res = None
    if res is not None:
        if isinstance(res, Path) and (res / "env.py").is_file():
            return res
        path = Path(str(res))
        if (path / "env.py").is_file():
            return path
        raise CatalogError(
            f"the ucp_store migrations package ({res}) is not a folder on a file system with env.py; "
            "install ucp_store unzipped"
        )
    checkout = Path(__file__).resolve().parents[2] / "migrations"
    if (checkout / "env.py").is_file():
        return checkout
    raise CatalogError(
        "cannot find the ucp_store migrations: neither the package ucp_store._migrations nor "
        f"{checkout}/env.py exists; reinstall ucp_store"
    )


def _alembic_config(url: str | None = None, connection: Connection | None = None) -> "Config":
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("path_separator", "os")
    if url is not None:
        # ConfigParser interpolation: a literal '%' (e.g. in a URL-encoded password) must be doubled
        cfg.set_main_option("sqlalchemy.url", str(url).replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@functools.lru_cache(maxsize=1)
def _script() -> "ScriptDirectory":
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config())


def head_revision() -> str:
    """The newest schema revision this ucp_store knows (e.g. ``'0003'``)."""
    head = _script().get_current_head()
    if head is None:  # pragma: no cover - broken installation
        raise CatalogError(f"no migrations found in {migrations_dir()}")
    return head


_REVISION_LINE = re.compile(r"""^(down_revision|revision)\s*(?::[^=]*)?=\s*(None|["']([0-9A-Za-z_]+)["'])\s*$""", re.M)


@functools.lru_cache(maxsize=1)
def _quick_head() -> str | None:
    """The head revision read from the migration files' ``revision``/``down_revision`` lines, without
    importing alembic (0.3 s): opening a catalog already at head then needs no alembic at all. None when
    anything is unusual (branches, merges, computed ids); the caller then asks alembic."""
    try:
        revs: dict[str, str | None] = {}
        for f in (migrations_dir() / "versions").glob("*.py"):
            found = dict((k, v) for k, _, v in _REVISION_LINE.findall(f.read_text()))
            if "revision" in found:
                if "down_revision" not in found or not found["revision"]:
                    return None
                revs[found["revision"]] = found["down_revision"] or None
        heads = set(revs) - {d for d in revs.values() if d}
        return heads.pop() if len(heads) == 1 else None
    except (OSError, CatalogError):
        return None


def known_revisions() -> list[str]:
    """Every schema revision this ucp_store knows, oldest first."""
    return [rev.revision for rev in reversed(list(_script().walk_revisions()))]


def _read_revision(conn: Connection, shown: str) -> str | None:
    # Read alembic_version directly: MigrationContext.configure() logs at INFO on every call.
    if not inspect(conn).has_table(_VERSION_TABLE):
        return None
    heads = tuple(conn.execute(text(f"SELECT version_num FROM {_VERSION_TABLE}")).scalars())
    if not heads:
        return None
    if len(heads) > 1:
        raise SchemaVersionError(
            f"catalog {shown} has several schema revisions {sorted(heads)!r} in alembic_version; "
            "expected exactly one"
        )
    return heads[0]


def _refuse_unknown(rev: str, shown: str) -> None:
    if rev not in known_revisions():
        raise SchemaVersionError(
            f"catalog {shown} has schema revision {rev!r}, newer than this ucp_store "
            f"(knows up to {head_revision()!r}); upgrade ucp_store"
        )


def _has_our_tables(conn: Connection) -> bool:
    return bool(_OUR_TABLES & set(inspect(conn).get_table_names()))


# --------------------------------------------------------------------------------------------------
# Engine


def _is_transient(e: BaseException) -> bool:
    """A conflict that succeeds when the transaction is simply tried again."""
    orig = getattr(e, "orig", e)
    if isinstance(orig, sqlite3.OperationalError):
        code = getattr(orig, "sqlite_errorcode", None)
        msg = str(orig).lower()
        return code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) or "locked" in msg or "busy" in msg
    pgcode = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)
    return pgcode in ("40001", "40P01")  # serialization_failure, deadlock_detected


def _backoff(attempt: int) -> None:
    time.sleep(min(2.0, 0.05 * (2**attempt)) * (0.5 + random.random()))


def _install_fork_guard(engine: Engine) -> None:
    # SQLAlchemy's recipe for pools used across os.fork(): a connection opened by another process is
    # discarded on checkout instead of being shared (sharing corrupts SQLite and confuses PostgreSQL).
    @event.listens_for(engine, "connect")
    def _remember_pid(dbapi_connection, connection_record):
        connection_record.info["pid"] = os.getpid()

    @event.listens_for(engine, "checkout")
    def _check_pid(dbapi_connection, connection_record, connection_proxy):
        pid = os.getpid()
        if connection_record.info.get("pid", pid) != pid:
            connection_record.dbapi_connection = connection_proxy.dbapi_connection = None
            raise exc.DisconnectionError(
                f"connection belongs to pid {connection_record.info['pid']}, checked out in pid {pid}"
            )


def _set_journal(cur, busy_timeout_ms: int, wanted: str = "wal") -> str:
    """Switch to the ``wanted`` journal mode unless the file is in it already. Switching upgrades a shared
    lock to an exclusive one; when several first opens of a fresh file upgrade at once, SQLite answers all
    but one with SQLITE_BUSY at once, without its busy handler (deadlock avoidance: seen in CI as "database
    is locked" from ``PRAGMA journal_mode = WAL``). So the switch is retried here for up to the busy timeout."""
    deadline = time.monotonic() + busy_timeout_ms / 1000.0
    attempt = 0
    while True:
        try:
            mode = str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower()
            if mode in (wanted, "memory"):
                return mode
            return str(cur.execute(f"PRAGMA journal_mode = {wanted.upper()}").fetchone()[0]).lower()
        except sqlite3.OperationalError as e:
            if not _is_transient(e) or time.monotonic() > deadline:
                raise
            _backoff(attempt)
            attempt += 1


def _install_sqlite_events(engine: Engine, busy_timeout_ms: int, shown: str,
                           journal: _fs.JournalChoice | None = None) -> None:
    warned: list[bool] = []
    wanted = journal.mode if journal is not None else "wal"
    if journal is not None and journal.filesystem:
        log.info("catalog %s: journal_mode=%s (%s)", shown, wanted.upper(), journal.reason)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, connection_record):
        # Take transaction control away from pysqlite; SQLAlchemy emits BEGIN in _on_begin.
        dbapi_connection.isolation_level = None
        cur = dbapi_connection.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            try:
                mode = _set_journal(cur, busy_timeout_ms, wanted)
            except sqlite3.OperationalError as e:
                if not _is_transient(e):
                    raise
                why = f" ({journal.reason})" if journal is not None else ""
                raise CatalogError(
                    f"catalog {shown}: cannot switch it to journal_mode={wanted.upper()}{why}: another process has it "
                    f"open in another journal mode ({redact(e)}); close that process, or open the catalog with its "
                    "mode (sqlite_journal=, ucp --sqlite-journal)") from e
            cur.execute("PRAGMA synchronous = FULL")
            cur.execute("PRAGMA foreign_keys = ON")
        finally:
            cur.close()
        if str(mode).lower() not in (wanted, "memory") and not warned:
            warned.append(True)
            log.warning("catalog %s: SQLite refused %s journal mode (got %r)", shown, wanted.upper(), mode)

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        options = conn.get_execution_options()
        if options.get(_WRITE_OPTION):
            if options.get(_LAZY_OPTION) and wanted == "wal":
                # SQLite refuses to change the safety level inside a transaction: before BEGIN, and back
                # to FULL when the connection returns to the pool (_on_checkin)
                conn.exec_driver_sql("PRAGMA synchronous = NORMAL")
                conn.info["ucp_not_durable"] = True
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")

    @event.listens_for(engine, "checkin")
    def _on_checkin(dbapi_connection, connection_record):
        if connection_record.info.pop("ucp_not_durable", False) and dbapi_connection is not None:
            cur = dbapi_connection.cursor()
            try:
                cur.execute("PRAGMA synchronous = FULL")
            finally:
                cur.close()


def _make_engine(u: URL, busy_timeout_ms: int, journal: _fs.JournalChoice | None = None) -> Engine:
    shown = display_url(u)
    backend = u.get_backend_name()
    kwargs: dict = {}
    if backend == "sqlite":
        kwargs["connect_args"] = {"timeout": busy_timeout_ms / 1000.0}
    else:
        kwargs["pool_pre_ping"] = True
        if backend == "postgresql" and "connect_timeout" not in u.query:
            # an unreachable server is an error within this many seconds, never a hang on TCP's own timeout
            kwargs["connect_args"] = {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    try:
        engine = create_engine(u, **kwargs)
    except (ImportError, exc.NoSuchModuleError) as e:
        hint = " (pip install 'ucp_store[postgres]')" if backend == "postgresql" else ""
        raise CatalogError(f"catalog {shown}: the database driver is not available{hint}: {redact(e)}") from e
    _install_fork_guard(engine)
    if backend == "sqlite":
        _install_sqlite_events(engine, busy_timeout_ms, shown, journal)
    return engine


# --------------------------------------------------------------------------------------------------
# Catalog


class Catalog:
    """An open catalog: the engine, a read/write ``session`` factory and serialised write transactions.

    ``catalog.session()`` is a plain ``sessionmaker(expire_on_commit=False)`` session (``BEGIN``: fine
    for reads and for writes that cannot conflict). Writes should go through ``write_session()`` or
    ``run_write()``, which take SQLite's write lock at BEGIN (``BEGIN IMMEDIATE``).
    """

    #: opened by :func:`open_catalog_read_only`: every write is refused by the database
    read_only: bool = False

    def __init__(self, url: str, engine: Engine, *, write_attempts: int = DEFAULT_WRITE_ATTEMPTS,
                 busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS):
        self.url = str(url)
        self.engine = engine
        self.write_attempts = write_attempts
        self.busy_timeout_ms = busy_timeout_ms
        self.session: sessionmaker[Session] = sessionmaker(bind=engine, expire_on_commit=False)
        self._write_engine = engine.execution_options(**{_WRITE_OPTION: True})
        self._write_session: sessionmaker[Session] = sessionmaker(bind=self._write_engine, expire_on_commit=False)
        self._lazy_write_session: sessionmaker[Session] = sessionmaker(
            bind=engine.execution_options(**{_WRITE_OPTION: True, _LAZY_OPTION: True}), expire_on_commit=False)
        for factory in (self.session, self._write_session, self._lazy_write_session):
            _bulk.install(factory)  # a save's rows in one COPY / executemany per table (catalog/bulk.py)

    @property
    def dialect(self) -> str:
        """``'sqlite'`` or ``'postgresql'``."""
        return self.engine.dialect.name

    @property
    def display_url(self) -> str:
        return display_url(self.url)

    def _locked_out(self, attempts: int, e: BaseException, waited: float | None = None) -> CatalogError:
        spent = f" and {waited:.0f} s" if waited is not None else ""
        return CatalogError(
            f"catalog {self.display_url}: could not start a write transaction after {attempts} attempts{spent} "
            f"(another process held its write lock the whole time); last error: {_why(e)}"
        )

    def _lock_notice(self) -> threading.Timer | None:
        """On SQLite, a timer that says once, after :data:`LOCK_NOTICE_S` seconds of waiting, what a write
        waits for and on what (the catalog's write lock, held by another process); None elsewhere."""
        if self.dialect != "sqlite":
            return None
        bound = self.write_attempts * (self.busy_timeout_ms / 1000.0 + 2.0)
        timer = threading.Timer(LOCK_NOTICE_S, log.warning, args=(
            "ucp: waiting for the write lock of catalog %s, held by another process (a save, rm, gc or tag); "
            "giving up after about %.0f s", self.display_url, bound))
        timer.daemon = True
        timer.start()
        return timer

    @contextlib.contextmanager
    def write_session(self, *, attempts: int | None = None, durable: bool = True) -> Iterator[Session]:
        """A session inside one write transaction; commits when the block ends, rolls back if it raises.

        On SQLite the transaction starts with ``BEGIN IMMEDIATE`` (each attempt waits up to
        ``busy_timeout`` for the lock; a lock still held after that is retried ``attempts`` times).
        The block itself runs once: to re-run it on transient conflicts, use ``run_write``.

        ``durable=False``: the commit does not wait for the disk (SQLite: ``synchronous=NORMAL`` for this
        transaction, PostgreSQL: ``SET LOCAL synchronous_commit = off``). The transaction is atomic and
        visible to every other connection at once; only an operating-system crash can lose it, and the
        next durable commit makes it durable too (both write one log in order). For rows whose loss in a
        crash loses nothing (a save's pending row: that save dies with the machine, gc sweeps its files).
        """
        attempts = attempts or self.write_attempts
        notice, started = self._lock_notice(), time.monotonic()
        try:
            for attempt in range(attempts):
                session = self._write_session() if durable or self.dialect != "sqlite" else self._lazy_write_session()
                try:
                    session.connection()  # BEGIN (IMMEDIATE) now, not at the first statement
                    if not durable and self.dialect == "postgresql":
                        session.execute(text("SET LOCAL synchronous_commit TO OFF"))
                except exc.OperationalError as e:
                    session.close()
                    if not _is_transient(e):
                        raise
                    if attempt + 1 == attempts:
                        raise self._locked_out(attempts, e, time.monotonic() - started) from e
                    log.debug("catalog %s is locked; retrying BEGIN IMMEDIATE (%d/%d)", self.display_url,
                              attempt + 1, attempts)
                    _backoff(attempt)
                    continue
                break
        finally:
            if notice is not None:
                notice.cancel()
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def run_write(self, fn: Callable[[Session], T], *, attempts: int | None = None) -> T:
        """Run ``fn(session)`` in a write transaction and commit; re-run it all on transient conflicts.

        Transient: SQLite lock timeouts, PostgreSQL serialization failures and deadlocks. Other errors
        (IntegrityError, ...) propagate at once. ``fn`` must not have side effects outside the session.
        """
        attempts = attempts or self.write_attempts
        for attempt in range(attempts):
            try:
                with self.write_session(attempts=1) as session:
                    return fn(session)
            except (exc.OperationalError, CatalogError) as e:
                cause = e.__cause__ if isinstance(e, CatalogError) else e
                if cause is None or not _is_transient(cause):
                    raise
                if attempt + 1 == attempts:
                    raise self._locked_out(attempts, cause) from e
                _backoff(attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    @contextlib.contextmanager
    def _migration_connection(self) -> Iterator[Connection]:
        """A connection inside a transaction that holds the schema lock; committed on success."""
        engine = self._write_engine if self.dialect == "sqlite" else self.engine
        for attempt in range(self.write_attempts):
            conn = engine.connect()
            try:
                conn.begin()
            except exc.OperationalError as e:
                conn.close()
                if not _is_transient(e) or attempt + 1 == self.write_attempts:
                    raise self._locked_out(attempt + 1, e) from e
                _backoff(attempt)
                continue
            break
        try:
            if self.dialect == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
            yield conn
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        finally:
            conn.close()

    def close(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    def __enter__(self) -> "Catalog":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Catalog({self.display_url!r})"


def current_revision(catalog: Catalog) -> str | None:
    """The schema revision recorded in the catalog's alembic_version (None: not created)."""
    with catalog.engine.connect() as conn:
        return _read_revision(conn, catalog.display_url)


def revision_at(url: str) -> str | None:
    """The schema revision of the catalog at ``url`` (``ucp db revision``), read without creating or migrating
    anything; a URL that does not parse, a missing driver, a missing SQLite file or an unreachable server is a
    CatalogError with the URL's credentials masked."""
    catalog = _connect(url, create=False)
    try:
        return current_revision(catalog)
    except exc.DBAPIError as e:
        raise CatalogError(f"catalog {catalog.display_url} cannot be read: {_why(e)}") from None
    finally:
        catalog.close()


def _migrate(catalog: Catalog, target: str, *, create: bool, allow_upgrade: bool) -> tuple[str | None, str]:
    """Bring the schema to ``target`` (a known revision or 'head') under the schema lock.

    Returns (revision before, revision after).
    """
    shown = catalog.display_url
    target_rev = head_revision() if target == "head" else target
    if target_rev not in known_revisions():
        raise SchemaVersionError(f"unknown schema revision {target!r}; this ucp_store knows {known_revisions()!r}")

    with catalog._migration_connection() as conn:
        rev = _read_revision(conn, shown)
        if rev is None:
            if _has_our_tables(conn):
                raise CatalogError(
                    f"catalog {shown} holds ucp_store tables but no schema revision (alembic_version is "
                    "missing or empty); it was not created by ucp_store's migrations, refusing to touch it"
                )
            if not create:
                raise CatalogError(f"catalog {shown} has not been created (no schema revision); pass create=True")
            log.info("creating catalog %s at schema revision %s", shown, target_rev)
        else:
            _refuse_unknown(rev, shown)
            order = known_revisions()
            if order.index(rev) > order.index(target_rev):
                raise SchemaVersionError(
                    f"catalog {shown} has schema revision {rev!r}, newer than the requested {target_rev!r}; "
                    "use downgrade_to() to go back"
                )
            if rev == target_rev:
                return rev, rev
            if not allow_upgrade:
                raise SchemaVersionError(
                    f"catalog {shown} has schema revision {rev!r}, older than this ucp_store's "
                    f"{target_rev!r}; run 'ucp db upgrade' (or open it with upgrade=True)"
                )
            log.warning(
                "upgrading catalog %s schema %s -> %s (older ucp_store versions will refuse it afterwards)",
                shown,
                rev,
                target_rev,
            )
        from alembic import command

        command.upgrade(_alembic_config(connection=conn), target_rev)
        after = _read_revision(conn, shown)
        if after != target_rev:  # pragma: no cover - a broken migration chain
            raise CatalogError(f"catalog {shown}: migration to {target_rev!r} ended at {after!r}")
        return rev, target_rev


def _connect(
    url: str | URL, *, create: bool, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS, sqlite_journal: str = "auto",
    statfs: Callable[[str], int | None] = _fs.statfs_type,
) -> Catalog:
    u = _parse_url(url)
    shown = display_url(u)
    path = _sqlite_file(u)
    journal = None
    if path is not None:
        journal = _fs.journal_mode(path, sqlite_journal, statfs=statfs)
        _inputs.present(str(path), f"catalog {shown}:", CatalogError)  # a FIFO there would block the open
        if not path.exists():
            if not create:
                raise CatalogError(f"catalog {shown} does not exist (no file {path}); pass create=True to create it")
            path.parent.mkdir(parents=True, exist_ok=True)
    return Catalog(u.render_as_string(hide_password=False), _make_engine(u, busy_timeout_ms, journal),
                   busy_timeout_ms=busy_timeout_ms)


def _unreadable(catalog: Catalog, e: exc.DatabaseError) -> str:
    """The message for a catalog the database refuses as a whole (not a lock or a connection problem)."""
    what = "an SQLite database file that is corrupt or of another format" if catalog.dialect == "sqlite" else \
        "a database the server refuses"
    return (f"catalog {catalog.display_url} cannot be opened: {_why(e)} (expected a ucp catalog; "
            f"found {what})")


def open_catalog(
    url: str,
    *,
    create: bool,
    upgrade: bool = True,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    sqlite_journal: str = "auto",
    statfs: Callable[[str], int | None] = _fs.statfs_type,
) -> Catalog:
    """Open the catalog at ``url`` (``sqlite:////abs/catalog.db``, ``postgresql+psycopg2://...``).

    - no schema yet: created at the head revision if ``create``, else ``CatalogError``;
    - an older revision: upgraded (logged as a warning) if ``upgrade``, else ``SchemaVersionError``;
    - a revision this ucp_store does not know (written by a newer one): ``SchemaVersionError``.

    ``sqlite_journal`` (SQLite only): ``'auto'`` runs WAL on a local filesystem and the rollback journal
    (DELETE) on a network or cluster one (``catalog/fs.py``); ``'wal'`` or ``'delete'`` force a mode.
    ``statfs``: how the filesystem's ``f_type`` is asked (tests pass another).
    """
    catalog = _connect(url, create=create, busy_timeout_ms=busy_timeout_ms, sqlite_journal=sqlite_journal,
                       statfs=statfs)
    try:
        with catalog.engine.connect() as conn:  # fast path: no write lock (and no alembic) when already at head
            rev = _read_revision(conn, catalog.display_url)
        if rev is None or rev != (_quick_head() or head_revision()):
            _migrate(catalog, "head", create=create, allow_upgrade=upgrade)
    except exc.OperationalError as e:
        catalog.close()
        db = _sqlite_file(_parse_url(url))
        why = unwritable_reason(db.parent) if db is not None else None
        if why is not None:
            raise CatalogError(f"catalog {catalog.display_url} cannot be opened for writing: {why} (commands that only "
                               "read, such as ls, show, verify and export, open it read-only and still work)") from e
        raise CatalogError(f"catalog {catalog.display_url} cannot be opened: {_why(e)}") from e
    except exc.DatabaseError as e:  # e.g. SQLite's "file is not a database": random bytes, another format
        catalog.close()
        raise CatalogError(_unreadable(catalog, e)) from e
    except BaseException:
        catalog.close()
        raise
    return catalog


def upgrade(url: str, revision: str = "head", *, create: bool = False) -> tuple[str | None, str]:
    """Upgrade the catalog at ``url`` to ``revision`` (``ucp db upgrade``); returns (before, after).

    ``create=True`` also creates a catalog that does not exist yet (at ``revision``).
    """
    catalog = _connect(url, create=create)
    try:
        return _migrate(catalog, revision, create=create, allow_upgrade=True)
    except exc.OperationalError as e:
        raise CatalogError(f"catalog {catalog.display_url} cannot be upgraded: {_why(e)}") from e
    except exc.DatabaseError as e:
        raise CatalogError(_unreadable(catalog, e)) from e
    finally:
        catalog.close()


def downgrade_to(url: str, revision: str) -> None:
    """Downgrade the catalog at ``url`` to ``revision`` (``'base'`` drops everything). For tests and
    emergencies: a downgrade drops the columns and tables added after ``revision``, with their data."""
    if revision != "base" and revision not in known_revisions():
        raise SchemaVersionError(f"unknown schema revision {revision!r}; this ucp_store knows {known_revisions()!r}")
    catalog = _connect(url, create=False)
    try:
        with catalog._migration_connection() as conn:
            rev = _read_revision(conn, catalog.display_url)
            if rev is None:
                raise CatalogError(f"catalog {catalog.display_url} has no schema revision to downgrade from")
            _refuse_unknown(rev, catalog.display_url)
            log.warning("downgrading catalog %s schema %s -> %s", catalog.display_url, rev, revision)
            from alembic import command

            command.downgrade(_alembic_config(connection=conn), revision)
    finally:
        catalog.close()


# --------------------------------------------------------------------------------------------------
# Read-only opens (issue 40: a read-only store, a full disk)

def _wal_pending(path: Path) -> bool:
    """Whether a WAL file next to the SQLite catalog holds frames (transactions not yet in the main file)."""
    try:
        return os.path.getsize(f"{path}-wal") > 0
    except OSError:
        return False


def _read_only_sqlite_engine(path: Path, busy_timeout_ms: int, immutable: bool) -> Engine:
    from urllib.parse import quote

    from sqlalchemy.pool import QueuePool

    uri = f"file:{quote(str(path))}?mode=ro" + ("&immutable=1" if immutable else "")

    def connect():
        con = sqlite3.connect(uri, uri=True, timeout=busy_timeout_ms / 1000.0, check_same_thread=False)
        con.isolation_level = None  # SQLAlchemy emits BEGIN (below)
        con.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        con.execute("PRAGMA query_only = ON")
        con.execute("PRAGMA foreign_keys = ON")
        return con

    engine = create_engine("sqlite://", creator=connect, poolclass=QueuePool)

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN")

    @event.listens_for(engine, "handle_error")
    def _read_only_write(context):
        if "readonly database" in str(context.original_exception):
            raise CatalogError(f"catalog {display_url(sqlite_url(path))} was opened read-only (a command or "
                               "open_store(read_only=True) that only reads); it cannot be written through this open")

    return engine


def unwritable_reason(path: str | os.PathLike) -> str | None:
    """Why nothing can be written in the folder ``path`` (a read-only filesystem, no write permission), or
    None when it looks writable."""
    folder = os.fspath(path)
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"{folder} is on a read-only filesystem"
    except OSError:
        return None
    if not os.access(folder, os.W_OK):
        return f"{folder} is not writable by this user"
    return None


def open_catalog_read_only(url: str, *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS) -> Catalog:
    """Open the catalog at ``url`` for reading only: nothing is written to it or beside it (no journal mode
    switch, no migration, no settings), so a read-only mount, a catalog file the user cannot write, or a
    full disk can still be listed and read.

    SQLite: a ``mode=ro`` connection; where even that cannot open (a WAL catalog on a read-only filesystem
    without its ``-shm`` file, or a full disk where SQLite cannot size that file), and no WAL file holds
    transactions not yet in the main file, an ``immutable=1`` one (nothing can write there meanwhile).
    PostgreSQL: every transaction ``READ ONLY``. A schema that is not this ucp_store's head is refused
    (upgrading it is a write: ``ucp db upgrade``)."""
    u = _parse_url(url)
    shown = display_url(u)
    path = _sqlite_file(u)
    if path is None:
        catalog = open_catalog(url, create=False, upgrade=False, busy_timeout_ms=busy_timeout_ms)
        if catalog.dialect == "postgresql":
            @event.listens_for(catalog.engine, "begin")
            def _read_only_txn(conn):
                conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        return catalog
    if not _inputs.present(str(path), f"catalog {shown}:", CatalogError):  # a FIFO there would block the open
        raise CatalogError(f"catalog {shown} does not exist (no file {path})")
    failure: BaseException | None = None
    for immutable in (False, True):
        if immutable and _wal_pending(path):
            break
        catalog = Catalog(u.render_as_string(hide_password=False),
                          _read_only_sqlite_engine(path, busy_timeout_ms, immutable))
        try:
            with catalog.engine.connect() as conn:
                rev = _read_revision(conn, shown)
        except exc.OperationalError as e:
            catalog.close()
            failure = e
            continue
        except exc.DatabaseError as e:
            catalog.close()
            raise CatalogError(_unreadable(catalog, e)) from e
        if immutable:
            log.info("catalog %s opened immutable (read-only; %s)", shown, getattr(failure, "orig", failure))
        head = _quick_head() or head_revision()
        if rev != head:
            catalog.close()
            if rev is None:
                raise CatalogError(f"catalog {shown} has not been created (no schema revision)")
            _refuse_unknown(rev, shown)
            raise SchemaVersionError(f"catalog {shown} has schema revision {rev!r}, older than this ucp_store's "
                                     f"{head!r}; it was opened read-only, so it is not upgraded: run 'ucp db "
                                     "upgrade' where the catalog can be written")
        catalog.read_only = True
        return catalog
    why = getattr(failure, "orig", failure)
    waiting = " (its WAL file holds transactions not yet in the main file)" if _wal_pending(path) else ""
    raise CatalogError(f"catalog {shown} cannot be opened read-only: {why}{waiting}")
