"""Planner: plans executed against random models and topology pairs (hypothesis), checked bit-exactly
against the independent numpy reference of test_patterns; chunk counts, coalescing, placement,
ZeRO buffers, JSON, split points and chunk alignment."""

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_store.errors import PlanError
from ucp_store.patterns import Box, FlatRange, is_writer, placement_stages
from ucp_store.plan.planner import Read, chunk_alignment, chunk_footprint, coalesce_reads, plan, split_points
from ucp_store.topology import Topology

from test_patterns import (  # the independent reference and the strategies live there
    SENTINEL,
    pattern_and_shape,
    ref_local,
    ref_zero_partition,
    ref_zero_rank,
    topologies,
)

OPT_STATES = ("fp32", "exp_avg", "exp_avg_sq")


# ---------------------------------------------------------------------- executing plans (what io.py does)
def execute(p, logical):
    """Run a plan against in-memory logical tensors; returns (tensors, group buffers, own flat buffers).

    Destinations start as SENTINEL; padding is zeroed; afterwards nothing may still be SENTINEL."""
    tensors, own = {}, {}
    buffers = {b.key: np.full(b.numel, SENTINEL, np.int64) for b in p.buffers}
    for b in p.buffers:
        for pad in b.padding:
            buffers[b.key][pad.start:pad.stop] = 0
    for t in p.tensors:
        x = logical[(t.name, t.state)]
        if not t.flat:
            out = np.full(t.local_shape, SENTINEL, np.int64)
            for r in t.reads:
                assert r.box.shape == r.dst.shape
                out[r.dst.slices()] = x[r.box.slices()]
            for pad in t.padding:
                out[pad.slices()] = 0
            tensors[(t.name, t.state)] = out
            continue
        f = t.fragment
        if t.buffer is None:
            view = own[(t.name, t.state)] = np.full(f.slot, SENTINEL, np.int64)
        else:
            view = buffers[t.buffer][f.buffer_start:f.buffer_start + f.slot]
        for r in t.reads:
            assert isinstance(r.dst, FlatRange) and r.dst.numel == r.box.numel
            view[r.dst.start:r.dst.stop] = x[r.box.slices()].ravel()
        for pad in t.padding:
            view[pad.start:pad.stop] = 0
    for arr in itertools.chain(tensors.values(), buffers.values(), own.values()):
        assert not (arr == SENTINEL).any(), "a destination element is neither read nor padding"
    return tensors, buffers, own


def reassemble(src, plans, shards, logical, patterns):
    """Inverse: every source rank writes what the writer rule gives it; each element exactly once.

    ``logical`` only gives the shapes; ``patterns`` maps tensor names to pattern records."""
    out = {k: np.full(v.shape, SENTINEL, np.int64) for k, v in logical.items()}
    hits = {k: np.zeros(v.shape, np.int64) for k, v in logical.items()}
    for rank, p in plans.items():
        tensors, buffers, own = shards[rank]
        for t in p.tensors:
            if not is_writer(patterns[t.name], src, rank, flat=t.flat):
                continue
            key = (t.name, t.state)
            if t.flat:
                f = t.fragment
                view = own[key] if t.buffer is None else buffers[t.buffer][f.buffer_start:f.buffer_start + f.slot]
                for r in t.reads:
                    out[key][r.box.slices()] = view[r.dst.start:r.dst.stop].reshape(r.box.shape)
                    hits[key][r.box.slices()] += 1
            else:
                for r in t.reads:
                    out[key][r.box.slices()] = tensors[key][r.dst.slices()]
                    hits[key][r.box.slices()] += 1
    for key in logical:
        assert (hits[key] == 1).all(), f"{key}: coverage {np.unique(hits[key])}"
    return out


