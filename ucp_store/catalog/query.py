"""Read-only SQL against the catalog (``ucp query``, ``Store.query``): one statement, writes refused by the
database, a bounded run time.

Parsing SQL to decide whether it writes is a losing game (CTEs, ATTACH, PRAGMA, functions with side
effects), so the database itself refuses writes:

- SQLite runs the statement under ``PRAGMA query_only`` *and* an authorizer that allows only reads
  (``query_only`` alone still lets ``ATTACH`` create files anywhere and a ``PRAGMA`` switch it off); the
  driver runs one statement only. The authorizer also refuses, by name, the functions that reach outside the
  catalog (``fts3_tokenizer`` hands out and takes native pointers; ``load_extension`` loads code; the shell's
  ``readfile``/``writefile``/``edit`` touch files when an extension provides them). A progress handler stops
  the statement at its time bound.
- PostgreSQL runs it in a ``READ ONLY`` transaction with ``statement_timeout`` set, and the text must not be
  able to leave that transaction: psycopg2 sends the simple query protocol, which runs every statement of a
  text (``END; UPDATE ...`` would commit the read-only transaction and write in a new one). So the text is
  checked first, conservatively (a refusal may be too cautious, never too lenient): at most one trailing
  ``;`` and no other anywhere (strings included: statements are separated by ``;`` only), it starts with
  ``SELECT``, ``WITH``, ``VALUES``, ``TABLE``, ``EXPLAIN`` or ``SHOW``, and it names none of the functions
  that reach outside the catalog or change the server's state (a superuser may call them, and reads such as
  ``pg_read_file`` are allowed in a read-only transaction): :data:`PG_DENIED`, matched as words anywhere in
  the text, and no ``U&"..."`` identifier (its escapes could spell a denied name).

Nothing here imports more than SQLAlchemy and sqlite3.
"""

from __future__ import annotations

import math
import re
import sqlite3
import time
from typing import Any

from ucp_store.errors import QueryError

__all__ = ["DEFAULT_QUERY_TIMEOUT_S", "DENIED_FUNCTIONS", "PG_DENIED", "check_pg_text", "read_only_query"]

#: seconds a catalog query may run unless the caller says otherwise (``ucp query --timeout``)
DEFAULT_QUERY_TIMEOUT_S = 60.0

_SCHEMA_PRAGMAS = frozenset({"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
                             "foreign_key_list"})


#: SQL functions ``ucp query`` refuses by name on SQLite (lower case; SQLite matches names case-insensitively)
DENIED_FUNCTIONS = frozenset({"fts3_tokenizer", "load_extension", "readfile", "writefile", "edit"})

#: PostgreSQL functions ``ucp query`` refuses (regular expressions of whole words, lower case): server files
#: and large objects, other databases, other sessions, the server's configuration and replication, locks that
#: outlive the query, sequences, the functions that run a query given as text (which no check here sees), and
#: the views and tables of server state that hold secrets (password hashes, connection strings, query texts)
PG_DENIED = (r"lo_\w*", r"pg_read_\w*", r"pg_ls_\w*", r"pg_stat_file", r"pg_file_\w*", r"pg_logdir_ls",
             r"dblink\w*", r"query_to_xml\w*", r"cursor_to_xml\w*", r"pg_terminate_backend",
             r"pg_cancel_backend", r"pg_signal_backend", r"pg_reload_conf", r"pg_rotate_logfile\w*",
             r"set_config", r"pg_advisory\w*", r"pg_try_advisory\w*", r"pg_promote", r"pg_switch_wal",
             r"pg_create_\w*", r"pg_drop_\w*", r"pg_replication_\w*", r"pg_logical_\w*", r"pg_notify",
             r"pg_backup_\w*", r"pg_start_backup", r"pg_stop_backup", r"pg_log_backend_memory_contexts",
             r"pg_stat_reset\w*", r"pg_wal_replay_\w*", r"pg_import_system_collations", r"binary_upgrade_\w*",
             r"pg_current_logfile", r"nextval", r"setval", r"pg_export_snapshot", r"pg_copy_\w*",
             r"pg_sequence_last_value", r"txid_current", r"pg_current_xact_id",
             # server state holding secrets: password hashes, connection strings, other sessions' query texts
             r"pg_authid", r"pg_shadow", r"pg_user_mappings?", r"pg_subscription", r"pg_foreign_server",
             r"pg_stat_activity", r"pg_stat_statements\w*", r"pg_file_settings", r"pg_hba_file_rules",
             r"pg_ident_file_mappings", r"pg_db_role_setting", r"pg_stat_replication", r"pg_stat_wal_receiver")
_PG_DENIED_RE = re.compile(r"(?<![\w$])(" + "|".join(PG_DENIED) + r")(?![\w$])")
_PG_FIRST_WORDS = ("select", "with", "values", "table", "explain", "show")
_LEADING = re.compile(r"(\s+|--[^\n]*(\n|$)|/\*.*?\*/|\()", re.S)


