"""Separate per-expert tensors (``expert_member`` patterns, ``...experts.<e>.w1``): parsing, schema, and the
planner against an independent numpy reference on random layers, topologies and ZeRO stages (hypothesis):
every rank gets exactly the experts the fused ``[E, ...]`` form would give it, each laid out by its inner
pattern, and its expert ZeRO group buffer is DeepSpeed's flat partition of its local experts, in order."""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ucp_store.errors import PatternError, TopologyError
from ucp_store.patterns import (
    ExpertMember,
    Partitioned,
    holds,
    is_expert,
    is_writer,
    parse_pattern,
    validate_pattern_record,
    writer_copies,
)
from ucp_store.plan.planner import EXPERT_GROUP, plan
from ucp_store.records import TensorInfo

from test_patterns import (
    SENTINEL,
    build_local,
    pattern_and_shape,
    ref_local,
    ref_zero_partition,
    ref_zero_rank,
    topologies,
)


def member(e, n, inner=None, group="moe.0.experts", **kw):
    rec = {"kind": "expert_member", "expert": e, "num_experts": n, "group": group, **kw}
    if inner is not None:
        rec["inner"] = inner
    return rec


def test_parse_roundtrip_and_schema():
    rec = member(3, 4, {"kind": "partitioned", "dim": 1}, placement={"layer": 1})
    p = validate_pattern_record(rec)
    assert isinstance(p, ExpertMember) and is_expert(p)
    assert (p.expert, p.num_experts, p.group, p.inner) == (3, 4, "moe.0.experts", Partitioned(dim=1))
    assert p.to_json() == rec and p.layer == 1
    assert [p.owner(ep) for ep in (1, 2, 4)] == [0, 1, 3]
    assert [p.local_index(ep) for ep in (1, 2, 4)] == [3, 1, 0]
    assert p.split_dims == (1,)


@pytest.mark.parametrize("rec, match", [
    ({"kind": "expert_member", "num_experts": 4}, "needs 'expert'"),
    ({"kind": "expert_member", "expert": 4, "num_experts": 4}, "not below num_experts 4"),
    ({"kind": "expert_member", "expert": 0, "num_experts": 0}, "num_experts must be an integer >= 1"),
    ({"kind": "expert_member", "expert": 0, "num_experts": 2, "group": ""}, "group must be a non-empty string"),
    ({"kind": "expert_member", "expert": 0, "num_experts": 2, "inner": {"kind": "expert", "num_experts": 2}},
     "cannot nest"),
    ({"kind": "expert_member", "expert": 0, "num_experts": 2, "dim": 0}, "unknown field"),
])
def test_parse_errors_name_the_field(rec, match):
    with pytest.raises(PatternError, match=match):
        parse_pattern(rec, name="moe.0.experts.0.w1")
    with pytest.raises(PatternError):
        validate_pattern_record(rec, name="moe.0.experts.0.w1")


