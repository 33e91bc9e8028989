"""The store's boundary (issue 30 items 2, 3, 4 and smaller ones): no walk of the store leaves it (links under
``arrays/``), retention values are checked, a plain path is a path (``p%20q``, ``x?y``), gc reports the bytes it
really freed, ``init`` never changes an existing store's settings, a FIFO in the store never blocks a command,
and ``ucp query`` refuses dangerous SQLite functions by name."""

from __future__ import annotations

import datetime as dt
import json
import os
import sqlite3
import stat
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from sqlalchemy import event, update

import ucp_store
from ucp_store.catalog import models as m
from ucp_store.catalog.query import DENIED_FUNCTIONS, _sqlite_read_authorizer
from ucp_store.errors import CatalogError, ConfigurationError, InvalidNameError, QueryError
from ucp_store.registry.retention import RetentionPolicy

from ucp_test_helpers import run_python, tree_digest


def _outside(tmp_path: Path) -> Path:
    """A folder outside the store with a file and a sub-folder: what no walk may touch."""
    out = tmp_path / "elsewhere"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "keep.bin").write_bytes(b"k" * 100)
    (out / "file.bin").write_bytes(b"f" * 10)
    return out


def _folder_bytes(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


# --- item 2: links under arrays/ ---------------------------------------------------------------------------


def _plant_links(store_path: Path, out: Path) -> dict[str, Path]:
    """A linked checkpoint folder, and a dead checkpoint folder holding a linked array folder, a linked file
    and a real stray file."""
    arrays = store_path / "arrays"
    dead = arrays / "deadbeefdeadbeef"
    dead.mkdir()
    links = {"ck": arrays / "feedfacefeedface", "dir": dead / "0123456789abcdef0123456789abcdef.zarr",
             "file": dead / "stray-link"}
    links["ck"].symlink_to(out, target_is_directory=True)
    links["dir"].symlink_to(out, target_is_directory=True)
    links["file"].symlink_to(out / "file.bin")
    (dead / "stray.bin").write_bytes(b"s" * 7)
    return links


@pytest.mark.parametrize("how", ["gc", "rm", "cli-gc", "cli-rm"])
def test_sweeps_never_follow_links_out_of_the_store(store, store_path, tmp_path, ucp, how):
    """gc and rm (both sweep arrays/) delete nothing outside the store; a link under arrays/ is not the store's
    data: it is never followed, and (issue 40: gc deletes only what it can tie to its catalog) it is reported
    and left, with the stray file beside it."""
    out = _outside(tmp_path)
    before = tree_digest(out)
    store.save("r", 1, {"a": torch.ones(8)})
    store.save("r", 2, {"a": torch.zeros(8)})
    links = _plant_links(store_path, out)
    if how == "gc":
        report = store.gc()
        assert report.removed_arrays == 0 and report.freed_bytes == 0
        # a folder holding nothing of ours is reported as one entry
        assert sorted(report.left) == ["arrays/deadbeefdeadbeef", "arrays/feedfacefeedface"]
    elif how == "rm":
        store.rm("r@1")
    else:
        rc, _, err = ucp(*(["gc"] if how == "cli-gc" else ["rm", "r@1"]), "--store", store_path)
        assert rc == 0, err
    assert tree_digest(out) == before
    assert all(os.path.islink(p) for p in links.values())
    assert (store_path / "arrays" / "deadbeefdeadbeef" / "stray.bin").read_bytes() == b"s" * 7
    assert torch.equal(store.checkpoint("r@2").read("a", "weight"), torch.zeros(8))


def test_verify_ls_and_dry_run_leave_links_and_the_outside_alone(store, store_path, tmp_path, ucp):
    out = _outside(tmp_path)
    before = tree_digest(out)
    cid = store.save("r", 1, {"a": torch.ones(8)}).id
    links = _plant_links(store_path, out)
    (store_path / "arrays" / cid / "live-link").symlink_to(out, target_is_directory=True)
    for argv in (["verify", "r@1"], ["ls", "r"], ["gc", "--dry-run"]):
        rc, _, err = ucp(*argv, "--store", store_path)
        assert rc == 0, (argv, err)
    report = store.gc(dry_run=True)
    assert report.freed_bytes == 0 and len(report.left) == 2  # foreign entries: reported, never deleted
    assert tree_digest(out) == before
    assert all(os.path.islink(p) for p in links.values())


def test_linked_arrays_folder_is_refused_before_any_row_changes(store, store_path, tmp_path, ucp):
    """arrays/ itself a link to elsewhere: gc and rm refuse with an error naming it, before a row is removed."""
    store.save("r", 1, {"a": torch.ones(8)})
    store.save("r", 2, {"a": torch.zeros(8)})
    moved = tmp_path / "moved-arrays"
    (store_path / "arrays").rename(moved)
    (store_path / "arrays").symlink_to(moved, target_is_directory=True)
    (moved / "deadbeefdeadbeef").mkdir()
    (moved / "deadbeefdeadbeef" / "x.bin").write_bytes(b"x")
    before = tree_digest(moved)
    with pytest.raises(InvalidNameError, match=r"arrays: it is a symbolic link"):
        store.gc(keep_last=1)
    with pytest.raises(InvalidNameError, match=r"arrays: it is a symbolic link"):
        store.rm("r@1")
    rc, _, err = ucp("gc", "--store", store_path, "--keep-last", "1")
    assert rc == 1 and err.startswith("ucp: error: refusing to delete under") and "Traceback" not in err
    assert [c["step"] for c in store.list_checkpoints("r")] == [1, 2]
    assert tree_digest(moved) == before


def test_location_deletes_a_link_and_never_its_target(tmp_path):
    from ucp_store.io.location import Location

    out = _outside(tmp_path)
    loc = Location.parse(str(tmp_path / "root"))
    loc.ensure_root()
    (tmp_path / "root" / "arrays" / "l").symlink_to(out, target_is_directory=True)
    assert loc.list_dirs("arrays/l") == [] and not loc.is_dir("arrays/l")
    assert loc.tree_bytes("arrays/l") == 0
    with pytest.raises(InvalidNameError, match="symbolic link"):
        loc.delete_tree("arrays/l/sub")  # through the link: refused
    assert loc.delete_tree("arrays/l") == 0
    assert not os.path.lexists(tmp_path / "root" / "arrays" / "l")
    assert (out / "sub" / "keep.bin").exists()


# --- item 3: retention values --------------------------------------------------------------------------------

BAD_COUNTS = [0, -2, 1.5, True, "3", 2**63]


@pytest.mark.parametrize("field", ["keep_last", "keep_every"])
@pytest.mark.parametrize("bad", BAD_COUNTS)
def test_retention_policy_refuses_out_of_range_counts(field, bad):
    with pytest.raises(ConfigurationError, match=rf"{field} must be an integer from 1"):
        RetentionPolicy(**{field: bad})


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_retention_policy_refuses_a_non_bool_keep_tagged(bad):
    with pytest.raises(ConfigurationError, match="keep_tagged must be true or false"):
        RetentionPolicy(keep_last=1, keep_tagged=bad)


@pytest.fixture
def five(store):
    for step in range(1, 6):
        store.save("r", step, {"a": torch.full((4,), float(step))})
    return store


@pytest.mark.parametrize("field", ["keep_last", "keep_every"])
@pytest.mark.parametrize("bad", [0, -2])
def test_api_refuses_bad_counts_and_removes_nothing(five, field, bad):
    with pytest.raises(ConfigurationError, match=field):
        five.set_retention("r", **{field: bad})
    with pytest.raises(ConfigurationError, match=field):
        five.gc(**{field: bad})
    with pytest.raises(ConfigurationError, match=field):
        five.retention_victims("r", **{field: bad})
    assert five.runs()[0]["retention"] is None
    assert [c["step"] for c in five.list_checkpoints("r")] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("record", [{"keep_every": 0}, {"keep_last": -2}, {"keep_last": 2, "keep_tagged": "no"},
                                    {"keep_last": 2, "bogus": 1}, {"keep_last": 2.0}, "keep_last=2", [2]])
def test_bad_policy_stored_in_the_catalog_is_refused_when_gc_reads_it(five, ucp, store_path, record):
    with five.catalog.write_session() as s:
        s.execute(update(m.Run).where(m.Run.name == "r").values(retention=record))
    with pytest.raises(CatalogError, match="run 'r': stored retention policy"):
        five.gc()
    rc, _, err = ucp("gc", "--store", store_path)
    assert rc == 1 and err.startswith("ucp: error: run 'r': stored retention policy") and "Traceback" not in err
    assert [c["step"] for c in five.list_checkpoints("r")] == [1, 2, 3, 4, 5]


def test_gc_refuses_a_negative_pending_timeout(store):
    with pytest.raises(ConfigurationError, match="pending_timeout"):
        store.gc(pending_timeout=dt.timedelta(seconds=-1))


@pytest.mark.parametrize("argv", [["retention", "r", "--keep-every", "0"], ["retention", "r", "--keep-last", "-2"],
                                  ["gc", "--keep-last", "0"], ["gc", "--keep-every", "-1"],
                                  ["retention", "r", "--keep-last", str(2**63)]])
def test_cli_refuses_bad_retention_flags_naming_the_option(five, ucp, store_path, argv):
    rc, out, err = ucp(*argv, "--store", store_path)
    flag = next(a for a in argv if a.startswith("--"))
    assert rc == 1 and err.startswith(f"ucp: error: {flag} ") and "Traceback" not in err, err
    assert five.runs()[0]["retention"] is None
    assert [c["step"] for c in five.list_checkpoints("r")] == [1, 2, 3, 4, 5]


def test_good_retention_still_works(five, ucp, store_path):
    rc, _, err = ucp("retention", "r", "--keep-last", "2", "--store", store_path)
    assert rc == 0, err
    assert five.gc().removed_checkpoints and [c["step"] for c in five.list_checkpoints("r")] == [4, 5]


# --- item 4: a plain path is a path --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["p%20q", "x?y", "a#b", "c;d"])
def test_odd_folder_names_keep_the_store_in_one_folder(tmp_path, monkeypatch, ucp, name):
    monkeypatch.chdir(tmp_path)
    rc, _, err = ucp("init", "--store", name)
    assert rc == 0, err
    store = ucp_store.open_store(name)
    store.save("r", 1, {"a": torch.arange(6.0)})
    assert os.listdir(tmp_path) == [name]
    assert {"arrays", "catalog.db"} <= set(os.listdir(tmp_path / name))
    again = ucp_store.open_store(str(tmp_path / name))
    assert torch.equal(again.checkpoint("r@1").read("a", "weight"), torch.arange(6.0))
    for argv in (["ls", "r"], ["verify", "r@1"], ["read", "r@1", "a"]):
        rc, out, err = ucp(*argv, "--store", name)
        assert rc == 0, (argv, err)
    assert "r@1" in out or "0. 1. 2." in out
    assert os.listdir(tmp_path) == [name]


def test_file_url_is_percent_decoded(tmp_path, ucp):
    url = (tmp_path / "f%20g").as_uri().replace("%2520", "%20")  # file:///.../f%20g names folder "f g"
    assert url.endswith("/f%20g")
    rc, _, err = ucp("init", "--store", url)
    assert rc == 0, err
    ucp_store.open_store(url).save("r", 1, {"a": torch.ones(3)})
    assert os.listdir(tmp_path) == ["f g"]
    assert torch.equal(ucp_store.open_store(str(tmp_path / "f g")).checkpoint("r@1").read("a", "weight"),
                       torch.ones(3))
    rc, _, err = ucp("verify", "r@1", "--store", url)
    assert rc == 0, err


def test_file_url_with_a_query_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="no query or fragment"):
        ucp_store.open_store(f"file://{tmp_path}/x?y", create=True)
    assert os.listdir(tmp_path) == []


