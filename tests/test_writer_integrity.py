"""The writer's data integrity (issue 30 items 1, 9 and 10).

1. ``write`` owns a copy of the tensor before it returns (bounded by the writer's window): a tensor changed in
   place afterwards is neither committed half-changed nor hashed as something it is not.
9. An array a pending save deduplicated against that a concurrent rm/gc sweeps between the writer's check and
   its row insert is written again: the save commits (SQLite and PostgreSQL).
10. One content-hash scheme for every save path: identical bits get identical hashes whatever the path and
    the storage chunk grid, ``diff`` says "same", and the second save deduplicates; a hash of an older scheme
    against the current one diffs by the data.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import update

import ucp_store
from ucp_store import patterns as pat
from ucp_store.catalog import models as m
from ucp_store.io import format as fmt
from ucp_store.registry.checkpoint import diff
from ucp_store.save.writer import CheckpointWriter
from ucp_store.topology import Topology

from ucp_test_helpers import store_on


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request, tmp_path):
    with store_on(request.param, tmp_path / "s") as st:
        yield st


@pytest.fixture
def local(tmp_path):
    return ucp_store.open_store(str(tmp_path / "l"), create=True)


# --- item 1: write() and the caller's memory -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["tensor", "view", "numpy"])
def test_a_tensor_changed_after_write_is_committed_as_it_was(local, kind):
    """The issue's reproduction: the tensor is zeroed in place after write() returns, inside the with block;
    the version holds the values write() saw, and a later save of those values dedups onto an array that
    really holds them."""
    base = torch.randn(512, 512, generator=_gen(1))
    original = base.clone()
    given = {"tensor": base, "view": base.t(), "numpy": base.numpy()}[kind]
    want = original.t().contiguous() if kind == "view" else original
    with local.begin("r", 1) as w:
        w.write("u", "weight", given)
        base.mul_(0)
    assert torch.equal(local.checkpoint("r@1").read("u", "weight"), want)
    local.save("r", 2, {"u": want.clone()})
    ck = local.checkpoint("r@2")
    assert ck.info("u", "weight").array == local.checkpoint("r@1").info("u", "weight").array  # deduplicated
    assert torch.equal(ck.read("u", "weight"), want)
    assert ck.verify() == []


def test_an_array_object_changed_after_write_object_is_committed_as_it_was(local):
    t = torch.randn(256, 300, generator=_gen(2))
    original = t.clone()
    with local.begin("r", 1) as w:
        w.write("x", "weight", torch.zeros(2))
        w.write_object("rng", t)
        t.add_(1)
    assert torch.equal(local.checkpoint("r@1").objects()["rng"], original)


def test_the_copies_stay_within_the_window(local):
    """A write waits for room in the window of writes in flight before it copies: the bytes the writer holds
    never pass the window (one tensor larger than the window passes alone)."""
    w = local.begin("r", 1)
    w.arrays.window.max_bytes = 3 << 20
    seen = []
    real = w._snapshot

    def snapshot(array, dtype):
        out = real(array, dtype)
        seen.append(w.arrays.window.bytes + array.nbytes)  # held once this copy is submitted
        return out

    w._snapshot = snapshot
    for i in range(8):
        w.write(f"t{i}", "weight", torch.randn(1024, 256, generator=_gen(i)))  # 1 MiB each
    w.write("big", "weight", torch.randn(2048, 1024, generator=_gen(9)))  # 8 MiB: alone in the window
    w.commit()
    assert max(seen[:8]) <= 3 << 20 and seen[8] == 8 << 20
    ck = local.checkpoint("r@1")
    assert torch.equal(ck.read("t3", "weight"), torch.randn(1024, 256, generator=_gen(3)))
    assert ck.verify() == []


def test_write_region_and_write_shard_hash_what_they_wrote(local):
    """write_region and write_shard write straight from the caller's memory (documented: it must not change
    until drain()); changed after drain(), the version holds and hashes the values written."""
    t = torch.randn(96, 64, generator=_gen(3))
    original = t.clone()
    w = local.begin("r", 1)
    w.write_region("a", "fp32", t[:48], shape=(96, 64), offset=(0, 0), pattern=None, origin=True)
    w.write_region("a", "fp32", t[48:], shape=(96, 64), offset=(48, 0), pattern=None)
    w.write_shard("b", "fp32", t, shape=(96, 64), pattern=None, topology=Topology(), rank=0, digest=True)
    for key, d in w.shard_digests().items():  # drains first
        w.set_chunk_digests(key[0], key[1], d)
    t.mul_(0)  # after drain: allowed
    ck = w.commit()
    for name in ("a", "b"):
        assert torch.equal(ck.read(name, "fp32"), original)
        assert ck.info(name, "fp32").content_hash == fmt.content_hash(original.numpy())
    assert ck.verify() == []


# --- item 9: a sweep between the writer's check and its row insert ---------------------------------------------

def _sweep_after_settle(monkeypatch, store, victim: str):
    """Run ``rm victim`` and ``gc`` right after the writer's own check that its dedup targets exist (the
    window the issue names), once."""
    real = CheckpointWriter._settle
    done = []

    def settle(self):
        real(self)
        if not done and self.store is store:
            done.append(True)
            array = store.checkpoint(victim).tensors()[0].array_id
            store.rm(victim)
            store.gc()
            with store.catalog.session() as s:  # the array the save deduplicated against is gone
                assert s.get(m.Array, array) is None
    monkeypatch.setattr(CheckpointWriter, "_settle", settle)
    return done


def test_a_dedup_target_swept_before_the_commit_is_written_again(store, monkeypatch):
    t = torch.randn(64, 64, generator=_gen(9))
    store.save("a", 1, {"x": t.clone()})
    done = _sweep_after_settle(monkeypatch, store, "a@1")
    w = store.begin("b", 1)
    w.write("x", "weight", t)
    ck = w.commit()
    assert done and [(c["run"], c["step"]) for c in store.list_checkpoints()] == [("b", 1)]
    assert torch.equal(ck.read("x", "weight"), t)
    assert ck.verify() == []
    assert store.gc().removed_arrays == 0  # the copy written again is the version's own


def test_a_dedup_target_swept_before_a_flush_is_written_again(store, monkeypatch):
    t = torch.randn(64, 64, generator=_gen(10))
    store.save("a", 1, {"x": t.clone()})
    done = _sweep_after_settle(monkeypatch, store, "a@1")
    w = store.begin("b", 1)
    w.write("x", "weight", t)
    w.flush()
    w.write("y", "weight", torch.ones(3))
    ck = w.commit()
    assert done and torch.equal(ck.read("x", "weight"), t) and ck.verify() == []


def test_a_joined_ranks_swept_dedup_target_aborts_and_says_why(store):
    """Rows a joined rank handed over name an array this process never held: swept before the commit, the
    save aborts with an error that says so (nothing listed), never a foreign-key error."""
    t = torch.randn(16, 16, generator=_gen(11))
    store.save("a", 1, {"x": t.clone()})
    owner = store.begin("b", 1)
    joined = store.join(owner.id)
    joined.write("x", "weight", t)
    rows = joined.export_rows()
    store.rm("a@1")
    store.gc()
    with pytest.raises(ucp_store.errors.CommitRaceError, match=r"another rank of this save.*removed by a "
                                                               r"concurrent rm/gc.*nothing is listed"):
        owner.commit(extra_rows=rows)
    assert store.list_checkpoints() == []


# --- item 10: one content-hash scheme ---------------------------------------------------------------------------

def _fragments(w, name, t, topo):
    """Every DP rank's ZeRO-1 fragment of ``t`` through ``write_shard(digest=True)``, digests merged."""
    group = pat.zero_group_layout([t.numel()], topo.dp, 1)
    for rank in range(topo.dp):
        f = group.fragment(0, rank)
        if f is not None and f.slot:
            w.write_shard(name, "fp32", t.reshape(-1)[f.start:f.stop], shape=tuple(t.shape), pattern=None,
                          topology=topo, rank=rank, fragment=f, digest=True)
    for key, d in w.shard_digests().items():
        w.set_chunk_digests(key[0], key[1], d)


