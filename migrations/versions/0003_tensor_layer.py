"""Tensor rows record their pipeline layer (tensors.layer); tensors are indexed by layer and position.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

``tensors.layer`` copies ``pattern.placement.layer`` (NULL when the pattern places the tensor on no
single layer: tied, unplaced or no pattern). With the index on ``(checkpoint_id, layer)`` a pipeline
stage's plan reads only its layers' rows plus the unlayered ones, instead of all of a 1000-layer
model's. Existing rows are filled from their pattern by SQL, so the offline script (``--sql``) does it
too. The ``(checkpoint_id, position)`` index gives a checkpoint's rows in saved order without sorting
them (sorting 100k wide rows was most of a full fetch on SQLite).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_BACKFILL = {
    # only integral layers: the pattern schema allows nothing else, but a hand-written row might
    "sqlite": ("UPDATE tensors SET layer = json_extract(pattern, '$.placement.layer') "
               "WHERE json_type(pattern, '$.placement.layer') = 'integer'"),
    "postgresql": ("UPDATE tensors SET layer = (pattern -> 'placement' ->> 'layer')::integer "
                   "WHERE json_typeof(pattern -> 'placement' -> 'layer') = 'number' "
                   "AND (pattern -> 'placement' ->> 'layer') ~ '^[0-9]+$'"),
}


def upgrade() -> None:
    with op.batch_alter_table("tensors") as batch:
        batch.add_column(sa.Column("layer", sa.Integer(), nullable=True))
    op.create_index("ix_tensors_checkpoint_id_layer", "tensors", ["checkpoint_id", "layer"])
    op.create_index("ix_tensors_checkpoint_id_position", "tensors", ["checkpoint_id", "position"])
    dialect = op.get_context().dialect.name
    if dialect not in _BACKFILL:  # pragma: no cover - the catalog supports these two
        raise NotImplementedError(f"no tensors.layer backfill for dialect {dialect!r}")
    op.execute(_BACKFILL[dialect])


def downgrade() -> None:
    op.drop_index("ix_tensors_checkpoint_id_position", table_name="tensors")
    op.drop_index("ix_tensors_checkpoint_id_layer", table_name="tensors")
    # native DROP COLUMN, as in 0002 (a batch copy would drop a table other tables reference)
    op.drop_column("tensors", "layer")
