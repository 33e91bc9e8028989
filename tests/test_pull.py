"""Pull (issue 39): a holder of version M moves to N in place, reading only the delta chunks of its boxes.

Versions are saved with ``delta="auto"`` (keyframes every 3 versions here), so chains have deltas, keyframes
between them, backwards routes and sibling versions. Every pull is compared bit for bit with a full read of N,
and its bytes are checked against an independent count: the shard indexes of the arrays it read plus the
stored bytes of the delta chunks that intersect its box (``io/delta.stored_entries``, the storage side's own
reader of shard indexes)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import ucp_store
from ucp_store import config
from ucp_store.cli import main as ucp_main
from ucp_store.errors import ChecksumError, ValidationError
from ucp_store.io import delta as dl
from ucp_store.io import deltaio
from ucp_store.io import format as fmt
from ucp_store.puller import pull
from ucp_store.registry.pull import chunk_diff, plan_pull

from ucp_test_helpers import moto_s3, postgres_schema_url

SHAPE = (256, 256)  # bf16: 128 KiB; chunks of 32 rows (16 KiB, aligned for 64-way splits): 8 per tensor


def _changed(t: torch.Tensor, rows: list[int], gen: torch.Generator) -> torch.Tensor:
    t = t.clone()
    for r in rows:
        col = int(torch.randint(0, t.shape[1], (1,), generator=gen))
        t[r, col] = t[r, col] + 1.0
    return t


@pytest.fixture
def versions(tmp_path):
    """A run of 7 bf16 versions: v0 full, v1/v2 deltas, v3 a keyframe, v4/v5 deltas, v6 a keyframe; 'a' changes
    a few rows per step, 'b' (1-D) never changes, 'c' changes everywhere from v5 (its delta is not small)."""
    gen = torch.Generator().manual_seed(7)
    w = {"a": torch.randn(SHAPE, generator=gen).to(torch.bfloat16),
         "b": torch.randn(40000, generator=gen).to(torch.bfloat16),
         "c": torch.randn(SHAPE, generator=gen).to(torch.bfloat16)}
    st = ucp_store.open_store(str(tmp_path / "s"), create=True)
    vals = []
    with config.override(delta_keyframe_every=3, delta_min_bytes=1024):
        for step in range(7):
            st.save("r", step, w, delta="auto")
            vals.append({k: v.clone() for k, v in w.items()})
            w = {"a": _changed(w["a"], [3 + step, 200 - step], gen), "b": w["b"],
                 "c": w["c"] if step < 4 else torch.randn(SHAPE, generator=gen).to(torch.bfloat16)}
    return st, vals


def _full_read(st, ref: str, name: str, box=None) -> torch.Tensor:
    h = st.checkpoint(ref).tensor(name, "weight")
    return h.read(tuple(slice(a, b) for a, b in box) if box else ())


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _independent_bytes(st, ref_have: str, ref_want: str, name: str, box) -> tuple[int, int]:
    """(stored bytes of the delta chunks within ``box`` on the route, index bytes of the shards it touches),
    from the catalog's chain and ``io/delta``'s own shard-index reader."""
    routes = plan_pull(st, ref_have, ref_want, [(name, "weight")])
    tr = routes[(name, "weight")]
    info = st.checkpoint(ref_want).info(name, "weight")
    layout = fmt.ArrayLayout(info.dtype, info.shape, info.chunk_shape, info.shard_shape)
    box = box or tuple((0, n) for n in info.shape)
    data = index = 0
    for a in tr.deltas:
        kv = deltaio.open_kvstore(st.location, a.path)
        data += sum(e.nbytes for e in dl.stored_entries(kv, layout, box))
        shards = {dl.shard_of_chunk(layout, c)[0] for c in layout.chunks_touching(box)}
        index += len(shards) * dl.index_nbytes(layout)
    return data, index


def test_one_step_pull_reads_only_the_changed_chunks_and_is_exact(versions):
    st, vals = versions
    assert st.checkpoint("r@1").info("a", "weight").encoding == "xor"
    held = {k: v.clone() for k, v in vals[0].items()}
    res = pull(st, "r@0", "r@1", held, verify=True)
    for k in held:
        assert _bits_equal(held[k], vals[1][k]), k
    by = {t.label: t for t in res.tensors}
    assert by["a"].kind == "delta" and by["b"].kind == "same" and by["b"].bytes_read == 0
    assert by["a"].verified is True
    data, index = _independent_bytes(st, "r@0", "r@1", "a", None)
    assert by["a"].delta_bytes == data > 0
    assert by["a"].bytes_read == data + index  # exactly the indexes and the changed chunks, nothing else
    # two rows changed: at most two chunks of 32 rows were read, of the 8 the tensor has
    assert len(by["a"].changed) <= 2 < by["a"].chunks
    assert res.bytes_read < fmt.ArrayLayout("bfloat16", SHAPE, (32, 256), SHAPE).nbytes // 4
    # the reads issued: the index of 'a''s one shard file, then one per run of adjacent stored chunks
    assert 2 <= res.requests <= 1 + len(by["a"].changed)
    # where the time went: every phase reported, none negative, the CPU of decoding and applying counted
    assert {"plan", "prepare", "execute", "verify", "index", "read", "crc", "decode", "apply"} <= set(res.phases)
    assert all(v >= 0 for v in res.phases.values())
    assert res.phases["execute"] <= res.seconds and res.to_json()["requests"] == res.requests


@pytest.mark.parametrize("half", [0, 1])
def test_tp_box_pull_reads_only_its_own_boxes(versions, half):
    """A TP=2 rank holding half of 'a' (rows) and of 'c' (columns) moves 1 -> 2; rows 4 and 199 changed, so
    each rank reads only the chunk in its half, and 'c' (unchanged there) nothing."""
    st, vals = versions
    boxes = {"a": [[128 * half, 128 * (half + 1)], [0, 256]], "c": [[0, 256], [128 * half, 128 * (half + 1)]]}
    held = {"a": vals[1]["a"][128 * half:128 * (half + 1)].clone(),
            "c": vals[1]["c"][:, 128 * half:128 * (half + 1)].clone()}
    res = pull(st, "r@1", "r@2", held, boxes=boxes)
    by = {t.label: t for t in res.tensors}
    for k, box in boxes.items():
        assert _bits_equal(held[k], _full_read(st, "r@2", k, box)), k
        data, index = _independent_bytes(st, "r@1", "r@2", k, box)
        assert by[k].delta_bytes == data and by[k].bytes_read <= data + index
    assert by["c"].kind == "same"
    assert len(by["a"].changed) == 1  # one changed row per half


def test_chain_across_keyframes_backwards_and_many_hops(versions):
    st, vals = versions
    cases = [("r@0", "r@2", "delta"), ("r@1", "r@4", "full"), ("r@5", "r@4", "delta"), ("r@2", "r@0", "delta"),
             ("r@4", "r@1", "full"), ("r@0", "r@6", "full")]
    for have, want, kind in cases:
        held = {k: v.clone() for k, v in vals[int(have[2:])].items()}
        res = pull(st, have, want, held, verify=True)
        for k in held:
            assert _bits_equal(held[k], vals[int(want[2:])][k]), (have, want, k)
        assert {t.label: t.kind for t in res.tensors}["a"] == kind, (have, want)
        if kind == "full":
            assert "keyframe" in {t.label: t for t in res.tensors}["a"].reason


def test_dense_change_is_stored_full_and_pulled_full(versions):
    st, vals = versions
    assert st.checkpoint("r@5").info("c", "weight").encoding == "plain"  # auto fell back: the delta is not small
    held = {"c": vals[4]["c"].clone()}
    res = pull(st, "r@4", "r@5", held)
    assert res.tensors[0].kind == "full" and _bits_equal(held["c"], vals[5]["c"])


def test_verify_catches_a_holder_that_did_not_hold_m(versions):
    st, vals = versions
    held = {"a": vals[2]["a"].clone()}  # claims to hold r@0
    with pytest.raises(ChecksumError, match="content hash"):
        pull(st, "r@0", "r@1", held, verify=True)


def test_bad_targets_are_named(versions):
    st, vals = versions
    with pytest.raises(ValidationError, match="'zz'"):
        pull(st, "r@0", "r@1", {"zz": torch.zeros(3)})
    with pytest.raises(ValidationError, match="dtype"):
        pull(st, "r@0", "r@1", {"a": vals[0]["a"].float()})
    with pytest.raises(ValidationError, match="shape"):
        pull(st, "r@0", "r@1", {"a": vals[0]["a"]}, boxes={"a": [[0, 10], [0, 256]]})


def test_corrupted_delta_chunk_is_caught_by_the_pull(versions):
    st, vals = versions
    info = st.checkpoint("r@1").info("a", "weight")
    kv = deltaio.open_kvstore(st.location, info.array)
    layout = fmt.ArrayLayout(info.dtype, info.shape, info.chunk_shape, info.shard_shape)
    entry = dl.stored_entries(kv, layout, tuple((0, n) for n in info.shape))[0]
    path = os.path.join(st.location.root, info.array, entry.key)
    with open(path, "r+b") as f:
        f.seek(entry.offset + 1)
        b = f.read(1)
        f.seek(entry.offset + 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ChecksumError, match=r"chunk \[.*crc32c"):
        pull(st, "r@0", "r@1", {"a": vals[0]["a"].clone()})


def test_diff_chunks_names_the_changed_chunks(versions, capsys):
    st, vals = versions
    rows = {r["name"]: r for r in chunk_diff(st, "r@1", "r@2")}
    # rows 4 and 199 changed in step 1 -> 2: chunks 0 and 6 (32 rows each)
    assert rows["a"]["how"] == "index" and sorted(rows["a"]["changed"]) == [(0, 0), (6, 0)]
    assert rows["b"]["status"] == "same" and rows["c"]["status"] == "same"
    # across a keyframe the values decide, and say the same
    far = {r["name"]: r for r in chunk_diff(st, "r@2", "r@4")}
    assert far["a"]["how"] == "values"
    want = sorted({(r // 32, 0) for r in (5, 198, 6, 197)})
    assert sorted(far["a"]["changed"]) == want
    assert ucp_main(["--store", st.location.root, "diff", "--chunks", "r@1", "r@2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(tuple(c) for c in {r["name"]: r for r in out}["a"]["changed"]) == [(0, 0), (6, 0)]
    assert ucp_main(["--store", st.location.root, "diff", "--chunks", "r@1", "r@2"]) == 0
    text = capsys.readouterr().out
    assert "2/8" in text and "2 of" in text


def test_hf_name_map_pull_of_fused_projections(tmp_path):
    """An engine holds HF-named q/k/v/gate/up (split from fused stored tensors by the shipped llama map), each a
    TP=2 rank's rows; it pulls 0 -> 1 and equals the new version's pieces bit for bit."""
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96}
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(64 + 32 + 32, 64, generator=gen).to(torch.bfloat16)
    gu = torch.randn(192, 64, generator=gen).to(torch.bfloat16)
    norm = torch.randn(64, generator=gen).to(torch.bfloat16)
    names = {"qkv": "model.layers.0.self_attn.qkv_proj.weight", "gu": "model.layers.0.mlp.gate_up_proj.weight",
             "norm": "model.layers.0.input_layernorm.weight"}
    st = ucp_store.open_store(str(tmp_path / "s"), create=True)
    v0 = {names["qkv"]: qkv, names["gu"]: gu, names["norm"]: norm}
    v1 = {k: t.clone() for k, t in v0.items()}
    v1[names["qkv"]][70, 5] += 1.0  # a row of K
    v1[names["gu"]][150, 1] += 1.0  # a row of up
    with config.override(delta_min_bytes=1024):
        st.save("m", 0, v0, delta="auto")
        st.save("m", 1, v1, delta="auto")
    pieces = {"model.layers.0.self_attn.q_proj.weight": (names["qkv"], 0, 64),
              "model.layers.0.self_attn.k_proj.weight": (names["qkv"], 64, 96),
              "model.layers.0.self_attn.v_proj.weight": (names["qkv"], 96, 128),
              "model.layers.0.mlp.gate_proj.weight": (names["gu"], 0, 96),
              "model.layers.0.mlp.up_proj.weight": (names["gu"], 96, 192)}
    for rank in range(2):
        held, boxes, want = {}, {}, {}
        for hf, (src, a, b) in pieces.items():
            half = (b - a) // 2
            lo, hi = a + rank * half, a + (rank + 1) * half
            held[hf] = v0[src][lo:hi].clone()
            boxes[hf] = [[rank * half, (rank + 1) * half], [0, 64]]
            want[hf] = v1[src][lo:hi]
        held[names["norm"]] = norm.clone()
        res = pull(st, "m@0", "m@1", held, boxes=boxes, name_map="llama", config=cfg)
        for hf in pieces:
            assert _bits_equal(held[hf], want[hf]), (rank, hf)
        changed = set(res.changed)
        expect = {"model.layers.0.self_attn.k_proj.weight"} if rank == 0 else {"model.layers.0.mlp.up_proj.weight"}
        # k rows 64..79 are rank 0's half of K (row 70); up rows 96+48.. are rank 1's half of up (row 150)
        assert changed == expect, (rank, changed)


def test_pull_without_deltas_reads_the_new_values(tmp_path):
    st = ucp_store.open_store(str(tmp_path / "s"), create=True)
    a0 = torch.arange(5000, dtype=torch.float32).reshape(50, 100)
    st.save("p", 0, {"a": a0})
    st.save("p", 1, {"a": a0 * 2})
    held = {"a": a0.clone()}
    res = pull(st, "p@0", "p@1", held, verify=True)
    assert res.tensors[0].kind == "full" and torch.equal(held["a"], a0 * 2)
    assert np.isclose(res.bytes_read, a0.numel() * 4, rtol=0.1)


def test_one_process_publisher_xors_against_what_it_published(tmp_path, monkeypatch):
    """``distributed.save(delta="auto")`` without a process group: version N is a delta of N-1, its base values
    taken from this process's memory of its last publish; after ``forget_published`` from the store."""
    import ucp_store.distributed as ucpd
    from ucp_store.distributed import coord, publish

    reads = []
    real = coord.detached_checkpoint
    monkeypatch.setattr(coord, "detached_checkpoint", lambda *a, **k: reads.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(SHAPE, generator=gen).to(torch.bfloat16)
    root = str(tmp_path / "s")
    vals = []
    for step in range(4):
        if step == 3:
            publish.forget_published()
        before = len(reads)
        ucpd.save({"model": {"w": w}}, store=root, run="d", step=step, delta="auto", progress=False)
        vals.append(w.clone())
        if step in (1, 2):
            assert len(reads) == before, step  # the base came from memory
        if step == 3:
            assert len(reads) == before + 1  # read back from the store
        w = _changed(w, [10 * step + 1], gen)
    st = ucp_store.open_store(root)
    assert [st.checkpoint(f"d@{s}").info("w", "weight").encoding for s in range(4)] == ["plain", "xor", "xor", "xor"]
    assert all(st.checkpoint(f"d@{s}").verify() == [] for s in range(4))
    held = {"w": vals[0].clone()}
    res = pull(st, "d@0", "d@3", held, verify=True)
    assert _bits_equal(held["w"], vals[3]) and res.tensors[0].kind == "delta"


def test_pull_from_a_bucket(tmp_path):
    """On S3 (moto's server over real HTTP) the pull reads shard indexes by suffix ranges and chunks by byte
    ranges through TensorStore's kvstore: exact, and the bytes are the indexes plus the changed chunks."""
    with moto_s3("pulls") as endpoint:
        st = ucp_store.open_store(f"s3://pulls/store?endpoint={endpoint}&region=us-east-1", create=True,
                                  catalog=f"sqlite:///{tmp_path}/c.db")
        gen = torch.Generator().manual_seed(9)
        w0 = torch.randn(SHAPE, generator=gen).to(torch.bfloat16)
        w1 = _changed(w0, [40, 41], gen)
        st.save("b", 0, {"w": w0}, delta="auto")
        st.save("b", 1, {"w": w1}, delta="auto")
        assert st.checkpoint("b@1").info("w", "weight").encoding == "xor"
        held = {"w": w0.clone()}
        res = pull(st, "b@0", "b@1", held, verify=True)
        assert _bits_equal(held["w"], w1) and res.tensors[0].verified is True
        data, index = _independent_bytes(st, "b@0", "b@1", "w", None)
        assert res.tensors[0].bytes_read == data + index and res.tensors[0].changed == [(1, 0)]


def test_pull_and_chunk_diff_on_postgresql(tmp_path):
    """The routes and the chunk diff read the catalog through SQLAlchemy alone: the same on PostgreSQL."""

    with postgres_schema_url() as url:
        st = ucp_store.open_store(str(tmp_path / "s"), create=True, catalog=url)
        gen = torch.Generator().manual_seed(2)
        vals = [torch.randn(SHAPE, generator=gen).to(torch.bfloat16)]
        for step in range(1, 4):
            vals.append(_changed(vals[-1], [33 * step], gen))
        with config.override(delta_keyframe_every=3):
            for step, w in enumerate(vals):
                st.save("g", step, {"w": w}, delta="auto")
        held = {"w": vals[0].clone()}
        assert pull(st, "g@0", "g@2", held, verify=True).tensors[0].kind == "delta"
        assert _bits_equal(held["w"], vals[2])
        assert pull(st, "g@2", "g@3", held, verify=True).tensors[0].kind == "full"  # g@3 is a keyframe
        assert _bits_equal(held["w"], vals[3])
        rows = chunk_diff(st, "g@1", "g@2")
        assert rows[0]["how"] == "index" and rows[0]["changed"] == [(66 // 32, 0)]
        st.catalog.engine.dispose()
