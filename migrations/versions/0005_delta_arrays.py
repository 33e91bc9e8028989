"""Arrays may be stored as the bitwise XOR of a base array (delta versions, issue 39).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06

- ``arrays.encoding``: ``plain`` (the values themselves, every array before 0005) or ``xor`` (the bitwise
  XOR of the values with ``base_array_id``'s, same shape and dtype; the values are ``base XOR delta``,
  recursively);
- ``arrays.base_array_id``: the base of an ``xor`` array (NULL for ``plain``), a foreign key to ``arrays.id``:
  an array that is a kept version's base is never freed while that version is kept (gc frees a chain top
  down, and a save whose base a concurrent gc swept fails on the key instead of committing a broken chain);
- ``arrays.stored_nbytes``: the bytes the array's files take in the store (NULL where unknown), so that
  ``ucp ls`` can show a version's stored beside its logical bytes;
- ``runs.delta``: the run's delta policy (``auto``: each save stores a tensor-state as a delta of the parent
  version's where that is small enough; NULL: full arrays), overridden per save.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_FK = "fk_arrays_base_array_id_arrays"  # the models' naming convention


def upgrade() -> None:
    # native ADD COLUMN (no batch copy: other tables reference arrays)
    op.add_column("arrays", sa.Column("encoding", sa.String(16), nullable=False, server_default="plain"))
    if op.get_context().dialect.name == "sqlite":  # SQLite adds a key only inline with its column
        op.execute("ALTER TABLE arrays ADD COLUMN base_array_id VARCHAR(32) "
                   f"CONSTRAINT {_FK} REFERENCES arrays (id)")
    else:
        op.add_column("arrays", sa.Column("base_array_id", sa.String(32), nullable=True))
        op.create_foreign_key(_FK, "arrays", "arrays", ["base_array_id"], ["id"])
    op.add_column("arrays", sa.Column("stored_nbytes", sa.BigInteger(), nullable=True))
    op.create_index("ix_arrays_base_array_id", "arrays", ["base_array_id"])
    op.add_column("runs", sa.Column("delta", sa.String(16), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "delta")
    op.drop_index("ix_arrays_base_array_id", table_name="arrays")
    op.drop_column("arrays", "stored_nbytes")
    if op.get_context().dialect.name == "sqlite":
        # SQLite drops a column that is in a key only by a table copy, whose DROP TABLE of the old ``arrays``
        # the other tables' keys refuse unless keys are off, which SQLite allows only between transactions
        op.execute("COMMIT")
        op.execute("PRAGMA foreign_keys = OFF")
        op.execute("BEGIN IMMEDIATE")
        with op.batch_alter_table("arrays") as batch:
            batch.drop_column("base_array_id")
        op.execute("COMMIT")
        op.execute("PRAGMA foreign_keys = ON")
        op.execute("BEGIN IMMEDIATE")
    else:
        op.drop_constraint(_FK, "arrays", type_="foreignkey")
        op.drop_column("arrays", "base_array_id")
    op.drop_column("arrays", "encoding")
