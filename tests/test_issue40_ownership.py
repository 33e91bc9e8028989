"""Issue 40, part A: a store never deletes what another store owns, the catalog is read-only where it says
so, and no secret is printed.

- store identity (item 1): a catalog and a location that are not one store's are refused by every command
  that writes or deletes, naming both; stores without ids are adopted only when plausibly one store;
- ``ucp query`` on PostgreSQL: one statement, in a READ ONLY transaction the text cannot leave, no function
  that reaches outside the catalog, even for a superuser (item 2); a time bound on both catalogs (item 11);
- gc deletes only what it can tie to its catalog: a store inside another store's ``arrays/`` survives (3);
- credentials masked in every message (4, 5); ``%`` and ``_`` in a reference are no wildcards (6);
- a version removed after it was opened says so on verify and read (7); a locked SQLite catalog says what a
  write waits for (12); step spellings in ASCII digits only; a non-numeric port is a clear error.

Data-loss and secret items run on both catalogs (SQLite, and PostgreSQL where ``UCP_TEST_POSTGRES_URL`` is
set).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from pathlib import Path

import pytest
import torch
from test_backends import BUCKET, s3, s3_server  # noqa: F401 (fixtures)

import ucp_store
from ucp_store.catalog.models import new_id
from ucp_store.errors import CatalogError, QueryError, ReferenceNotFound
from ucp_store.registry.identity import IDENTITY_FILE, SETTING_KEY, MismatchedStoreError

from ucp_test_helpers import postgres_schema_url

CATALOGS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def _catalog_for(kind: str, folder: Path, stack) -> str:
    if kind == "sqlite":
        return f"sqlite:///{folder}/catalog.db"
    return stack.enter_context(postgres_schema_url())


@pytest.fixture
def two_stores(request, tmp_path):
    """Stores A and B, each with one version (a@1, b@1), their catalogs on the parametrised database."""
    import contextlib

    kind = request.param
    with contextlib.ExitStack() as stack:
        out = {}
        for name in ("A", "B"):
            folder = tmp_path / name
            url = _catalog_for(kind, folder, stack)
            store = ucp_store.open_store(str(folder), create=True, catalog=url)
            store.save(name.lower(), 1, {"w": torch.arange(6.0)})
            store.catalog.close()
            out[name] = (folder, url)
        out["kind"] = kind
        yield out


def _tree(folder: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = "link"
        elif p.is_file() and "catalog.db" not in p.name:
            out[rel] = p.read_bytes()
        elif p.is_dir():
            out[rel] = "dir"
    return out


def _verify_ok(folder: Path, url: str, ref: str) -> None:
    store = ucp_store.open_store(str(folder), catalog=url)
    try:
        assert store.checkpoint(ref).verify() == []
    finally:
        store.catalog.close()


# --- item 1: store identity --------------------------------------------------------------------------------------


@pytest.mark.parametrize("two_stores", CATALOGS, indirect=True)
@pytest.mark.parametrize("how", ["env", "flag"])
@pytest.mark.parametrize("argv", [["gc"], ["gc", "--dry-run"], ["rm", "a@1"], ["tag", "a@1", "t"],
                                  ["retention", "a", "--keep-last", "1"]])
def test_a_command_that_writes_refuses_another_stores_catalog(two_stores, ucp, monkeypatch, how, argv):
    """The issue's repro: ``UCP_CATALOG=<A's catalog> ucp --store B gc`` emptied B. Now every writing
    command refuses, naming both sides (credentials masked), and B is byte-identical afterwards."""
    (a_dir, a_url), (b_dir, b_url) = two_stores["A"], two_stores["B"]
    before = _tree(b_dir)
    if how == "env":
        monkeypatch.setenv("UCP_CATALOG", a_url)
        rc, out, err = ucp("--store", b_dir, *argv)
    else:
        rc, out, err = ucp("--store", b_dir, "--catalog", a_url, *argv)
    assert rc == 1, (out, err)
    assert err.startswith("ucp: error: catalog ") and "are not one store" in err and str(b_dir) in err
    assert len(err.strip().splitlines()) == 1
    if two_stores["kind"] == "postgres":
        assert "ucp:***@" in err and ":ucp@" not in err  # the test role's password, masked
    assert _tree(b_dir) == before
    _verify_ok(b_dir, b_url, "b@1")
    _verify_ok(a_dir, a_url, "a@1")


@pytest.mark.parametrize("two_stores", CATALOGS, indirect=True)
def test_the_api_refuses_a_save_and_a_gc_through_a_mismatched_pair(two_stores):
    (a_dir, a_url), (b_dir, _) = two_stores["A"], two_stores["B"]
    before = _tree(b_dir)
    store = ucp_store.open_store(str(b_dir), catalog=a_url)  # opening to read is allowed
    try:
        assert [c["run"] for c in store.list_checkpoints()] == ["a"]
        with pytest.raises(MismatchedStoreError, match="are not one store"):
            store.gc()
        with pytest.raises(MismatchedStoreError):
            store.save("x", 1, {"w": torch.ones(2)})
        with pytest.raises(MismatchedStoreError):
            store.rm("a@1")
    finally:
        store.catalog.close()
    assert _tree(b_dir) == before
    _verify_ok(a_dir, a_url, "a@1")


@pytest.mark.parametrize("two_stores", CATALOGS, indirect=True)
def test_init_refuses_a_new_catalog_for_an_existing_location(two_stores, ucp, tmp_path):
    b_dir = two_stores["B"][0]
    before = _tree(b_dir)
    rc, _, err = ucp("--store", b_dir, "--catalog", f"sqlite:///{tmp_path}/fresh.db", "init")
    assert rc == 1 and "are not one store" in err and "refusing to create a second catalog" in err
    assert _tree(b_dir) == before
    assert not (tmp_path / "fresh.db").exists()  # the refusal leaves no empty catalog behind


@pytest.mark.parametrize("two_stores", CATALOGS, indirect=True)
def test_a_catalog_with_arrays_refuses_a_location_without_any_of_them(two_stores, ucp, tmp_path):
    """A's catalog in front of an empty folder, or of A's own arrays/ folder taken for a store: no identity
    file is written there and nothing is deleted; the catalog's versions still verify."""
    a_dir, a_url = two_stores["A"]
    for where in (tmp_path / "empty", a_dir / "arrays"):
        where.mkdir(exist_ok=True)
        before = _tree(a_dir)
        rc, _, err = ucp("--store", where, "--catalog", a_url, "gc")
        assert rc == 1 and "the catalog names arrays, and the location has no version folder" in err, err
        assert not (where / IDENTITY_FILE).exists() and _tree(a_dir) == before
    _verify_ok(a_dir, a_url, "a@1")


