"""Per-run retention policy: runs.retention.

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-15

``runs.retention`` holds ``{"keep_last": N, "keep_every": K, "keep_tagged": bool}`` or NULL
(keep every version). Existing runs get NULL, i.e. nothing changes for them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # add_column needs no table copy on SQLite, even in batch mode
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("retention", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    # Native ALTER TABLE ... DROP COLUMN (SQLite >= 3.35, PostgreSQL). A batch "move and copy" would
    # DROP the referenced runs table, which SQLite refuses with foreign_keys=ON.
    op.drop_column("runs", "retention")