def reference_rank(t, rank, tensors, logical):
    """What ``rank`` must hold, built from ref_local / ref_zero_partition only.

    ``tensors``: ``(name, pattern, shape, states)`` in record order (the ZeRO flat order)."""
    c = t.coords(rank)
    want_tensors, want_buffers, want_own = {}, {}, {}
    on_stage = [(name, pj, states) for name, pj, _, states in tensors if c["pp"] in placement_stages(pj, t)]
    locals_ = {}
    for name, pj, states in on_stage:
        for state in states:
            locals_[(name, state)] = ref_local(pj, logical[(name, state)], t.tp, c["tp"], t.ep, c["ep"],
                                               t.vocab_multiple)
    for name, pj, states in on_stage:
        for state in states:
            x = locals_[(name, state)]
            if t.zero_stage == 0 or state == "step" or (state == "weight" and t.zero_stage < 3):
                want_tensors[(name, state)] = x
            elif state == "weight":
                zrank, zworld = ref_zero_rank(t, rank, _kind(pj) == "expert")
                want_own[(name, state)] = ref_zero_partition([x], zworld, zrank, 3)
    if t.zero_stage:
        for group, expert in (("default", False), ("expert", True)):
            members = [(name, states) for name, pj, states in on_stage
                       if (_kind(pj) == "expert") == expert and any(s in OPT_STATES for s in states)]
            if not members:
                continue
            zrank, zworld = ref_zero_rank(t, rank, expert)
            for state in OPT_STATES:
                if not any(state in states for _, states in members):
                    continue
                parts = [locals_[(n, state)] if state in states else np.zeros_like(locals_[(n, "weight")])
                         for n, states in members]
                want_buffers[f"{group}/{state}"] = ref_zero_partition(parts, zworld, zrank, t.zero_stage,
                                                                      t.zero_alignment, t.zero_param_alignment)
    return want_tensors, want_buffers, want_own


def _kind(pj):
    return "replicated" if pj is None else pj["kind"]


@st.composite
def models(draw, src, tgt):
    specs = draw(st.lists(pattern_and_shape((src.tp, tgt.tp), (src.ep, tgt.ep)), min_size=1, max_size=5))
    out = []
    for i, (pj, shape) in enumerate(specs):
        states = ["weight"] + (list(OPT_STATES) if draw(st.booleans()) or not shape else [])
        chunk = tuple(draw(st.integers(1, max(n, 1))) for n in shape)
        out.append((f"t{i}", pj, shape, states, chunk))
    return out


def records_of(model):
    recs = []
    for name, pj, shape, states, chunk in model:
        for state in states:
            recs.append({"name": name, "state": state, "shape": list(shape),
                         "dtype": "bfloat16" if state == "weight" else "float32", "pattern": pj,
                         "chunk_shape": list(chunk)})
    recs.append({"name": "step", "state": "step", "shape": [], "dtype": "int64", "pattern": None, "chunk_shape": []})
    return recs


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_plans_reshard_random_models_bit_exact(data):
    src = data.draw(topologies(max_world=24), label="source")
    tgt = data.draw(topologies(max_world=24), label="target")
    model = data.draw(models(src, tgt), label="model")
    recs = records_of(model)
    rng = np.random.default_rng(2)
    logical = {(r["name"], r["state"]): rng.integers(1, 1 << 40, size=r["shape"], dtype=np.int64) for r in recs}
    patterns = {r["name"]: r["pattern"] for r in recs}
    tensors = [(name, pj, shape, states) for name, pj, shape, states, _ in model] + [("step", None, (), ["step"])]

    # source: every rank's shards through its plan (the forward map), checked against the reference
    plans, shards = {}, {}
    for rank in range(src.world_size):
        plans[rank] = plan(recs, src, rank)
        shards[rank] = execute(plans[rank], logical)
        _assert_matches(shards[rank], reference_rank(src, rank, tensors, logical))
    rebuilt = reassemble(src, plans, shards, logical, patterns)
    for key, x in logical.items():
        assert np.array_equal(rebuilt[key], x), key

    # target: every rank's plan from the rebuilt tensors, bit-exact against the reference
    for rank in range(tgt.world_size):
        p = plan(recs, tgt, rank)
        json.dumps(p.to_json())
        _assert_matches(execute(p, rebuilt), reference_rank(tgt, rank, tensors, logical))
        assert p.bytes_read >= p.bytes_needed