def _forget_ids(folder: Path, url: str) -> None:
    """Make a store as one made before store ids existed: no identity file, no settings row."""
    (folder / IDENTITY_FILE).unlink()
    store = ucp_store.open_store(str(folder), catalog=url)
    try:
        from sqlalchemy import delete

        from ucp_store.catalog import models as m

        with store.catalog.write_session() as s:
            s.execute(delete(m.Setting).where(m.Setting.key == SETTING_KEY))
    finally:
        store.catalog.close()


@pytest.mark.parametrize("two_stores", CATALOGS, indirect=True)
def test_stores_made_before_ids_are_adopted_by_a_write_and_never_by_a_read(two_stores, ucp):
    a_dir, a_url = two_stores["A"]
    _forget_ids(a_dir, a_url)
    rc, _, err = ucp("--store", a_dir, "--catalog", a_url, "ls", "a")
    assert rc == 0, err
    assert not (a_dir / IDENTITY_FILE).exists()  # a read writes nothing
    rc, _, err = ucp("--store", a_dir, "--catalog", a_url, "tag", "a@1", "best")
    assert rc == 0, err
    sid = json.loads((a_dir / IDENTITY_FILE).read_text())["store_id"]
    rc, out, err = ucp("--store", a_dir, "--catalog", a_url, "query", f"SELECT value FROM settings WHERE key = "
                       f"'{SETTING_KEY}'", "--json")
    assert rc == 0 and sid in out, (out, err)


