"""Alembic environment of the ucp_store catalog.

Driven programmatically by ``ucp_store.catalog.db`` (no alembic.ini at runtime):

- online, with a connection (or an engine) in ``config.attributes["connection"]``. When that
  connection is already inside a transaction, the migrations join it and the caller commits; this is
  how ``open_catalog`` upgrades under its write lock;
- online, from ``sqlalchemy.url`` (a fresh engine, closed afterwards);
- offline (``alembic upgrade --sql`` / ``command.upgrade(cfg, "head", sql=True)``): emits SQL for the
  dialect of ``sqlalchemy.url`` without connecting.

SQLite gets ``render_as_batch=True`` so ALTER-style operations are run as batch operations.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

config = context.config


def _target_metadata():
    # Only needed by `alembic revision --autogenerate` (a development aid); never required at runtime.
    try:
        from ucp_store.catalog.models import Base
    except ImportError:  # pragma: no cover - package partially importable
        return None
    return Base.metadata


def _run_with(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=_target_metadata(),
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("ucp_store migrations: offline mode needs sqlalchemy.url in the Alembic config")
    context.configure(
        url=url,
        target_metadata=_target_metadata(),
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=sa.engine.make_url(url).get_backend_name() == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    given = config.attributes.get("connection")
    if isinstance(given, Connection):
        _run_with(given)
        return
    if isinstance(given, Engine):
        with given.connect() as connection:
            _run_with(connection)
            connection.commit()
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError(
            "ucp_store migrations: pass a connection in config.attributes['connection'] or set sqlalchemy.url"
        )
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            _run_with(connection)
            connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
