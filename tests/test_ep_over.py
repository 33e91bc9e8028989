"""``Topology(ep_over="stage")``: DeepSpeed's expert groups of whole experts with an mpu (ep rank = rank % ep over
a pipeline stage's ranks, tp included), checked against DeepSpeed's own group construction
(``deepspeed.utils.groups._create_expert_and_data_parallel``, run with a recording stand-in for
``torch.distributed``), and the planner on such a topology against an independent numpy reference
(hypothesis): each rank plans exactly its ep rank's experts, whole (no TP split), ZeRO-partitioned over the
stage's ranks of its ep rank in DeepSpeed's flat order, and the writer rule writes every element once."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ucp_store.errors import TopologyError
from ucp_store.patterns import holds, writer_copies
from ucp_store.plan.planner import EXPERT_GROUP, plan
from ucp_store.topology import Topology

from test_patterns import SENTINEL, pattern_and_shape, ref_local, ref_zero_partition


@st.composite
def stage_topologies(draw, max_world=32, pp_last=False):
    tp, sp, dp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 1, 2])), draw(st.integers(1, 4))
    stage = tp * sp * dp
    ep = draw(st.sampled_from([d for d in (1, 2, 3, 4, 8) if stage % d == 0]))
    pp = draw(st.integers(1, 3))
    inner = list(draw(st.permutations(["tp", "sp", "dp"])))
    order = inner + ["pp"] if pp_last else list(draw(st.permutations(inner + ["pp"])))
    t = Topology(tp=tp, sp=sp, dp=dp, pp=pp, ep=ep, ep_over="stage", layers=3, order=tuple(order),
                 zero_stage=draw(st.integers(0, 3)), zero_alignment=draw(st.sampled_from([1, 2])))
    assume(t.world_size <= max_world)
    return t


class _RecordingDist:
    """What ``_create_expert_and_data_parallel`` asks of ``deepspeed.comm``: it records every group."""

    def __init__(self, world: int):
        self.world, self.groups = world, []

    def is_initialized(self):
        return True

    def get_world_size(self):
        return self.world

    def get_rank(self):
        return 0

    def new_group(self, ranks):
        self.groups.append(list(ranks))
        return len(self.groups) - 1


def deepspeed_groups(world: int, ep: int, pp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-data-parallel groups, expert-parallel groups) as DeepSpeed builds them for ``MoE`` without
    expert tensor parallelism (``MoE._create_process_groups`` -> ``_create_expert_and_data_parallel``)."""
    from deepspeed.utils import groups

    fake = _RecordingDist(world)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(groups, "dist", fake)
        m.setattr(groups, "log_dist", lambda *a, **k: None)
        m.setattr(groups, "_EXPERT_PARALLEL_GROUP", {})
        m.setattr(groups, "_EXPERT_PARALLEL_GROUP_RANKS", {})
        m.setattr(groups, "_EXPERT_DATA_PARALLEL_GROUP", {})
        m.setattr(groups, "_EXPERT_DATA_PARALLEL_GROUP_RANKS", {})
        groups._create_expert_and_data_parallel(ep, pp_size=pp)
    n_edp = ep * pp  # the expert-data-parallel groups come first: ep per stage
    return fake.groups[:n_edp], fake.groups[n_edp:]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_stage_rule_is_deepspeeds_expert_groups(data):
    """Every rank's ep rank, expert-data-parallel index and ZeRO index equal its place in DeepSpeed's groups."""
    pytest.importorskip("deepspeed")
    t = data.draw(stage_topologies(pp_last=True), label="topology")
    edp_groups, ep_groups = deepspeed_groups(t.world_size, t.ep, t.pp)
    assert len(ep_groups) == t.world_size // t.ep
    for g in edp_groups:  # ep rank i of a stage: DeepSpeed's range(stage_start + i, stage_end, ep)
        coords = [t.coords(r) for r in g]
        assert len({(c["pp"], c["ep"]) for c in coords}) == 1
        assert [c["edp"] for c in coords] == list(range(t.edp))
        if t.zero_stage:
            assert [t.zero_rank(r, expert=True) for r in g] == list(range(len(g)))
            assert t.zero_world(expert=True) == len(g)
    for g in ep_groups:  # consecutive ranks: one expert-parallel (all-to-all) group
        coords = [t.coords(r) for r in g]
        assert [c["ep"] for c in coords] == list(range(t.ep)) and len({(c["pp"], c["edp"]) for c in coords}) == 1
    for r in range(t.world_size):
        c = t.coords(r)
        assert c["ep"] == r % t.ep  # pp slowest: the stage index is r % (world / pp)
        assert t.rank({"pp": c["pp"], "ep": c["ep"], "edp": c["edp"]}) == r