@pytest.mark.parametrize("two_stores", CATALOGS, indirect=True)
@pytest.mark.parametrize("which", ["both", "location", "catalog"])
def test_a_store_without_ids_is_never_adopted_by_another_stores_catalog(two_stores, ucp, which):
    """Neither side, or one side, without an id: the pair is adopted only when plausibly one store. B's version
    folders are no versions of A's catalog (and a folder B holds its own catalog.db): refused, B intact."""
    (a_dir, a_url), (b_dir, b_url) = two_stores["A"], two_stores["B"]
    if which in ("both", "catalog"):
        _forget_ids(a_dir, a_url)
        (a_dir / IDENTITY_FILE).write_text(json.dumps({"store_id": "x" * 32}))  # A's location keeps one
    if which in ("both", "location"):
        _forget_ids(b_dir, b_url)
    before = _tree(b_dir)
    for argv in (["gc"], ["gc", "--dry-run"], ["rm", "a@1"]):
        rc, _, err = ucp("--store", b_dir, "--catalog", a_url, *argv)
        assert rc == 1 and "are not one store" in err, (argv, err)
    assert _tree(b_dir) == before
    _verify_ok(b_dir, b_url, "b@1")


def test_a_location_with_an_unreadable_identity_file_is_refused(tmp_path, ucp):
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    store.save("r", 1, {"w": torch.ones(3)})
    (tmp_path / "s" / IDENTITY_FILE).write_text("not json")
    rc, _, err = ucp("--store", tmp_path / "s", "gc")
    assert rc == 1 and "is not a ucp store identity file" in err
    assert store.checkpoint("r@1").verify() == []


@pytest.mark.parametrize("catalog", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_an_s3_location_records_its_id_and_refuses_another_catalog(s3, s3_server, catalog, tmp_path):  # noqa: F811
    import contextlib

    with contextlib.ExitStack() as stack:
        urls = [_catalog_for(catalog, tmp_path / f"c{i}", stack) for i in range(2)]
        if catalog == "sqlite":
            for i in range(2):
                (tmp_path / f"c{i}").mkdir()
        prefix = f"stores/{new_id(8)}"
        url = f"s3://{BUCKET}/{prefix}?endpoint={s3_server}&region=us-east-1"
        store = ucp_store.open_store(url, create=True, catalog=urls[0])
        store.save("r", 1, {"w": torch.ones(4)})
        body = s3.get_object(Bucket=BUCKET, Key=f"{prefix}/{IDENTITY_FILE}")["Body"].read()
        assert json.loads(body)["store_id"] == store.settings[SETTING_KEY]
        store.catalog.close()
        with pytest.raises(MismatchedStoreError):
            ucp_store.open_store(url, create=True, catalog=urls[1])
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]}
        assert any(k.endswith("zarr.json") for k in keys)
        again = ucp_store.open_store(url, catalog=urls[0])
        assert again.gc().removed_arrays == 0 and again.checkpoint("r@1").verify() == []
        again.catalog.close()


# --- item 3: gc deletes only what it can tie to its catalog ---------------------------------------------------------


