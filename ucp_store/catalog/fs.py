"""Which filesystem holds a SQLite catalog, and the journal mode it gets there (pure but for ``statfs``).

SQLite's WAL mode keeps its index in a memory-mapped ``-shm`` file, so every process using a WAL database
must be on one host (SQLite: "WAL does not work over a network filesystem"). On a network or cluster
filesystem (NFS, Lustre, GPFS, CephFS, SMB, FUSE, ...) processes on two hosts would each trust their own
view of that index and can lose or corrupt commits, silently. There the catalog runs SQLite's rollback
journal (``journal_mode=DELETE``), which needs only the filesystem's POSIX byte-range locks: correct where
the filesystem implements them across hosts (NFSv4 with its lock manager, GPFS, CephFS, Lustre mounted with
``flock``), and an error at the first lock where it refuses them (Lustre's ``noflock``), but still unsafe
where locks are only node-local (Lustre's ``localflock``, NFS mounted ``nolock``). A job whose catalog is
written from several hosts belongs on PostgreSQL; :func:`journal_mode` says so in its reason.

The filesystem is identified by ``statfs(2)``'s ``f_type`` (``statfs_type``, via ctypes on Linux; None
elsewhere, which counts as local). Callers pass another ``statfs`` function to test each family.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ucp_store.errors import ConfigurationError

__all__ = ["JOURNAL_CHOICES", "SHARED_FILESYSTEMS", "JournalChoice", "filesystem_of", "journal_mode", "statfs_type"]

#: what a caller may ask for: ``auto`` (WAL on a local filesystem, DELETE on a shared one), or a mode forced
#: whatever the filesystem (``wal``: the caller vouches that every process is on one host)
JOURNAL_CHOICES = ("auto", "wal", "delete")

#: statfs ``f_type`` magic numbers (linux/magic.h and the filesystems' own sources) of filesystems that
#: several hosts can mount at once. FUSE is counted in: most FUSE filesystems met on clusters are network
#: ones (sshfs, gcsfuse, s3fs, JuiceFS, GlusterFS, ceph-fuse, DAOS dfuse), and its magic cannot tell them apart.
SHARED_FILESYSTEMS: dict[int, str] = {
    0x6969: "nfs",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x00C36400: "cephfs",
    0x517B: "smb",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x65735546: "fuse",
    0x01021997: "9p",
    0x5346414F: "afs",
    0x6B414653: "kafs",
    0x19830326: "beegfs",
    0x73757245: "coda",
    0x564C: "ncp",
    0x7461636F: "ocfs2",
    0x01161970: "gfs2",
    0xAAD7AAEA: "panfs",
    0x20030528: "orangefs",
    0x786F4256: "vboxsf",
}

_STATFS_BUF = 512  # larger than struct statfs on every Linux ABI; f_type is its first field everywhere


def _libc_statfs() -> Callable | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.statfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_statfs = _libc_statfs()


def statfs_type(path: str | os.PathLike) -> int | None:
    """``f_type`` of the filesystem holding ``path`` (which must exist), or None where statfs is unavailable."""
    if _statfs is None:
        return None
    buf = ctypes.create_string_buffer(_STATFS_BUF)
    if _statfs(os.fsencode(os.fspath(path)), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(path))
    # f_type is a signed word of the ABI (32 or 64 bits): the magic is its low 32 bits either way
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (a catalog being created has no file yet)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def filesystem_of(path: str | os.PathLike, statfs: Callable[[str], int | None] = statfs_type) -> str | None:
    """The shared filesystem family holding ``path`` (``'nfs'``, ``'lustre'``, ...), or None for a local one
    (or when the filesystem cannot be asked)."""
    try:
        magic = statfs(str(_existing(Path(path))))
    except OSError:
        return None
    return None if magic is None else SHARED_FILESYSTEMS.get(int(magic) & 0xFFFFFFFF)


@dataclass(frozen=True)
class JournalChoice:
    """The journal mode a SQLite catalog file gets: ``mode`` (``'wal'``/``'delete'``), the shared filesystem
    found (None: local), and why, for logs and errors."""

    mode: str
    filesystem: str | None
    reason: str


def journal_mode(db_path: str | os.PathLike, requested: str = "auto", *,
                 statfs: Callable[[str], int | None] = statfs_type) -> JournalChoice:
    """The journal mode for the SQLite catalog at ``db_path``: ``requested`` (``sqlite_journal``) when it
    names a mode, else WAL on a local filesystem and DELETE on a shared one (see the module docstring)."""
    if requested not in JOURNAL_CHOICES:
        raise ConfigurationError(f"sqlite_journal {requested!r}: expected one of {', '.join(JOURNAL_CHOICES)}")
    fs = filesystem_of(db_path, statfs)
    where = f"{db_path} is on {fs}" if fs else f"{db_path} is on a local filesystem"
    if requested != "auto":
        return JournalChoice(requested, fs, f"{where}; sqlite_journal={requested!r} was asked for")
    if fs is None:
        return JournalChoice("wal", None, where)
    return JournalChoice("delete", fs, (
        f"{where}, a filesystem other hosts can mount: SQLite's WAL mode works only with every process on one "
        "host, so the catalog uses the rollback journal (DELETE), which relies on the filesystem's cross-host "
        "locks; for a job writing the catalog from several hosts use a PostgreSQL catalog (--catalog / "
        "catalog=), or sqlite_journal='wal' if every process is on one host"))