def test_identical_bits_hash_alike_on_every_save_path(local):
    """Whole-tensor save, ZeRO fragments with digests (the DeepSpeed engine's path, chunks aligned to dp=3
    and a declared target), TP column shards (each rank digests its own tiles), and DTensor-style boxes:
    one hash, diff "same", and every later path deduplicates onto the first path's array."""
    t = torch.randn(200, 3000, generator=_gen(4))  # tiles of [25, 375]: cut by dp=3 fragments, not by tp=2
    local.save("whole", 1, {"w": {"fp32": t.clone()}})
    local.save("whole", 2, {"w": t.clone()})  # state "weight", as ucp_store.distributed saves it
    w = local.begin("zero", 1)
    _fragments(w, "w", t, Topology(dp=3, zero_stage=1))
    w.commit()
    w = local.begin("tp", 1)
    topo = Topology(tp=2)
    part = {"kind": "partitioned", "dim": 1}
    for rank in range(2):
        shard = pat.local_layout(part, tuple(t.shape), topo, rank, name="w")
        w.write_shard("w", "fp32", t[:, rank * 1500:(rank + 1) * 1500].contiguous(), shape=tuple(t.shape),
                      pattern=part, topology=topo, rank=rank, targets=[Topology(tp=4)], digest=True)
        assert tuple(shard.shape) == (200, 1500)
    for key, d in w.shard_digests().items():
        w.set_chunk_digests(key[0], key[1], d)
    w.commit()
    import ucp_store.distributed as ucpd

    ucpd.save({"w": t.clone()}, store=local, run="dist", step=1, progress=False)
    infos = {r: local.checkpoint(f"{r}@1").tensors()[0] for r in ("whole", "zero", "tp", "dist")}
    want = fmt.content_hash(t.numpy())
    assert {r: i.content_hash for r, i in infos.items()} == dict.fromkeys(infos, want)
    arrays = {i.array for i in infos.values()}
    assert len(arrays) == 1, arrays  # each later save deduplicated onto the first one's array
    for r in ("zero", "tp", "dist"):
        rows = diff(local.checkpoint("whole@2" if r == "dist" else "whole@1"), local.checkpoint(f"{r}@1"))
        assert [x["status"] for x in rows] == ["same"], (r, rows)
        assert local.checkpoint(f"{r}@1").verify() == []