def _assert_matches(got, want):
    for g, w, what in zip(got, want, ("tensors", "buffers", "own buffers")):
        # a flat state whose fragment is empty on this rank is simply absent from the plan
        for key in set(w) - set(g):
            assert w[key].size == 0 or what == "own buffers" and not w[key].any(), (what, key)
        for key in g:
            assert key in w, (what, key)
            assert g[key].shape == w[key].shape and np.array_equal(g[key], w[key]), (what, key)


# ---------------------------------------------------------------------- placement, experts, filters
def _layer_model(layers):
    recs = [{"name": "embed", "state": "weight", "shape": [10, 4], "dtype": "float32", "chunk_shape": [5, 4],
             "pattern": {"kind": "vocab", "original_size": 10, "placement": {"stages": ["first", "last"]}}},
            {"name": "norm", "state": "weight", "shape": [4], "dtype": "float32", "chunk_shape": [4],
             "pattern": {"kind": "replicated", "placement": {"stages": ["last"]}}}]
    for i in range(layers):
        for state in ("weight", "fp32", "exp_avg"):
            recs.append({"name": f"layers.{i}.w", "state": state, "shape": [8, 4], "dtype": "float32",
                         "chunk_shape": [2, 4],
                         "pattern": {"kind": "partitioned", "dim": 0, "placement": {"layer": i}}})
    return recs


def test_stage_gets_only_its_layers_and_tied_params():
    t = Topology(pp=3, layers=6, tp=2)
    recs = _layer_model(6)
    for stage in range(3):
        p = plan(recs, t, t.rank({"tp": 0, "pp": stage}))
        names = {x.name for x in p.tensors}
        want = {f"layers.{i}.w" for i in t.layers_of_stage(stage)}
        want |= {"embed"} if stage in (0, 2) else set()
        want |= {"norm"} if stage == 2 else set()
        assert names == want


def test_experts_only_on_their_ep_rank():
    t = Topology(dp=4, ep=4, tp=2)
    rec = {"name": "moe.w1", "state": "weight", "shape": [8, 6, 4], "dtype": "bfloat16", "chunk_shape": [1, 6, 4],
           "pattern": {"kind": "expert", "num_experts": 8, "inner": {"kind": "partitioned", "dim": 0}}}
    for rank in range(t.world_size):
        c = t.coords(rank)
        (tp_,) = plan([rec], t, rank).tensors
        (read,) = tp_.reads
        assert read.box.ranges[0] == (2 * c["ep"], 2 * c["ep"] + 2)
        assert read.box.ranges[1] == (3 * c["tp"], 3 * c["tp"] + 3)
        assert tp_.chunks_touched == 2 and tp_.bytes_needed == 2 * 3 * 4 * 2


def test_states_filter_and_layout_independence():
    t = Topology(dp=2, zero_stage=1, layers=2)
    recs = _layer_model(2)
    full = plan(recs, t, 1)
    only = plan(recs, t, 1, states={"exp_avg"})
    assert {x.state for x in only.tensors} == {"exp_avg"}
    for x in only.tensors:  # the ZeRO layout is the same whether or not fp32 is planned
        assert x.fragment == full.tensor(x.name, "exp_avg").fragment
    assert [b.key for b in only.buffers] == ["default/exp_avg"]


