"""A SQLite catalog on a network or cluster filesystem never runs WAL unless asked (issue 27 item 3).

The filesystem is identified by statfs's f_type; tests inject that answer through ``statfs=`` (no
monkeypatching), one filesystem family at a time, and check the journal mode SQLite really runs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

import ucp_store
from ucp_store.catalog import fs
from ucp_store.catalog.db import open_catalog, sqlite_url
from ucp_store.errors import ConfigurationError

# f_type magics of local filesystems (linux/magic.h): ext2/3/4, xfs, btrfs, tmpfs, overlayfs, zfs
LOCAL = {"ext4": 0xEF53, "xfs": 0x58465342, "btrfs": 0x9123683E, "tmpfs": 0x01021994, "overlayfs": 0x794C7630,
         "zfs": 0x2FC12FC1}
# what every family must map to (the ones the issue names, and the others a cluster may mount)
SHARED = {"nfs": 0x6969, "lustre": 0x0BD00BD0, "gpfs": 0x47504653, "cephfs": 0x00C36400, "smb": 0x517B,
          "cifs": 0xFF534D42, "smb2": 0xFE534D42, "fuse": 0x65735546, "9p": 0x01021997, "afs": 0x5346414F,
          "beegfs": 0x19830326, "gfs2": 0x01161970, "ocfs2": 0x7461636F, "panfs": 0xAAD7AAEA}


def _answer(magic: int | None):
    asked: list[str] = []

    def statfs(path: str) -> int | None:
        asked.append(path)
        return magic

    statfs.asked = asked  # type: ignore[attr-defined]
    return statfs


def _journal(catalog) -> str:
    with catalog.engine.connect() as conn:
        return str(conn.exec_driver_sql("PRAGMA journal_mode").scalar()).lower()


@pytest.mark.parametrize("family", sorted(SHARED))
def test_shared_families_get_the_rollback_journal(tmp_path, family):
    choice = fs.journal_mode(tmp_path / "catalog.db", statfs=_answer(SHARED[family]))
    assert (choice.mode, choice.filesystem) == ("delete", family)
    assert family in choice.reason and "PostgreSQL" in choice.reason


@pytest.mark.parametrize("family", sorted(LOCAL))
def test_local_filesystems_keep_wal(tmp_path, family):
    assert fs.journal_mode(tmp_path / "catalog.db", statfs=_answer(LOCAL[family])) == fs.JournalChoice(
        "wal", None, f"{tmp_path / 'catalog.db'} is on a local filesystem")


def test_detection_edges(tmp_path):
    # a 32-bit ABI returns CIFS's magic as a negative word; only its low 32 bits name the filesystem
    assert fs.filesystem_of(tmp_path, _answer(0xFF534D42 - (1 << 32))) == "cifs"
    # a file not created yet is asked about through its nearest existing folder
    probe = _answer(0x6969)
    assert fs.filesystem_of(tmp_path / "new" / "deeper" / "catalog.db", probe) == "nfs"
    assert probe.asked == [str(tmp_path)]

    def failing(path: str) -> int:
        raise OSError(5, "I/O error", path)

    assert fs.filesystem_of(tmp_path, failing) is None  # cannot ask: counted local
    assert fs.filesystem_of(tmp_path, _answer(None)) is None  # no statfs on this platform


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("stat") is None, reason="Linux statfs")
def test_statfs_type_reads_the_real_f_type(tmp_path):
    want = int(subprocess.run(["stat", "-f", "-c", "%t", str(tmp_path)], capture_output=True, text=True,
                              check=True).stdout, 16)
    assert fs.statfs_type(tmp_path) == want
    with pytest.raises(OSError):
        fs.statfs_type(tmp_path / "missing")


def test_catalog_on_nfs_runs_delete_and_commits(tmp_path):
    url = sqlite_url(tmp_path / "catalog.db")
    catalog = open_catalog(url, create=True, statfs=_answer(SHARED["nfs"]))
    try:
        assert _journal(catalog) == "delete"
        # a commit that does not wait for the disk stays FULL in rollback mode (NORMAL can corrupt it there)
        with catalog.write_session(durable=False) as s:
            assert s.connection().exec_driver_sql("PRAGMA synchronous").scalar() == 2
    finally:
        catalog.close()
    assert not (tmp_path / "catalog.db-wal").exists()


def test_wal_file_moved_onto_a_shared_filesystem_is_switched(tmp_path):
    url = sqlite_url(tmp_path / "catalog.db")
    catalog = open_catalog(url, create=True, statfs=_answer(LOCAL["ext4"]))
    assert _journal(catalog) == "wal"
    catalog.close()
    catalog = open_catalog(url, create=False, statfs=_answer(SHARED["lustre"]))
    try:
        assert _journal(catalog) == "delete"
    finally:
        catalog.close()


def test_override_wins_both_ways(tmp_path):
    nfs_wal = open_catalog(sqlite_url(tmp_path / "a.db"), create=True, sqlite_journal="wal",
                           statfs=_answer(SHARED["nfs"]))
    local_delete = open_catalog(sqlite_url(tmp_path / "b.db"), create=True, sqlite_journal="delete",
                                statfs=_answer(LOCAL["ext4"]))
    try:
        assert _journal(nfs_wal) == "wal"
        assert _journal(local_delete) == "delete"
    finally:
        nfs_wal.close()
        local_delete.close()
    with pytest.raises(ConfigurationError, match="sqlite_journal 'off'"):
        open_catalog(sqlite_url(tmp_path / "c.db"), create=True, sqlite_journal="off")
    assert not (tmp_path / "c.db").exists()


def test_open_store_and_cli_override(tmp_path):
    import torch

    store = ucp_store.open_store(str(tmp_path / "s"), create=True, sqlite_journal="delete")
    try:
        assert _journal(store.catalog) == "delete"
        with store.begin("r", 1) as w:
            w.write("w", "weight", torch.arange(6.0))
        assert torch.equal(store.checkpoint("r@1").read("w", "weight"), torch.arange(6.0))
    finally:
        store.catalog.close()
    ucp = [sys.executable, "-m", "ucp_store.cli", "--store", str(tmp_path / "s")]
    # a command that only reads opens the catalog read-only (issue 40): it never switches the journal mode
    out = subprocess.run(ucp + ["--sqlite-journal", "wal", "ls"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert _file_mode(tmp_path / "s" / "catalog.db") == "delete"
    out = subprocess.run(ucp + ["--sqlite-journal", "wal", "tag", "r@1", "t"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "s" / "catalog.db-wal").exists() or _file_mode(tmp_path / "s" / "catalog.db") == "wal"
    bad = subprocess.run(ucp + ["--sqlite-journal", "off", "ls"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--sqlite-journal" in bad.stderr and "Traceback" not in bad.stderr


def _file_mode(path) -> str:
    import sqlite3

    with sqlite3.connect(path) as conn:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()


def test_switch_refused_while_another_process_holds_wal(tmp_path):
    """A catalog another process holds open in WAL cannot be switched to the rollback journal: a clear error
    naming the mode and the filesystem, never a WAL catalog on a shared filesystem."""
    import sqlite3

    from ucp_store.errors import CatalogError

    url = sqlite_url(tmp_path / "catalog.db")
    open_catalog(url, create=True, statfs=_answer(LOCAL["ext4"])).close()
    holder = sqlite3.connect(tmp_path / "catalog.db")  # WAL, as the file says
    try:
        holder.execute("SELECT count(*) FROM runs").fetchall()
        with pytest.raises(CatalogError, match=r"journal_mode=DELETE.*on nfs"):
            open_catalog(url, create=False, busy_timeout_ms=200, statfs=_answer(SHARED["nfs"]))
    finally:
        holder.close()
    catalog = open_catalog(url, create=False, statfs=_answer(SHARED["nfs"]))  # nobody holds it: switched
    try:
        assert _journal(catalog) == "delete"
    finally:
        catalog.close()
