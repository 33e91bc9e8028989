"""SQLAlchemy models of the catalog (SQLAlchemy 2 typed declarative).

The schema itself is owned by the Alembic migrations in ``migrations/versions`` (shipped as
``ucp_store._migrations``); these models must describe exactly what the head revision creates.
``tests/test_catalog.py`` checks that the two agree.

Conventions:
- string ids are lowercase hex (``new_id()``); integer ids are surrogate keys;
- timestamps are timezone-aware UTC (``UTCDateTime``; SQLite stores them without an offset, so the
  offset is re-attached on load);
- JSON columns use ``sqlalchemy.JSON`` (TEXT on SQLite, JSON on PostgreSQL); a nullable JSON column
  stores Python ``None`` as SQL NULL;
- an object's value (``objects.value``) is a TEXT column holding the JSON text Python wrote
  (``JSONText``), never a JSON column the database parses: SQLite's numeric affinity turned ``1.0`` into
  ``1`` and ``2**64-1`` into a float (migration 0004);
- reference counts of arrays are never stored: they are derived from ``tensors.array_id`` and
  ``objects.array_id``.
"""

from __future__ import annotations

import datetime as _dt
import json
import secrets
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

__all__ = [
    "NAMING_CONVENTION",
    "CHECKPOINT_STATUSES",
    "ARRAY_STATUSES",
    "OBJECT_KINDS",
    "UTCDateTime",
    "JSONText",
    "encode_json",
    "decode_json",
    "utcnow",
    "new_id",
    "Base",
    "Run",
    "Checkpoint",
    "Array",
    "Tensor",
    "Provenance",
    "StoredObject",
    "Tag",
    "Setting",
    "Placement",
    "ARRAY_ENCODINGS",
    "TIERS",
    "PLACEMENT_STATES",
    "SAFETY_LEVELS",
]

#: Constraint names are explicit (and stable across SQLite/PostgreSQL) so migrations can refer to them.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

CHECKPOINT_STATUSES = ("pending", "committed")
ARRAY_STATUSES = ("pending", "ready")
OBJECT_KINDS = ("json", "array")
#: how an array holds its values (0005): the values, or their bitwise XOR with a base array's
ARRAY_ENCODINGS = ("plain", "xor")
#: where a copy lives (0006): a node-local fast tier, or the store's durable location
TIERS = ("fast", "durable")
PLACEMENT_STATES = ("writing", "complete", "evicted")
#: a version's safety levels, weakest first (0006); NULL in checkpoints.safety: written durable directly
SAFETY_LEVELS = ("local", "replicated", "durable")


def utcnow() -> _dt.datetime:
    """The current time, timezone-aware, in UTC."""
    return _dt.datetime.now(_dt.UTC)