def test_duplicate_and_bad_records():
    rec = {"name": "w", "state": "weight", "shape": [4], "dtype": "float32", "pattern": None}
    with pytest.raises(PlanError, match="listed twice"):
        plan([rec, dict(rec)], Topology(), 0)
    with pytest.raises(PlanError, match="unknown dtype"):
        plan([dict(rec, dtype="float7")], Topology(), 0)
    with pytest.raises(PlanError, match="chunk_shape"):
        plan([dict(rec, chunk_shape=[2, 2])], Topology(), 0)
    moe = {"name": "m", "state": "fp32", "shape": [2, 4], "dtype": "float32",
           "pattern": {"kind": "expert", "num_experts": 2}}
    with pytest.raises(PlanError, match="mixes expert"):
        plan([dict(rec, state="fp32"), moe], Topology(dp=2, ep=2, zero_stage=1), 0, zero_groups={"w": "g", "m": "g"})


def test_records_as_objects_and_topology_as_dict():
    class Info:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    recs = [Info(name="w", state="weight", shape=(8, 2), dtype="torch.float32", chunk_shape=None,
                 pattern=json.dumps({"kind": "partitioned", "dim": 0}))]
    p = plan(recs, {"tp": 4}, 3)
    assert p.tensors[0].reads[0].box == Box(((6, 8), (0, 2)))
    assert p.tensors[0].chunks_touched == 1 and p.tensors[0].bytes_read == 64
    assert p.read_amplification == 4.0


def test_zero3_weights_are_per_parameter_partitions():
    t = Topology(dp=4, zero_stage=3)
    recs = [{"name": "w", "state": "weight", "shape": [5, 2], "dtype": "bfloat16", "pattern": None},
            {"name": "w", "state": "fp32", "shape": [5, 2], "dtype": "float32", "pattern": None}]
    p = plan(recs, t, 3)
    w = p.tensor("w", "weight")
    assert w.buffer is None and w.fragment.slot == 3 and (w.fragment.start, w.fragment.stop) == (9, 10)
    assert w.padding == (FlatRange(1, 3),)
    assert p.tensor("w", "fp32").buffer == "default/fp32"


def test_custom_zero_groups_and_buffer_padding():
    t = Topology(dp=2, zero_stage=2)
    recs = [{"name": n, "state": "fp32", "shape": [3], "dtype": "float32", "pattern": None} for n in "abc"]
    p = plan(recs, t, 1, zero_groups={"a": "g0", "b": "g1", "c": "g0"})
    assert {b.key: b.numel for b in p.buffers} == {"g0/fp32": 4, "g1/fp32": 2}
    g0 = next(b for b in p.buffers if b.key == "g0/fp32")
    assert g0.members == ("c",) and g0.padding == (FlatRange(2, 4),)  # a|c = 6 elems + 2 padding; rank 1: c[1:3]


