"""Bulk inserts of catalog rows: a save's array, tensor and object rows in one driver call per table.

A save of a large mixture-of-experts model records hundreds of thousands of rows in its commit transaction
(``CheckpointWriter._insert_rows``: ``session.execute(insert(Model), [dict, ...])``). SQLAlchemy's ORM bulk
path spends most of that time in Python per row (its parameter dicts and compiled VALUES batches), and
PostgreSQL parses and plans a multi-row INSERT per batch. Here such a statement is run instead as

- PostgreSQL (psycopg2): one ``COPY <table> (<columns>) FROM STDIN``, the text format;
- SQLite: one ``executemany`` of the same INSERT SQLAlchemy would issue, on the DBAPI cursor;

inside the session's transaction, with every value passed through the column type's own SQLAlchemy bind
processor (JSON text, UTC datetimes, ...), so the stored rows are exactly what SQLAlchemy would store.
Anything else (another statement form, driver, table, or rows whose keys differ) goes through SQLAlchemy.

The hook is a ``do_orm_execute`` listener (:func:`install`) on the catalog's session factories: the writer's
code stays plain SQLAlchemy.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from sqlalchemy import event, insert
from sqlalchemy.engine import Dialect
from sqlalchemy.engine.result import IteratorResult, SimpleResultMetaData
from sqlalchemy.orm import ORMExecuteState, sessionmaker
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.schema import Table

from ucp_store.catalog import models as m

__all__ = ["BULK_TABLES", "install", "bulk_insert", "copy_lines"]

#: the tables a save fills row by row in bulk
BULK_TABLES = frozenset({m.Array.__tablename__, m.Tensor.__tablename__, m.StoredObject.__tablename__})

_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
_SPECIAL = re.compile(r"[\\\t\n\r]")


def _plain_insert(stmt: Any) -> Table | None:
    """The table of ``insert(<bulk table>)`` with nothing added (no values, RETURNING, ON CONFLICT, ...)."""
    if not isinstance(stmt, Insert) or not isinstance(stmt.table, Table) or stmt.table.name not in BULK_TABLES:
        return None
    if stmt._values or stmt._multi_values or stmt._returning or stmt._post_values_clause is not None \
            or stmt._hints or stmt._prefixes or stmt.select is not None:
        return None
    return stmt.table


def _columns(table: Table, keys: Sequence[str]) -> list | None:
    """The columns named by ``keys``, or None when a column left out has a Python-side default (which only
    SQLAlchemy's own insert would fill in)."""
    by_key = {c.key: c for c in table.columns}
    if any(k not in by_key for k in keys):
        return None
    for c in table.columns:
        if c.key not in keys and (c.default is not None or c.onupdate is not None) and not (
                c.primary_key and c.autoincrement in (True, "auto")):
            return None
    return [c for c in table.columns if c.key in keys]  # the table's order: the order compile() lists them in


def _processed(columns: list, rows: list[dict], dialect: Dialect) -> list[tuple]:
    """Each row's values through its column's bind processor, column by column. A list or dict value met
    again (one object shared by many rows: a shape, a pattern) is processed once."""
    values: list[list] = []
    for c in columns:
        proc: Callable[[Any], Any] | None = c.type._cached_bind_processor(dialect)
        column = [d[c.key] for d in rows]
        if proc is not None:
            keep_none = not getattr(c.type, "should_evaluate_none", False)  # None stays NULL, unless JSON 'null'
            memo: dict[int, Any] = {}

            def one(v: Any, proc: Callable[[Any], Any] = proc, keep_none: bool = keep_none,
                    memo: dict[int, Any] = memo) -> Any:
                if v is None and keep_none:
                    return None
                if isinstance(v, (list, dict)):
                    got = memo.get(id(v))
                    if got is None:
                        got = memo[id(v)] = proc(v)  # the rows keep v alive: its id is not reused meanwhile
                    return got
                return proc(v)

            column = list(map(one, column))
        values.append(column)
    return list(zip(*values))


def _copy_value(v: Any) -> str:
    if v is None:
        return "\\N"
    if isinstance(v, str):
        return v.translate(_COPY_ESCAPES) if _SPECIAL.search(v) else v
    if isinstance(v, int):
        return str(v)
    return (v.isoformat() if hasattr(v, "isoformat") else str(v)).translate(_COPY_ESCAPES)


def _copy_converter(column: Any, dialect: Dialect) -> Callable[[Any], str]:
    """A value of ``column`` -> its COPY text field, through the column's bind processor (a list or dict value
    met again, one object shared by many rows, is converted once)."""
    proc: Callable[[Any], Any] | None = column.type._cached_bind_processor(dialect)
    keep_none = not getattr(column.type, "should_evaluate_none", False)  # None stays NULL, unless JSON 'null'
    memo: dict[int, str] = {}

    def conv(v: Any) -> str:
        if v is None and keep_none:
            return "\\N"
        if proc is None:
            return _copy_value(v)
        if isinstance(v, (list, dict)):
            got = memo.get(id(v))
            if got is None:
                got = memo[id(v)] = _copy_value(proc(v))  # the rows keep v alive: its id is not reused meanwhile
            return got
        return _copy_value(proc(v))

    return conv


def copy_lines(columns: list, rows: Iterable[dict], dialect: Dialect) -> Iterator[str]:
    """``rows`` as lines of PostgreSQL's COPY text format (tab-separated, ``\\N`` for NULL, backslash escapes)."""
    convs = [(c.key, _copy_converter(c, dialect)) for c in columns]
    for d in rows:
        yield "\t".join([conv(d[k]) for k, conv in convs]) + "\n"


class _LineReader:
    """A file-like ``read(size)`` over an iterator of lines, for ``copy_expert``: the lines are made while
    the server copies the ones before (the client's serialising and the server's COPY overlap)."""

    def __init__(self, lines: Iterator[str]):
        self._lines = lines

    def read(self, size: int = -1) -> str:
        parts: list[str] = []
        n = 0
        for line in self._lines:
            parts.append(line)
            n += len(line)
            if 0 <= size <= n:
                break
        return "".join(parts)



_COPY_PIECE = 1 << 20  # characters per piece handed to the server


def bulk_insert(connection: Any, table: Table, rows: list[dict]) -> bool:
    """Insert ``rows`` (dicts with the same keys) into ``table`` on SQLAlchemy ``connection`` in one driver
    call; False (nothing done) when this path does not apply and SQLAlchemy's insert must run instead."""
    if not rows:
        return True
    keys = list(rows[0])
    if any(len(d) != len(keys) or d.keys() != rows[0].keys() for d in rows):
        return False
    columns = _columns(table, keys)
    if columns is None:
        return False
    defaulted = [c.key for c in columns if c.default is not None or c.server_default is not None]
    if defaulted and any(d[k] is None for d in rows for k in defaulted):
        return False  # SQLAlchemy leaves such a None out, and the column's default fills it
    dialect = connection.dialect
    if dialect.name == "postgresql" and dialect.driver == "psycopg2":
        names = ", ".join(dialect.identifier_preparer.quote(c.name) for c in columns)
        sql = f"COPY {dialect.identifier_preparer.format_table(table)} ({names}) FROM STDIN"
        with connection.connection.driver_connection.cursor() as cur:
            cur.copy_expert(sql, _LineReader(copy_lines(columns, rows, dialect)), size=_COPY_PIECE)
        return True
    if dialect.name == "sqlite" and dialect.driver == "pysqlite":
        values = _processed(columns, rows, dialect)
        sql = str(insert(table).compile(dialect=dialect, column_keys=[c.key for c in columns]))
        if sql.count("?") != len(columns):  # pragma: no cover - a dialect rendering something else
            return False
        cur = connection.connection.driver_connection.cursor()
        try:
            cur.executemany(sql, values)
        finally:
            cur.close()
        return True
    return False


def _on_execute(state: ORMExecuteState) -> Any:
    if not state.is_insert or not isinstance(state.parameters, list) or len(state.parameters) < 2:
        return None
    table = _plain_insert(state.statement)
    if table is None or not all(isinstance(d, dict) for d in state.parameters):
        return None
    session = state.session
    if session.autoflush:
        session.flush()  # what SQLAlchemy's own ORM insert does first
    if not bulk_insert(session.connection(), table, state.parameters):
        return None
    return IteratorResult(SimpleResultMetaData([]), iter([]))


def install(factory: sessionmaker) -> None:
    """Run bulk row inserts of sessions from ``factory`` through :func:`bulk_insert`."""
    event.listen(factory, "do_orm_execute", _on_execute)