def new_id(nchars: int = 16) -> str:
    """A random lowercase hex id of ``nchars`` characters (at most 32, the width of the id columns).

    16 characters (64 random bits) for checkpoint versions, 32 (128 bits) for arrays.
    """
    if not 1 <= nchars <= 32:
        raise ValueError(f"new_id: nchars must be in 1..32 (the id columns are 32 wide), got {nchars}")
    return secrets.token_hex((nchars + 1) // 2)[:nchars]


class UTCDateTime(TypeDecorator):
    """``DateTime(timezone=True)`` that only accepts aware datetimes and always returns aware UTC ones."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: _dt.datetime | None, dialect) -> _dt.datetime | None:
        if value is None:
            return None
        if not isinstance(value, _dt.datetime):
            raise TypeError(f"UTCDateTime: expected a datetime, got {type(value).__name__}")
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(
                f"UTCDateTime: naive datetime {value.isoformat()} given; pass a timezone-aware one "
                "(e.g. ucp_store.catalog.models.utcnow())"
            )
        value = value.astimezone(_dt.UTC)
        if dialect.name == "sqlite":
            # SQLite has no offset type; store UTC wall time, re-attach UTC on load.
            value = value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: _dt.datetime | None, dialect) -> _dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=_dt.UTC)
        return value.astimezone(_dt.UTC)


def encode_json(value: Any) -> str:
    """The canonical text of a JSON value: ``json.dumps`` with plain separators, insertion-ordered keys and
    only ASCII (a NUL, any control or non-ASCII character is a ``\\uXXXX`` escape: text every database stores).

    Exact for what Python's ``json`` reads back: ``1.0`` stays a float (``repr``), ``-0.0`` keeps its
    sign, integers of any size stay integers, and NaN/Infinity/-Infinity are written as those tokens
    (Python's extension of JSON: this text is decoded by :func:`decode_json` only, never by the database).
    Raises ``TypeError``/``ValueError`` for what is not JSON (tuples become lists, as ``json`` does)."""
    return json.dumps(value, ensure_ascii=True, allow_nan=True, separators=(",", ":"))


def decode_json(text_: str) -> Any:
    """:func:`encode_json`'s value back (any JSON text Python's ``json`` reads)."""
    return json.loads(text_)


class JSONText(TypeDecorator):
    """A JSON value stored as TEXT written by :func:`encode_json` and read by :func:`decode_json`.

    Unlike ``sqlalchemy.JSON`` the database never parses it: SQLite gives a ``JSON`` column numeric
    affinity, so ``'1.0'`` was stored as the integer 1, ``'-0.0'`` as 0 and ``'18446744073709551615'`` as a
    float. Python ``None`` is SQL NULL (as ``JSON(none_as_null=True)`` did), so NULL reads back as None."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect) -> str | None:
        return None if value is None else encode_json(value)

    def process_result_value(self, value: Any, dialect) -> Any:
        return None if value is None else decode_json(value)


def _json_nullable() -> JSON:
    return JSON(none_as_null=True)


# BIGINT surrogate keys autoincrement on PostgreSQL; on SQLite only "INTEGER PRIMARY KEY" does.
_BigIntPK = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        _dt.datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
    }


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[_dt.datetime] = mapped_column(default=utcnow)
    description: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: {"keep_last": N, "keep_every": K, "keep_tagged": bool} or NULL (keep everything). Added by 0002.
    retention: Mapped[dict[str, Any] | None] = mapped_column(_json_nullable(), nullable=True)
    #: the run's delta policy: ``auto`` or NULL (full arrays); a save's ``delta=`` overrides it. Added by 0005.
    delta: Mapped[str | None] = mapped_column(String(16), nullable=True)

    checkpoints: Mapped[list["Checkpoint"]] = relationship(back_populates="run", passive_deletes=True)
    tags: Mapped[list["Tag"]] = relationship(back_populates="run", passive_deletes=True)

    def __repr__(self) -> str:
        return f"Run(id={self.id!r}, name={self.name!r})"