# ---------------------------------------------------------------------- coalescing and counts
def test_coalescing_merges_contiguous_reads():
    fused = {"kind": "fused", "dim": 0, "sizes": [4, 2, 2]}
    rec = {"name": "qkv", "state": "weight", "shape": [8, 3], "dtype": "float32", "pattern": fused}
    (t,) = plan([rec], Topology(tp=1), 0).tensors
    assert t.reads == (Read(Box(((0, 8), (0, 3))), Box(((0, 8), (0, 3)))),)
    (t,) = plan([rec], Topology(tp=1), 0, coalesce=False).tensors
    assert len(t.reads) == 3
    # flat reads: a fragment of rows 1.. of a fused param under tp=1 is one contiguous read
    rec = dict(rec, state="fp32")
    p = plan([rec], Topology(dp=2, zero_stage=1), 1)
    assert len(p.tensors[0].reads) == 1 and p.tensors[0].reads[0].dst == FlatRange(0, 12)
    reads = [Read(Box(((0, 1), (0, 2))), FlatRange(0, 2)), Read(Box(((1, 2), (0, 2))), FlatRange(2, 4))]
    assert coalesce_reads(reads) == (Read(Box(((0, 2), (0, 2))), FlatRange(0, 4)),)
    # column pieces are adjacent as boxes but not in the flattening: no merge
    reads = [Read(Box(((0, 2), (0, 1))), FlatRange(0, 2)), Read(Box(((0, 2), (1, 2))), FlatRange(2, 4))]
    assert len(coalesce_reads(reads)) == 2


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=0, max_size=3), st.data())
def test_chunk_footprint_matches_brute_force(shape, data):
    chunk = [data.draw(st.integers(1, n)) for n in shape]
    boxes = []
    for _ in range(data.draw(st.integers(1, 4))):
        ranges = []
        for n in shape:
            a = data.draw(st.integers(0, n - 1))
            ranges.append((a, data.draw(st.integers(a + 1, n))))
        boxes.append(Box(tuple(ranges)))
    touched = set()
    for b in boxes:
        touched |= set(itertools.product(*(range(a // c, (hi - 1) // c + 1) for (a, hi), c in zip(b.ranges, chunk))))
    nbytes = sum(math.prod(min((i + 1) * c, n) - i * c for i, c, n in zip(idx, chunk, shape)) for idx in touched) * 2
    assert chunk_footprint(boxes, shape, chunk, 2) == (len(touched), nbytes)


# ---------------------------------------------------------------------- split points and chunk alignment
def test_split_points_examples():
    part = {"kind": "partitioned", "dim": 0, "widths": {"3": [384, 384, 256]}}
    pts = split_points(part, (1024, 16), [Topology(tp=4), Topology(tp=8), Topology(tp=3)])
    assert pts == (tuple(sorted({128 * i for i in range(1, 8)} | {384, 768})), ())
    fused = {"kind": "fused", "dim": 0, "sizes": [8, 4, 4]}
    assert split_points(fused, (16, 2), [Topology(tp=1)]) == ((8, 12), ())  # sub-parameter edges always
    assert split_points(fused, (16, 2), [Topology(tp=2)]) == ((4, 8, 10, 12, 14), ())
    vocab = {"kind": "vocab", "original_size": 10}
    assert split_points(vocab, (10, 2), [Topology(tp=4, vocab_multiple=2)]) == ((4, 8), ())
    expert = {"kind": "expert", "num_experts": 4, "inner": {"kind": "partitioned", "dim": 1}}
    assert split_points(expert, (4, 3, 8), [Topology(dp=2, ep=2, tp=2)]) == ((2,), (), (4,))
    assert split_points(None, (4, 4), [Topology(tp=8)]) == ((), ())


def test_chunk_alignment_gcd_and_uneven_fallback():
    part = {"kind": "partitioned", "dim": 0}
    assert chunk_alignment(part, (1024, 1024), [Topology(tp=4), Topology(tp=8)]) == (128, 1024)
    # widths that share the head size keep chunks aligned to every topology
    heads = {"kind": "partitioned", "dim": 0, "widths": {"3": [384, 384, 256]}}
    assert chunk_alignment(heads, (1024, 1024), [Topology(tp=4), Topology(tp=3)]) == (128, 1024)
    # ragged widths: the power-of-two boundaries stay aligned, chunks stay >= 64 KiB
    ragged = {"kind": "partitioned", "dim": 0, "widths": {"3": [342, 341, 341]}}
    ext = chunk_alignment(ragged, (1024, 1024), [Topology(tp=4), Topology(tp=3)], itemsize=4)
    assert ext[0] * 1024 * 4 >= 64 << 10 and 256 % ext[0] == 0
    assert chunk_alignment(ragged, (1024, 1024), [Topology(tp=3)], min_chunk_bytes=1) == (1, 1024)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_aligned_chunks_read_no_extra_bytes(data):
    src = data.draw(topologies(max_world=24))
    tgt = data.draw(topologies(max_world=24))
    pj, shape = data.draw(pattern_and_shape((src.tp, tgt.tp), (src.ep, tgt.ep)))
    chunk = chunk_alignment(pj, shape, [src, tgt], min_chunk_bytes=1)
    rec = {"name": "x", "state": "weight", "shape": list(shape), "dtype": "float32", "pattern": pj,
           "chunk_shape": list(chunk)}
    for t in (src, tgt):
        for rank in range(t.world_size):
            for tp_ in plan([rec], t, rank, states={"weight"}).tensors:
                if not tp_.flat:
                    assert tp_.bytes_read == tp_.bytes_needed, (chunk, tp_.reads)


def test_plan_json_shape():
    t = Topology(tp=2, dp=2, zero_stage=1)
    recs = [{"name": "emb", "state": s, "shape": [5, 2], "dtype": "float32", "chunk_shape": [2, 2],
             "pattern": {"kind": "vocab", "original_size": 5}} for s in ("weight", "fp32")]
    doc = json.loads(plan(recs, t, 3).to_json_text())
    assert doc["format"] == "ucp_store.plan" and doc["version"] == 1 and doc["rank"] == 3
    assert doc["coords"] == {"tp": 1, "sp": 0, "dp": 1, "pp": 0, "ep": 0, "edp": 1}
    weight, fp32 = doc["tensors"]
    # tp rank 1 holds padded rows [3, 6): logical rows 3, 4 and one zero row
    assert weight["reads"] == [{"box": [[3, 5], [0, 2]], "dst": [[0, 2], [0, 2]]}]
    assert weight["padding"] == [[[2, 3], [0, 2]]]
    # 6 flat elements padded to 8 (alignment 2 x 2 ranks); dp rank 1 owns [4, 8): the zero row, then tail
    assert fp32["fragment"] == {"start": 4, "stop": 6, "buffer_start": 0, "slot": 2}
    assert fp32["reads"] == [] and fp32["padding"] == [[0, 2]]
    assert doc["buffers"] == [{"key": "default/fp32", "group": "default", "state": "fp32", "dtype": "float32",
                               "numel": 4, "members": ["emb"], "padding": [[2, 4]]}]
    assert doc["totals"]["bytes_needed"] == 2 * 2 * 4
    (fp32_rank1,) = [t for t in plan(recs, t, 1).tensors if t.state == "fp32"]  # dp rank 0: rows 3, 4
    assert [r.to_json() for r in fp32_rank1.reads] == [{"box": [[3, 5], [0, 2]], "flat": [0, 4]}]


def test_plan_mesh_shares_layouts_without_changing_plans():
    """plan_mesh plans each layout (pattern object, shape, chunks, dtype) once: rows sharing one pattern object
    plan exactly like the same rows each with its own copy, or with the pattern as JSON text."""
    from ucp_store.plan.planner import plan_mesh

    mesh = {"shape": [4, 2], "dims": ["dp", "tp"]}
    col = {"kind": "dtensor", "mesh": mesh, "placements": [{"type": "strided_shard", "dim": 0, "split_factor": 2},
                                                           {"type": "shard", "dim": 0}]}
    row = {"kind": "dtensor", "mesh": mesh, "placements": [{"type": "shard", "dim": 0}, {"type": "shard", "dim": 1}]}
    shared = []
    for i in range(6):
        for pat, shape in ((col, (16, 6)), (row, (6, 16)), (col, (10, 3)), (None, (5,))):
            for state, dtype in (("fp32", "float32"), ("weight", "bfloat16")):
                shared.append({"name": f"l{i}.{shape}", "state": state, "shape": shape, "dtype": dtype,
                               "pattern": pat, "chunk_shape": (4,) * len(shape) if i % 2 else None})
    copied = [{**r, "pattern": json.loads(json.dumps(r["pattern"]))} for r in shared]
    as_text = [{**r, "pattern": json.dumps(r["pattern"])} for r in shared]
    for target in ("dp=4,tp=2", "dp=2,tp=2", "dp=8"):
        for rank in range(math.prod(int(p.split("=")[1]) for p in target.split(","))):
            want = plan_mesh(copied, target, rank).to_json()
            assert plan_mesh(shared, target, rank).to_json() == want
            assert plan_mesh(as_text, target, rank).to_json() == want
