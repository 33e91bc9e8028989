"""The local write path (ucp_store/io/localwrite.py): whole shard files written without TensorStore.

The files must be the bytes TensorStore writes for the same array (the one format every reader knows),
the digests of the content hash's units must be of the bytes written, and a save through it must commit
the same content hash as the TensorStore path, verify clean and read back exactly.
"""

from __future__ import annotations

import filecmp
import os

import numpy as np
import pytest
import torch

import ucp_store
from ucp_store import config, dtypes
from ucp_store.errors import WriteError
from ucp_store.io import format as fmt
from ucp_store.io import localwrite
from ucp_store.io.location import Location

# (shape, chunk, shard, dtype): column-cut chunks, edge chunks and overhanging edge shards, 1-D, 3-D
LAYOUTS = [
    ((64, 96), (16, 32), (32, 96), "float32"),
    ((50, 70), (16, 32), (32, 64), "float32"),
    ((10,), (4,), (8,), "bfloat16"),
    ((6, 5, 7), (2, 5, 4), (4, 5, 8), "int16"),
    ((9, 8), (3, 8), (6, 8), "bool"),
]


def _data(shape, dtype):
    a = np.random.default_rng(7).standard_normal(shape)
    if dtype == "bool":
        return a > 0
    return a.astype(dtypes.numpy_dtype(dtype))


@pytest.mark.parametrize(("shape", "chunk", "shard", "dtype"), LAYOUTS)
def test_shard_files_are_tensorstores_bytes(tmp_path, shape, chunk, shard, dtype):
    loc = Location.parse(str(tmp_path))
    ctx = fmt.make_context()
    layout = fmt.ArrayLayout(dtype, shape, chunk, shard)
    a = _data(shape, dtype)
    fmt.create_array(loc, "ts", layout, ctx).write(a).result()
    fmt.create_array(loc, "lw", layout, ctx)
    folder = localwrite.local_folder(loc, "lw", layout)
    assert folder == os.path.join(str(tmp_path), "lw")
    zero = (0,) * len(shape)
    assert localwrite.whole_shards(layout, zero, shape)
    digests: dict = {}
    for s in localwrite.shard_boxes(layout, zero, shape):
        localwrite.write_shard_file(folder, layout, s, a, zero, digests)
    files = []
    for root, _, names in os.walk(tmp_path / "ts"):
        files += [os.path.relpath(os.path.join(root, n), tmp_path / "ts") for n in names]
    assert len(files) > 1
    for f in files:  # byte for byte what TensorStore wrote, index and crc included
        assert filecmp.cmp(tmp_path / "ts" / f, tmp_path / "lw" / f, shallow=False), f
    assert sorted(os.listdir(tmp_path / "lw" / "c")) == sorted(os.listdir(tmp_path / "ts" / "c"))  # no temp left
    # the content hash's units each shard held whole, digested from the bytes written; with the rest (units a
    # shard boundary cuts) the digests give the array's content hash
    fmt.read_missing_units(layout.dtype, layout.shape, digests, lambda box: a[tuple(slice(*r) for r in box)])
    assert fmt.units_hash(layout.dtype, layout.shape, digests) == fmt.content_hash(a)
    back = fmt.open_array(loc, "lw", layout, ctx).read().result()
    assert np.array_equal(back, a)


def test_whole_shards_decides():
    layout = fmt.ArrayLayout("float32", (50, 70), (16, 32), (32, 64))
    assert localwrite.whole_shards(layout, (32, 0), (18, 70))      # edge shard up to the array's end
    assert localwrite.whole_shards(layout, (0, 64), (50, 6))
    assert not localwrite.whole_shards(layout, (0, 0), (16, 70))   # half a shard row
    assert not localwrite.whole_shards(layout, (16, 0), (34, 70))  # starts inside a shard
    assert not localwrite.whole_shards(layout, (0, 0), (0, 70))    # empty
    assert list(localwrite.shard_boxes(layout, (0, 0), (50, 70))) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    s3 = Location.parse("s3://bucket/prefix", catalog="sqlite:///x.db")
    assert localwrite.local_folder(s3, "a", layout) is None
    assert localwrite.local_folder(Location.parse("/tmp/x"), "a", fmt.ArrayLayout("float32", (4,), (4,), (4,),
                                                                                 "zstd")) is None


def test_a_failed_shard_write_is_a_write_error_naming_the_tensor(tmp_path, monkeypatch):
    st = ucp_store.open_store(str(tmp_path / "s"), create=True)
    w = st.begin("r", 1)
    real = localwrite.write_shard_file

    def full_disk(*args):
        real(*args)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(localwrite, "write_shard_file", full_disk)
    w.write_region("w", "fp32", torch.ones(8, 4), shape=(8, 4), offset=(0, 0), pattern=None, origin=True)
    with pytest.raises(WriteError, match=r"tensor 'w' state 'fp32'.*No space left"):
        w.drain()
    w.abort()
    assert st.list_checkpoints() == []


