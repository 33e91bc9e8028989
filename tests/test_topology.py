"""Topology: rank order, coordinates, pipeline stages, ZeRO groups, stage-local names, JSON."""

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_store.errors import TopologyError
from ucp_store.topology import AXES, Topology, validate_topology_record


@st.composite
def topologies(draw):
    dp = draw(st.sampled_from([1, 2, 3, 4, 6]))
    ep = draw(st.sampled_from([d for d in (1, 2, 3, 4, 6) if dp % d == 0]))
    pp = draw(st.integers(1, 4))
    layers = draw(st.integers(pp, 9))
    order = draw(st.permutations(AXES))
    return Topology(tp=draw(st.sampled_from([1, 2, 3, 4, 8])), pp=pp, dp=dp, sp=draw(st.integers(1, 2)), ep=ep,
                    zero_stage=draw(st.integers(0, 3)), layers=layers, order=tuple(order))


def test_default_order_is_megatron_tp_fastest_then_sp_dp_pp():
    t = Topology(tp=2, sp=3, dp=4, pp=5, layers=5)
    assert t.world_size == 120
    for tp, sp, dp, pp in itertools.product(range(2), range(3), range(4), range(5)):
        rank = tp + 2 * (sp + 3 * (dp + 4 * pp))
        assert t.rank({"tp": tp, "sp": sp, "dp": dp, "pp": pp}) == rank
        c = t.coords(rank)
        assert (c["tp"], c["sp"], c["dp"], c["pp"]) == (tp, sp, dp, pp)


def test_custom_order_fastest_first():
    t = Topology(tp=2, dp=3, pp=2, layers=2, order=("dp", "tp", "pp"))
    # dp fastest: rank = dp + 3 * (tp + 2 * pp)
    assert t.rank({"tp": 1, "dp": 2, "pp": 1}) == 2 + 3 * (1 + 2 * 1)
    t2 = Topology(tp=2, dp=3, pp=2, layers=2, order=("tp", "dp", "pp"))  # sp omitted: size 1
    assert t2.rank({"tp": 1, "dp": 2, "pp": 1}) == 1 + 2 * (2 + 3 * 1)


@settings(max_examples=60, deadline=None)
@given(topologies())
def test_coords_rank_roundtrip_and_bijective(t):
    seen = set()
    for r in range(t.world_size):
        c = t.coords(r)
        assert t.rank(c) == r
        assert t.rank({k: c[k] for k in ("tp", "sp", "pp", "ep", "edp")}) == r  # dp given as ep + edp
        assert c["dp"] == c["ep"] + t.ep * c["edp"]
        seen.add((c["tp"], c["sp"], c["dp"], c["pp"]))
    assert len(seen) == t.world_size


@settings(max_examples=60, deadline=None)
@given(topologies())
def test_zero_groups_partition_ranks_in_global_order(t):
    if t.zero_stage == 0:
        assert t.zero_world() == 1 and t.zero_rank(0) == 0
        return
    for expert in (False, True):
        groups = {}
        for r in range(t.world_size):
            c = t.coords(r)
            key = (c["tp"], c["pp"], c["ep"] if expert else None)
            groups.setdefault(key, []).append(r)
        for ranks in groups.values():
            assert len(ranks) == t.zero_world(expert)
            assert [t.zero_rank(r, expert) for r in ranks] == list(range(len(ranks)))


def test_rank_errors():
    t = Topology(tp=2, dp=2)
    with pytest.raises(TopologyError, match="outside"):
        t.coords(4)
    with pytest.raises(TopologyError, match="lack axis 'dp'"):
        t.rank({"tp": 0})
    with pytest.raises(TopologyError, match="outside"):
        t.rank({"tp": 2, "dp": 0})
    with pytest.raises(TopologyError, match="unknown coordinate"):
        t.rank({"tp": 0, "dp": 0, "xx": 1})
    assert Topology().rank({}) == 0


def test_ep_carved_out_of_dp():
    t = Topology(dp=4, ep=2)
    assert [t.coords(r)["ep"] for r in range(4)] == [0, 1, 0, 1]  # consecutive dp ranks: one ep group
    assert [t.coords(r)["edp"] for r in range(4)] == [0, 0, 1, 1]
    assert t.zero_world(expert=True) == 1  # zero_stage 0
    assert Topology(dp=4, ep=2, zero_stage=1, sp=2).zero_world(expert=True) == 4
    with pytest.raises(TopologyError, match="ep=3 must divide dp=4"):
        Topology(dp=4, ep=3)