@pytest.mark.parametrize("catalog", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_store_inside_another_stores_arrays_survives_the_outer_gc(tmp_path, catalog, ucp):
    import contextlib

    with contextlib.ExitStack() as stack:
        outer_url = _catalog_for(catalog, tmp_path / "outer", stack)
        outer = ucp_store.open_store(str(tmp_path / "outer"), create=True, catalog=outer_url)
        outer.save("o", 1, {"w": torch.ones(5)})
        inner_dirs = [tmp_path / "outer" / "arrays" / "inner",
                      tmp_path / "outer" / "arrays" / "0123456789abcdef"]  # a name like a version folder's
        for d in inner_dirs:
            inner = ucp_store.open_store(str(d), create=True)
            inner.save("i", 1, {"w": torch.arange(7.0)})
            inner.catalog.close()
        foreign = tmp_path / "outer" / "arrays" / "notes.txt"
        foreign.write_text("mine")
        befores = [_tree(d) for d in inner_dirs]
        rc, out, err = ucp("--store", tmp_path / "outer", "--catalog", outer_url, "gc", "--json")
        assert rc == 0, err
        report = json.loads(out)
        assert report["removed_arrays"] == 0
        assert sorted(report["left"]) == ["arrays/0123456789abcdef", "arrays/inner", "arrays/notes.txt"]
        assert "that this catalog does not own (not deleted)" in err
        assert [_tree(d) for d in inner_dirs] == befores and foreign.read_text() == "mine"
        for d in inner_dirs:
            _verify_ok(d, f"sqlite:///{d}/catalog.db", "i@1")
        assert outer.checkpoint("o@1").verify() == []
        outer.catalog.close()


def test_gc_still_reclaims_its_own_removed_versions_folders(tmp_path):
    """What gc can tie to its catalog still goes: an array folder of a version folder no row owns any more
    (a crash between the rows' deletion and the files'), while a foreign file beside it stays."""
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    keep = store.save("r", 1, {"w": torch.ones(5)}).id
    dead = tmp_path / "s" / "arrays" / "deadbeefdeadbeef"
    arr = dead / ("ab" * 16 + ".zarr")
    (arr / "c").mkdir(parents=True)
    (arr / "zarr.json").write_text("{}")
    (arr / "c" / "0").write_bytes(b"x" * 100)
    (dead / "README").write_text("foreign")
    report = store.gc()
    assert report.removed_arrays == 1 and report.freed_bytes == 102
    assert report.left == ["arrays/deadbeefdeadbeef/README"]
    assert not arr.exists() and (dead / "README").exists()
    assert sorted(os.listdir(tmp_path / "s" / "arrays")) == sorted([keep, "deadbeefdeadbeef"])


# --- item 2 and 11: ucp query is read-only and bounded ---------------------------------------------------------------

ESCAPES = [
    "END; UPDATE checkpoints SET status='pending'",
    "COMMIT; DELETE FROM tags",
    "ROLLBACK; DELETE FROM tensors",
    "SELECT 1; DELETE FROM tags",
    "SELECT 1;DELETE FROM tags;",
    "SELECT ';'; DELETE FROM tags",
    "/* x */ COMMIT",
    "END",
    "SET TRANSACTION READ WRITE",
    "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE",
    "RESET ALL",
    "BEGIN",
    "DELETE FROM tags",
    "UPDATE checkpoints SET status = 'pending'",
    "WITH x AS (DELETE FROM tags RETURNING *) SELECT count(*) FROM x",
    "WITH x AS (UPDATE checkpoints SET status = 'pending' RETURNING 1) SELECT count(*) FROM x",
    "SELECT * FROM checkpoints FOR UPDATE",
    "SELECT * INTO stolen FROM tags",
    "EXPLAIN ANALYZE DELETE FROM tags",
    "SELECT lo_import('/etc/hostname')",
    "SELECT LO_IMPORT('/etc/hostname')",
    "SELECT pg_catalog.lo_import('/etc/hostname')",
    'SELECT "lo_import"(\'/etc/hostname\')',
    'SELECT U&"lo\\005Fimport"(\'/etc/hostname\')',
    "SELECT lo_export(1, '/tmp/ucp-leak')",
    "SELECT pg_read_file('/etc/hostname')",
    "SELECT pg_read_binary_file('/etc/hostname')",
    "SELECT * FROM pg_ls_dir('.')",
    "SELECT pg_stat_file('/etc/hostname')",
    "SELECT set_config('default_transaction_read_only', 'off', false)",
    "SELECT query_to_xml('DELETE FROM tags RETURNING 1', true, true, '')",
    "SELECT * FROM dblink('dbname=ucp_test', 'DELETE FROM tags')",
    "SELECT pg_advisory_lock(1)",
    "SELECT pg_terminate_backend(pg_backend_pid())",
    "SELECT pg_reload_conf()",
    "SELECT rolname, rolpassword FROM pg_authid",
    "SELECT passwd FROM pg_shadow",
    "SELECT umoptions FROM pg_user_mappings",
    "SELECT query FROM pg_stat_activity",
    "SELECT subconninfo FROM pg_catalog.pg_subscription",
    "SELECT nextval('runs_id_seq')",
    "COPY tags TO PROGRAM 'touch /tmp/ucp-pwned'",
    "COPY (SELECT 1) TO '/tmp/ucp-pwned'",
    "DO $$ BEGIN DELETE FROM tags; END $$",
    "CALL nothing()",
    "PREPARE p AS DELETE FROM tags",
    "VACUUM",
    "LOCK TABLE tags",
    "NOTIFY x",
    "",
    "   ",
]


@pytest.fixture(params=CATALOGS)
def tagged_store(request, tmp_path):
    import contextlib

    with contextlib.ExitStack() as stack:
        url = _catalog_for(request.param, tmp_path / "s", stack)
        store = ucp_store.open_store(str(tmp_path / "s"), create=True, catalog=url)
        store.save("r", 1, {"w": torch.ones(3)})
        store.save("r", 2, {"w": torch.zeros(3)})
        store.tag("r@1", "best")
        store.kind, store.url = request.param, url  # type: ignore[attr-defined]
        yield store
        store.catalog.close()


def _catalog_rows(store) -> list:
    return [store.list_checkpoints(include_pending=True),
            store.query("SELECT count(*) FROM tags")[1], store.query("SELECT count(*) FROM tensors")[1],
            store.query("SELECT key FROM settings ORDER BY key")[1]]


@pytest.mark.parametrize("sql", ESCAPES)
def test_query_cannot_write_or_leave_its_read_only_transaction(tagged_store, sql, ucp, tmp_path):
    before = _catalog_rows(tagged_store)
    rc, out, err = ucp("--store", tmp_path / "s", "--catalog", tagged_store.url, "query", sql)
    assert rc == 1, (sql, out, err)
    assert err.startswith("ucp: error: query") and len(err.strip().splitlines()) == 1, err
    assert _catalog_rows(tagged_store) == before
    assert not os.path.exists("/tmp/ucp-pwned")
    rc, out, err = ucp("--store", tmp_path / "s", "--catalog", tagged_store.url, "gc", "--json")
    assert rc == 0 and json.loads(out)["removed_checkpoints"] == [], err
    assert tagged_store.checkpoint("r@1").verify() == []


@pytest.mark.parametrize("sql", ["SELECT count(*) FROM tags;", "select run_id, name from tags",
                                 "WITH t AS (SELECT * FROM tags) SELECT count(*) FROM t", "VALUES (1)",
                                 "  -- a comment\n  SELECT 1", "(SELECT 1)", "EXPLAIN SELECT * FROM tags"])
def test_reads_still_run(tagged_store, sql):
    if sql.startswith("(") and tagged_store.kind == "sqlite":
        pytest.skip("SQLite has no parenthesised statement")
    cols, rows = tagged_store.query(sql)
    assert cols and rows


def test_reads_of_the_superuser_only_functions_are_refused_by_name_on_postgres(tagged_store):
    if tagged_store.kind != "postgres":
        pytest.skip("PostgreSQL only")
    with pytest.raises(QueryError, match="pg_read_file reaches outside the catalog"):
        tagged_store.query("SELECT pg_read_file('/etc/hostname')")
    with pytest.raises(QueryError, match="exactly one statement"):
        tagged_store.query("SELECT 1; SELECT 2")


RECURSIVE = "WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c) SELECT count(*) FROM c"


def test_query_stops_at_its_time_bound(tagged_store, ucp, tmp_path):
    rc, out, err = ucp("--store", tmp_path / "s", "--catalog", tagged_store.url, "query", RECURSIVE, "--timeout", "1")
    assert rc == 1 and "query stopped after its time bound of 1 s" in err, (out, err)
    with pytest.raises(QueryError, match="time bound of 0.5 s"):
        tagged_store.query(RECURSIVE, timeout=0.5)
    assert tagged_store.query("SELECT 1", timeout=5)[1] == [(1,)]


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "1e9"])
def test_query_timeout_values_are_checked(tagged_store, ucp, tmp_path, bad):
    rc, _, err = ucp("--store", tmp_path / "s", "--catalog", tagged_store.url, "query", "SELECT 1", "--timeout", bad)
    assert rc == 1 and "query timeout" in err and "expected a number of seconds" in err