@settings(max_examples=80, deadline=None)
@given(stage_topologies())
def test_stage_rule_in_any_rank_order(t):
    """In any rank order the ep and edp coordinates number a stage's ranks in global-rank order (ep fastest),
    and give the rank back."""
    for stage in range(t.pp):
        ranks = t.ranks_where(pp=stage)
        assert [(t.coords(r)["ep"], t.coords(r)["edp"]) for r in ranks] == [(i % t.ep, i // t.ep)
                                                                              for i in range(len(ranks))]
        for r in ranks:
            c = t.coords(r)
            assert t.rank({"pp": stage, "ep": c["ep"], "edp": c["edp"]}) == r
            assert t.rank({k: c[k] for k in ("tp", "sp", "dp", "ep", "edp")} | {"pp": stage}) == r
    assert t.tp_for(True) == 1 and t.tp_for(False) == t.tp
    assert Topology.from_json(t.to_json()) == t and t.to_json()["ep_over"] == "stage"


def test_stage_rule_examples_and_errors():
    t = Topology(tp=2, dp=2, ep=2, ep_over="stage", zero_stage=2)
    assert [t.coords(r)["ep"] for r in range(4)] == [0, 1, 0, 1]  # tp rank 0 holds ep rank 0's experts
    assert [t.coords(r)["ep"] for r in range(4)] != [Topology(tp=2, dp=2, ep=2).coords(r)["ep"] for r in range(4)]
    assert (t.zero_world(expert=True), t.zero_world()) == (2, 2)
    assert "ep_over" not in Topology(tp=2, dp=2, ep=2).to_json()
    Topology(tp=2, dp=1, ep=2, ep_over="stage")  # ep may exceed dp: it is carved out of tp x dp
    with pytest.raises(TopologyError, match="ep=2 must divide dp=1"):
        Topology(tp=2, dp=1, ep=2)
    with pytest.raises(TopologyError, match=r"ep=4 must divide the 6 ranks of a pipeline stage \(tp=2 x sp=1 x dp=3\)"):
        Topology(tp=2, dp=3, ep=4, ep_over="stage")
    with pytest.raises(TopologyError, match="'ep_over' must be one of"):
        Topology(ep_over="world")
    with pytest.raises(TopologyError, match="coordinates disagree: tp=0"):
        t.rank({"tp": 0, "dp": 0, "ep": 1, "edp": 0})
    with pytest.raises(TopologyError, match="does not match topology.schema.json"):
        Topology.from_json({**t.to_json(), "ep_over": "tp"})


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_planner_gives_each_rank_its_whole_experts_in_deepspeed_order(data):
    t = data.draw(stage_topologies(max_world=16), label="topology")
    n_exp = t.ep * data.draw(st.integers(1, 2))
    inner, shape = data.draw(pattern_and_shape((t.tp,), kinds=["replicated", "partitioned"], inner=True),
                             label="inner")
    assume(math.prod(shape) > 0)
    rng = np.random.default_rng(3)
    xs = {(e, k): rng.integers(1, 1 << 40, size=shape, dtype=np.int64) for e in range(n_exp) for k in range(2)}
    recs = [{"name": "dense", "state": "fp32", "shape": [6], "dtype": "int64", "pattern": None}]
    pats = {}
    for e in range(n_exp):
        for k in range(2):
            pats[(e, k)] = {"kind": "expert_member", "expert": e, "num_experts": n_exp, "group": "moe.experts",
                            "inner": inner}
            recs.append({"name": f"moe.experts.{e}.w{k}", "state": "fp32", "shape": list(shape), "dtype": "int64",
                         "pattern": pats[(e, k)]})
    per = n_exp // t.ep
    hits = {key: np.zeros(shape, np.int64) for key in xs}
    for rank in range(t.world_size):
        c = t.coords(rank)
        mine = list(range(c["ep"] * per, (c["ep"] + 1) * per))
        for key, pj in pats.items():
            assert holds(pj, t, rank) == (key[0] in mine)
            for cp in writer_copies(pj, shape, t, rank):
                hits[key][cp.logical.slices()] += 1
        p = plan(recs, t, rank)
        experts = {tp.name: tp for tp in p.tensors if tp.name != "dense"}
        expected = {f"moe.experts.{e}.w{k}" for e in mine for k in range(2)}
        assert set(experts) == expected if t.zero_stage == 0 else set(experts) <= expected
        for tp in experts.values():
            assert tp.local_shape == tuple(shape)  # whole: the inner TP pattern is not applied
        if t.zero_stage in (1, 2):
            buf = next(b for b in p.buffers if b.group == EXPERT_GROUP)
            whole = [ref_local({"kind": "replicated"}, xs[(e, k)], 1, 0) for e in mine for k in range(2)]
            ref = ref_zero_partition(whole, t.edp, c["edp"], t.zero_stage, t.zero_alignment, t.zero_param_alignment)
            out = np.full(buf.numel, SENTINEL, np.int64)
            for tp in experts.values():
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