def test_the_hash_does_not_depend_on_the_chunk_grid(tmp_path):
    t = np.random.default_rng(0).standard_normal((300, 5000)).astype(np.float32)
    hashes = set()
    for kib in (128, 1024, 8192):
        st = ucp_store.open_store(str(tmp_path / f"s{kib}"), create=True, chunk_target_bytes=kib << 10)
        st.save("r", 1, {"w": torch.from_numpy(t)})
        info = st.checkpoint("r@1").info("w", "weight")
        hashes.add((info.content_hash, tuple(info.chunk_shape)))
    assert len({h for h, _ in hashes}) == 1 and len({c for _, c in hashes}) == 3


def _legacy(store, ref: str, name: str, state: str, h: str) -> None:
    ck = store.checkpoint(ref)
    info = ck.info(name, state)
    with store.catalog.write_session() as s:
        s.execute(update(m.Tensor).where(m.Tensor.checkpoint_id == ck.id, m.Tensor.name == name)
                  .values(content_hash=h))
        s.execute(update(m.Array).where(m.Array.id == info.array_id).values(content_hash=h))


def test_a_version_hashed_by_an_older_scheme_diffs_by_its_data(store):
    """Rows saved before the one scheme keep their hashes (``xxh3-128:`` whole-array, ``xxh3-128-chunks:``
    per storage chunk): verify recomputes them in their scheme, and diff against a current-scheme row of the
    same bits says "same" (the data decides), of other bits "changed"."""
    t = torch.randn(40, 50, generator=_gen(5))
    store.save("old", 1, {"w": t.clone(), "c": t.clone() + 1})
    # the two older schemes, computed here from their definitions
    head = b"float32:40,50;"
    _legacy(store, "old@1", "w", "weight", "xxh3-128:" + xxhash.xxh3_128(head + t.numpy().tobytes()).hexdigest())
    layout = store.checkpoint("old@1").tensor("c", "weight").layout
    c = (t + 1).numpy()
    tree = xxhash.xxh3_128(b"float32:40,50/" + ",".join(map(str, layout.chunk_shape)).encode() + b";")
    for i in range(-(-40 // layout.chunk_shape[0])):
        for j in range(-(-50 // layout.chunk_shape[1])):
            ci, cj = layout.chunk_shape
            tree.update(xxhash.xxh3_128_digest(c[i * ci:(i + 1) * ci, j * cj:(j + 1) * cj].tobytes()))
    _legacy(store, "old@1", "c", "weight", "xxh3-128-chunks:" + tree.hexdigest())
    old = store.checkpoint("old@1")
    assert old.verify() == []  # each recomputed in the scheme it was recorded in
    store.save("new", 1, {"w": t.clone(), "c": t.clone() + 2})
    new = store.checkpoint("new@1")
    assert new.info("w", "weight").content_hash == fmt.content_hash(t.numpy())
    got = {r["name"]: r for r in diff(old, new)}
    assert got["w"]["status"] == "same" and got["w"]["relative_change"] == 0.0
    assert got["c"]["status"] == "changed" and got["c"]["relative_change"] > 0
    store.save("new", 2, {"w": t.clone(), "c": t.clone() + 1})
    assert {r["name"]: r["status"] for r in diff(old, store.checkpoint("new@2"))} == {"w": "same", "c": "same"}


def _count_reads(monkeypatch) -> list[int]:
    """Elements read back from stored arrays by the save paths' hashing (``fmt.read_box``), appended per read."""
    reads: list[int] = []
    real = fmt.read_box

    def read_box(handle, layout, box, **kw):
        out = real(handle, layout, box, **kw)
        reads.append(out.size)
        return out
    monkeypatch.setattr(fmt, "read_box", read_box)
    return reads


def _regions(w, name: str, t: torch.Tensor, splits: dict[int, int]) -> dict:
    """Every box of ``t`` split evenly ``splits[dim]`` ways per dim, through ``write_region`` from a contiguous
    local copy (a DTensor shard as a rank holds it); returns the merged unit digests, handed to the origin."""
    import itertools

    shape = tuple(t.shape)
    ranges = [[(i * s // splits.get(d, 1), (i + 1) * s // splits.get(d, 1)) for i in range(splits.get(d, 1))]
              for d, s in enumerate(shape)]
    bounds = {d: {a for r in ranges[d] for a in r} for d in splits}
    for box in itertools.product(*ranges):
        local = t[tuple(slice(a, b) for a, b in box)].contiguous()
        w.write_region(name, "fp32", local, shape=shape, offset=tuple(a for a, _ in box), pattern=None,
                       boundaries=bounds, origin=all(a == 0 for a, _ in box))
    merged: dict = {}
    for key, d in w.region_digests().items():
        merged.update(d)
        w.set_chunk_digests(key[0], key[1], d)
    return merged


def _shards(w, name: str, t: torch.Tensor, dim: int, tp: int) -> dict:
    """TP shards of ``t`` along ``dim`` through ``write_shard(digest=True)`` (the DeepSpeed engine's path)."""
    topo, part = Topology(tp=tp), {"kind": "partitioned", "dim": dim}
    for rank, local in enumerate(torch.chunk(t, tp, dim=dim)):
        w.write_shard(name, "fp32", local.contiguous(), shape=tuple(t.shape), pattern=part, topology=topo,
                      rank=rank, digest=True)
    merged: dict = {}
    for key, d in w.shard_digests().items():
        merged.update(d)
        w.set_chunk_digests(key[0], key[1], d)
    return merged


def test_every_split_of_a_3d_tensor_hashes_alike_and_aligned_splits_read_nothing_back(local, monkeypatch):
    """An [E, out, in] tensor saved whole, as ZeRO fragments of odd sizes, as TP shards of dim 1 (Shard(0) of
    each expert's weight) and of dim 2 (Shard(1): row-parallel, which cut every row under the former row
    units and so was read back whole), as EP slices (dim 0) and as 2-D boxes (EP x TP): one hash, one array.
    The power-of-two splits hold every tile of the hash: their digests leave no unit missing and nothing is
    read back; the ZeRO fragment boundaries cut a few tiles, and only those are read back."""
    t = torch.randn(8, 256, 512, generator=_gen(12))  # tiles [1, 64, 64]: 8 x 4 x 8 of them
    want = fmt.content_hash(t.numpy())
    shape = tuple(t.shape)
    reads = _count_reads(monkeypatch)
    local.save("whole", 1, {"w": {"fp32": t.clone()}})
    assert reads == []
    saves = {
        "tp-dim1": lambda w: _shards(w, "w", t, 1, 4),
        "tp-dim2": lambda w: _shards(w, "w", t, 2, 8),
        "ep": lambda w: _regions(w, "w", t, {0: 8}),
        "ep-x-tp": lambda w: _regions(w, "w", t, {0: 4, 2: 8}),
    }
    for run, save in saves.items():
        w = local.begin(run, 1)
        digests = save(w)
        assert fmt.missing_units("float32", shape, digests) == [], run  # every tile digested by its rank
        assert fmt.units_hash("float32", shape, digests) == want, run
        w.commit()
        assert reads == [], run  # nothing read back
    w = local.begin("zero", 1)
    _fragments(w, "w", t, Topology(dp=3, zero_stage=1))  # 1398101 + 1398101 + 1398102 elements
    w.commit()
    assert 0 < sum(reads) <= 2 * 4 * 64 * 512  # the two tile-rows (4 tiles of [1, 64, 64] each) the cuts fall in
    infos = {r: local.checkpoint(f"{r}@1").info("w", "fp32") for r in ["whole", *saves, "zero"]}
    assert {r: i.content_hash for r, i in infos.items()} == dict.fromkeys(infos, want)
    assert len({i.array for i in infos.values()}) == 1  # every later save deduplicated onto the first array
    monkeypatch.undo()
    assert local.checkpoint("ep-x-tp@1").verify() == []


def test_a_column_split_hash_does_not_depend_on_the_chunk_target(tmp_path, monkeypatch):
    """TP column shards (Shard(1), tp=8) saved into stores of three chunk targets: one hash, the whole
    tensor's, with nothing read back, whatever chunk grid each store chose."""
    t = torch.randn(300, 5000, generator=_gen(13))  # tiles [75, 625]
    reads = _count_reads(monkeypatch)
    seen = set()
    for kib in (128, 1024, 8192):
        st = ucp_store.open_store(str(tmp_path / f"s{kib}"), create=True, chunk_target_bytes=kib << 10)
        w = st.begin("r", 1)
        _shards(w, "w", t, 1, 8)
        w.commit()
        info = st.checkpoint("r@1").info("w", "fp32")
        seen.add((info.content_hash, tuple(info.chunk_shape)))
    assert {h for h, _ in seen} == {fmt.content_hash(t.numpy())} and len(seen) > 1
    assert reads == []


# shapes of real parameters (LLaMA/Qwen/Mixtral-like): tile properties must hold for every one
_REAL_SHAPES = [(4096, 4096), (11008, 4096), (14336, 4096), (128256, 8192), (151936, 3584), (50257, 768),
                (32000, 4096), (8, 14336, 4096), (64, 1408, 2048), (4096,), (1,), (3, 7), (1 << 33,),
                (256, 7168, 2048), (2, 1000003)]


@pytest.mark.parametrize("shape", _REAL_SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_tile_grid_holds_the_splits_and_stays_sane(shape, dtype):
    """The tiles of the content hash (a function of dtype and shape alone): at least 16 KiB (or the whole
    array), about 16384 of them at most however large the tensor, a block of the stream (what a hasher fed
    slab by slab buffers) of at most 64 MiB or 1/32 of the array; and in an array of 16 MiB or more every even
    power-of-two split <= 64 of dim 0 (EP, ZeRO/FSDP rows) and <= 16 of every other dim (TP) falls on tile
    edges (smaller arrays trade splits for the 16 KiB floor; the last dim keeps those that leave 256 B)."""
    itemsize = 2 if dtype == "bfloat16" else 4
    tile = fmt.tile_shape(shape, itemsize)
    t = fmt._Tiles.of(dtype, shape)
    assert t.tile == tile
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    tbytes = int(np.prod(tile, dtype=np.int64)) * itemsize
    assert min(nbytes, 16 << 10) <= tbytes <= max(256 << 10, 4 * -(-nbytes // (1 << 14)))
    assert t.count <= 2 << 14
    assert tile[t.j] * t.row_bytes <= max(64 << 20, nbytes // 32)
    if nbytes >= 16 << 20:
        for d, (s, x) in enumerate(zip(shape, tile)):
            for p in (2, 4, 8, 16, 32, 64):
                if p <= (64 if d == 0 else 16) and s % p == 0 and (d < len(shape) - 1 or s // p * itemsize >= 256):
                    assert (s // p) % x == 0, (shape, tile, d, p)


def _tilings(shape, draw):
    """Boxes that tile the array: per dim, sorted random cut points (a grid of boxes)."""
    import itertools

    cuts = []
    for s in shape:
        pts = sorted(set(draw(st.lists(st.integers(1, max(1, s - 1)), max_size=3)))) if s > 1 else []
        edges = [0, *pts, s]
        cuts.append([(a, b) for a, b in zip(edges, edges[1:]) if a < b])
    return list(itertools.product(*cuts))


@st.composite
def _hash_cases(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.sampled_from([1, 3, 8, 24, 64, 96, 128, 130, 256])) for _ in range(ndim))
    dtype = draw(st.sampled_from(["uint8", "float16", "float32", "float64", "complex128"]))
    kind = draw(st.sampled_from(["grid", "flat", "pow2"]))
    return shape, dtype, kind, draw(st.data())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_hash_cases())
def test_box_digests_and_read_back_give_the_whole_tensor_hash(case):
    """For random shapes, dtypes and tilings of the array into boxes (a grid, ZeRO-like flat fragments, or an
    even power-of-two split of one dim), each box digesting its whole tiles from memory (a strided view, a
    contiguous copy or a Fortran-order one) plus a read-back of the missing tiles gives the whole-tensor hash,
    as does the hasher fed in pieces of any size; a split that falls on tile edges leaves no tile missing."""
    from ucp_store.geometry import flat_range_to_boxes

    shape, dtype, kind, data = case
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    a = rng.integers(0, 256, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    a = a.view(dtype).reshape(shape)
    want = fmt.content_hash(a)
    if kind == "grid":
        boxes = _tilings(shape, data.draw)
    elif kind == "flat" and a.size:
        cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, a.size - 1)), max_size=4))))
        edges = [0, *cuts, a.size] if a.size > 1 else [0, a.size]
        boxes = [b.ranges for lo, hi in zip(edges, edges[1:]) for b in flat_range_to_boxes(shape, lo, hi)] \
            if shape else [()]
    else:
        dims = [d for d, s in enumerate(shape) if s % 2 == 0]
        d = data.draw(st.sampled_from(dims)) if dims else None
        parts = 1
        if d is not None:
            while parts < 64 and shape[d] % (parts * 2) == 0 and data.draw(st.booleans()):
                parts *= 2
        boxes = [tuple((i * s // parts, (i + 1) * s // parts) if dd == d else (0, s) for dd, s in enumerate(shape))
                 for i in range(parts)] if shape else [()]
    digests: dict = {}
    for box in boxes:
        view = a[tuple(slice(lo, hi) for lo, hi in box)]
        local = data.draw(st.sampled_from([lambda x: x, np.ascontiguousarray, np.asfortranarray]))(view)
        fmt.box_unit_digests(dtype, shape, tuple(lo for lo, _ in box), local, digests)
    if kind == "pow2" and (d is None or (shape[d] // parts) % fmt.tile_shape(shape, a.itemsize)[d] == 0):
        # the split falls on tile edges (a small array grown to the 16 KiB floor keeps fewer splits)
        assert fmt.missing_units(dtype, shape, digests) == []
    read = []
    fmt.read_missing_units(dtype, shape, digests, lambda box: read.append(box) or a[tuple(slice(*r) for r in box)])
    assert fmt.units_hash(dtype, shape, digests) == want
    h = fmt.ContentHasher(dtype, shape)
    flat = a.reshape(-1)
    i = 0
    while i < flat.size:
        n = data.draw(st.integers(1, max(1, flat.size)))
        h.update(flat[i:i + n])
        i += n
    if not flat.size:
        h.update(a)
    assert h.hexdigest() == want
    t = fmt._Tiles.of(dtype, shape)  # one pass, holding at most one block of the stream
    assert h._buf is None or h._buf.size == t.tile[t.j] * t.row_bytes