# --- gc reports the bytes it freed -----------------------------------------------------------------------------


def test_gc_reports_the_bytes_it_really_freed(store, store_path, ucp):
    store.save("r", 1, {"a": torch.randn(300, 100)})
    victim = store.resolve("r@1")
    keep = store.save("r", 2, {"a": torch.randn(300, 100)}).id
    victim_bytes = _folder_bytes(store_path / "arrays" / victim)
    assert victim_bytes > 120_000
    # a killed save's files, which no row knows (a copy of the kept version's folder)
    stray = store_path / "arrays" / "0badc0de0badc0de"
    os.makedirs(stray)
    for p in (store_path / "arrays" / keep).rglob("*"):
        if p.is_file():
            dest = stray / p.relative_to(store_path / "arrays" / keep)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(p.read_bytes())
    stray_bytes = _folder_bytes(stray)
    assert store.gc(keep_last=1, dry_run=True).freed_bytes == victim_bytes + stray_bytes
    rc, out, err = ucp("gc", "--keep-last", "1", "--json", "--store", store_path)
    assert rc == 0, err
    report = json.loads(out)
    assert report["freed_bytes"] == victim_bytes + stray_bytes and report["removed_arrays"] == 2
    assert sorted(os.listdir(store_path / "arrays")) == [keep]
    stray.mkdir()
    (stray / "junk.bin").write_bytes(b"j" * 2048)  # not an array folder: gc cannot tie it to its catalog
    rc, out, err = ucp("gc", "--store", store_path)
    assert rc == 0 and "0 array(s), 0 B" in out and "arrays/0badc0de0badc0de" in err, (out, err)
    assert (stray / "junk.bin").read_bytes() == b"j" * 2048


