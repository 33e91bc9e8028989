"""Delta versions (issue 39, storage side): XOR deltas of a base version's arrays, the auto policy, chains and
keyframes, gc/rm/retention under deltas, corruption, and the standard format of the delta arrays.

Real stores in tmp_path (SQLite; the catalog tests cover PostgreSQL's schema), real TensorStore and
zarr-python reads of the delta files.
"""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucp_store
from ucp_store import config
from ucp_store.errors import ChecksumError, ConfigurationError
from ucp_store.io import delta as dl
from ucp_store.io import deltaio
from ucp_store.io import format as fmt
from ucp_store.io.location import Location
from ucp_store.save.writer import CheckpointWriter

from ucp_test_helpers import flip_byte, moto_s3, postgres_schema_url, shard_file_and_range

DTYPES = {
    "bfloat16": (torch.bfloat16, ml_dtypes.bfloat16),
    "float16": (torch.float16, np.float16),
    "float32": (torch.float32, np.float32),
    "float8_e4m3fn": (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
    "float8_e5m2": (torch.float8_e5m2, ml_dtypes.float8_e5m2),
}
CHUNK, SHARD = (8, 16), (16, 32)  # small grids: a (40, 48) tensor is 5 x 3 chunks in 3 x 2 shard files
SHAPE = (40, 48)


@pytest.fixture
def tiny_layout(monkeypatch):
    """Writers use CHUNK/SHARD for 2-d tensors (many chunks and shard files, edge chunks included)."""
    def _layout(self, shape, dtype, pattern, boundaries=None, shard_shape=None, units=None):
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2 or 0 in shape:
            return fmt.plan_layout(shape, dtype)
        return fmt.ArrayLayout(dtype, shape, CHUNK, SHARD)

    monkeypatch.setattr(CheckpointWriter, "_layout", _layout)
    with config.override(delta_min_bytes=1):
        yield


def _bits(t: torch.Tensor) -> np.ndarray:
    return dl.bits(t.contiguous().view(torch.uint8).numpy().view(np.uint8)).copy()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((_bits(a) == _bits(b)).all())


def _random(shape, dtype: str, seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` (NaN payloads, -0.0, subnormals: every pattern)."""
    tdt = DTYPES[dtype][0]
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * tdt.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(tdt).reshape(shape)


def _change(t: torch.Tensor, mask: np.ndarray, seed: int) -> torch.Tensor:
    """``t`` with the elements under ``mask`` given other random bits."""
    new = _random(t.shape, str(t.dtype).removeprefix("torch."), seed)
    out = t.clone()
    m = torch.from_numpy(mask)
    out.view(torch.uint8).view(-1, t.element_size())[m.reshape(-1)] = new.view(torch.uint8).view(
        -1, t.element_size())[m.reshape(-1)]
    return out


# --- the bit math ---------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(sorted(DTYPES)), n=st.integers(1, 300), seed=st.integers(0, 2**31 - 1),
       density=st.floats(0, 1))
def test_xor_round_trips_every_dtype_bit_exactly(dtype, n, seed, density):
    a = _random((n,), dtype, seed)
    mask = np.random.default_rng(seed + 1).random(n) < density
    b = _change(a, mask, seed + 2)
    an = a.view(torch.uint8).numpy().view(DTYPES[dtype][1])
    bn = b.view(torch.uint8).numpy().view(DTYPES[dtype][1])
    d = dl.xor(bn, an)
    assert d.dtype.itemsize == a.element_size() and d.dtype.kind == "u"
    assert int(np.count_nonzero(d)) <= int(mask.sum())
    out = an.copy()
    dl.xor_into(out, d)
    assert (dl.bits(out) == dl.bits(bn)).all()
    t = a.clone()
    dl.xor_tensor_(t, d)  # torch, in place (the puller's path; works on a GPU tensor the same way)
    assert _same(t, b)
    strided = np.zeros((n, 2), an.dtype)[:, 0]  # a strided destination
    strided[...] = an
    dl.xor_into(strided, d)
    assert (dl.bits(np.ascontiguousarray(strided)) == dl.bits(bn)).all()


def test_delta_files_are_standard_zarr(tmp_path):
    """TensorStore and zarr-python read the delta array (missing chunks as 0); its stored chunks are exactly
    the non-zero ones, listed from the shard indexes alone; every shard file exists."""
    import tensorstore as ts
    import zarr

    loc = Location.parse(str(tmp_path))
    base = fmt.ArrayLayout("bfloat16", SHAPE, CHUNK, SHARD)
    a = _random(SHAPE, "bfloat16", 1).view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    b = a.copy()
    b[3, 5] = 1.5
    b[39, 40:] = -2.0  # the last row's edge chunk
    for codec in deltaio.DELTA_CODECS:
        layout = deltaio.delta_layout(base, codec)
        d = dl.xor(b, a)
        enc = deltaio.encode_delta(layout, d)
        rel = f"arrays/x/{codec}.zarr"
        for f in deltaio.write_delta(loc, rel, layout, enc, fmt.make_context()):
            f.result()
        assert enc.chunks == len(dl.nonzero_chunks(d, layout)) == 2 and enc.total_chunks == 15
        assert sorted(enc.files) == ["c/0/0", "c/0/1", "c/1/0", "c/1/1", "c/2/0", "c/2/1"]
        got = ts.open(deltaio.delta_spec(loc, rel, layout)).result().read().result()
        assert (dl.bits(got) == d).all()
        z = zarr.open_array(str(tmp_path / rel), mode="r")
        assert (dl.bits(np.asarray(z[:])) == d).all()
        kv = deltaio.open_kvstore(loc, rel)
        assert dl.stored_chunks(kv, layout, ((0, 40), (0, 48))) == sorted(dl.nonzero_chunks(d, layout))
        assert dl.stored_chunks(kv, layout, ((0, 8), (0, 48))) == [(0, 0)]
        assert dl.stored_chunks(kv, layout, ((8, 32), (0, 48))) == []
        assert enc.nbytes == sum(p.stat().st_size for p in (tmp_path / rel / "c").rglob("*") if p.is_file())


# --- saves: chains, keyframes, every read path --------------------------------------------------------------------

@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**31 - 1),
       patterns=st.lists(st.sampled_from(["none", "one", "row", "sparse", "block", "all"]), min_size=2, max_size=6),
       keyframe=st.integers(1, 4), codec=st.sampled_from(deltaio.DELTA_CODECS))
def test_delta_versions_round_trip(tmp_path_factory, tiny_layout, dtype, seed, patterns, keyframe, codec):
    """Versions saved with delta="auto" over random change patterns read back bit-exact (Checkpoint reads,
    slices, load_shard, state_dict), verify clean, keep chains within the keyframe bound, and a tensor equal
    to its base stays a plain dedup."""
    store = ucp_store.open_store(str(tmp_path_factory.mktemp("d") / "s"), create=True)
    rng = np.random.default_rng(seed)
    w = _random(SHAPE, dtype, seed)
    versions = [w]
    with config.override(delta_keyframe_every=keyframe, delta_max_fraction=1.0, delta_codec=codec):
        store.save("r", 0, {"w": w, "v": w[:1].clone()}, delta="auto")
        for step, pat in enumerate(patterns, 1):
            mask = np.zeros(SHAPE, bool)
            if pat == "one":
                mask[tuple(rng.integers(0, s) for s in SHAPE)] = True
            elif pat == "row":
                mask[rng.integers(0, SHAPE[0])] = True
            elif pat == "sparse":
                mask = rng.random(SHAPE) < 0.02
            elif pat == "block":
                mask[8:24, 16:40] = True
            elif pat == "all":
                mask[...] = True
            w = _change(w, mask, seed + step)
            versions.append(w)
            store.save("r", step, {"w": w, "v": versions[0][:1].clone()}, delta="auto")
    depth, prev_array = 0, None
    for step, want in enumerate(versions):
        ck = store.checkpoint(f"r@{step}")
        info = ck.info("w", "weight")
        if step and _same(want, versions[step - 1]):
            assert info.array_id == prev_array  # unchanged: the same array (plain dedup), whatever its encoding
        elif step == 0 or depth + 1 >= keyframe:
            depth = 0  # the first version, or a keyframe is due
            assert info.encoding == "plain", (step, patterns)
        elif patterns[step - 1] != "all":  # a partial change always fits under delta_max_fraction=1.0
            depth += 1
            assert info.encoding == "xor", (step, patterns)
        else:  # every element new: a delta of random bits is no smaller than the array, so it is stored full
            depth = 0 if info.encoding == "plain" else depth + 1
        assert info.depth == depth < max(keyframe, 1), (step, patterns)
        prev_array = info.array_id
        assert ck.info("v", "weight").encoding == "plain"  # identical to its base: plain dedup
        assert _same(ck.read("w", "weight"), want)
        assert _same(ck.read("w", "weight", (slice(3, 37), slice(5, 45))), want[3:37, 5:45])
        assert _same(ck.read("w", "weight", 39), want[39])
        shard = ck.load_shard(ucp_store.Topology(tp=1), 0)
        assert _same(shard[("w", "weight")], want)
        assert _same(ck.state_dict("weight")["w"], want)
        assert ck.verify() == []


def test_load_shard_tp_boxes_and_torchstore_reads(store, tiny_layout):
    """TP=2 boxes (partitioned pattern) of a delta version, through the local and the TensorStore read paths."""
    w0 = torch.randn(SHAPE)
    w1 = w0.clone()
    w1[1, 2] += 1
    w1[30:33, 40:] *= 2
    pattern = {"kind": "partitioned", "dim": 1}
    store.save("r", 0, {"w": w0}, patterns={"w": pattern}, state="fp32")
    ck = store.save("r", 1, {"w": w1}, patterns={"w": pattern}, state="fp32", delta="auto")
    assert ck.info("w").encoding == "xor"
    for local in (True, False):
        with config.override(local_read=local):
            ck = store.checkpoint("r@1")
            for rank in range(2):
                got = ck.load_shard(ucp_store.Topology(tp=2), rank)[("w", "fp32")]
                assert torch.equal(got, w1[:, rank * 24:(rank + 1) * 24])


def test_auto_policy_falls_back_to_full_and_never_exceeds_it(store, tiny_layout):
    """A dense change (every bit pattern new) is stored in full: stored bytes never pass 1.02x the full
    array; a sparse one is a delta far below the fraction. ls's stored bytes say so."""
    w0 = _random(SHAPE, "float32", 3)
    store.save("r", 0, {"w": w0})
    dense = _random(SHAPE, "float32", 4)
    ck = store.save("r", 1, {"w": dense}, delta="auto")
    full = ck.info("w").nbytes
    assert ck.info("w").encoding == "plain"
    sql = "SELECT stored_nbytes FROM arrays WHERE id = '{}'"
    v0, v1 = (store.query(sql.format(store.checkpoint(r).info("w").array_id))[1][0][0] for r in ("r@0", "r@1"))
    assert v1 <= 1.02 * v0  # the full array's own size (this layout's crc and index overhead included), no more
    sparse = dense.clone()
    sparse[7, 7] = 0.5
    ck = store.save("r", 2, {"w": sparse}, delta="auto")
    assert ck.info("w").encoding == "xor"
    stored = store.query(f"SELECT stored_nbytes FROM arrays WHERE id = '{ck.info('w').array_id}'")[1][0][0]
    assert stored < config.current().delta_max_fraction * full
    with config.override(delta_max_fraction=1e-6):  # nothing is small enough: full, not a byte more
        ck = store.save("r", 3, {"w": _change(sparse, np.eye(40, 48, dtype=bool), 5)}, delta="auto")
    assert ck.info("w").encoding == "plain"
    with pytest.raises(ConfigurationError, match="delta="):
        store.save("r", 4, {"w": sparse}, delta="yes")
    with pytest.raises(ConfigurationError, match="delta_max_fraction"):
        config.current().replace(delta_max_fraction=1.5)


def test_run_setting_turns_deltas_on(store, tiny_layout):
    w = torch.randn(SHAPE)
    store.save("r", 0, {"w": w})
    store.run_delta("r", "auto")
    w[0, 0] += 1
    assert store.save("r", 1, {"w": w}).info("w").encoding == "xor"
    w[0, 1] += 1
    assert store.save("r", 2, {"w": w}, delta="off").info("w").encoding == "plain"
    assert store.run_delta("r", None) == "off"
    w[0, 2] += 1
    assert store.save("r", 3, {"w": w}).info("w").encoding == "plain"


# --- gc, rm and retention under deltas ----------------------------------------------------------------------------

def _chain(store, n: int) -> list[torch.Tensor]:
    w = torch.randn(SHAPE)
    out = []
    for step in range(n):
        if step:
            w = w.clone()
            w[step % 40, step] += 1
        out.append(w)
        store.save("r", step, {"w": w}, delta="auto")
    return out


def _array_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in (root / "arrays").glob("*/*.zarr")}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_store(request, store_path):
    """A fresh store whose catalog is SQLite or PostgreSQL (a schema of its own)."""
    if request.param == "sqlite":
        yield ucp_store.open_store(str(store_path), create=True)
        return
    with postgres_schema_url() as url:
        store = ucp_store.open_store(str(store_path), create=True, catalog=url)
        yield store
        store.catalog.engine.dispose()


def test_rm_and_gc_keep_bases_while_needed(any_store, store_path, tiny_layout):
    store = any_store
    vals = _chain(store, 5)  # r@0 plain, r@1..4 deltas (depths 1..4)
    assert [store.checkpoint(f"r@{i}").info("w").depth for i in range(5)] == [0, 1, 2, 3, 4]
    files = _array_files(store_path)
    assert len(files) == 5
    store.rm("r@0")
    store.rm("r@2")
    assert _array_files(store_path) == files  # every array is a base of r@4's chain: nothing freed
    for i in (1, 3, 4):
        ck = store.checkpoint(f"r@{i}")
        assert torch.equal(ck.read("w"), vals[i]) and ck.verify() == []
    report = store.gc(keep_last=1)  # only r@4 left: its chain (4 arrays + keyframe) still needed
    assert sorted(report.removed_checkpoints) and report.removed_arrays == 0
    assert _array_files(store_path) == files
    assert torch.equal(store.checkpoint("r@4").read("w"), vals[4])
    store.rm("r@4")  # the last reader: the whole chain goes, deltas before bases
    assert _array_files(store_path) == set()
    assert store.query("SELECT count(*) FROM arrays")[1] == [(0,)]


def test_retention_counts_bases_across_keyframes(any_store, store_path, tiny_layout):
    store = any_store
    with config.override(delta_keyframe_every=3):
        vals = _chain(store, 7)  # depths 0 1 2 | 0 1 2 | 0
    assert [store.checkpoint(f"r@{i}").info("w").depth for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    dry = store.gc(keep_last=2, dry_run=True)
    report = store.gc(keep_last=2)  # keeps r@5 (depth 2 over r@3's keyframe) and r@6 (a keyframe)
    assert report.removed_arrays == dry.removed_arrays == 3  # r@0..r@2's chain; r@3, r@4 stay as bases
    for i in (5, 6):
        ck = store.checkpoint(f"r@{i}")
        assert torch.equal(ck.read("w"), vals[i]) and ck.verify() == []
    assert len(_array_files(store_path)) == 4


# --- corruption ---------------------------------------------------------------------------------------------------

def test_corrupt_delta_chunk_is_caught_on_read_and_by_verify(store, store_path, tiny_layout, ucp):
    w0 = torch.randn(SHAPE)
    w1 = w0.clone()
    w1[2, 3] += 1  # chunk (0, 0)
    w1[20, 40] += 1  # chunk (2, 2)
    store.save("r", 0, {"w": w0})
    ck = store.save("r", 1, {"w": w1}, delta="auto")
    info = ck.info("w")
    assert info.encoding == "xor"
    path, off, n = shard_file_and_range(store_path, info, (2, 2))
    flip_byte(path, off + n // 2)
    for local in (True, False):
        with config.override(local_read=local):
            ck = store.checkpoint("r@1")
            with pytest.raises(ChecksumError, match=r"chunk \[2, 2\]"):
                ck.read("w")
            assert torch.equal(ck.read("w", None, (slice(0, 8),)), w1[:8])  # chunk row 0 is intact
    problems = store.checkpoint("r@1").verify()
    assert [p["chunk"] for p in problems] == [[2, 2]] and "crc32c" in problems[0]["error"]
    rc, out, _ = ucp("--store", store_path, "verify", "r@1")
    assert rc == 1
    assert torch.equal(store.checkpoint("r@0").read("w"), w0)  # the base is untouched


def test_missing_delta_shard_file_is_an_error_not_unchanged(store, store_path, tiny_layout):
    w0 = torch.randn(SHAPE)
    w1 = w0.clone()
    w1[2, 3] += 1  # only shard c/0/0 holds a change; c/2/1 is an index alone
    store.save("r", 0, {"w": w0})
    info = store.save("r", 1, {"w": w1}, delta="auto").info("w")
    os.remove(store_path / info.array / "c" / "2" / "1")
    ck = store.checkpoint("r@1")
    with pytest.raises(ChecksumError, match="missing"):
        ck.read("w")
    assert ck.verify()


# --- standard formats stay readable --------------------------------------------------------------------------------

def _flat_tensors(obj, out=None):
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _flat_tensors(v, out)
    return out


def test_exports_of_a_delta_version_write_full_tensors(store, tmp_path):
    """ucp export torch / hf / dcp / deepspeed-universal of a version whose every state is a delta (depth 2)
    write the full tensors, bit for bit."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ucp_store.deepspeed.universal import export_universal
    from ucp_store.formats.dcp.adapter import export_dcp
    from ucp_store.formats.hf.adapter import export_hf
    from ucp_store.formats.torch_file import export_torch_file

    name = "model.layers.0.mlp.up_proj.weight"
    g = torch.Generator().manual_seed(0)
    states = {"fp32": torch.randn(256, 128, generator=g), "exp_avg": torch.randn(256, 128, generator=g),
              "exp_avg_sq": torch.rand(256, 128, generator=g), "weight": torch.randn(256, 128, generator=g).bfloat16()}
    store.save("r", 0, {name: states})
    for step in (1, 2):
        states = {k: v.clone() for k, v in states.items()}
        for v in states.values():
            v.view(-1)[step::97] += 1
        ck = store.save("r", step, {name: states}, delta="auto")
    assert {i.state: i.depth for i in ck.tensors()} == {"fp32": 2, "exp_avg": 2, "exp_avg_sq": 2, "weight": 2}

    export_torch_file(ck, str(tmp_path / "t.pt"), state="weight", progress=False)
    assert _same(torch.load(tmp_path / "t.pt", weights_only=True)[name], states["weight"])

    export_hf(ck, tmp_path / "hf", config={"model_type": "llama"}, progress=False)
    assert _same(load_file(tmp_path / "hf" / "model.safetensors")[name], states["weight"])

    export_dcp(ck, str(tmp_path / "dcp"), progress=False)
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "dcp.pt"))
    got = _flat_tensors(torch.load(tmp_path / "dcp.pt", weights_only=True))
    want = [states[s] for s in ("fp32", "exp_avg", "exp_avg_sq")]
    assert len(got) == 3 and all(any(_same(t, w) for t in got) for w in want)

    folder = export_universal(ck, tmp_path / "uni")
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        saved = torch.load(Path(folder) / "zero" / name / f"{state}.pt", weights_only=True)
        assert _same(_flat_tensors(saved)[0], states[state])


def test_show_and_ls_print_encoding_depth_and_stored_bytes(store, store_path, tiny_layout, ucp):
    w = torch.randn(SHAPE)
    store.save("r", 0, {"w": w, "b": torch.ones(3)})
    w[0, 0] += 1
    ck = store.save("r", 1, {"w": w, "b": torch.ones(3)}, delta="auto")
    rc, out, _ = ucp("--store", store_path, "show", "r@1")
    assert rc == 0
    header = out.splitlines()[1].split()
    assert header[-3:] == ["encoding", "depth", "array"]
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:4]}
    assert rows["w"][-3:-1] == ["xor", "1"] and rows["b"][-3:-1] == ["plain", "0"]
    rc, out, _ = ucp("--store", store_path, "show", "r@1", "--json")
    tensors = {t["name"]: t for t in __import__("json").loads(out)["tensors"]}
    assert tensors["w"]["encoding"] == "xor" and tensors["w"]["depth"] == 1
    assert tensors["w"]["base"] == store.checkpoint("r@0").info("w").array
    rc, out, _ = ucp("--store", store_path, "ls", "r", "--json")
    rows = __import__("json").loads(out)
    delta_bytes = store.query(f"SELECT stored_nbytes FROM arrays WHERE id = '{ck.info('w').array_id}'")[1][0][0]
    assert rows[1]["stored_nbytes"] == delta_bytes < rows[1]["nbytes"] // 10  # b is r@0's array: not counted
    assert rows[0]["stored_nbytes"] >= rows[0]["nbytes"]  # plain: the full array and its index
    rc, out, _ = ucp("--store", store_path, "ls", "r")
    assert out.splitlines()[0].split()[5:7] == ["bytes", "stored"]
    rc, out, _ = ucp("--store", store_path, "delta", "r", "auto")
    assert rc == 0 and "auto" in out and store.run_delta("r") == "auto"
    rc, _, err = ucp("--store", store_path, "delta", "nope", "auto")
    assert rc != 0 and "nope" in err


# --- a bucket (moto's S3 server over real HTTP) -------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_url():
    """A store URL in a fresh bucket of moto's S3 server on a free local port (dummy credentials)."""
    import boto3

    with moto_s3("deltas") as endpoint:
        yield (f"s3://deltas/store?endpoint={endpoint}&region=us-east-1",
               boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1"))


def test_delta_chain_on_a_bucket(s3_url, tmp_path, tiny_layout):
    """Deltas on S3: written through the kvstore, shard indexes read by suffix ranges, reconstructed exactly,
    verified; rm/gc keep the chain's base and free it all once nothing needs it."""
    url, client = s3_url
    store = ucp_store.open_store(url, create=True, catalog=f"sqlite:///{tmp_path}/c.db")
    vals = _chain(store, 3)
    assert [store.checkpoint(f"r@{i}").info("w").depth for i in range(3)] == [0, 1, 2]
    for i, want in enumerate(vals):
        ck = store.checkpoint(f"r@{i}")
        assert torch.equal(ck.read("w"), want) and ck.verify() == []
    store.rm("r@0")
    store.rm("r@1")
    assert torch.equal(store.checkpoint("r@2").read("w"), vals[2])
    store.rm("r@2")
    store.gc()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="deltas", Prefix="store/arrays/").get("Contents", [])]
    assert keys == []


def test_imports_follow_the_run_setting(store, tmp_path, tiny_layout):
    """An import passes no delta=: with the run's policy on, its tensor-states are deltas of the parent."""
    from ucp_store.formats.torch_file import import_torch_file

    w = torch.randn(SHAPE).bfloat16()
    torch.save({"w": w, "n": 3}, tmp_path / "a.pt")
    import_torch_file(store, str(tmp_path / "a.pt"), "imp", 1, progress=False)
    store.run_delta("imp", "auto")
    w2 = w.clone()
    w2[5, 5] = 7
    torch.save({"w": w2, "n": 4}, tmp_path / "b.pt")
    ck = import_torch_file(store, str(tmp_path / "b.pt"), "imp", 2, progress=False)
    assert ck.info("w").encoding == "xor" and _same(ck.read("w"), w2) and ck.verify() == []


def test_corrupt_keyframe_chunk_names_the_base_on_read(store, store_path, tiny_layout):
    w0 = torch.randn(SHAPE)
    w1 = w0.clone()
    w1[2, 3] += 1
    store.save("r", 0, {"w": w0})
    store.save("r", 1, {"w": w1}, delta="auto")
    base = store.checkpoint("r@0").info("w")
    path, off, n = shard_file_and_range(store_path, base, (4, 1))
    flip_byte(path, off + n // 2)
    for local in (True, False):
        with config.override(local_read=local):
            with pytest.raises(ChecksumError, match=rf"chunk \[4, 1\].*in its delta base .*{base.array}"):
                store.checkpoint("r@1").read("w")
    problems = store.checkpoint("r@1").verify()
    assert [p["chunk"] for p in problems] == [[4, 1]] and base.array in problems[0]["error"]


def test_a_base_removed_during_the_save_is_written_in_full(any_store, store_path, tiny_layout):
    """rm of the parent between write() and commit: the base a delta needs is gone, so the save writes that
    tensor in full from the data in hand and commits (no broken chain, no stray files)."""
    store = any_store
    w = torch.randn(SHAPE)
    store.save("r", 0, {"w": w})
    w[1, 1] += 1
    writer = store.begin("r", 1, delta="auto")
    writer.write("w", "weight", w)
    store.rm("r@0")  # its array was only r@0's, and the pending delta's base
    ck = writer.commit()
    info = ck.info("w")
    assert info.encoding == "plain" and torch.equal(ck.read("w"), w) and ck.verify() == []
    assert _array_files(store_path) == {info.array}
    assert store.gc().removed_arrays == 0


def test_a_corrupt_base_is_never_chained_onto(store, store_path, tiny_layout):
    w = torch.randn(SHAPE)
    store.save("r", 0, {"w": w})
    base = store.checkpoint("r@0").info("w")
    path, off, n = shard_file_and_range(store_path, base, (0, 0))
    flip_byte(path, off + 3)
    w[1, 1] += 1
    ck = store.save("r", 1, {"w": w}, delta="auto")
    assert ck.info("w").encoding == "plain" and torch.equal(ck.read("w"), w) and ck.verify() == []