class Checkpoint(Base):
    """One version of a run: its tensors, objects, provenance and tags hang off it."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        CheckConstraint("status IN ('pending', 'committed')", name="status"),
        Index("ix_checkpoints_run_id_step", "run_id", "step"),
        # At most one *committed* version per (run, step); pending saves may overlap it.
        Index(
            "uq_checkpoints_committed_run_step",
            "run_id",
            "step",
            unique=True,
            sqlite_where=text("status = 'committed'"),
            postgresql_where=text("status = 'committed'"),
        ),
        Index("ix_checkpoints_parent_id", "parent_id"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    step: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    created_at: Mapped[_dt.datetime] = mapped_column(default=utcnow)
    committed_at: Mapped[_dt.datetime | None] = mapped_column(nullable=True)
    parent_id: Mapped[str | None] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="SET NULL"), nullable=True
    )
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: host and pid of the writer, so gc can recognise a pending save whose process died
    owner_host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    owner_pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    nbytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    format_version: Mapped[int] = mapped_column(Integer)
    #: safety level of a tiered save (``SAFETY_LEVELS``); NULL: written to the durable tier directly (0006)
    safety: Mapped[str | None] = mapped_column(String(16), nullable=True)

    run: Mapped[Run] = relationship(back_populates="checkpoints")
    parent: Mapped["Checkpoint | None"] = relationship(remote_side="Checkpoint.id")
    tensors: Mapped[list["Tensor"]] = relationship(
        back_populates="checkpoint",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="Tensor.position",
    )
    objects: Mapped[list["StoredObject"]] = relationship(
        back_populates="checkpoint", cascade="all, delete-orphan", passive_deletes=True
    )
    provenance: Mapped["Provenance | None"] = relationship(
        back_populates="checkpoint", cascade="all, delete-orphan", passive_deletes=True, uselist=False
    )
    tags: Mapped[list["Tag"]] = relationship(
        back_populates="checkpoint", cascade="all, delete-orphan", passive_deletes=True
    )

    def __repr__(self) -> str:
        return f"Checkpoint(id={self.id!r}, run_id={self.run_id!r}, step={self.step!r}, status={self.status!r})"


class Array(Base):
    """One Zarr v3 array under the store root; shared by every tensor-state with the same content."""

    __tablename__ = "arrays"
    __table_args__ = (CheckConstraint("status IN ('pending', 'ready')", name="status"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id(32))
    #: location relative to the store root, e.g. ``arrays/<id>.zarr``
    path: Mapped[str] = mapped_column(String(1024), unique=True)
    #: zarr v3 data type name (``float32``, ``bfloat16``, ...)
    dtype: Mapped[str] = mapped_column(String(64))
    shape: Mapped[list[Any]] = mapped_column(JSON)
    #: inner (read) chunk shape
    chunk_shape: Mapped[list[Any]] = mapped_column(JSON)
    shard_shape: Mapped[list[Any]] = mapped_column(JSON)
    #: the zarr codec chain, as in zarr.json
    codecs: Mapped[list[Any]] = mapped_column(JSON)
    #: logical bytes (product of shape x itemsize)
    nbytes: Mapped[int] = mapped_column(BigInteger)
    content_hash: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    created_at: Mapped[_dt.datetime] = mapped_column(default=utcnow)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    #: ``plain`` or ``xor`` (``ARRAY_ENCODINGS``, 0005): an ``xor`` array holds values XOR base_array's
    encoding: Mapped[str] = mapped_column(String(16), server_default="plain")
    base_array_id: Mapped[str | None] = mapped_column(ForeignKey("arrays.id"), nullable=True, index=True)
    #: bytes the array's files take in the store, where known (0005)
    stored_nbytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    def __repr__(self) -> str:
        return f"Array(id={self.id!r}, path={self.path!r}, status={self.status!r})"


class Tensor(Base):
    """One tensor-state ``(name, state)`` of a checkpoint, pointing at the array holding its values."""

    __tablename__ = "tensors"
    __table_args__ = (
        UniqueConstraint("checkpoint_id", "name", "state"),
        Index("ix_tensors_name", "name"),
        Index("ix_tensors_array_id", "array_id"),
        Index("ix_tensors_checkpoint_id_layer", "checkpoint_id", "layer"),
        Index("ix_tensors_checkpoint_id_position", "checkpoint_id", "position"),
    )

    id: Mapped[int] = mapped_column(_BigIntPK, primary_key=True)
    checkpoint_id: Mapped[str] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(1024))
    state: Mapped[str] = mapped_column(String(64))
    array_id: Mapped[str] = mapped_column(ForeignKey("arrays.id"))
    shape: Mapped[list[Any]] = mapped_column(JSON)
    dtype: Mapped[str] = mapped_column(String(64))
    #: pattern record (schemas/pattern.schema.json) or NULL (replicated everywhere)
    pattern: Mapped[dict[str, Any] | None] = mapped_column(_json_nullable(), nullable=True)
    nbytes: Mapped[int] = mapped_column(BigInteger)
    content_hash: Mapped[str] = mapped_column(String(128))
    #: order in which the tensor-states were saved
    position: Mapped[int] = mapped_column(Integer)
    #: ``pattern.placement.layer`` (NULL: no layer, e.g. tied or unplaced), so that a pipeline stage's
    #: plan fetches only its own layers' rows
    layer: Mapped[int | None] = mapped_column(Integer, nullable=True)

    checkpoint: Mapped[Checkpoint] = relationship(back_populates="tensors")
    array: Mapped[Array] = relationship()

    def __repr__(self) -> str:
        return f"Tensor(checkpoint_id={self.checkpoint_id!r}, name={self.name!r}, state={self.state!r})"


class Provenance(Base):
    """Where a checkpoint came from (schemas/provenance.schema.json describes the public record)."""

    __tablename__ = "provenance"

    checkpoint_id: Mapped[str] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    #: e.g. ``deepspeed``, ``torch_file``, ``training``
    source_kind: Mapped[str] = mapped_column(String(64))
    source_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: topology record of the source (schemas/topology.schema.json) or NULL
    source_topology: Mapped[dict[str, Any] | None] = mapped_column(_json_nullable(), nullable=True)
    tool_version: Mapped[str] = mapped_column(String(64))
    library_versions: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    host: Mapped[str] = mapped_column(String(255))
    #: {path relative to source_path: hash}
    source_hashes: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    extra: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)

    checkpoint: Mapped[Checkpoint] = relationship(back_populates="provenance")


class StoredObject(Base):
    """A named non-tensor object of a checkpoint: JSON data, or a reference to an array. Never a pickle."""

    __tablename__ = "objects"
    __table_args__ = (
        UniqueConstraint("checkpoint_id", "name"),
        CheckConstraint("kind IN ('json', 'array')", name="kind"),
        Index("ix_objects_array_id", "array_id"),
    )

    id: Mapped[int] = mapped_column(_BigIntPK, primary_key=True)
    checkpoint_id: Mapped[str] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(1024))
    kind: Mapped[str] = mapped_column(String(16))
    #: kind ``json``: the value as JSON text (``JSONText``; NULL is None); kind ``array``: NULL
    value: Mapped[Any | None] = mapped_column(JSONText(), nullable=True)
    array_id: Mapped[str | None] = mapped_column(ForeignKey("arrays.id"), nullable=True)

    checkpoint: Mapped[Checkpoint] = relationship(back_populates="objects")
    array: Mapped[Array | None] = relationship()


class Tag(Base):
    __tablename__ = "tags"
    __table_args__ = (
        UniqueConstraint("run_id", "name"),
        Index("ix_tags_checkpoint_id", "checkpoint_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    name: Mapped[str] = mapped_column(String(200))
    checkpoint_id: Mapped[str] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    created_at: Mapped[_dt.datetime] = mapped_column(default=utcnow)

    run: Mapped[Run] = relationship(back_populates="tags")
    checkpoint: Mapped[Checkpoint] = relationship(back_populates="tags")


class Placement(Base):
    """Where one stored object of a version has a copy (0006): tier, node and the copy's state."""

    __tablename__ = "placements"
    __table_args__ = (
        CheckConstraint("tier IN ('fast', 'durable')", name="tier"),
        CheckConstraint("state IN ('writing', 'complete', 'evicted')", name="state"),
        UniqueConstraint("checkpoint_id", "tier", "node", "object"),
        Index("ix_placements_checkpoint_id_tier_node", "checkpoint_id", "tier", "node"),
    )

    id: Mapped[int] = mapped_column(_BigIntPK, primary_key=True)
    checkpoint_id: Mapped[str] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    tier: Mapped[str] = mapped_column(String(16))
    #: the node holding the copy; "" for the durable tier
    node: Mapped[str] = mapped_column(String(255))
    #: the object's key relative to the tier's root
    object: Mapped[str] = mapped_column(String(1024))
    state: Mapped[str] = mapped_column(String(16))
    nbytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    #: crc32c of the object's bytes as written (hex), where known
    crc32c: Mapped[str | None] = mapped_column(String(16), nullable=True)
    updated_at: Mapped[_dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Setting(Base):
    """Store-level settings (compression, chunk target bytes, format version), one JSON value per key."""

    __tablename__ = "settings"

    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    value: Mapped[Any] = mapped_column(JSON)
