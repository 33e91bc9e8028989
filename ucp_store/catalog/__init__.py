"""The SQL catalog: SQLAlchemy models, engine set-up and Alembic migrations applied on open.

    from ucp_store.catalog import open_catalog, Run

    catalog = open_catalog("sqlite:////data/ckpt/catalog.db", create=True)
    with catalog.write_session() as session:      # one write transaction (BEGIN IMMEDIATE on SQLite)
        session.add(Run(name="llama-7b"))
    with catalog.session() as session:            # reads
        runs = session.scalars(select(Run)).all()

Nothing in this package imports torch, TensorStore or numpy: the catalog-only commands run on it alone.
"""

from ucp_store.catalog.db import (
    DEFAULT_BUSY_TIMEOUT_MS,
    DEFAULT_WRITE_ATTEMPTS,
    Catalog,
    current_revision,
    display_url,
    downgrade_to,
    head_revision,
    known_revisions,
    migrations_dir,
    open_catalog,
    sqlite_url,
    upgrade,
)
from ucp_store.catalog.models import (
    ARRAY_STATUSES,
    CHECKPOINT_STATUSES,
    OBJECT_KINDS,
    Array,
    Base,
    Checkpoint,
    Provenance,
    Run,
    Setting,
    StoredObject,
    Tag,
    Tensor,
    UTCDateTime,
    new_id,
    utcnow,
)
from ucp_store.catalog.query import read_only_query

__all__ = [
    "DEFAULT_BUSY_TIMEOUT_MS",
    "DEFAULT_WRITE_ATTEMPTS",
    "Catalog",
    "open_catalog",
    "current_revision",
    "head_revision",
    "known_revisions",
    "upgrade",
    "downgrade_to",
    "migrations_dir",
    "sqlite_url",
    "display_url",
    "ARRAY_STATUSES",
    "CHECKPOINT_STATUSES",
    "OBJECT_KINDS",
    "Base",
    "Run",
    "Checkpoint",
    "Array",
    "Tensor",
    "Provenance",
    "StoredObject",
    "Tag",
    "Setting",
    "UTCDateTime",
    "new_id",
    "utcnow",
    "read_only_query",
]