def _sqlite_read_authorizer(denied: list[str]) -> Any:
    """SQLite authorizer for ``ucp query``: reading only. Refuses every action but SELECT, reads, functions
    other than :data:`DENIED_FUNCTIONS` and the schema-inspection pragmas (their argument is a table or
    index name). A refused function's name is appended to ``denied`` (for the error message)."""
    allowed = (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE)

    def authorize(action: int, arg1: Any, arg2: Any, *_rest: Any) -> int:
        if action in allowed:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION:  # arg2: the function's name as written
            if str(arg2).lower() in DENIED_FUNCTIONS:
                denied.append(str(arg2))
                return sqlite3.SQLITE_DENY
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA and str(arg1).lower() in _SCHEMA_PRAGMAS:
            return sqlite3.SQLITE_OK
        return sqlite3.SQLITE_DENY

    return authorize


def _result(res: Any) -> tuple[list[str], list[tuple]]:
    if not res.returns_rows:
        return [], []
    return list(res.keys()), [tuple(r) for r in res.fetchall()]


def _failed(exc: BaseException, timeout_s: float) -> QueryError:
    orig = getattr(exc, "orig", exc)
    text = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
    if "statement timeout" in text or (isinstance(orig, sqlite3.OperationalError) and text == "interrupted"):
        return QueryError(f"query stopped after its time bound of {timeout_s:g} s (ucp query --timeout SECONDS, "
                          f"Store.query(timeout=) to change it): {text}")
    return QueryError(f"query failed: {orig.__class__.__name__}: {text}")


def _check_timeout(timeout_s: Any) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or not 0 < timeout_s <= 86_400:
        raise QueryError(f"query timeout {timeout_s!r}: expected a number of seconds above 0 and at most 86400")
    return float(timeout_s)


def check_pg_text(sql: str) -> None:
    """Refuse (QueryError) a PostgreSQL query text that could run more than one statement, is not a read
    (its first word), or names a function of :data:`PG_DENIED`. Conservative: see the module docstring."""
    if not isinstance(sql, str) or not sql.strip():
        raise QueryError(f"query {sql!r}: expected one SQL statement")
    body = sql.rstrip()
    body = body[:-1] if body.endswith(";") else body
    if ";" in body:
        raise QueryError("query refused: a catalog query is exactly one statement, and the text holds a ';' before "
                         "its end (a ';' inside a string counts too: write chr(59))")
    pos = 0
    while (m := _LEADING.match(body, pos)) is not None and m.end() > pos:
        pos = m.end()
    first = re.match(r"[A-Za-z]+", body[pos:])
    if first is None or first.group(0).lower() not in _PG_FIRST_WORDS:
        word = first.group(0) if first else body[pos:pos + 10]
        raise QueryError(f"query refused: it starts with {word!r}; a catalog query is one read-only statement "
                         f"starting with {', '.join(w.upper() for w in _PG_FIRST_WORDS)}")
    lowered = body.lower()
    if re.search(r"u&\s*\"", lowered):
        raise QueryError("query refused: U&\"...\" identifiers are not allowed in a catalog query (write the name "
                         "plainly)")
    found = _PG_DENIED_RE.search(lowered)
    if found:
        raise QueryError(f"query refused: {found.group(1)} reaches outside the catalog, changes the server's state "
                         "or holds its secrets, and is not allowed in a catalog query")


def _sqlite_query(conn: Any, sql: str, timeout_s: float) -> tuple[list[str], list[tuple]]:
    conn.exec_driver_sql("PRAGMA query_only = ON")
    raw = conn.connection.dbapi_connection
    denied: list[str] = []
    deadline = time.monotonic() + timeout_s
    raw.set_authorizer(_sqlite_read_authorizer(denied))
    raw.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    try:
        return _result(conn.exec_driver_sql(sql))
    except Exception as exc:
        if denied:
            raise QueryError(f"query refused: function {denied[0]}() is not allowed in a catalog query "
                             f"(refused: {', '.join(sorted(DENIED_FUNCTIONS))})") from None
        raise _failed(exc, timeout_s) from None
    finally:
        raw.set_progress_handler(None, 0)
        raw.set_authorizer(None)
        conn.exec_driver_sql("PRAGMA query_only = OFF")
        conn.rollback()


def _pg_query(conn: Any, sql: str, timeout_s: float) -> tuple[list[str], list[tuple]]:
    check_pg_text(sql)
    trans = conn.begin()
    try:
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        conn.exec_driver_sql(f"SET LOCAL statement_timeout = {max(1, int(timeout_s * 1000))}")
        conn.exec_driver_sql("SET LOCAL idle_in_transaction_session_timeout = 0")
        try:
            return _result(conn.exec_driver_sql(sql))
        except Exception as exc:
            raise _failed(exc, timeout_s) from None
    finally:
        trans.rollback()  # a read: nothing to keep


def read_only_query(engine: Any, sql: str, *,
                    timeout: float = DEFAULT_QUERY_TIMEOUT_S) -> tuple[list[str], list[tuple]]:
    """Run one SQL statement with writes refused by the database itself, stopped after ``timeout``
    seconds; returns (columns, rows)."""
    timeout_s = _check_timeout(timeout)
    if not isinstance(sql, str) or not sql.strip():
        raise QueryError(f"query {sql!r}: expected one SQL statement as text")
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            return _sqlite_query(conn, sql, timeout_s)
        return _pg_query(conn, sql, timeout_s)
