"""Arrays may be stored as the bitwise XOR of a base array (delta versions, issue 39).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06

- ``arrays.encoding``: ``plain`` (the values themselves, every array before 0005) or ``xor`` (the bitwise
  XOR of the values with ``base_array_id``'s, same shape and dtype; the values are ``base XOR delta``,
  recursively);
- ``arrays.base_array_id``: the base of an ``xor`` array (NULL for ``plain``); an array that is a kept
  version's base is never freed while that version is kept;
- ``arrays.stored_nbytes``: the bytes the array's files take in the store (NULL where unknown), so that
  ``ucp ls`` can show a version's stored beside its logical bytes.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # native ADD COLUMN (no batch copy: other tables reference arrays)
    op.add_column("arrays", sa.Column("encoding", sa.String(16), nullable=False, server_default="plain"))
    op.add_column("arrays", sa.Column("base_array_id", sa.String(32), nullable=True))
    op.add_column("arrays", sa.Column("stored_nbytes", sa.BigInteger(), nullable=True))
    op.create_index("ix_arrays_base_array_id", "arrays", ["base_array_id"])


def downgrade() -> None:
    op.drop_index("ix_arrays_base_array_id", table_name="arrays")
    op.drop_column("arrays", "stored_nbytes")
    op.drop_column("arrays", "base_array_id")
    op.drop_column("arrays", "encoding")