def test_ep_must_divide_the_experts():
    from ucp_store.topology import Topology

    t = Topology(dp=4, ep=4)
    with pytest.raises(TopologyError, match="6 experts cannot be split over ep=4"):
        plan([{"name": "w", "state": "fp32", "shape": [2], "dtype": "float32", "pattern": member(0, 6)}], t, 0)
    with pytest.raises(TopologyError, match="6 experts cannot be split over ep=4"):
        holds(member(0, 6), t, 0)


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_separate_experts_match_the_fused_form_and_deepspeed_zero_order(data):
    t = data.draw(topologies(max_world=24), label="topology")
    n_exp = t.ep * data.draw(st.integers(1, 2))
    inner, shape = data.draw(pattern_and_shape((t.tp,), kinds=["replicated", "partitioned", "fused", "vocab"],
                                               inner=True), label="inner")
    assume(math.prod(shape) > 0)
    n_tensors = data.draw(st.integers(1, 2))  # tensors per expert (w1, w2)
    rng = np.random.default_rng(2)
    xs = {(e, k): rng.integers(1, 1 << 40, size=shape, dtype=np.int64) for e in range(n_exp) for k in range(n_tensors)}
    # records layer by layer, expert by expert (the import's order), plus one dense parameter
    recs = [{"name": "dense", "state": "fp32", "shape": [3], "dtype": "int64", "pattern": None}]
    pats = {}
    for e in range(n_exp):
        for k in range(n_tensors):
            pats[(e, k)] = member(e, n_exp, inner)
            recs.append({"name": f"moe.experts.{e}.w{k}", "state": "fp32", "shape": list(shape), "dtype": "int64",
                         "pattern": pats[(e, k)]})
    fused = {"kind": "expert", "dim": 0, "num_experts": n_exp, "inner": inner}
    stacked = [np.stack([xs[(e, k)] for e in range(n_exp)]) for k in range(n_tensors)]

    hits = {key: np.zeros(shape, np.int64) for key in xs}
    for rank in range(t.world_size):
        c = t.coords(rank)
        per = n_exp // t.ep
        mine = list(range(c["ep"] * per, (c["ep"] + 1) * per))
        for key, pj in pats.items():
            assert holds(pj, t, rank) == (key[0] in mine)
            for cp in writer_copies(pj, shape, t, rank):  # writer rule: each element exactly once
                hits[key][cp.logical.slices()] += 1
            if key[0] in mine:  # same local tensor as the fused form's expert slot
                fused_local = ref_local(fused, stacked[key[1]], t.tp, c["tp"], t.ep, c["ep"], t.vocab_multiple)
                assert np.array_equal(build_local(pj, xs[key], t, rank), fused_local[key[0] - mine[0]])
        p = plan(recs, t, rank)
        got = {tp.name for tp in p.tensors}
        expected = {"dense"} | {f"moe.experts.{e}.w{k}" for e in mine for k in range(n_tensors)}
        # ZeRO leaves out a parameter of which the rank's partition holds nothing
        assert got == expected if t.zero_stage == 0 else got <= expected
        if t.zero_stage in (1, 2):
            buf = next(b for b in p.buffers if b.group == EXPERT_GROUP)
            zrank, zworld = ref_zero_rank(t, rank, True)
            locals_ = [ref_local(inner, xs[(e, k)], t.tp, c["tp"], vmult=t.vocab_multiple)
                       for e in mine for k in range(n_tensors)]
            ref = ref_zero_partition(locals_, zworld, zrank, t.zero_stage, t.zero_alignment, t.zero_param_alignment)
            out = np.full(buf.numel, SENTINEL, np.int64)
            for tp in p.tensors:
                if tp.buffer != buf.key:
                    continue
                e, k = int(tp.name.split(".")[2]), int(tp.name[-1])
                base = tp.fragment.buffer_start
                for r in tp.reads:
                    out[base + r.dst.start:base + r.dst.stop] = xs[(e, k)][r.box.slices()].ravel()
                for pad in tp.padding:
                    out[base + pad.start:base + pad.stop] = 0
            for pad in buf.padding:
                out[pad.start:pad.stop] = 0
            assert np.array_equal(out, ref)
    for key, h in hits.items():
        assert (h == 1).all(), f"expert {key}: every element written exactly once"


def test_writer_is_the_owner_with_edp_zero():
    from ucp_store.topology import Topology

    t = Topology(dp=4, ep=2)
    writers = [r for r in range(t.world_size) if is_writer(member(3, 4), t, r)]
    assert writers == [t.rank({"ep": 1, "edp": 0})]


def test_planner_reads_catalog_rows():
    from ucp_store.topology import Topology

    rows = [TensorInfo(name=f"e{e}", state="fp32", shape=(2, 3), dtype="float32", pattern=member(e, 4),
                       chunk_shape=(2, 3), shard_shape=(2, 3), array=f"a{e}", array_id=f"a{e}")
            for e in range(4)]
    t = Topology(dp=2, ep=2, zero_stage=1, zero_alignment=1)
    assert [x.name for x in plan(rows, t, 1).tensors] == ["e2", "e3"]