def test_the_default_query_timeout_is_bounded():
    from ucp_store.catalog.query import DEFAULT_QUERY_TIMEOUT_S

    assert 0 < DEFAULT_QUERY_TIMEOUT_S <= 600


# --- items 4 and 5: no secret is printed --------------------------------------------------------------------------

SECRET = "hunter2"
SECRET_URLS = [
    f"postgresql+psycopg2://127.0.0.1:1/ucp?password={SECRET}&user=x",
    f"postgresql+psycopg2://x:{SECRET}@127.0.0.1:1/ucp",
    f"postgresql+psycopg2://x@127.0.0.1:1/ucp?sslpassword={SECRET}&connect_timeout=2",
    f"postgresql+psycopg2://x:{SECRET}@127.0.0.1:notaport/ucp",
    f"x:{SECRET}@localhost/ucp",
    f"localhost/ucp?password={SECRET}",
    "sqlite:///{tmp}/a-file/catalog.db?password=" + SECRET,  # under a file: it can never be created
    f"mysql://x:{SECRET}@127.0.0.1:1/ucp",
]


@pytest.mark.parametrize("url", SECRET_URLS)
@pytest.mark.parametrize("argv", [["ls"], ["init"], ["query", "SELECT 1"], ["gc"], ["gc", "--json"], ["db", "revision"],
                                  ["tag", "r@1", "t"]])