# --- init on an existing store -------------------------------------------------------------------------------


def test_init_never_changes_an_existing_stores_settings(store_path):
    from ucp_store.io.chunking import MAX_TARGET, MIN_TARGET

    made = ucp_store.open_store(str(store_path), create=True, chunk_target_bytes=MIN_TARGET, compression="zstd")
    assert made.created
    same = ucp_store.open_store(str(store_path), create=True, chunk_target_bytes=MIN_TARGET, compression="zstd")
    assert not same.created and same.settings["chunk_target_bytes"] == MIN_TARGET
    with pytest.raises(ConfigurationError, match=rf"chunk_target_bytes = {MIN_TARGET} bytes .*asked for "
                                                 rf"chunk_target_bytes = {MAX_TARGET} bytes"):
        ucp_store.open_store(str(store_path), create=True, chunk_target_bytes=MAX_TARGET)
    with pytest.raises(ConfigurationError, match="compression = 'zstd'.*compression = 'none'"):
        ucp_store.open_store(str(store_path), create=True, compression="none")
    settings = ucp_store.open_store(str(store_path)).settings
    assert (settings["chunk_target_bytes"], settings["compression"]) == (MIN_TARGET, "zstd")
    assert ucp_store.open_store(str(store_path), create=True).settings["compression"] == "zstd"


