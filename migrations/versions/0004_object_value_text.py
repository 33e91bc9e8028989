"""Object values are JSON text the database never parses: objects.value becomes TEXT.

Revision ID: 0004
Revises: 0003
Create Date: 2027-01-10

``objects.value`` was a ``JSON`` column. SQLite gives that declared type numeric affinity, so a value
whose JSON text looks like a number was stored as a number: ``1.0`` came back as ``1``, ``-0.0`` as ``0``
and ``18446744073709551615`` as a float. From 0004 the column is TEXT holding ``json.dumps`` output
(``ucp_store.catalog.models.encode_json``), read back with ``json.loads``, so every value round-trips.

Existing rows:

- PostgreSQL kept each value's JSON text verbatim (``json``, not ``jsonb``): ``value::text`` is exact.
- SQLite: rows stored as text (strings, lists, dicts, ``null``, NaN/Infinity) keep their text; a top-level
  number was stored as an SQLite INTEGER or REAL and is written back as that number's JSON text
  (``repr`` of the REAL, exact). What the old column already lost cannot be repaired: a float that
  looked like an integer (``1.0``, ``-0.0``) reads back as the integer, and an integer beyond 64 bits
  as the float SQLite rounded it to. Values nested in a list or dict were text and are exact.
  Offline (``--sql``) on SQLite converts a REAL with ``printf('%!.17g')`` instead, which SQLite before
  3.43 may round in the last digit for exponents beyond about +-200.
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_SQLITE_OFFLINE = ("UPDATE objects SET value_text = CASE typeof(value) WHEN 'real' THEN printf('%!.17g', value) "
                   "WHEN 'integer' THEN CAST(value AS TEXT) ELSE value END")


def _sqlite_text(value: object) -> object:
    """The JSON text of an old SQLite row's stored value: a number (stored by numeric affinity) as its JSON
    text, exact for the stored INTEGER or REAL; text as it is."""
    return json.dumps(value, allow_nan=True) if isinstance(value, (int, float)) else value


def upgrade() -> None:
    dialect = op.get_context().dialect.name
    if dialect == "postgresql":
        op.execute("ALTER TABLE objects ALTER COLUMN value TYPE TEXT USING value::text")
        return
    if dialect != "sqlite":  # pragma: no cover - the catalog supports these two
        raise NotImplementedError(f"no objects.value conversion for dialect {dialect!r}")
    # A new TEXT column, filled, then swapped in (native DROP/RENAME COLUMN, SQLite >= 3.35): writing the
    # text back into the old column would let its numeric affinity turn it into a number again.
    op.add_column("objects", sa.Column("value_text", sa.Text(), nullable=True))
    if op.get_context().as_sql:
        op.execute(_SQLITE_OFFLINE)
    else:
        conn = op.get_bind()
        rows = conn.execute(sa.text("SELECT id, value FROM objects WHERE value IS NOT NULL")).all()
        if rows:
            conn.execute(sa.text("UPDATE objects SET value_text = :v WHERE id = :id"),
                         [{"id": i, "v": _sqlite_text(v)} for i, v in rows])
    op.drop_column("objects", "value")
    op.alter_column("objects", "value_text", new_column_name="value")


def downgrade() -> None:
    dialect = op.get_context().dialect.name
    if dialect == "postgresql":
        # fails on a value holding NaN or Infinity, which a PostgreSQL json column cannot hold
        op.execute("ALTER TABLE objects ALTER COLUMN value TYPE JSON USING value::json")
        return
    op.add_column("objects", sa.Column("value_json", sa.JSON(none_as_null=True), nullable=True))
    op.execute("UPDATE objects SET value_json = value")
    op.drop_column("objects", "value")
    op.alter_column("objects", "value_json", new_column_name="value")
