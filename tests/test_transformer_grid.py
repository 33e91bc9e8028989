"""A full small transformer resharded over a grid of source -> target topologies, bit-exact.

Model: vocab-padded embedding tied with the LM head (stored once, on the first and last stage, named
differently there), per layer norms, fused QKV under GQA (uneven widths for tp=3), row-parallel
attention output with a replicated bias, fused SwiGLU, row-parallel down projection, and on odd layers
an MoE block (replicated router, experts [E, 2F, H] fused inside each expert and [E, H, F] row-parallel,
uneven widths for tp=8); a final norm on the last stage. States: bf16 weight, fp32 master, both Adam
moments, and the step.

For every topology: every rank's plan is executed (the forward map) and checked against an independent
numpy construction (tensors, ZeRO-1/2 group partitions, ZeRO-3 per-parameter partitions); the logical
tensors are rebuilt from those shards through the writer rule (each element exactly once). For every
(source, target) pair: the target's plans are executed against the source's rebuilt tensors and
compared with the reference, bit for bit.
"""

import itertools

import numpy as np
import pytest
from test_planner import execute, reassemble, reference_rank

from ucp_store.patterns import stage_local_name
from ucp_store.plan.planner import chunk_alignment, plan
from ucp_store.topology import Topology

V, H, Q, KV, F, E, FE, LAYERS = 50, 24, 24, 8, 24, 4, 12, 4
OPT = ("fp32", "exp_avg", "exp_avg_sq")

TOPOLOGIES = [
    Topology(),
    Topology(tp=2, pp=2, dp=2, zero_stage=1, layers=LAYERS),
    Topology(tp=4, dp=2, ep=2, zero_stage=2, layers=LAYERS, vocab_multiple=4),
    Topology(tp=3, pp=2, dp=2, zero_stage=1, layers=LAYERS, vocab_multiple=2),
    Topology(tp=8, dp=2, zero_stage=3, layers=LAYERS),
    Topology(tp=2, pp=4, dp=2, sp=2, layers=LAYERS),
    Topology(pp=2, dp=4, ep=4, zero_stage=2, layers=LAYERS),
    Topology(tp=3, dp=4, ep=2, zero_stage=3, layers=LAYERS, order=("dp", "tp", "pp")),
    Topology(tp=4, pp=2, layers=LAYERS, layer_stages=(0, 0, 0, 1)),
    Topology(tp=2, dp=4, ep=4, zero_stage=1, layers=LAYERS, zero_param_alignment=8),
    Topology(pp=4, dp=2, sp=2, zero_stage=3, layers=LAYERS, order=("sp", "tp", "dp", "pp")),
    Topology(tp=8, pp=2, layers=LAYERS),
    Topology(tp=1, pp=2, dp=2, ep=2, zero_stage=1, layers=LAYERS, zero_alignment=4),
]


def transformer():
    """``(name, pattern, shape)`` in parameter (= ZeRO flat) order."""
    def at(layer, pattern):
        return {**pattern, "placement": {"layer": layer}}

    params = [("embedding.weight", {"kind": "vocab", "dim": 0, "original_size": V, "placement": {
        "stages": ["first", "last"],
        "local_name": {"first": "embedding.word_embeddings.weight", "last": "output_layer.weight"}}}, (V, H))]
    qkv_widths = {"3": [[8, 8, 8], [3, 3, 2], [3, 3, 2]]}
    for i in range(LAYERS):
        p = f"layers.{i}."
        params += [
            (p + "input_norm.weight", at(i, {"kind": "replicated"}), (H,)),
            (p + "attn.qkv.weight", at(i, {"kind": "fused", "dim": 0, "sizes": [Q, KV, KV], "widths": qkv_widths}),
             (Q + 2 * KV, H)),
            (p + "attn.qkv.bias", at(i, {"kind": "fused", "dim": 0, "sizes": [Q, KV, KV], "widths": qkv_widths}),
             (Q + 2 * KV,)),
            (p + "attn.o.weight", at(i, {"kind": "partitioned", "dim": 1}), (H, Q)),
            (p + "attn.o.bias", at(i, {"kind": "replicated"}), (H,)),
            (p + "post_norm.weight", at(i, {"kind": "replicated"}), (H,)),
        ]
        if i % 2:
            params += [
                (p + "moe.router.weight", at(i, {"kind": "replicated"}), (E, H)),
                (p + "moe.experts.w13", at(i, {"kind": "expert", "dim": 0, "num_experts": E, "inner": {
                    "kind": "fused", "dim": 0, "sizes": [FE, FE],
                    "widths": {"8": [[2, 2, 2, 2, 1, 1, 1, 1], [2, 2, 2, 2, 1, 1, 1, 1]]}}}), (E, 2 * FE, H)),
                (p + "moe.experts.w2", at(i, {"kind": "expert", "dim": 0, "num_experts": E, "inner": {
                    "kind": "partitioned", "dim": 1, "widths": {"8": [2, 2, 2, 2, 1, 1, 1, 1]}}}), (E, H, FE)),
            ]
        else:
            params += [
                (p + "mlp.gate_up.weight", at(i, {"kind": "fused", "dim": 0, "sizes": [F, F]}), (2 * F, H)),
                (p + "mlp.down.weight", at(i, {"kind": "partitioned", "dim": 1}), (H, F)),
            ]
    params.append(("final_norm.weight", {"kind": "replicated", "placement": {"stages": ["last"]}}, (H,)))
    return params