def test_init_of_a_store_that_never_recorded_its_chunk_target_keeps_1_mib(store_path):
    store = ucp_store.open_store(str(store_path), create=True)
    store.save("r", 1, {"a": torch.ones(2)})
    with store.catalog.write_session() as s:
        s.delete(s.get(m.Setting, "chunk_target_bytes"))
    assert ucp_store.open_store(str(store_path), create=True).settings["chunk_target_bytes"] == 1 << 20
    assert ucp_store.open_store(str(store_path)).settings["chunk_target_bytes"] == 1 << 20


def test_cli_init_on_an_existing_store(store_path, ucp):
    assert ucp("init", "--store", store_path, "--chunk-mib", "1")[0] == 0
    rc, out, err = ucp("init", "--store", store_path, "--chunk-mib", "2")
    assert rc == 1 and err.startswith("ucp: error: store ") and "chunk_target_bytes = 1048576 bytes (1 MiB)" in err
    assert "2097152 bytes (2 MiB)" in err and "--chunk-mib" in err and "Traceback" not in err
    for argv in ([], ["--chunk-mib", "1"]):
        rc, out, err = ucp("init", "--store", store_path, *argv)
        assert rc == 0 and "already exists, settings unchanged" in out, err
    rc, out, err = ucp("init", "--store", store_path, "--compression", "zstd")
    assert rc == 1 and "compression = 'none'" in err
    assert ucp_store.open_store(str(store_path)).settings["chunk_target_bytes"] == 1 << 20