def test_no_secret_in_any_error(url, argv, ucp, tmp_path):
    (tmp_path / "a-file").write_text("")
    rc, out, err = ucp("--store", tmp_path / "s", "--catalog", url.format(tmp=tmp_path), *argv)
    assert rc == 1, (out, err)
    assert SECRET not in out + err, err
    assert any(w in err for w in ("127.0.0.1", "localhost", "a-file")), err  # still names the catalog
    assert "please report it" not in err and "Traceback" not in err
    assert not (tmp_path / "s").exists()  # a failed init leaves no folder


@pytest.mark.parametrize("url", [f"s3://b/p?endpoint=http://127.0.0.1:1&catalog=postgresql://x:{SECRET}@h:1/d",
                                 f"s3:///p?catalog=postgresql://x:{SECRET}@h:1/d",
                                 f"file://host/p?token={SECRET}", f"ftp://u:{SECRET}@h/p"])
def test_no_secret_in_a_store_url_error(url, ucp):
    rc, out, err = ucp("--store", url, "ls")
    assert rc == 1 and SECRET not in out + err, err


def test_no_secret_in_log_lines(caplog, tmp_path):
    from ucp_store.catalog.db import display_url

    assert SECRET not in display_url(f"postgresql://u:{SECRET}@h/d?password={SECRET}&sslkey=/k&token={SECRET}")
    with caplog.at_level(logging.DEBUG, logger="ucp_store"):
        with pytest.raises(CatalogError):
            ucp_store.open_store(str(tmp_path / "s"), catalog=f"postgresql+psycopg2://u:{SECRET}@127.0.0.1:1/d"
                                 f"?password={SECRET}&connect_timeout=2")
    assert SECRET not in caplog.text


def test_redact_masks_every_form_and_keeps_the_rest():
    from ucp_store.redact import redact

    assert redact("postgresql://u:pw@h:5/d?password=x&user=y&token=z") == \
        "postgresql://u:***@h:5/d?password=***&user=y&token=***"
    assert redact("host=h password='a b' dbname=d") == "host=h password=*** dbname=d"
    assert redact("reference 'r@1' at 12:30 keep_last=3") == "reference 'r@1' at 12:30 keep_last=3"
    assert redact("s3://b/p?endpoint=http://h:9000") == "s3://b/p?endpoint=http://h:9000"


# --- item 6: no wildcards in a reference -------------------------------------------------------------------------

@pytest.fixture
def one_version(tmp_path):
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    store.save("b", 1, {"w": torch.ones(3)})
    return store


@pytest.mark.parametrize("ref", ["%", "b_", "_" * 16, "%%", "_%", "\\%", "[0-9a-f]%"])
def test_percent_and_underscore_are_no_wildcards(one_version, ucp, tmp_path, ref):
    for argv in (["show", ref], ["rm", ref], ["verify", ref], ["log", ref]):
        rc, _, err = ucp("--store", tmp_path / "s", *argv)
        assert rc == 1 and "matches no committed checkpoint" in err, (argv, err)
    assert [c["step"] for c in one_version.list_checkpoints("b")] == [1]
    with pytest.raises(ReferenceNotFound):
        one_version.resolve(ref)


