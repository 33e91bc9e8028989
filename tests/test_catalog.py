"""The SQL catalog: migrations on open, constraints, cascades, concurrent writers, record schemas.

Real SQLite files under tmp_path; the same tests run against PostgreSQL when UCP_TEST_POSTGRES_URL is
set (e.g. postgresql+psycopg2://ucp:ucp@localhost/ucp_test), each test in a schema of its own.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import multiprocessing as mp
import os
import sqlite3
import traceback

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, Table, create_engine, delete, func, inspect, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import NullPool

from ucp_store.catalog import (
    Array,
    Base,
    Catalog,
    Checkpoint,
    Provenance,
    Run,
    Setting,
    StoredObject,
    Tag,
    Tensor,
    current_revision,
    downgrade_to,
    head_revision,
    known_revisions,
    new_id,
    open_catalog,
    sqlite_url,
    upgrade,
    utcnow,
)
from ucp_store.catalog.db import _alembic_config
from ucp_store.errors import CatalogError, SchemaVersionError, ValidationError
from ucp_store.schema import validate

from ucp_test_helpers import postgres_schema_url

# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request, tmp_path):
    """A URL where no catalog exists yet."""
    if request.param == "sqlite":
        yield sqlite_url(tmp_path / "catalog.db")
        return
    with postgres_schema_url() as pg:
        yield pg


@pytest.fixture
def opened():
    """open_catalog that closes what it opened at teardown (before the PostgreSQL schema is dropped)."""
    catalogs: list[Catalog] = []

    def _open(url: str, **kw) -> Catalog:
        kw.setdefault("create", True)
        catalog = open_catalog(url, **kw)
        catalogs.append(catalog)
        return catalog

    yield _open
    for catalog in catalogs:
        catalog.close()


def _checkpoint(run: Run, step: int, status: str = "committed", **kw) -> Checkpoint:
    return Checkpoint(
        run=run,
        step=step,
        status=status,
        committed_at=utcnow() if status == "committed" else None,
        format_version=1,
        owner_host="host",
        owner_pid=os.getpid(),
        **kw,
    )


def _array(**kw) -> Array:
    aid = new_id(32)
    fields = dict(
        id=aid,
        path=f"arrays/{aid}.zarr",
        dtype="float32",
        shape=[4, 2],
        chunk_shape=[2, 2],
        shard_shape=[4, 2],
        codecs=[{"name": "bytes"}, {"name": "crc32c"}],
        nbytes=32,
        content_hash="xxh3-128:" + "0" * 32,
        status="ready",
    )
    fields.update(kw)
    return Array(**fields)


def _count(session, model) -> int:
    return session.scalar(select(func.count()).select_from(model))


# ---------------------------------------------------------------------------------------------- opening


def test_revisions_are_linear():
    assert known_revisions() == ["0001", "0002", "0003", "0004", "0005", "0006"]
    assert head_revision() == "0006"


def test_create_at_head(url, opened):
    catalog = opened(url, create=True)
    assert current_revision(catalog) == head_revision()
    tables = set(inspect(catalog.engine).get_table_names())
    assert {"runs", "checkpoints", "arrays", "tensors", "provenance", "objects", "tags", "settings"} <= tables
    assert "retention" in {c["name"] for c in inspect(catalog.engine).get_columns("runs")}

    with catalog.write_session() as s:
        s.add(Setting(key="format_version", value=1))
        s.add(Run(name="llama", retention={"keep_last": 3, "keep_every": 1000, "keep_tagged": True}))
    with catalog.session() as s:
        run = s.scalars(select(Run)).one()
        assert run.retention == {"keep_last": 3, "keep_every": 1000, "keep_tagged": True}
        assert run.created_at.tzinfo is not None and run.created_at.utcoffset() == dt.timedelta(0)
        assert s.get(Setting, "format_version").value == 1


def test_models_match_migrations(url, opened):
    catalog = opened(url)
    with catalog.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
        assert compare_metadata(ctx, Base.metadata) == []


def test_sqlite_connection_settings(tmp_path, opened):
    catalog = opened(sqlite_url(tmp_path / "c.db"))
    with catalog.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000


def test_not_durable_write_session_is_one_transaction_and_leaves_durable_defaults(url, opened):
    """write_session(durable=False) (a save's pending row): committed and visible like any transaction, rolled
    back on an error, and only that transaction skips waiting for the disk: the connection goes back to the
    pool with SQLite's synchronous=FULL, PostgreSQL's synchronous_commit stays on outside it."""
    catalog = opened(url)
    with catalog.write_session(durable=False) as s:
        if catalog.dialect == "postgresql":
            assert s.execute(text("SHOW synchronous_commit")).scalar() == "off"
        s.add(Run(name="lazy"))
    with pytest.raises(RuntimeError):
        with catalog.write_session(durable=False) as s:
            s.add(Run(name="rolled-back"))
            s.flush()
            raise RuntimeError("boom")
    with catalog.session() as s:
        assert sorted(s.scalars(select(Run.name))) == ["lazy"]
    for _ in range(3):  # every pooled connection, whichever the pool hands out
        with catalog.write_session() as s:
            if catalog.dialect == "sqlite":
                assert s.connection().exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
            else:
                assert s.execute(text("SHOW synchronous_commit")).scalar() == "on"


def test_open_existing(url, opened):
    first = opened(url, create=True)
    with first.write_session() as s:
        s.add(Run(name="r1", description="first run"))
    first.close()

    again = opened(url, create=False)
    assert current_revision(again) == head_revision()
    with again.session() as s:
        assert s.scalars(select(Run.description)).all() == ["first run"]


def test_missing_catalog_is_not_created(url, tmp_path):
    with pytest.raises(CatalogError, match="create=True"):
        open_catalog(url, create=False)
    if url.startswith("sqlite"):
        assert not (tmp_path / "catalog.db").exists()


def test_upgrade_from_0001_keeps_rows(url, opened):
    assert upgrade(url, "0001", create=True) == (None, "0001")
    # write rows the way a 0001-era ucp_store did (no runs.retention), through reflected tables
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            meta = MetaData()
            runs = Table("runs", meta, autoload_with=conn)
            checkpoints = Table("checkpoints", meta, autoload_with=conn)
            assert "retention" not in runs.c
            created = dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
            conn.execute(runs.insert().values(id=1, name="old-run", created_at=created, description="from 0001"))
            conn.execute(
                checkpoints.insert().values(
                    id="abcdef0123456789", run_id=1, step=100, status="committed", created_at=created,
                    committed_at=created, format_version=1, nbytes=1234,
                )
            )
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0001"
    finally:
        engine.dispose()

    with pytest.raises(SchemaVersionError, match=r"'0001', older than .*'0006'.*ucp db upgrade"):
        open_catalog(url, create=False, upgrade=False)

    catalog = opened(url, create=False)  # upgrade=True by default
    assert current_revision(catalog) == "0006"
    assert "retention" in {c["name"] for c in inspect(catalog.engine).get_columns("runs")}
    with catalog.session() as s:
        run = s.scalars(select(Run)).one()
        assert (run.name, run.description, run.retention) == ("old-run", "from 0001", None)
        assert run.created_at == dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
        ckpt = s.get(Checkpoint, "abcdef0123456789")
        assert (ckpt.run_id, ckpt.step, ckpt.status, ckpt.nbytes) == (1, 100, "committed", 1234)
    with catalog.write_session() as s:
        s.get(Run, 1).retention = {"keep_last": 2}
    with catalog.session() as s:
        assert s.get(Run, 1).retention == {"keep_last": 2}


def test_downgrade_then_upgrade(url, opened):
    catalog = opened(url)
    with catalog.write_session() as s:
        s.add(Run(name="r", retention={"keep_last": 1}))
    catalog.close()
    downgrade_to(url, "0001")
    assert upgrade(url) == ("0001", "0006")
    assert upgrade(url) == ("0006", "0006")
    with opened(url, create=False).session() as s:
        assert s.scalars(select(Run.retention)).one() is None  # the 0002 column came back empty


def test_upgrade_from_0002_fills_tensor_layers(url, opened):
    """0003 copies pattern.placement.layer into tensors.layer for rows written before it."""
    assert upgrade(url, "0002", create=True) == (None, "0002")
    engine = create_engine(url, poolclass=NullPool)
    rows = {  # name -> (pattern, expected layer)
        "layers.7.attn.qkv.weight": ({"kind": "fused", "dim": 0, "sizes": [4, 2, 2], "placement": {"layer": 7}}, 7),
        "layers.0.norm.weight": ({"kind": "replicated", "placement": {"layer": 0, "local_name": "n{local}"}}, 0),
        "embedding.weight": ({"kind": "vocab", "original_size": 10, "placement": {"stages": ["first", "last"]}},
                             None),
        "lm_head.bias": ({"kind": "replicated"}, None),
        "loose": (None, None),
        "odd": ({"kind": "replicated", "placement": {"layer": "3"}}, None),  # not an integer: left NULL
    }
    try:
        with engine.begin() as conn:
            meta = MetaData()
            t = {n: Table(n, meta, autoload_with=conn) for n in ("runs", "checkpoints", "arrays", "tensors")}
            assert "layer" not in t["tensors"].c
            now = dt.datetime(2025, 6, 1, tzinfo=dt.UTC)
            conn.execute(t["runs"].insert().values(id=1, name="r", created_at=now))
            conn.execute(t["checkpoints"].insert().values(id="c" * 16, run_id=1, step=1, status="committed",
                                                          created_at=now, committed_at=now, format_version=1))
            conn.execute(t["arrays"].insert().values(id="a" * 32, path="arrays/x", dtype="float32", shape=[2],
                                                     chunk_shape=[2], shard_shape=[2], codecs=[], nbytes=8,
                                                     created_at=now, status="ready"))
            for pos, (name, (pattern, _)) in enumerate(rows.items()):
                conn.execute(t["tensors"].insert().values(checkpoint_id="c" * 16, name=name, state="fp32",
                                                          array_id="a" * 32, shape=[2], dtype="float32",
                                                          pattern=pattern, nbytes=8, content_hash="h",
                                                          position=pos))
    finally:
        engine.dispose()
    assert upgrade(url, "0003") == ("0002", "0003")
    with opened(url, create=False).session() as s:
        got = dict(s.execute(select(Tensor.name, Tensor.layer)).all())
    assert got == {name: layer for name, (_, layer) in rows.items()}
    downgrade_to(url, "0002")
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            assert "layer" not in {c["name"] for c in inspect(conn).get_columns("tensors")}
    finally:
        engine.dispose()


def test_upgrade_from_0003_keeps_object_values(url, opened):
    """0004 turns objects.value into JSON text the database never parses. Old rows keep their values: every
    one on PostgreSQL (its json column kept the text); on SQLite each top-level number as SQLite stored it
    (1.0 had become 1 there, -0.0 had become 0: lost before 0004) and everything nested exactly."""
    assert upgrade(url, "0003", create=True) == (None, "0003")
    sqlite = url.startswith("sqlite")
    values = {"int": 7, "float": 0.30000000000000004, "tiny": 5e-324, "huge": 1.5e300, "text": "1.5",
              "nul": "a\x00b", "nested": {"k": [1.0, -0.0, 2**64 - 1, "\u00e9", None]}, "none": None,
              "list": [], "true": True}
    if sqlite:
        values["nan"] = float("nan")  # a PostgreSQL json column refused NaN before 0004
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            meta = MetaData()
            t = {n: Table(n, meta, autoload_with=conn) for n in ("runs", "checkpoints", "objects")}
            now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
            conn.execute(t["runs"].insert().values(id=1, name="r", created_at=now))
            conn.execute(t["checkpoints"].insert().values(id="c" * 16, run_id=1, step=1, status="committed",
                                                          created_at=now, committed_at=now, format_version=1))
            for name, value in {**values, "one": 1.0, "negzero": -0.0}.items():
                conn.execute(t["objects"].insert().values(checkpoint_id="c" * 16, name=name, kind="json",
                                                          value=value))
            conn.execute(t["objects"].insert().values(checkpoint_id="c" * 16, name="arr", kind="array"))
    finally:
        engine.dispose()
    assert upgrade(url) == ("0003", "0006")

    def stored() -> dict:
        with opened(url, create=False).session() as s:
            return {o.name: o.value for o in s.scalars(select(StoredObject))}

    got = stored()
    assert json.dumps({k: got[k] for k in values}) == json.dumps(values)  # json.dumps: 1.0 is not 1
    assert got["arr"] is None
    if sqlite:  # what the JSON column had already lost stays lost (documented in 0004)
        assert (got["one"], got["negzero"]) == (1, 0) and type(got["one"]) is int
    else:
        assert repr(got["one"]) == "1.0" and repr(got["negzero"]) == "-0.0"
    downgrade_to(url, "0003")
    assert upgrade(url) == ("0003", "0006")
    again = stored()
    assert json.dumps({k: again[k] for k in values if k not in ("nan", "huge", "tiny")}) == json.dumps(
        {k: v for k, v in values.items() if k not in ("nan", "huge", "tiny")})


def test_newer_revision_is_refused(url, opened):
    catalog = opened(url)
    with catalog.write_session() as s:
        s.execute(text("UPDATE alembic_version SET version_num = '0099_from_the_future'"))
    catalog.close()
    for create in (False, True):
        with pytest.raises(SchemaVersionError) as info:
            open_catalog(url, create=create)
        msg = str(info.value)
        assert "'0099_from_the_future', newer than this ucp_store" in msg
        assert "knows up to '0006'" in msg and "upgrade ucp_store" in msg
    with pytest.raises(SchemaVersionError, match="0099_from_the_future"):
        upgrade(url)


def test_foreign_tables_without_revision_are_refused(url):
    engine = create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE runs (id INTEGER PRIMARY KEY)")
    engine.dispose()
    with pytest.raises(CatalogError, match="no schema revision"):
        open_catalog(url, create=True)


def test_offline_sql_generation():
    cfg = _alembic_config(url="postgresql+psycopg2://u:p%40ss@h/db")
    buf = io.StringIO()
    cfg.output_buffer = buf
    command.upgrade(cfg, "head", sql=True)
    sql = buf.getvalue()
    assert "CREATE TABLE checkpoints" in sql
    assert "CREATE UNIQUE INDEX uq_checkpoints_committed_run_step" in sql and "WHERE status = 'committed'" in sql
    assert "ALTER TABLE runs ADD COLUMN retention JSON" in sql
    assert "UPDATE alembic_version SET version_num='0002'" in sql
    assert "ALTER TABLE tensors ADD COLUMN layer INTEGER" in sql
    assert "CREATE INDEX ix_tensors_checkpoint_id_layer ON tensors (checkpoint_id, layer)" in sql
    assert "CREATE INDEX ix_tensors_checkpoint_id_position ON tensors (checkpoint_id, position)" in sql
    assert "UPDATE tensors SET layer = (pattern -> 'placement' ->> 'layer')::integer" in sql  # backfill
    assert "UPDATE alembic_version SET version_num='0003'" in sql
    assert "ALTER TABLE objects ALTER COLUMN value TYPE TEXT USING value::text" in sql  # 0004, exact on PostgreSQL
    assert "UPDATE alembic_version SET version_num='0004'" in sql
    assert "ALTER TABLE arrays ADD COLUMN encoding VARCHAR(16) DEFAULT 'plain' NOT NULL" in sql  # 0005
    assert "CREATE TABLE placements" in sql and "UPDATE alembic_version SET version_num='0006'" in sql


# ---------------------------------------------------------------------------------------------- constraints


def test_one_committed_checkpoint_per_step(url, opened):
    catalog = opened(url)
    with catalog.write_session() as s:
        run = Run(name="r")
        s.add_all([run, _checkpoint(run, 10)])
    with pytest.raises(IntegrityError):
        with catalog.write_session() as s:
            s.add(_checkpoint(s.get(Run, run.id), 10))
    with catalog.write_session() as s:  # pending saves of the same step are allowed, several of them
        r = s.get(Run, run.id)
        s.add_all([_checkpoint(r, 10, status="pending"), _checkpoint(r, 10, status="pending"), _checkpoint(r, 11)])
    with catalog.session() as s:
        rows = s.execute(select(Checkpoint.step, Checkpoint.status).order_by(Checkpoint.step, Checkpoint.status)).all()
        assert rows == [(10, "committed"), (10, "pending"), (10, "pending"), (11, "committed")]
    # committing a pending one at an already-committed step is refused as well
    with pytest.raises(IntegrityError):
        with catalog.write_session() as s:
            pending = s.scalars(select(Checkpoint).where(Checkpoint.status == "pending")).first()
            pending.status = "committed"
    with pytest.raises(IntegrityError):  # CHECK constraint on status
        with catalog.write_session() as s:
            s.add(_checkpoint(s.get(Run, run.id), 12, status="deleted"))


def test_naive_timestamps_are_refused(url, opened):
    catalog = opened(url)
    with pytest.raises(Exception, match="naive datetime"):
        with catalog.write_session() as s:
            s.add(Run(name="r", created_at=dt.datetime(2025, 1, 1)))


def _populate(catalog: Catalog) -> tuple[str, str, str]:
    """A run with a parent and a child checkpoint; the child has tensors, objects, provenance, a tag."""
    with catalog.write_session() as s:
        run = Run(name="r")
        parent = _checkpoint(run, 1)
        child = _checkpoint(run, 2, parent=parent, message="second")
        arr, arr2 = _array(), _array()
        child.tensors = [
            Tensor(name="layers.0.w", state=state, array=arr, shape=[4, 2], dtype="float32",
                   pattern={"kind": "partitioned", "dim": 0}, nbytes=32, content_hash=arr.content_hash, position=i)
            for i, state in enumerate(["fp32", "exp_avg"])
        ]
        child.objects = [
            StoredObject(name="args", kind="json", value={"lr": 1e-4}),
            StoredObject(name="rng", kind="array", array=arr2),
        ]
        child.provenance = Provenance(source_kind="training", tool_version="0.1.0", host="h",
                                      library_versions={"torch": "2.5"}, source_hashes={}, extra={})
        child.tags = [Tag(run=run, name="best")]
        s.add_all([run, parent, child])
    return parent.id, child.id, arr.id


@pytest.mark.parametrize("how", ["core", "orm"])
def test_delete_checkpoint_cascades(url, opened, how):
    catalog = opened(url)
    parent_id, child_id, array_id = _populate(catalog)
    with catalog.session() as s:
        assert [_count(s, m) for m in (Tensor, StoredObject, Provenance, Tag, Array)] == [2, 2, 1, 1, 2]
        tensor = s.scalars(select(Tensor).where(Tensor.state == "fp32")).one()
        assert tensor.pattern == {"kind": "partitioned", "dim": 0}
        args_id = s.scalars(select(StoredObject.id).where(StoredObject.name == "args")).one()
        assert s.get(StoredObject, args_id).value == {"lr": 1e-4}

    with catalog.write_session() as s:
        if how == "core":  # the database's ON DELETE CASCADE alone
            s.execute(delete(Checkpoint).where(Checkpoint.id == child_id))
        else:
            s.delete(s.get(Checkpoint, child_id))
    with catalog.session() as s:
        assert [_count(s, m) for m in (Tensor, StoredObject, Provenance, Tag)] == [0, 0, 0, 0]
        assert _count(s, Array) == 2  # arrays outlive their references; gc removes them
        assert s.get(Checkpoint, parent_id) is not None

    # deleting a parent leaves its children with parent_id NULL
    with catalog.write_session() as s:
        child = _checkpoint(s.get(Run, 1), 3, parent_id=parent_id)
        s.add(child)
    with catalog.write_session() as s:
        s.execute(delete(Checkpoint).where(Checkpoint.id == parent_id))
    with catalog.session() as s:
        assert s.get(Checkpoint, child.id).parent_id is None


def test_referenced_array_cannot_be_deleted(url, opened):
    catalog = opened(url)
    _, _, array_id = _populate(catalog)
    with pytest.raises(IntegrityError):
        with catalog.write_session() as s:
            s.execute(delete(Array).where(Array.id == array_id))


def test_tensor_state_unique_per_checkpoint(url, opened):
    catalog = opened(url)
    _, child_id, array_id = _populate(catalog)
    with pytest.raises(IntegrityError):
        with catalog.write_session() as s:
            s.add(Tensor(checkpoint_id=child_id, name="layers.0.w", state="fp32", array_id=array_id, shape=[4, 2],
                         dtype="float32", nbytes=32, content_hash="x", position=9))


# ---------------------------------------------------------------------------------------------- concurrency


N_PROCS = 4
N_WRITES = 25


def _writer(url: str, worker: int, barrier, errors) -> None:
    try:
        barrier.wait(timeout=120)
        catalog = open_catalog(url, create=True)  # all at once, on a catalog nobody has created yet
        with catalog.write_session() as s:
            s.add(Run(name=f"worker-{worker}"))
            if worker == 0:
                s.add(Setting(key="counter", value=0))
        barrier.wait(timeout=120)
        for step in range(N_WRITES):
            with catalog.write_session() as s:
                # read-modify-write: lost updates would show in the final counter
                counter = s.get(Setting, "counter", with_for_update=True)
                counter.value = counter.value + 1
                run = s.scalars(select(Run).where(Run.name == f"worker-{worker}")).one()
                s.add(_checkpoint(run, step))
        catalog.close()
    except BaseException:
        errors.put(f"worker {worker}:\n{traceback.format_exc()}")
        raise SystemExit(1) from None


def test_concurrent_writers_lose_nothing(url, tmp_path):
    # fork: separate processes without re-importing ucp_store (torch) in each; the engine's fork guard
    # would discard any pooled connection inherited from this process
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    barrier = ctx.Barrier(N_PROCS)
    errors = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(url, i, barrier, errors)) for i in range(N_PROCS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(failures)
    assert [p.exitcode for p in procs] == [0] * N_PROCS

    with open_catalog(url, create=False) as catalog, catalog.session() as s:
        assert current_revision(catalog) == head_revision()
        assert s.get(Setting, "counter").value == N_PROCS * N_WRITES
        per_run = dict(s.execute(select(Run.name, func.count(Checkpoint.id)).join(Checkpoint.run)
                                 .group_by(Run.name)).all())
        assert per_run == {f"worker-{i}": N_WRITES for i in range(N_PROCS)}


def test_write_lock_timeout_is_reported(tmp_path):
    url = sqlite_url(tmp_path / "c.db")
    with open_catalog(url, create=True, busy_timeout_ms=50) as catalog:
        holder = sqlite3.connect(tmp_path / "c.db", isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            with pytest.raises(CatalogError, match="could not start a write transaction after 2 attempts"):
                with catalog.write_session(attempts=2):
                    pass
            with pytest.raises(CatalogError, match="after 2 attempts"):
                catalog.run_write(lambda s: s.add(Run(name="x")), attempts=2)
            with catalog.session() as s:  # WAL: readers are not blocked by the writer
                assert s.scalars(select(Run)).all() == []
            holder.execute("ROLLBACK")
        finally:
            holder.close()
        assert catalog.run_write(lambda s: s.add(Run(name="x")) or "done") == "done"
        with catalog.session() as s:
            assert s.scalars(select(Run.name)).all() == ["x"]


# ---------------------------------------------------------------------------------------------- schemas


GOOD_PROVENANCE = {
    "source_kind": "deepspeed",
    "source_path": "/ckpt/global_step100",
    "source_topology": {"tp": 2, "pp": 1, "dp": 4},
    "tool_version": "0.1.0",
    "library_versions": {"torch": "2.5.1", "deepspeed": None},
    "host": "node-1",
    "source_hashes": {"mp_rank_00_model_states.pt": "xxh3-128:00ff"},
    "extra": {"anything": [1, {"goes": True}]},
}


def test_provenance_schema_accepts_good_record():
    validate("provenance", GOOD_PROVENANCE)
    validate("provenance", {"source_kind": "training"})


@pytest.mark.parametrize(
    "change, where, expectation",
    [
        ({"library_versions": {"torch": 2}}, "$.library_versions.torch", "is not of type"),
        ({"source_kind": "Has Spaces"}, "$.source_kind", "does not match"),
        ({"host": ["a"]}, "$.host", "is not of type 'string'"),
        ({"surprise": 1}, "top level", "'surprise' was unexpected"),
        ({"source_hashes": {"../escape": "h"}}, "$.source_hashes", "does not match"),
    ],
)
def test_provenance_schema_rejects_bad_record(change, where, expectation):
    with pytest.raises(ValidationError) as info:
        validate("provenance", {**GOOD_PROVENANCE, **change})
    msg = str(info.value)
    assert msg.startswith("invalid provenance record")
    assert where in msg and expectation in msg


def test_provenance_schema_requires_source_kind():
    record = dict(GOOD_PROVENANCE)
    del record["source_kind"]
    with pytest.raises(ValidationError, match="'source_kind' is a required property"):
        validate("provenance", record)


def test_manifest_schema():
    manifest = {
        "id": "0123456789abcdef", "run": "llama", "step": 100, "status": "committed",
        "created_at": "2025-01-02T03:04:05+00:00", "committed_at": "2025-01-02T03:04:06+00:00",
        "parent": None, "message": None, "tags": ["best"], "nbytes": 64,
        "provenance": GOOD_PROVENANCE,
        "objects": {"args": {"kind": "json", "value": {"lr": 0.1}}, "rng": {"kind": "array", "array": "arrays/x.zarr"}},
        "tensors": [{
            "name": "layers.0.w", "state": "fp32", "shape": [4, 2], "dtype": "float32", "pattern": None,
            "nbytes": 32, "array": "arrays/0a.zarr", "chunk_shape": [2, 2], "content_hash": "xxh3-128:00",
        }],
    }
    validate("manifest", manifest)
    validate("manifest", {**manifest, "provenance": None})
    bad = {**manifest, "provenance": {**GOOD_PROVENANCE, "host": 7}}
    with pytest.raises(ValidationError, match=r"invalid manifest record at \$\.provenance\.host"):
        validate("manifest", bad)
    bad = {**manifest, "tensors": [{**manifest["tensors"][0], "shape": [4, -1]}]}
    with pytest.raises(ValidationError, match=r"\$\.tensors\[0\]\.shape\[1\]"):
        validate("manifest", bad)


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown record kind 'nope'"):
        validate("nope", {})


def test_tensor_info_from_catalog_sets_every_field():
    import dataclasses

    from ucp_store.records import ArrayRef, TensorInfo

    values = dict(name="w", state="fp32", shape=(2, 3), dtype="float32", pattern={"kind": "replicated"},
                  chunk_shape=(2, 3), shard_shape=(2, 3), array="arrays/ab/cd", array_id="a" * 32,
                  codecs=[{"name": "bytes"}], nbytes=24, content_hash="xxh3-128:0", position=5, encoding="xor",
                  bases=(ArrayRef("arrays/ab/ef", "b" * 32, [{"name": "bytes"}], "plain"),))
    assert set(values) == {f.name for f in dataclasses.fields(TensorInfo)}  # a new field must be added here
    fast = TensorInfo.from_catalog(**values)
    assert fast == TensorInfo(**values) and vars(fast) == values
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.name = "x"