@pytest.mark.parametrize("order,msg", [
    (("tp", "dp", "ep", "pp"), "may not list 'ep'"),
    (("tp", "pp"), "omits axis"),
    (("tp", "tp", "dp", "pp"), "twice"),
    (("tp", "xx", "dp", "pp"), "unknown axis"),
])
def test_order_errors(order, msg):
    with pytest.raises(TopologyError, match=msg):
        Topology(tp=2, dp=2, pp=2, layers=2, order=order)


def _partition_uniform(num_items, num_parts):
    # DeepSpeed runtime/utils.py::partition_uniform, transcribed
    chunksize = num_items // num_parts
    residual = num_items - chunksize * num_parts
    parts = [i * chunksize for i in range(num_parts + 1)]
    for i in range(residual):
        for j in range(i + 1, num_parts + 1):
            parts[j] += 1
    return parts


@pytest.mark.parametrize("layers,pp", [(8, 2), (7, 3), (10, 4), (5, 5), (6, 1), (13, 4)])
def test_even_stage_split_matches_deepspeed_uniform(layers, pp):
    t = Topology(pp=pp, layers=layers)
    parts = _partition_uniform(layers, pp)
    assert t.stage_starts == tuple(parts)
    for s in range(pp):
        assert t.layers_of_stage(s) == range(parts[s], parts[s + 1])
        for layer in t.layers_of_stage(s):
            assert t.stage_of_layer(layer) == s


def test_explicit_layer_stages():
    t = Topology(pp=3, layers=6, layer_stages=[0, 0, 0, 1, 2, 2])
    assert [t.stage_of_layer(i) for i in range(6)] == [0, 0, 0, 1, 2, 2]
    assert t.layers_of_stage(0) == range(0, 3)
    assert t.layers_of_stage(1) == range(3, 4)
    assert t.layers_of_stage(2) == range(4, 6)


@pytest.mark.parametrize("stages,msg", [
    ([0, 0, 2, 2], "skips stage"),
    ([0, 1, 0, 2], "not monotonic"),
    ([0, 1, 2], "layers=4"),
    ([1, 1, 2, 2], "start at stage 0"),
    ([0, 0, 1, 1], "ends at stage 1"),
    ([0, 1, 2, 3], "not a stage"),
])
def test_bad_layer_stages(stages, msg):
    with pytest.raises(TopologyError, match=msg):
        Topology(pp=3, layers=4, layer_stages=stages)


def test_too_few_layers_for_pp():
    with pytest.raises(TopologyError, match="at least 4 layers"):
        Topology(pp=4, layers=3)
    with pytest.raises(TopologyError, match="outside"):
        Topology(pp=2, layers=4).stage_of_layer(4)


@pytest.mark.parametrize("field,value", [("tp", 0), ("zero_stage", 4), ("layers", -1), ("dp", 1.5)])
def test_field_validation(field, value):
    with pytest.raises(TopologyError, match=field):
        Topology(**{field: value})


@settings(max_examples=30, deadline=None)
@given(topologies())
def test_json_roundtrip_and_schema(t):
    rec = t.to_json()
    validate_topology_record(rec)
    assert Topology.from_json(rec) == t
    assert Topology.from_json(json.dumps(rec)) == t


def test_json_defaults_and_schema_errors():
    assert Topology.from_json({"tp": 2}) == Topology(tp=2)
    with pytest.raises(TopologyError, match="topology.schema.json"):
        Topology.from_json({"tp": 2, "tensor_parallel": 2})
    with pytest.raises(TopologyError, match="topology.schema.json"):
        Topology.from_json({"zero_stage": 5})
    with pytest.raises(TopologyError, match="not valid JSON"):
        Topology.from_json("{")
    # cross-field rules are Topology's own
    with pytest.raises(TopologyError, match="skips stage"):
        Topology.from_json({"pp": 3, "layers": 3, "layer_stages": [0, 2, 2]})


def test_layer_name_rule_roundtrip():
    t = Topology(pp=2, layers=6, layer_names={"canonical": "layers.{layer}.", "local": "decoder.layers.{local}."})
    assert t.local_name("layers.4.mlp.w") == "decoder.layers.1.mlp.w"
    assert t.local_name("layers.2.mlp.w") == "decoder.layers.2.mlp.w"
    assert t.local_name("embedding.weight") == "embedding.weight"
    assert t.canonical_name("decoder.layers.1.mlp.w", stage=1) == "layers.4.mlp.w"
    for layer in range(6):
        name = f"layers.{layer}.attn.qkv"
        assert t.canonical_name(t.local_name(name), t.stage_of_layer(layer)) == name
    with pytest.raises(TopologyError, match="does not exist on stage 1"):
        t.canonical_name("decoder.layers.3.x", stage=1)
    assert Topology.from_json(t.to_json()) == t
    with pytest.raises(TopologyError, match="exactly once"):
        Topology(layer_names={"canonical": "layers.", "local": "l.{local}."})
