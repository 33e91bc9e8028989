"""The deferred-durability pass (``save.durable.Durability``): which files and folders it fsyncs."""

from __future__ import annotations

import os

from ucp_store import open_store
from ucp_store.save import durable


def _recording(monkeypatch) -> list[str]:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    return synced


def _array(root: str, rel: str, files: list[str]) -> None:
    os.makedirs(os.path.join(root, rel, "c", "0"), exist_ok=True)
    for f in files:
        with open(os.path.join(root, rel, f), "wb") as fh:
            fh.write(b"x")


def test_touch_file_syncs_that_file_and_its_folders_not_the_whole_array(tmp_path, monkeypatch):
    st = open_store(str(tmp_path / "s"), create=True)
    root = st.location.root
    d = durable.Durability(st.store_context, "ck")
    d.defer()
    a, b = "arrays/ck/a.zarr", "arrays/ck/b.zarr"
    _array(root, a, ["zarr.json", "c/0/0", "c/0/1"])
    _array(root, b, ["zarr.json", "c/0/0"])
    synced = _recording(monkeypatch)
    d.touch_file(a, "zarr.json")
    d.make_durable()
    want = {os.path.join(root, a, "zarr.json"), os.path.join(root, a), os.path.join(root, "arrays/ck"),
            os.path.join(root, "arrays")}
    assert set(synced) == want
    synced.clear()
    d.touch(b)  # a folder touched whole: every file under it, as before
    d.make_durable_async().result()
    assert {os.path.join(root, b, "zarr.json"), os.path.join(root, b, "c/0/0"), os.path.join(root, b, "c/0"),
            os.path.join(root, b)} <= set(synced)
    assert not any(p.startswith(os.path.join(root, a)) for p in synced)
    synced.clear()
    d.make_durable()  # nothing new: nothing synced
    assert synced == []


def test_touch_file_is_ignored_unless_durability_is_deferred(tmp_path, monkeypatch):
    st = open_store(str(tmp_path / "s"), create=True)
    d = durable.Durability(st.store_context, "ck")
    _array(st.location.root, "arrays/ck/a.zarr", ["zarr.json"])
    synced = _recording(monkeypatch)
    d.touch_file("arrays/ck/a.zarr", "zarr.json")
    d.make_durable()
    assert synced == []