PARAMS = transformer()
PATTERNS = {name: pj for name, pj, _ in PARAMS} | {"step": None}
TENSORS = [(name, pj, shape, ["weight", *OPT]) for name, pj, shape in PARAMS] + [("step", None, (), ["step"])]


def _records():
    recs = []
    for name, pj, shape in PARAMS:
        chunk = chunk_alignment(pj, shape, TOPOLOGIES, min_chunk_bytes=1)  # every split aligned
        for state in ("weight", *OPT):
            recs.append({"name": name, "state": state, "shape": list(shape), "pattern": pj, "chunk_shape": list(chunk),
                         "dtype": "bfloat16" if state == "weight" else "float32"})
    recs.append({"name": "step", "state": "step", "shape": [], "dtype": "int64", "pattern": None, "chunk_shape": []})
    return recs


RECORDS = _records()
_rng = np.random.default_rng(7)
LOGICAL = {(r["name"], r["state"]): _rng.integers(1, 1 << 40, size=r["shape"], dtype=np.int64) for r in RECORDS}
_cache: dict = {}


def _topology_results(i):
    """Per topology: plans, executed shards (checked against the reference) and the rebuilt tensors."""
    if i in _cache:
        return _cache[i]
    t = TOPOLOGIES[i]
    plans, shards, refs = {}, {}, {}
    for rank in range(t.world_size):
        plans[rank] = plan(RECORDS, t, rank)
        shards[rank] = execute(plans[rank], LOGICAL)
        refs[rank] = reference_rank(t, rank, TENSORS, LOGICAL)
        _assert_equal(shards[rank], refs[rank], t, rank)
    rebuilt = reassemble(t, plans, shards, LOGICAL, PATTERNS)
    for key, x in LOGICAL.items():
        assert np.array_equal(rebuilt[key], x), (t, key)
    _cache[i] = plans, refs, rebuilt
    return _cache[i]


def _assert_equal(got, want, t, rank):
    for g, w, what in zip(got, want, ("tensors", "buffers", "own buffers")):
        assert set(g) <= set(w), (what, set(g) - set(w))
        for key in set(w) - set(g):  # flat states whose fragment is empty on this rank are not planned
            assert what != "tensors" and (w[key].size == 0 or what == "own buffers" and not w[key].any()), key
        for key in g:
            assert g[key].shape == w[key].shape and np.array_equal(g[key], w[key]), (t.describe(), rank, what, key)


PAIRS = [(s, d) for s, d in itertools.product(range(len(TOPOLOGIES)), repeat=2) if s != d]


def test_grid_covers_the_parallelism_space():
    assert len(PAIRS) >= 50
    tps = {(TOPOLOGIES[s].tp, TOPOLOGIES[d].tp) for s, d in PAIRS}
    assert {(1, 8), (8, 2), (4, 3), (3, 4), (2, 3), (8, 3)} <= tps
    assert {t.zero_stage for t in TOPOLOGIES} == {0, 1, 2, 3}
    assert {t.pp for t in TOPOLOGIES} == {1, 2, 4} and {t.ep for t in TOPOLOGIES} == {1, 2, 4}
    assert {t.sp for t in TOPOLOGIES} == {1, 2}


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{TOPOLOGIES[s].describe()}->{TOPOLOGIES[d].describe()}"
                                                 for s, d in PAIRS])
def test_reshard_pair_bit_exact(src, dst):
    _, _, rebuilt = _topology_results(src)
    plans, refs, _ = _topology_results(dst)
    t = TOPOLOGIES[dst]
    for rank, p in plans.items():
        _assert_equal(execute(p, rebuilt), refs[rank], t, rank)


def test_tied_embedding_is_planned_on_first_and_last_stage_with_local_names():
    t = Topology(tp=2, pp=2, layers=LAYERS)
    for stage, local in ((0, "embedding.word_embeddings.weight"), (1, "output_layer.weight")):
        p = plan(RECORDS, t, t.rank({"tp": 1, "pp": stage}), states={"weight"})
        (emb,) = [x for x in p.tensors if x.name == "embedding.weight"]
        assert emb.local_name == local == stage_local_name("embedding.weight", PATTERNS["embedding.weight"], t, stage)
        assert emb.local_shape == (25, H) and emb.padding == ()
        layers = {int(x.name.split(".")[1]) for x in p.tensors if x.name.startswith("layers.")}
        assert layers == set(t.layers_of_stage(stage))
        assert ("final_norm.weight" in {x.name for x in p.tensors}) == (stage == 1)


def test_aligned_chunks_mean_no_read_amplification_for_tensor_states():
    for t in TOPOLOGIES:
        for rank in range(0, t.world_size, max(1, t.world_size // 4)):
            for x in plan(RECORDS, t, rank).tensors:
                if not x.flat:
                    assert x.bytes_read == x.bytes_needed, (t.describe(), x.name, x.state)
