"""Where each version's copies are: tiers, nodes and copy states (issue 38).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06

One ``placements`` row per (version, tier, node, object): ``tier`` is ``fast`` (a node-local folder: host
memory through /dev/shm, or local NVMe) or ``durable`` (the store's location); ``node`` names the node
holding the copy (empty for the durable tier); ``object`` is the stored object's key relative to the
tier's root (a shard file or a zarr.json); ``state`` is ``writing``, ``complete`` or ``evicted``.
A version's safety level (``local`` < ``replicated`` < ``durable``) follows from its complete rows and is
kept in ``checkpoints.safety`` (NULL: a version written straight to the durable tier, as before 0006).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("safety", sa.String(16), nullable=True))
    op.create_table(
        "placements",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("checkpoint_id", sa.String(32),
                  sa.ForeignKey("checkpoints.id", ondelete="CASCADE",
                                name="fk_placements_checkpoint_id_checkpoints"), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("object", sa.String(1024), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("crc32c", sa.String(16), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("tier IN ('fast', 'durable')", name="ck_placements_tier"),
        sa.CheckConstraint("state IN ('writing', 'complete', 'evicted')", name="ck_placements_state"),
        sa.UniqueConstraint("checkpoint_id", "tier", "node", "object",
                            name="uq_placements_checkpoint_id_tier_node_object"),
    )
    op.create_index("ix_placements_checkpoint_id_tier_node", "placements", ["checkpoint_id", "tier", "node"])


def downgrade() -> None:
    op.drop_index("ix_placements_checkpoint_id_tier_node", table_name="placements")
    op.drop_table("placements")
    op.drop_column("checkpoints", "safety")
