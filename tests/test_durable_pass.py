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


def test_a_deferred_region_writer_syncs_its_own_shard_files_not_other_writers(tmp_path, monkeypatch):
    """A rank of a multi-rank save writes whole shard files of arrays that other ranks fill too: its pass
    fsyncs the files it wrote and the folders whose entries changed, never every file of the arrays (each of
    N ranks walking every array made the passes O(N^2) files); its commit still lists a complete version."""
    import numpy as np

    st = open_store(str(tmp_path / "s"), create=True)
    w = st.begin("r", 1)
    assert w.defer_durability()
    shape = (256, 1024)
    w.open_regions([("w", "fp32", "float32", shape, None, {0: [0, 128, 256]})])
    a = np.arange(256 * 1024, dtype=np.float32).reshape(shape)
    w.write_region("w", "fp32", a[:128], shape=shape, offset=(0, 0), pattern=None, boundaries={0: [0, 128, 256]},
                   origin=True)
    w.region_digests()
    root = st.location.root
    folders = [f for f, _, names in os.walk(root) if "zarr.json" in names or os.path.basename(f) == "c"]
    array = next(os.path.dirname(f) for f in folders if os.path.basename(f) == "c")
    stray = os.path.join(array, "c", "zz")  # another rank's file in the same array
    with open(stray, "wb") as fh:
        fh.write(b"x")
    synced = _recording(monkeypatch)
    w.make_durable_async().result()
    mine = [p for p in synced if p.startswith(os.path.join(array, "c")) and os.path.isfile(p)]
    assert mine and stray not in synced
    assert os.path.join(array, "c") in synced or any(p.startswith(os.path.join(array, "c") + "/") for p in synced)
    os.unlink(stray)
    w.write_region("w", "fp32", a[128:], shape=shape, offset=(128, 0), pattern=None, boundaries={0: [0, 128, 256]})
    w.commit()
    assert np.array_equal(st.checkpoint("r@1").read("w", "fp32").numpy(), a)
