"""Bulk row inserts (catalog/bulk.py: COPY on PostgreSQL, executemany on SQLite) store exactly what
SQLAlchemy's own insert stores, on both catalogs; what they cannot do goes through SQLAlchemy."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import insert, select, text
from sqlalchemy.orm import sessionmaker

from ucp_store.catalog import Array, Checkpoint, Run, Tensor, bulk, open_catalog, sqlite_url, utcnow

from ucp_test_helpers import postgres_schema_url

NAMES = ["plain.weight", "tab\there", "new\nline", "back\\slash", "cr\rx", "quote'\"", "ünï ✓", "\\N"]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def catalog(request, tmp_path):
    if request.param == "sqlite":
        c = open_catalog(sqlite_url(tmp_path / "catalog.db"), create=True)
        yield c
        c.close()
        return
    with postgres_schema_url() as pg:
        c = open_catalog(pg, create=True)
        yield c
        c.close()


def _rows(ck: str, prefix: str) -> tuple[list[dict], list[dict]]:
    when = dt.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    shape = [4, 2]
    arrays, tensors = [], []
    for i, name in enumerate(NAMES):
        aid = f"{prefix}{i:08x}"
        arrays.append({"id": aid, "path": f"arrays/{ck}/{aid}.zarr", "dtype": "float32", "shape": shape,
                       "chunk_shape": [2, 2], "shard_shape": shape,
                       "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                       "nbytes": 32 + i, "content_hash": None if i % 3 == 0 else f"h\t{i}", "created_at": when,
                       "status": "ready"})
        pattern = None if i % 2 else {"kind": "partitioned", "dim": 0, "note": name, "placement": {"layer": i}}
        tensors.append({"checkpoint_id": ck, "name": name, "state": "fp32", "array_id": aid, "shape": shape,
                        "dtype": "float32", "pattern": pattern, "nbytes": 32 + i, "content_hash": f"c{i}",
                        "position": i, "layer": None if i % 2 else i})
    return arrays, tensors


def _stored(catalog, ck: str) -> list[tuple]:
    with catalog.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(
            "SELECT t.name, t.state, CAST(t.shape AS TEXT), t.dtype, CAST(t.pattern AS TEXT), t.nbytes, "
            "t.content_hash, t.position, t.layer, a.dtype, CAST(a.shape AS TEXT), CAST(a.chunk_shape AS TEXT), "
            "CAST(a.shard_shape AS TEXT), CAST(a.codecs AS TEXT), a.nbytes, a.content_hash, a.created_at, a.status "
            "FROM tensors t JOIN arrays a ON t.array_id = a.id WHERE t.checkpoint_id = :ck ORDER BY t.position"),
            {"ck": ck})]


def _checkpoints(catalog) -> tuple[str, str]:
    with catalog.write_session() as s:
        run = Run(name="r")
        s.add(run)
        s.flush()
        a, b = Checkpoint(run_id=run.id, step=1, format_version=1), Checkpoint(run_id=run.id, step=2, format_version=1)
        s.add_all([a, b])
        s.flush()
        return a.id, b.id


def test_bulk_rows_equal_sqlalchemy_rows(catalog):
    ck_bulk, ck_plain = _checkpoints(catalog)
    arrays, tensors = _rows(ck_bulk, "b")
    with catalog.engine.connect() as conn:
        with conn.begin():  # the driver call itself applies on this dialect
            assert bulk.bulk_insert(conn, Array.__table__, arrays)
            assert bulk.bulk_insert(conn, Tensor.__table__, tensors)
    # the same rows through SQLAlchemy's own insert: a session factory without the hook
    plain = sessionmaker(bind=catalog.engine)
    arrays, tensors = _rows(ck_plain, "p")
    with plain() as s, s.begin():
        s.execute(insert(Array), arrays)
        s.execute(insert(Tensor), tensors)
    got, want = _stored(catalog, ck_bulk), _stored(catalog, ck_plain)
    assert len(got) == len(NAMES) and got == want
    assert [r[0] for r in got] == NAMES


def test_write_session_takes_the_bulk_path_and_rolls_back(catalog):
    ck, _ = _checkpoints(catalog)
    arrays, tensors = _rows(ck, "w")
    with pytest.raises(RuntimeError):
        with catalog.write_session() as s:
            s.execute(insert(Array), arrays)
            s.execute(insert(Tensor), tensors)
            assert len(_in_session(s, ck)) == len(NAMES)  # inserted inside this transaction
            raise RuntimeError("abort")
    assert _stored(catalog, ck) == []  # COPY / executemany ran inside the session's transaction
    with catalog.write_session() as s:
        s.execute(insert(Array), arrays)
        s.execute(insert(Tensor), tensors)
    assert [r[0] for r in _stored(catalog, ck)] == NAMES


def _in_session(s, ck: str) -> list:
    return list(s.scalars(select(Tensor.name).where(Tensor.checkpoint_id == ck)))


def test_what_bulk_cannot_do_goes_through_sqlalchemy(catalog):
    ck, _ = _checkpoints(catalog)
    arrays, _ = _rows(ck, "d")
    for a in arrays:
        a["status"] = None  # SQLAlchemy leaves it out and the column default ('pending') fills it
    uneven = [dict(arrays[0]), {k: v for k, v in arrays[1].items() if k != "content_hash"}]
    with catalog.engine.connect() as conn:
        assert not bulk.bulk_insert(conn, Array.__table__, arrays)
        assert not bulk.bulk_insert(conn, Array.__table__, uneven)
        assert not bulk.bulk_insert(conn, Array.__table__, [{**arrays[0], "bogus": 1}])
    with catalog.write_session() as s:
        s.execute(insert(Array), arrays)
    with catalog.session() as s:
        assert set(s.scalars(select(Array.status).where(Array.path.like(f"arrays/{ck}/%")))) == {"pending"}


def test_rows_beyond_one_copy_piece(catalog):
    """More COPY text than one piece handed to the server (1 MiB): every row arrives, in order."""
    ck, _ = _checkpoints(catalog)
    n = 3000
    arrays, tensors = [], []
    codecs = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c", "pad": "x" * 300}]
    for i in range(n):
        aid = f"m{i:031x}"
        arrays.append({"id": aid, "path": f"arrays/{ck}/{aid}.zarr", "dtype": "float32", "shape": [i + 1],
                       "chunk_shape": [1], "shard_shape": [i + 1], "codecs": codecs, "nbytes": 4 * (i + 1),
                       "content_hash": None, "created_at": utcnow(), "status": "ready"})
        tensors.append({"checkpoint_id": ck, "name": f"t{i}", "state": "fp32", "array_id": aid, "shape": [i + 1],
                        "dtype": "float32", "pattern": None, "nbytes": 4 * (i + 1), "content_hash": "c",
                        "position": i, "layer": None})
    with catalog.write_session() as s:
        s.execute(insert(Array), arrays)
        s.execute(insert(Tensor), tensors)
    got = _stored(catalog, ck)
    assert [r[0] for r in got] == [f"t{i}" for i in range(n)]
    assert [r[2].replace(" ", "") for r in got] == [f"[{i + 1}]" for i in range(n)]
