"""Initial catalog: runs, checkpoints, arrays, tensors, provenance, objects, tags, settings.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Frozen: this file describes the schema as first released and must not import the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_BigIntPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        _ts("created_at"),
        sa.Column("description", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        sa.UniqueConstraint("name", name="uq_runs_name"),
    )

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        _ts("created_at"),
        _ts("committed_at", nullable=True),
        sa.Column("parent_id", sa.String(32), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("owner_host", sa.String(255), nullable=True),
        sa.Column("owner_pid", sa.Integer(), nullable=True),
        sa.Column("nbytes", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("format_version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoints"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_checkpoints_run_id_runs"),
        sa.ForeignKeyConstraint(
            ["parent_id"], ["checkpoints.id"], name="fk_checkpoints_parent_id_checkpoints", ondelete="SET NULL"
        ),
        sa.CheckConstraint("status IN ('pending', 'committed')", name="ck_checkpoints_status"),
    )
    op.create_index("ix_checkpoints_run_id_step", "checkpoints", ["run_id", "step"])
    op.create_index(
        "uq_checkpoints_committed_run_step",
        "checkpoints",
        ["run_id", "step"],
        unique=True,
        sqlite_where=sa.text("status = 'committed'"),
        postgresql_where=sa.text("status = 'committed'"),
    )
    op.create_index("ix_checkpoints_parent_id", "checkpoints", ["parent_id"])

    op.create_table(
        "arrays",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("dtype", sa.String(64), nullable=False),
        sa.Column("shape", sa.JSON(), nullable=False),
        sa.Column("chunk_shape", sa.JSON(), nullable=False),
        sa.Column("shard_shape", sa.JSON(), nullable=False),
        sa.Column("codecs", sa.JSON(), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("content_hash", sa.String(128), nullable=True),
        _ts("created_at"),
        sa.Column("status", sa.String(16), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_arrays"),
        sa.UniqueConstraint("path", name="uq_arrays_path"),
        sa.CheckConstraint("status IN ('pending', 'ready')", name="ck_arrays_status"),
    )
    op.create_index("ix_arrays_content_hash", "arrays", ["content_hash"])

    op.create_table(
        "tensors",
        sa.Column("id", _BigIntPK, nullable=False),
        sa.Column("checkpoint_id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(1024), nullable=False),
        sa.Column("state", sa.String(64), nullable=False),
        sa.Column("array_id", sa.String(32), nullable=False),
        sa.Column("shape", sa.JSON(), nullable=False),
        sa.Column("dtype", sa.String(64), nullable=False),
        sa.Column("pattern", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("content_hash", sa.String(128), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_tensors"),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name="fk_tensors_checkpoint_id_checkpoints", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(["array_id"], ["arrays.id"], name="fk_tensors_array_id_arrays"),
        sa.UniqueConstraint("checkpoint_id", "name", "state", name="uq_tensors_checkpoint_id_name_state"),
    )
    op.create_index("ix_tensors_name", "tensors", ["name"])
    op.create_index("ix_tensors_array_id", "tensors", ["array_id"])

    op.create_table(
        "provenance",
        sa.Column("checkpoint_id", sa.String(32), nullable=False),
        sa.Column("source_kind", sa.String(64), nullable=False),
        sa.Column("source_path", sa.Text(), nullable=True),
        sa.Column("source_topology", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("tool_version", sa.String(64), nullable=False),
        sa.Column("library_versions", sa.JSON(), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("source_hashes", sa.JSON(), nullable=False),
        sa.Column("extra", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("checkpoint_id", name="pk_provenance"),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name="fk_provenance_checkpoint_id_checkpoints", ondelete="CASCADE"
        ),
    )

    op.create_table(
        "objects",
        sa.Column("id", _BigIntPK, nullable=False),
        sa.Column("checkpoint_id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(1024), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("value", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("array_id", sa.String(32), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_objects"),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name="fk_objects_checkpoint_id_checkpoints", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(["array_id"], ["arrays.id"], name="fk_objects_array_id_arrays"),
        sa.UniqueConstraint("checkpoint_id", "name", name="uq_objects_checkpoint_id_name"),
        sa.CheckConstraint("kind IN ('json', 'array')", name="ck_objects_kind"),
    )
    op.create_index("ix_objects_array_id", "objects", ["array_id"])

    op.create_table(
        "tags",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("checkpoint_id", sa.String(32), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_tags"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_tags_run_id_runs"),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name="fk_tags_checkpoint_id_checkpoints", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("run_id", "name", name="uq_tags_run_id_name"),
    )
    op.create_index("ix_tags_checkpoint_id", "tags", ["checkpoint_id"])

    op.create_table(
        "settings",
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("value", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_settings"),
    )


def downgrade() -> None:
    for table in ("settings", "tags", "objects", "provenance", "tensors", "arrays", "checkpoints", "runs"):
        op.drop_table(table)