# --- FIFOs and other non-regular files in the store --------------------------------------------------------------

FIFO_DRIVER = textwrap.dedent("""
    import json, sys
    from ucp_store import cli
    rcs = {}
    for argv in json.loads(sys.argv[1]):
        rcs[" ".join(argv)] = cli.main(argv)
    print(json.dumps(rcs))
""")


def test_a_fifo_in_the_store_never_blocks_a_command(tmp_path):
    """verify, read, ls and gc with a FIFO in place of a shard file (one store) or a zarr.json (another), and
    a FIFO where gc sweeps: each returns (a clear error naming the path where the file is needed) instead of
    waiting for a writer forever. One subprocess with a timeout, so a regression fails instead of hanging."""
    cmds, folders = [], {}
    for which in ("c/0", "zarr.json"):
        root = tmp_path / which.replace("/", "-")
        ucp_store.open_store(str(root), create=True).save("r", 1, {"a": torch.ones(16)})
        folder = folders[which] = next((root / "arrays").glob("*/*.zarr"))
        (folder / which).unlink()
        os.mkfifo(folder / which)
        (root / "arrays" / "deadbeefdeadbeef").mkdir()
        os.mkfifo(root / "arrays" / "deadbeefdeadbeef" / "pipe")
        cmds += [["--store", str(root), *argv] for argv in (["verify", "r@1"], ["read", "r@1", "a"], ["ls", "r"],
                                                            ["gc"])]
    proc = run_python(["-c", FIFO_DRIVER, json.dumps(cmds)], timeout=120)
    rcs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Traceback" not in proc.stderr, proc.stderr
    for which, folder in folders.items():
        root = folder.parent.parent.parent
        assert rcs[f"--store {root} verify r@1"] == 1
        assert rcs[f"--store {root} ls r"] == 0 and rcs[f"--store {root} gc"] == 0
        assert f"{folder}/{which} is not a regular file" in proc.stderr or (
            f"shard file {which} of {folder} is corrupt: not a regular file" in proc.stderr)
        assert stat.S_ISFIFO(os.lstat(root / "arrays" / "deadbeefdeadbeef" / "pipe").st_mode)  # left, unopened
        assert os.path.exists(folder / which)  # a live version's file: left for the user to repair
    assert rcs[f"--store {folders['c/0'].parent.parent.parent} read r@1 a"] == 1


# --- ucp query: dangerous functions refused by name ------------------------------------------------------------


@pytest.mark.parametrize("call", ["fts3_tokenizer('simple')", "FTS3_TOKENIZER('porter')", "load_extension('x')"])
def test_query_refuses_dangerous_functions(store, store_path, ucp, call):
    rc, out, err = ucp("query", f"SELECT {call}", "--store", store_path)
    name = call.split("(")[0].lower()
    assert rc == 1 and err.startswith(f"ucp: error: query refused: function {name}() is not allowed"), err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("name", sorted(DENIED_FUNCTIONS))
def test_query_refuses_denied_functions_even_when_they_exist(store, name):
    """readfile/writefile/edit exist only where an extension (the sqlite3 shell) adds them: registered here,
    each is still refused by name and never called."""
    called = []
    store.catalog.engine.dispose()
    event.listen(store.catalog.engine, "connect",
                 lambda conn, _rec: conn.create_function(name, -1, lambda *a: called.append(a) or 1))
    with pytest.raises(QueryError, match=rf"function {name}\(\) is not allowed"):
        store.query(f"SELECT {name}('/etc/passwd')")
    assert called == []
    assert store.query("SELECT upper('ok')")[1] == [("OK",)]


def test_authorizer_allows_ordinary_functions_and_refuses_by_name():
    conn = sqlite3.connect(":memory:")
    conn.create_function("readfile", 1, lambda p: b"secret")
    denied: list[str] = []
    conn.set_authorizer(_sqlite_read_authorizer(denied))
    assert conn.execute("SELECT lower('A'), abs(-2), json_extract('{\"a\": 1}', '$.a')").fetchone() == ("a", 2, 1)
    with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
        conn.execute("SELECT readfile('x')")
    assert denied == ["readfile"]
    assert sys.version_info >= (3, 8)
