"""Loading rank shards from a real store: planner + TensorStore reads, against the in-memory executor.

The planner's index math is proven bit-exact against independent numpy constructions in
test_planner.py / test_transformer_grid.py; here the same plans run through ``io.py`` against arrays on
disk (chunked, sharded, crc32c) and must give exactly what the in-memory executor gives.
"""

import numpy as np
import pytest
import torch
from test_planner import execute
from test_transformer_grid import PARAMS, TOPOLOGIES

import ucp_store
from ucp_store.plan.planner import plan
from ucp_store.topology import Topology

OPT = ("fp32", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def transformer_store(tmp_path_factory):
    """The small transformer of the grid test, saved with integer-valued states (exact in bf16/fp32)."""
    rng = np.random.default_rng(3)
    store = ucp_store.open_store(str(tmp_path_factory.mktemp("ls") / "store"), create=True)
    logical = {}
    with store.begin("tf", 1) as w:
        for name, pattern, shape in PARAMS:
            for state in ("weight", *OPT):
                hi = 256 if state == "weight" else 1 << 24
                x = rng.integers(1, hi, size=shape).astype(np.float32)
                t = torch.from_numpy(x)
                w.write(name, state, t.bfloat16() if state == "weight" else t, pattern=pattern)
                logical[(name, state)] = x.astype(np.int64)
        w.write("step", "step", torch.tensor(7, dtype=torch.int64))
        logical[("step", "step")] = np.array(7, dtype=np.int64)
    return store.checkpoint("tf@1"), logical


@pytest.mark.parametrize("ti", [1, 2, 3, 4, 7, 9])
def test_load_shard_matches_plan_executed_in_memory(transformer_store, ti):
    ck, logical = transformer_store
    topo = TOPOLOGIES[ti]
    for rank in range(0, topo.world_size, max(1, topo.world_size // 5)):
        got = ck.load_shard(topo, rank)
        want_tensors, want_buffers, want_own = execute(got.plan, logical)
        names = {(t.name, t.state): (t.local_name, t.state) for t in got.plan.tensors}
        for key, want in want_tensors.items():
            t = got.tensors[names[key]]
            assert t.dtype == (torch.bfloat16 if key[1] == "weight" else
                               torch.int64 if key[1] == "step" else torch.float32)
            assert np.array_equal(t.to(torch.float64).numpy().astype(np.int64), want), (topo, rank, key)
        for key, want in want_own.items():
            assert np.array_equal(got.tensors[names[key]].to(torch.float64).numpy().astype(np.int64), want)
        for key, want in want_buffers.items():
            assert np.array_equal(got.buffers[key].to(torch.float64).numpy().astype(np.int64), want), (topo, rank, key)
        assert got.bytes_read == got.plan.bytes_needed


def test_load_shard_casts_and_lazy(transformer_store):
    ck, logical = transformer_store
    topo = Topology(tp=2, dp=2, zero_stage=1, layers=4)
    eager = ck.load_shard(topo, 3, dtype={"fp32": torch.bfloat16})
    assert all(b.dtype == torch.bfloat16 for k, b in eager.buffers.items() if k.endswith("/fp32"))
    assert all(b.dtype == torch.float32 for k, b in eager.buffers.items() if k.endswith("/exp_avg"))
    lazy = ck.load_shard(topo, 3, lazy=True)
    assert lazy.bytes_read == 0
    key = next(k for k in lazy.keys() if k[1] == "weight")
    t = lazy[key]
    assert lazy.bytes_read == t.numel() * t.element_size()
    assert torch.equal(t, eager.tensors[key])
    buf_key = next(iter(eager.buffers))
    assert torch.equal(lazy.buffer(buf_key), eager.buffers[buf_key].float()
                       if buf_key.endswith("/fp32") else eager.buffers[buf_key])


def test_states_filter_reads_only_those_states(transformer_store):
    ck, _ = transformer_store
    got = ck.load_shard(Topology(tp=4, layers=4), 1, states=["weight"])
    assert {s for _, s in got.tensors} == {"weight"}
    assert not got.buffers


def test_unknown_state_is_an_error_not_an_empty_shard(transformer_store):
    ck, _ = transformer_store
    with pytest.raises(ucp_store.errors.UcpError, match=r"no state 'fp16'.*exp_avg.*weight"):
        ck.load_shard(Topology(tp=2, layers=4), 0, states=["weight", "fp16"])


def _layer(info):
    placement = (info.pattern or {}).get("placement") or {}
    return placement.get("layer")


@pytest.mark.parametrize("ti", [i for i, t in enumerate(TOPOLOGIES) if t.pp > 1])
def test_pipeline_stage_fetches_only_its_rows(transformer_store, ti):
    """With pp > 1 the catalog returns a stage's layers plus the unlayered tensors, and the plan made from
    them equals the plan made from every row."""
    ck, _ = transformer_store
    topo = TOPOLOGIES[ti]
    every = ck.store.checkpoint("tf@1").tensors()
    for rank in range(topo.world_size):
        fresh = ck.store.checkpoint("tf@1")
        records = fresh.plan_records(topo, rank)
        assert fresh._infos is None  # the full row set was never loaded
        layers = topo.layers_of_stage(topo.coords(rank)["pp"])
        assert records == [i for i in every if _layer(i) is None or _layer(i) in layers]
        assert len(records) < len(every)
        assert plan(records, topo, rank) == plan(every, topo, rank)


def test_pipeline_stage_on_too_few_layers_names_the_tensor(transformer_store):
    ck, _ = transformer_store
    fresh = ck.store.checkpoint("tf@1")
    short = Topology(tp=2, pp=2, layers=2)  # the checkpoint has 4 layers
    with pytest.raises(ucp_store.errors.UcpError, match=r"layers\.[23]\..* is placed on layer [23] but the topology "
                                                        r"has layers=2"):
        fresh.load_shard(short, 0)


@pytest.mark.parametrize("ti", [2, 3, 7, 9])
def test_padding_is_zero_in_reused_memory(transformer_store, ti):
    """Destinations are allocated uninitialised and only the plan's padding is zeroed (the reads fill the
    rest): memory the allocator hands back dirty must still give zero padding (vocab rows, ZeRO-3 clip
    tails, ZeRO-1/2 alignment gaps), equal to the in-memory executor."""
    ck, logical = transformer_store
    topo = TOPOLOGIES[ti]
    padded = 0
    for rank in range(topo.world_size):
        p = ck.load_shard(topo, rank).plan
        padded += sum(len(t.padding) for t in p.tensors) + sum(len(b.padding) for b in p.buffers)
        sizes = ([b.numel * 4 for b in p.buffers] + [t.fragment.slot * 4 for t in p.tensors if t.fragment]
                 + [int(np.prod(t.local_shape)) * 4 for t in p.tensors])
        junk = [torch.full((n,), 0x7F, dtype=torch.uint8) for n in sizes for _ in range(2)]
        del junk  # freed: the load's allocations of the same sizes get these bytes back
        got = ck.load_shard(topo, rank)
        want_tensors, want_buffers, want_own = execute(got.plan, logical)
        names = {(t.name, t.state): (t.local_name, t.state) for t in got.plan.tensors}
        for key, want in {**want_tensors, **want_own}.items():
            t = got.tensors[names[key]]
            assert np.array_equal(t.to(torch.float64).numpy().astype(np.int64), want), (topo, rank, key)
        for key, want in want_buffers.items():
            assert np.array_equal(got.buffers[key].to(torch.float64).numpy().astype(np.int64), want), (topo, rank, key)
    assert padded, "the topology must have padding for this test to mean anything"


@pytest.mark.parametrize("text", ['[4, 8]', '[]', '{"kind": "partitioned", "dim": 0, "placement": {"layer": 3}}',
                                  ' [1]', '[1] ', 'null', '"x"', '{"a": [1.5, true, null, "\\u00e9"]}'])
def test_catalog_json_decoder_equals_json_loads(text):
    """Catalog text goes through the JSON decoder's C scanner alone; whatever it takes, the value is
    json.loads', and text it does not take (leading or trailing space) still goes through json.loads."""
    import json

    from ucp_store.registry.checkpoint import _json_value

    assert _json_value(text) == json.loads(text)
    assert _json_value(text.encode()) == json.loads(text)  # a driver handing bytes


@pytest.mark.parametrize("text", ['[1,', '[1] x', '', '{"a": }'])
def test_catalog_json_decoder_refuses_what_json_loads_refuses(text):
    import json

    from ucp_store.registry.checkpoint import _json_value

    with pytest.raises(json.JSONDecodeError):
        _json_value(text)


def test_fetches_share_shapes_and_codecs(transformer_store):
    """Two fetches of a version hand out the same shape and codec objects (io's held readers match a
    later load's records by identity), with values equal to the catalog's."""
    ck, _ = transformer_store
    a = ck.store.checkpoint("tf@1").tensors()
    b = ck.store.checkpoint("tf@1").tensors()
    assert a == b
    for x, y in zip(a, b):
        assert x.codecs is y.codecs and x.shape is y.shape and x.chunk_shape is y.chunk_shape
    import json

    from sqlalchemy import text

    with ck.store.catalog.engine.connect() as conn:
        rows = dict(conn.execute(text("SELECT id, codecs FROM arrays")).fetchall())
    for x in a:
        assert x.codecs == json.loads(rows[x.array_id])  # the catalog's own text, decoded independently