def test_save_through_either_path_commits_one_hash(tmp_path, monkeypatch):
    """A save through the local path and one through TensorStore (the ``local_write`` setting off) commit
    the same content hash, verify clean and read back exactly."""
    import ucp_store.distributed as ucpd

    t = torch.randn(128, 96)
    hashes = {}
    for mode in ("1", "0"):
        store = str(tmp_path / f"s{mode}")
        with config.override(local_write=mode == "1"):
            cid = ucpd.save({"w": t}, store=store, run="r", step=1, progress=False)
        st = ucp_store.open_store(store)
        ck = st.checkpoint(cid)
        (info,) = [i for i in ck.tensors() if i.name == "w"]
        hashes[mode] = info.content_hash
        assert ck.verify() == []
        assert np.array_equal(ck.tensor("w", info.state).read_numpy((slice(40, 100), slice(None))), t[40:100].numpy())
        target = {"w": torch.zeros(128, 96)}
        ucpd.load(target, store=store, ref=cid, progress=False)
        assert torch.equal(target["w"], t)
    assert hashes["1"] == hashes["0"] == fmt.content_hash(t.numpy())  # the one scheme, whatever the path


def test_boxes_that_share_a_shard_go_through_tensorstore(tmp_path, monkeypatch):
    """Half-shard boxes (two writers of one shard file) are merged by TensorStore, never written here."""
    calls = []
    real = localwrite.write_shard_file
    monkeypatch.setattr(localwrite, "write_shard_file", lambda *a: calls.append(a[2]) or real(*a))
    st = ucp_store.open_store(str(tmp_path / "s"), create=True)
    w = st.begin("r", 1)
    t = torch.randn(8, 4)
    w.write_region("w", "fp32", t[:4], shape=(8, 4), offset=(0, 0), pattern=None, origin=True)
    w.write_region("w", "fp32", t[4:], shape=(8, 4), offset=(4, 0), pattern=None)
    w.write_region("v", "fp32", t, shape=(8, 4), offset=(0, 0), pattern=None, origin=True)
    ck = w.commit()
    assert calls == [(0, 0)]  # only v's one whole shard
    assert ck.verify() == []
    assert torch.equal(ck.tensor("w", "fp32").read(), t) and torch.equal(ck.tensor("v", "fp32").read(), t)


# (shape, dtype, chunk from the content hash's tile, shard rows in chunks, fused): the units are digested
# per chunk where units nest in chunks (contiguous runs, or regrouped tile by tile), per box otherwise
DIGEST_CASES = [
    ((1024, 2048), "float32", lambda t: (16 * t[0], t[1]), 2, "runs"),         # units span the chunk's width
    ((2048, 2048), "float32", lambda t: (4 * t[0], 4 * t[1]), 2, "split"),     # units regrouped in cache
    ((2048, 2048), "float32", lambda t: (3 * t[0], 2 * t[1]), 2, "split"),     # edge chunks (2048 % 96)
    ((2048, 1024), "bfloat16", lambda t: t, 4, "runs"),                          # a chunk is one unit
    ((64, 32, 512), "float32", lambda t: (2 * t[0], t[1], 2 * t[2]), 3, "split"),
    ((1 << 21,), "float32", lambda t: (4 * t[0],), 2, "runs"),
    ((3000, 1024), "float32", lambda t: (512, 1024), 2, None),                   # units do not nest
]


@pytest.mark.parametrize(("shape", "dtype", "chunk_of", "rows", "fused"), DIGEST_CASES)
def test_unit_digests_per_chunk_equal_the_box_digests(tmp_path, shape, dtype, chunk_of, rows, fused):
    itemsize = dtypes.itemsize(dtype)
    chunk = tuple(chunk_of(fmt.tile_shape(shape, itemsize)))
    shard = (rows * chunk[0],) + tuple(-(-s // c) * c for s, c in zip(shape[1:], chunk[1:]))
    layout = fmt.ArrayLayout(dtype, shape, chunk, shard)
    runs = localwrite._unit_runs(layout)
    assert (None if runs is None else ("runs" if runs[4] is None else "split")) == fused
    a = _data(shape, dtype)
    zero = (0,) * len(shape)
    got: dict = {}
    want: dict = {}
    os.makedirs(tmp_path / "a")
    for s in localwrite.shard_boxes(layout, zero, shape):
        localwrite.write_shard_file(str(tmp_path / "a"), layout, s, a, zero, got)
        lo = tuple(i * n for i, n in zip(s, shard))
        box = a[tuple(slice(o, o + n) for o, n in zip(lo, shard))]
        fmt.box_unit_digests(dtype, shape, lo, box, want)
    assert got and got == want
    fmt.read_missing_units(dtype, shape, got, lambda box: a[tuple(slice(*r) for r in box)])
    assert fmt.units_hash(dtype, shape, got) == fmt.content_hash(a)
