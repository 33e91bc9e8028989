"""A tier's stored objects: whole files (a shard file, a zarr.json) under a root, by key (issue 38).

An object's key is its path relative to a store root (``arrays/<ckpt>/<id>.zarr/c/0/0``), the same on every
tier, so a node's fast folder reads as a store root for the objects it holds. Keys go through
``location.safe_rel``: nothing escapes a root. A write is atomic (a temporary file, fsync, rename, the
folder fsynced), so a reader never sees half an object, and a killed writer leaves only a ``.ucp-tmp-*``
file that no catalog row names.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from ucp_store.errors import ChecksumError, UcpError
from ucp_store.io import crc as _crc
from ucp_store.io.location import ARRAYS_DIR, Location, safe_rel
from ucp_store.tiers.placement import ObjectInfo

__all__ = ["crc_hex", "object_path", "read_object", "write_object", "describe", "walk_objects", "put_durable",
           "get_durable", "read_checked", "remove_version", "TMP_PREFIX"]

TMP_PREFIX = ".ucp-tmp-"


def crc_hex(data) -> str:
    """The crc32c of ``data``'s bytes, as 8 lowercase hex digits (``placements.crc32c``)."""
    return f"{_crc.value(memoryview(data).cast('B')) & 0xFFFFFFFF:08x}"


def object_path(root: str | os.PathLike, key: str) -> Path:
    """The file of ``key`` under the folder ``root`` (a key that would leave the root raises)."""
    return Path(root) / safe_rel(key)


def read_object(root: str | os.PathLike, key: str) -> bytes:
    """The bytes of ``key`` under the folder ``root``."""
    with open(object_path(root, key), "rb") as f:
        return f.read()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_object(root: str | os.PathLike, key: str, data, *, fsync: bool = True) -> ObjectInfo:
    """Write ``data`` as ``key`` under the folder ``root`` atomically; returns its :class:`ObjectInfo`."""
    path = object_path(root, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex}-{path.name}")
    view = memoryview(data).cast("B")
    try:
        with open(tmp, "wb") as f:
            f.write(view)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(path.parent)
    return ObjectInfo(safe_rel(key), view.nbytes, crc_hex(view))


def describe(root: str | os.PathLike, key: str) -> ObjectInfo:
    """The :class:`ObjectInfo` of ``key`` as it is under ``root`` now (reads it whole)."""
    data = read_object(root, key)
    return ObjectInfo(safe_rel(key), len(data), crc_hex(data))


def walk_objects(root: str | os.PathLike, prefix: str = ARRAYS_DIR) -> Iterator[str]:
    """Every object key under ``root/prefix`` (files, sorted per folder; temporaries included, so gc sees them)."""
    base = Path(root)
    start = base / safe_rel(prefix)
    if not start.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(start):
        dirnames.sort()
        for name in sorted(filenames):
            yield Path(dirpath, name).relative_to(base).as_posix()


def _kv(location: Location):
    import tensorstore as ts

    return ts.KvStore.open(location.kvstore("")).result()


def put_durable(location: Location, key: str, data) -> ObjectInfo:
    """Write ``key`` on the store's durable location (a folder: atomic and fsynced; S3: one PUT)."""
    key = safe_rel(key)
    if location.kind == "file":
        return write_object(location.root, key, data)
    view = memoryview(data).cast("B")
    _kv(location).write(key, bytes(view)).result()
    return ObjectInfo(key, view.nbytes, crc_hex(view))


def get_durable(location: Location, key: str) -> bytes:
    """The bytes of ``key`` on the store's durable location."""
    key = safe_rel(key)
    if location.kind == "file":
        return read_object(location.root, key)
    got = _kv(location).read(key).result()
    if got.state != "value":
        raise UcpError(f"object {location.display(key)} is missing on the durable tier")
    return bytes(got.value)


def read_checked(root: str | os.PathLike, key: str, crc32c: str | None, nbytes: int | None = None) -> bytes:
    """The bytes of ``key`` under ``root``, checked against the catalog's size and crc32c (ChecksumError
    naming the file and both values when they differ; a missing file raises FileNotFoundError)."""
    data = read_object(root, key)
    got = crc_hex(data)
    if (nbytes is not None and len(data) != nbytes) or (crc32c is not None and got != crc32c):
        raise ChecksumError(f"{object_path(root, key)}: {len(data)} bytes with crc32c {got}, the catalog "
                              f"records {nbytes} bytes with crc32c {crc32c}")
    return data


def remove_version(root: str | os.PathLike, checkpoint_id: str) -> int:
    """Delete a version's folder (``arrays/<id>``) under a fast tier's ``root`` (after its rows are ``evicted``);
    returns the files removed. Links are removed, never followed."""
    import shutil

    from ucp_store.io.location import checkpoint_dir

    folder = object_path(root, checkpoint_dir(checkpoint_id))
    if folder.is_symlink():
        folder.unlink()
        return 1
    if not folder.is_dir():
        return 0
    count = sum(len(files) for _, _, files in os.walk(folder))
    shutil.rmtree(folder)
    return count