def test_an_ambiguous_id_prefix_is_refused_with_its_candidates(tmp_path):
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    ids = [store.save("r", step, {"w": torch.full((2,), float(step))}).id for step in range(17)]
    first = next(c for c in "0123456789abcdef" if sum(i.startswith(c) for i in ids) >= 2)  # 17 ids, 16 digits
    both = sorted(i for i in ids if i.startswith(first))
    with pytest.raises(ReferenceNotFound, match="ambiguous id prefix") as exc:
        store.resolve(first)
    assert all(i in str(exc.value) for i in both[:5])
    assert store.resolve(ids[3]) == ids[3] and store.resolve(ids[3][:15]) == ids[3]


# --- item 7: a version removed after it was opened ---------------------------------------------------------------

@pytest.mark.parametrize("catalog", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
@pytest.mark.parametrize("loaded", [False, True])
def test_verify_and_read_of_a_removed_version_say_it_was_removed(tmp_path, catalog, loaded):
    import contextlib

    with contextlib.ExitStack() as stack:
        url = _catalog_for(catalog, tmp_path / "s", stack)
        store = ucp_store.open_store(str(tmp_path / "s"), create=True, catalog=url)
        store.save("r", 1, {"w": torch.ones(300)})
        store.save("r", 2, {"w": torch.zeros(300)})
        ck = store.checkpoint("r@1")
        if loaded:
            ck.tensors()  # rows already read: the files' absence must not read as corruption
        store.rm("r@1")
        with pytest.raises(ReferenceNotFound, match=r"r@1 \(.*\) was removed after it was opened"):
            ck.verify()
        with pytest.raises(ReferenceNotFound, match="was removed after it was opened"):
            ck.read("w")
        assert store.checkpoint("r@2").verify() == []
        store.catalog.close()


# --- item 12: a locked SQLite catalog says what it waits for -------------------------------------------------------

def test_a_write_waiting_for_the_sqlite_lock_says_so_and_gives_up(tmp_path, caplog, monkeypatch):
    from ucp_store.catalog import db

    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    store.save("r", 1, {"w": torch.ones(3)})
    store.catalog.close()
    monkeypatch.setattr(db, "LOCK_NOTICE_S", 0.2)
    holder = sqlite3.connect(tmp_path / "s" / "catalog.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        catalog = db.open_catalog(f"sqlite:///{tmp_path}/s/catalog.db", create=False, busy_timeout_ms=400)
        catalog.write_attempts = 2
        with caplog.at_level(logging.WARNING, logger="ucp_store.catalog"):
            with pytest.raises(CatalogError, match=r"could not start a write transaction after 2 attempts and \d+ s "
                                                   r"\(another process held its write lock"):
                with catalog.write_session():
                    pass
        assert "waiting for the write lock of catalog sqlite:///" in caplog.text
        assert "held by another process" in caplog.text
        catalog.close()
    finally:
        holder.rollback()
        holder.close()


def test_ucp_tag_on_a_locked_catalog_says_what_it_waits_for(tmp_path):
    """The CLI line, in a real process: the notice on stderr after a few seconds while the lock is held."""
    import subprocess
    import sys
    import time

    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    store.save("r", 1, {"w": torch.ones(3)})
    store.catalog.close()
    holder = sqlite3.connect(tmp_path / "s" / "catalog.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    proc = subprocess.Popen([sys.executable, "-m", "ucp_store.cli", "--store", str(tmp_path / "s"), "tag", "r@1",
                             "best"], stderr=subprocess.PIPE, text=True, env={**os.environ, "UCP_PROGRESS": "0"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any("waiting for the write lock" in ln for ln in lines):
        time.sleep(0.2)
    holder.rollback()
    holder.close()
    assert proc.wait(timeout=300) == 0
    reader.join(timeout=10)
    assert any(f"waiting for the write lock of catalog sqlite:///{tmp_path}/s/catalog.db" in ln for ln in lines), lines


# --- smaller ones ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("step", ["1_0", "\u0661", "\uff11", "+1", "01", " 1", "1 ", "0x1", "1.0", "-0", "00"])
def test_a_step_is_written_in_ascii_digits_only(one_version, step, ucp, tmp_path):
    with pytest.raises(ReferenceNotFound, match="ASCII digits"):
        one_version.resolve(f"b@{step}")
    rc, _, err = ucp("--store", tmp_path / "s", "rm", f"b@{step}")
    assert rc == 1 and "ASCII digits" in err
    assert one_version.resolve("b@1") and one_version.resolve("b@latest")


@pytest.mark.parametrize("url", ["postgresql+psycopg2://u:p@h:abc/db", "postgresql+psycopg2://u:p@h:99999/db",
                                 "postgresql+psycopg2://u:p@h:-1/db"])
def test_a_port_that_is_no_number_is_a_clear_catalog_error(url, ucp, tmp_path):
    rc, _, err = ucp("--store", tmp_path / "s", "--catalog", url, "ls")
    assert rc == 1 and "port" in err and "please report" not in err and "u:***@" in err, err
    with pytest.raises(CatalogError, match="port"):
        ucp_store.open_store(str(tmp_path / "s"), catalog=url)


# --- found in the attacker pass ------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", [IDENTITY_FILE, "catalog.db", "arrays", "arrays/x"])
def test_gc_never_deletes_what_a_hand_edited_row_names_outside_an_array_folder(tmp_path, target):
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    store.save("r", 1, {"w": torch.ones(4)})
    store.save("r", 2, {"w": torch.zeros(4)})
    con = sqlite3.connect(tmp_path / "s" / "catalog.db")
    with con:
        con.execute("UPDATE arrays SET path = ? WHERE id = (SELECT array_id FROM tensors t JOIN checkpoints c "
                    "ON c.id = t.checkpoint_id WHERE c.step = 1)", (target,))
    con.close()
    store.rm("r@1")
    assert (tmp_path / "s" / IDENTITY_FILE).is_file() and (tmp_path / "s" / "catalog.db").is_file()
    report = store.gc()
    assert store.checkpoint("r@2").verify() == [] and (tmp_path / "s" / IDENTITY_FILE).is_file()
    assert report.removed_arrays >= 0


@pytest.mark.parametrize("url", [f"s3://AKIA:{SECRET}@bucket/p?catalog=sqlite:////tmp/x.db",
                                 f"s3://bucket:{SECRET}@h/p?catalog=sqlite:////tmp/x.db"])
def test_an_s3_url_with_credentials_in_the_bucket_is_refused_unprinted(url, ucp):
    rc, out, err = ucp("--store", url, "ls")
    assert rc == 1 and "the bucket name holds credentials" in err and SECRET not in out + err, err


@pytest.mark.parametrize("inside", ["dead", "row"])
def test_a_store_made_deep_inside_an_array_folder_survives_gc(tmp_path, inside):
    """A store made inside the chunk folder of an array gc would delete (a dead version's folder, or the
    array of a version just removed): the array's files are left, reported, and the inner store verifies."""
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    cid = store.save("r", 1, {"w": torch.ones(4)}).id
    store.save("r", 2, {"w": torch.zeros(4)})
    if inside == "dead":
        arr = tmp_path / "s" / "arrays" / "deadbeefdeadbeef" / ("ab" * 16 + ".zarr")
        (arr / "c").mkdir(parents=True)
        (arr / "zarr.json").write_text("{}")
    else:
        arr = next((tmp_path / "s" / "arrays" / cid).glob("*.zarr"))
    inner = ucp_store.open_store(str(arr / "c" / "inner"), create=True)
    inner.save("i", 1, {"w": torch.arange(3.0)})
    inner.catalog.close()
    if inside == "row":
        store.rm("r@1")  # its array (holding the inner store) is the one a sweep would delete
    report = store.gc()
    again = ucp_store.open_store(str(arr / "c" / "inner"))
    assert again.checkpoint("i@1").verify() == []
    again.catalog.close()
    if inside == "dead":
        assert any(str(arr.relative_to(tmp_path / "s")).startswith(x) for x in report.left), report.left
    assert store.checkpoint("r@2").verify() == []
