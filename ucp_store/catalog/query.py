"""Read-only SQL against the catalog (``ucp query``, ``Store.query``): writes are refused by the database.

Parsing SQL to decide whether it writes is a losing game (CTEs, ATTACH, PRAGMA, functions with side
effects), so the database itself refuses: SQLite runs the statement under ``PRAGMA query_only`` *and* an
authorizer that allows only reads (``query_only`` alone still lets ``ATTACH`` create files anywhere and a
``PRAGMA`` switch it off); PostgreSQL runs it in a ``READ ONLY`` transaction. The SQLite authorizer also
refuses, by name, the functions that reach outside the catalog (``fts3_tokenizer`` hands out and takes
native pointers; ``load_extension`` loads code; the shell's ``readfile``/``writefile``/``edit`` touch files
when an extension provides them). Nothing here imports more than SQLAlchemy and sqlite3.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from ucp_store.errors import QueryError

__all__ = ["DENIED_FUNCTIONS", "read_only_query"]

_SCHEMA_PRAGMAS = frozenset({"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
                             "foreign_key_list"})


#: SQL functions ``ucp query`` refuses by name (lower case; SQLite matches function names case-insensitively)
DENIED_FUNCTIONS = frozenset({"fts3_tokenizer", "load_extension", "readfile", "writefile", "edit"})


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


def _failed(exc: BaseException) -> QueryError:
    return QueryError(f"query failed: {exc.__class__.__name__}: {str(exc).splitlines()[0]}")


def read_only_query(engine: Any, sql: str) -> tuple[list[str], list[tuple]]:
    """Run one SQL statement with writes refused by the database itself; returns (columns, rows)."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql("PRAGMA query_only = ON")
            raw = conn.connection.dbapi_connection
            denied: list[str] = []
            raw.set_authorizer(_sqlite_read_authorizer(denied))
            try:
                cols, rows = _result(conn.exec_driver_sql(sql))
            except Exception as exc:
                if denied:
                    raise QueryError(f"query refused: function {denied[0]}() is not allowed in a catalog query "
                                     f"(refused: {', '.join(sorted(DENIED_FUNCTIONS))})") from None
                raise _failed(exc) from None
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
                raise _failed(exc) from None
