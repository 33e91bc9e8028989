"""ucp_store.distributed: DTensor / FSDP2 / TP state dicts saved from every rank and resumed on other meshes.

Fast tests (one process, no process group): the placement arithmetic against torch's own splitting,
the state-dict keys, a save / load / verify / async_save / Checkpointer round trip with the demo model,
and the bad-input errors. Slow tests (real gloo processes, tests/dist_worker.py): the demo transformer
trained on a mesh, saved with ucp_store.distributed.save and DCP, resumed on other meshes with both; model and
optimizer state must be bit-identical to DCP's resume and the next-step losses equal.
"""

from __future__ import annotations

import itertools
import json
import sys

import pytest
import torch

import ucp_store
import ucp_store.distributed as ucpd
from ucp_store.demo.model import ModelConfig, batch, build_model, build_optimizer, train_step
from ucp_store.distributed import layout as lay
from ucp_store.distributed.statedict import flatten
from ucp_store.errors import (
    ConfigurationError,
    InvalidNameError,
    PatternError,
    PlanError,
    ReferenceNotFound,
    ShapeMismatch,
    TopologyError,
    UcpError,
)
from ucp_store.plan import planner
from ucp_store.topology import Topology

from ucp_test_helpers import REPO, run_python


# ----------------------------------------------------------------------------------------- pure layout
def _torch_local_indices(size, mesh_shape, placements, coord):
    """The indices torch's own placement splitting gives ``coord`` (left to right, as distribute_tensor)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    local = torch.arange(size)
    for n, p, c in zip(mesh_shape, placements, coord):
        if p["type"] == "replicate":
            pl = Replicate()
            continue
        pl = Shard(0) if p["type"] == "shard" else _StridedShard(0, split_factor=p["split_factor"])
        local = pl._split_tensor(local, n, with_padding=False)[0][c]
    return local.tolist()


_MESHES = [
    ((2,), [{"type": "shard", "dim": 0}]),
    ((3,), [{"type": "shard", "dim": 0}]),
    ((4,), [{"type": "shard", "dim": 0}]),
    ((2, 2), [{"type": "shard", "dim": 0}, {"type": "shard", "dim": 0}]),
    ((2, 3), [{"type": "replicate"}, {"type": "shard", "dim": 0}]),
    ((2, 2), [{"type": "strided_shard", "dim": 0, "split_factor": 2}, {"type": "shard", "dim": 0}]),
]
# _StridedShard needs even splits (torch's own rule), so it only meets sizes divisible by 4
_CASES = [(size, case) for size in (8, 12, 40, 41, 88, 2) for case in _MESHES
          if size % 4 == 0 or all(p["type"] != "strided_shard" for p in case[1])]


@pytest.mark.parametrize(("size", "case"), _CASES)
def test_dim_indices_match_torch_splitting(size, case):
    mesh_shape, placements = case
    seen = []
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        mine = lay.dim_indices((size,), mesh_shape, placements, coord)[0]
        assert mine == _torch_local_indices(size, mesh_shape, placements, coord), coord
        if lay.is_writer_coord(placements, coord):
            seen += mine
    assert sorted(seen) == list(range(size))  # writers tile the tensor exactly once


def test_strided_shard_regions_are_the_documented_rows():
    # torch's docstring: 8 rows on a 2x2 (dp, tp) mesh with [_StridedShard(0, sf=2), Shard(0)]
    pl = [{"type": "strided_shard", "dim": 0, "split_factor": 2}, {"type": "shard", "dim": 0}]
    rows = {c: [r.global_box[0] for r in lay.local_regions((8, 3), (2, 2), pl, c)] for c in lay.all_coords((2, 2))}
    assert rows == {(0, 0): [(0, 2)], (0, 1): [(4, 6)], (1, 0): [(2, 4)], (1, 1): [(6, 8)]}
    assert lay.split_points((8, 3), (2, 2), pl) == {0: [2, 4, 6]}
    # two boxes when the rank's rows are not contiguous (sf=2 over a 1-D mesh of 2)
    regions = lay.local_regions((8,), (2,), [{"type": "strided_shard", "dim": 0, "split_factor": 2}], (1,))
    assert [(r.global_box, r.local_box) for r in regions] == [(((2, 4),), ((0, 2),)), (((6, 8),), ((2, 4),))]


def test_partial_placement_is_refused():
    from torch.distributed.tensor import Partial

    with pytest.raises(UcpError, match="Partial"):
        lay.placement_json(Partial())


def test_dtensor_pattern_validation():
    from ucp_store.patterns import check_pattern
    from ucp_store.schema import validate

    good = {"kind": "dtensor", "mesh": {"shape": [2, 2], "dims": ["dp", "tp"]},
            "placements": [{"type": "strided_shard", "dim": 0, "split_factor": 2}, {"type": "shard", "dim": 0}]}
    validate("pattern", good)
    assert check_pattern(good, (8, 4)).to_json() == good
    with pytest.raises(PatternError, match="dim 2"):
        check_pattern({**good, "placements": [{"type": "shard", "dim": 2}, {"type": "replicate"}]}, (8, 4), name="w")
    with pytest.raises(PatternError, match="one placement per mesh dim"):
        check_pattern({**good, "placements": [{"type": "replicate"}]}, (8, 4), name="w")
    with pytest.raises(PatternError, match="not one of"):
        check_pattern({**good, "placements": [{"type": "partial"}, {"type": "replicate"}]}, (8, 4), name="w")


# ----------------------------------------------------------------------------------------- state dict keys
_FSDP_TP = {"kind": "dtensor", "mesh": {"shape": [2, 2], "dims": ["dp", "tp"]},
            "placements": [{"type": "strided_shard", "dim": 0, "split_factor": 2}, {"type": "shard", "dim": 0}]}


@pytest.mark.parametrize(("mesh", "rows"), [
    ("dp=2,tp=2", [[(0, 4)], [(8, 12)], [(4, 8)], [(12, 16)]]),  # the saving mesh: FSDP over TP's row blocks
    ("dp=4", [[(0, 4)], [(4, 8)], [(8, 12)], [(12, 16)]]),  # FSDP only: the strided split becomes Shard(0)
    ("tp=2", [[(0, 8)], [(8, 16)]]),  # TP only: the dp dim is dropped
    ("dp=3", [[(0, 6)], [(6, 12)], [(12, 16)]]),  # uneven: torch.chunk sizes
    ("dp=1,tp=4", [[(0, 4)], [(4, 8)], [(8, 12)], [(12, 16)]]),
    ("dp=2,tp=4", [[(0, 2)], [(4, 6)], [(8, 10)], [(12, 14)], [(2, 4)], [(6, 8)], [(10, 12)], [(14, 16)]]),
])
def test_plan_mesh_reads_each_ranks_dtensor_boxes(mesh, rows):
    recs = [{"name": "w", "state": "exp_avg", "shape": [16, 8], "dtype": "float32", "pattern": _FSDP_TP,
             "chunk_shape": [4, 8]},
            {"name": "b", "state": "weight", "shape": [8], "dtype": "float32", "pattern": None, "chunk_shape": [8]}]
    plans = [planner.plan_mesh(recs, mesh, r) for r in range(len(rows))]
    for p, want in zip(plans, rows):
        w = p.tensor("w", "exp_avg")
        assert [r.box.ranges[0] for r in w.reads] == want and all(r.box.ranges[1] == (0, 8) for r in w.reads)
        assert w.local_shape == (sum(b - a for a, b in want), 8) and w.bytes_needed == w.local_shape[0] * 32
        # chunks of 4 rows: a rank needing 2 rows reads its whole chunk; 6 rows touch two chunks
        assert w.bytes_read == sum(-(-b // 4) * 4 - a // 4 * 4 for a, b in want) * 32
        b = p.tensor("b", "weight")  # a plain tensor: every rank reads it whole
        assert [r.box.ranges for r in b.reads] == [((0, 8),)] and b.bytes_needed == 32
    assert sorted(r for w in rows for r in w) == sorted(set(r for w in rows for r in w))  # each row once
    # a topology plan treats the dtensor pattern as replicated: every rank reads the whole tensor
    assert planner.plan(recs, Topology(dp=len(rows)), 0).tensor("w", "exp_avg").bytes_needed == 16 * 8 * 4
    assert planner.plan_mesh(recs, mesh, 0).to_json()["assumes"] == planner.MESH_ASSUMPTION


def test_plan_mesh_errors():
    recs = [{"name": "w", "state": "fp32", "shape": [16, 8], "dtype": "float32", "pattern": _FSDP_TP}]
    with pytest.raises(PlanError, match="NAME=SIZE"):
        planner.plan_mesh(recs, "dp=0", 0)
    with pytest.raises(PlanError, match="name every dim once"):
        planner.plan_mesh(recs, "dp=2,2", 0)
    with pytest.raises(PlanError, match="outside the mesh's 4 ranks"):
        planner.plan_mesh(recs, "dp=2,tp=2", 4)
    with pytest.raises(TopologyError, match=r"tensor 'w' state 'fp32'.*must name its dims"):
        planner.plan_mesh(recs, "2,2", 0)


def test_state_dict_keys():
    t = torch.zeros(2)
    groups = [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["a.weight"]}]
    sd = {"model": {"a.weight": t}, "optim": {"state": {"a.weight": {"exp_avg": t, "step": torch.tensor(1.0)}},
                                              "param_groups": groups},
          "extra": {"opt2": {"state": {"a.weight": {"exp_avg": t}}, "param_groups": []}},
          "flat": {"state.b.weight.exp_avg": t, "param_groups.b.weight.lr": 0.5}}
    keys = {leaf.path: leaf.key for leaf in flatten(sd)}
    assert keys[("model", "a.weight")] == ("a.weight", "weight")
    assert keys[("optim", "state", "a.weight", "exp_avg")] == ("a.weight", "exp_avg")
    assert keys[("optim", "state", "a.weight", "step")] == ("a.weight", "step")
    assert keys[("extra", "opt2", "state", "a.weight", "exp_avg")] == ("a.weight", "extra.opt2.exp_avg")
    assert keys[("flat", "state.b.weight.exp_avg")] == ("b.weight", "flat.exp_avg")
    assert keys[("optim", "param_groups", 0, "betas")] is None  # a JSON leaf
    with pytest.raises(ConfigurationError, match="both map to"):
        flatten({"model": {"a": t}, "a": t})
    with pytest.raises(InvalidNameError, match="escape"):
        flatten({"model": {"../../etc/passwd": t}})


# ----------------------------------------------------------------------------------------- one process
def _sd(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = get_state_dict(model, opt)
    return {"model": m, "optim": o}


def _set(model, opt, sd):
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _trained(seed=0, steps=2, tie=False):
    cfg = ModelConfig(tie=tie)
    model = build_model(cfg, seed)
    opt = build_optimizer(model)
    for s in range(steps):
        train_step(model, opt, *batch(cfg, s))
    return cfg, model, opt


@pytest.mark.parametrize("tie", [False, True])
def test_single_process_round_trip(tmp_path, tie):
    cfg, model, opt = _trained(tie=tie)
    sd = _sd(model, opt)
    cid = ucpd.save(sd, store=tmp_path / "s", run="gpt", step=2, progress=False)
    _, m2, o2 = _trained(seed=7, steps=1, tie=tie)
    sd2 = _sd(m2, o2)
    assert not ucpd.verify(sd2, "gpt@2", store=tmp_path / "s").ok
    res = ucpd.load(sd2, store=tmp_path / "s", ref="gpt@latest")
    assert res.checkpoint_id == cid and res.missing == [] and res.unexpected == []
    _set(m2, o2, sd2)
    for (k, a), (_, b) in zip(_sd(model, opt)["model"].items(), _sd(m2, o2)["model"].items()):
        assert torch.equal(a, b), k
    assert ucpd.verify(_sd(m2, o2), "gpt@2", store=tmp_path / "s").ok
    assert train_step(model, opt, *batch(cfg, 2)) == train_step(m2, o2, *batch(cfg, 2))
    # the learning rate (a JSON leaf) round-trips too
    st = ucp_store.open_store(str(tmp_path / "s"))
    infos = {(i.name, i.state): i for i in st.checkpoint("gpt@2").tensors()}
    assert ("layers.0.attention.wq.weight", "exp_avg_sq") in infos and infos[("norm.weight", "weight")].pattern is None
    # hashed from the writers' unit digests in the one scheme of every save path; `ucp verify` recomputes and agrees
    assert all(i.content_hash.startswith("xxh3-128-tiles:") for i in infos.values())
    assert st.checkpoint("gpt@2").verify() == []
    # the same state saved again deduplicates against the first version's arrays
    ucpd.save(_sd(model, opt), store=tmp_path / "s", run="gpt", step=3, progress=False)
    ucpd.save(_sd(model, opt), store=tmp_path / "s", run="copy", step=3, progress=False)
    first = {(i.name, i.state): (i.content_hash, i.array_id) for i in st.checkpoint("gpt@3").tensors()}
    copy = {(i.name, i.state): (i.content_hash, i.array_id) for i in st.checkpoint("copy@3").tensors()}
    assert {k: h for k, (h, _) in copy.items()} == {k: h for k, (h, _) in first.items()}
    assert {a for _, a in copy.values()} <= {a for _, a in first.values()}  # no new array written


def test_verify_names_tensor_and_box(tmp_path):
    _, model, opt = _trained()
    sd = _sd(model, opt)
    ucpd.save(sd, store=tmp_path / "s", run="gpt", step=2, progress=False)
    with torch.no_grad():
        sd["optim"]["state"]["layers.1.feed_forward.w2.weight"]["exp_avg"][3, 5] += 1e-3
    report = ucpd.verify(sd, "gpt@2", store=tmp_path / "s")
    assert not report.ok and len(report.mismatches) == 1
    m = report.mismatches[0]
    assert (m.name, m.state, m.box, m.differing, m.first) == ("layers.1.feed_forward.w2.weight", "exp_avg",
                                                               [[0, 40], [0, 88]], 1, [3, 5])
    assert "layers.1.feed_forward.w2.weight" in str(report) and "[[0, 40], [0, 88]]" in str(report)


def test_load_errors(tmp_path):
    _, model, opt = _trained()
    ucpd.save(_sd(model, opt), store=tmp_path / "s", run="gpt", step=2, progress=False)
    with pytest.raises(ReferenceNotFound, match="gpt@9"):
        ucpd.load(_sd(model, opt), store=tmp_path / "s", ref="gpt@9")
    sd = _sd(model, opt)
    sd["model"]["norm.weight"] = torch.zeros(41)
    with pytest.raises(ShapeMismatch, match=r"norm\.weight.*\[41\].*\[40\]"):
        ucpd.load(sd, store=tmp_path / "s", ref="gpt@2")
    sd = _sd(model, opt)
    sd["model"]["head.extra"] = torch.zeros(3)
    with pytest.raises(ReferenceNotFound, match=r"head\.extra"):
        ucpd.load(sd, store=tmp_path / "s", ref="gpt@2")
    res = ucpd.load(sd, store=tmp_path / "s", ref="gpt@2", strict=False)
    assert res.missing == ["head.extra [weight]"]
    sd = {"model": {"norm.weight": torch.zeros(40)}}
    res = ucpd.load(sd, store=tmp_path / "s", ref="gpt@2", strict=False)
    assert res.missing == [] and "norm.bias [weight]" in res.unexpected
    with pytest.raises(ConfigurationError, match="neither a tensor nor JSON"):
        ucpd.save({"model": {"w": torch.zeros(2), "obj": object()}}, store=tmp_path / "s", run="x", step=0)
    assert [r["run"] for r in ucp_store.open_store(str(tmp_path / "s")).runs()] == ["gpt"]


def test_async_save_thread_is_the_state_at_the_call(tmp_path):
    cfg, model, opt = _trained(steps=1)
    sd = _sd(model, opt)
    ucpd.save(sd, store=tmp_path / "s", run="ref", step=1, progress=False)
    handle = ucpd.async_save(sd, store=tmp_path / "s", run="a", step=1, mode="thread")
    for s in range(1, 4):  # mutates every parameter and Adam moment in place while the save runs
        train_step(model, opt, *batch(cfg, s))
    cid = handle.result()
    st = ucp_store.open_store(str(tmp_path / "s"))
    a = {(i.name, i.state): i.content_hash for i in st.checkpoint("a@1").tensors()}
    b = {(i.name, i.state): i.content_hash for i in st.checkpoint("ref@1").tensors()}
    assert a == b and len(a) == 104 and st.resolve("a@1") == cid
    assert not ucpd.verify(_sd(model, opt), "a@1", store=tmp_path / "s").ok
    # a second call waits for the first; a failure surfaces through result() and lists nothing
    h2 = ucpd.async_save(_sd(model, opt), store=tmp_path / "s", run="a", step=4, mode="thread")
    h3 = ucpd.async_save(_sd(model, opt), store=tmp_path / "s", run="a", step=4, mode="thread")
    assert h2.result()
    with pytest.raises(UcpError, match="already has a committed checkpoint at step 4"):
        h3.result()
    assert [v["step"] for v in st.list_checkpoints("a")] == [1, 4]


def test_async_save_staging_buffers_are_reused_and_exact(tmp_path):
    # tensors over 1 MiB stage into prefaulted anonymous mappings; the second call reuses them
    from ucp_store.distributed import asyncsave

    g = torch.Generator().manual_seed(5)
    sd = {"w": torch.randn(512, 1024, generator=g), "h": torch.randn(700, 1024, generator=g).to(torch.bfloat16),
          "s": torch.tensor(3, dtype=torch.int64)}
    want = {k: v.clone() for k, v in sd.items()}
    h1 = ucpd.async_save(sd, store=tmp_path / "s", run="a", step=1)
    bufs = list(asyncsave._STAGER.buffers)
    assert [tuple(b.shape) for b in bufs] == [(512, 1024), (700, 1024), ()]
    assert [b.dtype for b in bufs] == [torch.float32, torch.bfloat16, torch.int64]
    for v in sd.values():
        v.add_(1)  # training goes on: the staged copy must not see it
    h1.result()
    h2 = ucpd.async_save(sd, store=tmp_path / "s", run="a", step=2)
    assert all(a is b for a, b in zip(asyncsave._STAGER.buffers, bufs))  # the same layout reuses the buffers
    h2.result()
    st = ucp_store.open_store(str(tmp_path / "s"))
    for step, state in ((1, want), (2, {k: v + 1 for k, v in want.items()})):
        ck = st.checkpoint(f"a@{step}")
        for k, v in state.items():
            assert torch.equal(ck.tensor(k, "weight").read(), v), (step, k)


def test_prepare_async_makes_the_buffers_the_first_call_uses(tmp_path):
    """prepare_async at setup makes the staging buffers (and the background group): the first async_save of
    that layout only copies into them, and saves the state at the call, not the zeros of a fresh buffer."""
    from ucp_store.distributed import asyncsave

    g = torch.Generator().manual_seed(6)
    sd = {"w": torch.randn(600, 1024, generator=g), "b": torch.randn(7, generator=g)}
    ucpd.prepare_async(sd)
    bufs, gen = list(asyncsave._STAGER.buffers), asyncsave._STAGER.generation
    assert [tuple(b.shape) for b in bufs] == [(600, 1024), (7,)]
    want = {k: v.clone() for k, v in sd.items()}
    h = ucpd.async_save(sd, store=tmp_path / "s", run="p", step=1)
    assert asyncsave._STAGER.generation == gen and all(a is b for a, b in zip(asyncsave._STAGER.buffers, bufs))
    for v in sd.values():
        v.mul_(2)
    h.result()
    ck = ucp_store.open_store(str(tmp_path / "s")).checkpoint("p@1")
    for k, v in want.items():
        assert torch.equal(ck.tensor(k, "weight").read(), v), k
    with pytest.raises(ConfigurationError, match="mode='fork'"):
        ucpd.prepare_async(sd, mode="fork")
    # an argument neither async_save nor the fast tier takes is named, with what it does take
    with pytest.raises(ConfigurationError, match=r"unexpected argument\(s\) progress; .* replicas"):
        ucpd.async_save(sd, store=tmp_path / "s", run="p", step=2, tier="fast", progress=False)


def test_checkpointer_retention_and_resume(tmp_path):
    cfg, model, opt = _trained(steps=0)
    ck = ucpd.Checkpointer(tmp_path / "s", "run", every=2, keep_last=2, async_mode="thread")
    assert ck.load_latest(_sd(model, opt)) is None  # nothing saved yet
    for s in range(1, 9):
        train_step(model, opt, *batch(cfg, s))
        out = ck.maybe_save(s, _sd(model, opt))
        assert (out is None) == (s % 2 == 1)
    ck.close()
    st = ucp_store.open_store(str(tmp_path / "s"))
    assert [v["step"] for v in st.list_checkpoints("run")] == [6, 8]
    _, m2, o2 = _trained(seed=3, steps=0)
    sd2 = _sd(m2, o2)
    assert ucpd.Checkpointer(tmp_path / "s", "run").load_latest(sd2) == 8
    _set(m2, o2, sd2)
    assert ucpd.verify(_sd(m2, o2), "run@8", store=tmp_path / "s").ok
    assert train_step(model, opt, *batch(cfg, 9)) == train_step(m2, o2, *batch(cfg, 9))
    with pytest.raises(ConfigurationError, match="every"):
        ucpd.Checkpointer(tmp_path / "s", "run", every=0)


def test_checkpointer_on_the_fast_tier(tmp_path):
    """``Checkpointer(tier="fast")``: every save goes to the node's fast tier (the catalog lists where), and
    ``load_latest`` resumes from the newest restorable version, from the fast tier's copies; bad options are
    refused naming them."""
    cfg, model, opt = _trained(steps=0)
    opts = {"replicas": 0, "fast_tier": str(tmp_path / "fast" / "{node}"), "node": "n0", "drain": False}
    ck = ucpd.Checkpointer(tmp_path / "s", "run", every=2, tier="fast", **opts)
    for s in range(1, 5):
        train_step(model, opt, *batch(cfg, s))
        ck.maybe_save(s, _sd(model, opt))
    ck.close()
    assert list((tmp_path / "fast" / "n0").rglob("*"))  # the bytes are on the node's fast tier
    st = ucp_store.open_store(str(tmp_path / "s"))
    assert [(v["step"], v.get("safety")) for v in st.list_checkpoints("run")] == [(2, "local"), (4, "local")]
    _, m2, o2 = _trained(seed=3, steps=0)
    sd2 = _sd(m2, o2)
    back = ucpd.Checkpointer(tmp_path / "s", "run", tier="fast", **opts)
    assert back.load_latest(sd2) == 4 and back.last_note is None
    _set(m2, o2, sd2)
    assert train_step(model, opt, *batch(cfg, 5)) == train_step(m2, o2, *batch(cfg, 5))
    with pytest.raises(ConfigurationError, match="tier='disk'"):
        ucpd.Checkpointer(tmp_path / "s", "run", tier="disk")
    with pytest.raises(ConfigurationError, match="replicas need tier='fast'"):
        ucpd.Checkpointer(tmp_path / "s", "run", replicas=1)
    with pytest.raises(ConfigurationError, match="replica are not options"):
        ucpd.Checkpointer(tmp_path / "s", "run", tier="fast", replica=1)


# ----------------------------------------------------------------------------------------- real gloo ranks
def _spawn(tmp_path, name, spec, timeout=900):
    out = tmp_path / name
    spec = {**spec, "out": str(out), "timeout": timeout - 30}
    proc = run_python([str(REPO / "tests" / "dist_worker.py"), json.dumps(spec)], timeout=timeout,
                      UCP_DIST_TIMEOUT="120")
    results = []
    for r in range(spec["world"]):
        path = out / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return proc, results


def _ok(proc, results):
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in results:
        assert r is not None and "crash" not in r, (r or {}).get("crash", proc.stderr[-3000:])
    return results


SOURCES = {  # name -> (world, mesh)
    "tpfsdp": (4, {"tp": 2, "dp": 2}),
    "fsdp4": (4, {"dp": 4}),
    "hsdp": (4, {"rep": 2, "dp": 2}),
    "fsdp2": (2, {"dp": 2}),
    "tied": (4, {"tp": 2, "dp": 2}),  # output projection tied to the (vocab-sharded) embedding
}
SOURCE_CFG = {"tied": {"tie": True}}  # ModelConfig overrides per source (the resumes use the same)
STEPS = 2


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Every source mesh trained STEPS steps and saved with ucp_store.distributed and with DCP."""
    base = tmp_path_factory.mktemp("dist")
    store = str(base / "store")
    for world in sorted({w for w, _ in SOURCES.values()}, reverse=True):
        jobs = [{"role": "source", "run": name, "dcp": str(base / f"dcp-{name}"), "steps": STEPS, **mesh,
                 "store": store, "cfg": SOURCE_CFG.get(name, {})} for name, (w, mesh) in SOURCES.items() if w == world]
        _ok(*_spawn(base, f"src{world}", {"world": world, "role": "source", "jobs": jobs}))
    return base, store


RESUMES = {  # world -> [(source, target mesh)]
    2: [("tpfsdp", {"tp": 2}), ("tpfsdp", {"dp": 2}), ("fsdp4", {"dp": 2}), ("tied", {"tp": 2})],
    1: [("tpfsdp", {})],
    3: [("fsdp2", {"dp": 3})],
    4: [("hsdp", {"dp": 4})],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(RESUMES))
def test_resume_on_other_meshes_equals_dcp(sources, world):
    base, store = sources
    jobs = [{"role": "resume", "ref": f"{src}@{STEPS}", "dcp": str(base / f"dcp-{src}"), "steps": STEPS, "store": store,
             "tp": 1, "dp": 1, "rep": 1, **mesh, "cfg": SOURCE_CFG.get(src, {})} for src, mesh in RESUMES[world]]
    results = _ok(*_spawn(base, f"resume{world}", {"world": world, "role": "resume", "jobs": jobs}))
    st = ucp_store.open_store(store)
    for r in results:
        for (src, mesh), job in zip(RESUMES[world], r["jobs"]):
            what = f"{src} -> {mesh or '1x1'} rank {r['rank']}"
            assert job["diffs"] == [], what  # model and optimizer state bit-identical to DCP's resume
            assert job["loss_ucp"] == job["loss_dcp"], what  # and so are the next-step losses
            assert job["after"] == [], what
            assert job["verify_ok"], what
            # the planner's DTensor mesh plan names exactly the bytes this live rank loaded
            dims = [d for d in ("replicate", "dp", "tp") if mesh.get(d, 1) > 1] or ["dp"]
            target = {"shape": [mesh.get(d, 1) for d in dims], "dims": dims}
            mp = planner.plan_mesh(st.checkpoint(f"{src}@{STEPS}").tensors(), target, r["rank"])
            assert mp.bytes_needed == job["bytes_read"], what


@pytest.mark.slow
def test_placements_recorded_in_catalog(sources):
    _, store = sources
    st = ucp_store.open_store(store)
    infos = {(i.name, i.state): i for i in st.checkpoint(f"tpfsdp@{STEPS}").tensors()}
    wq = infos[("layers.0.attention.wq.weight", "exp_avg")].pattern
    assert wq == {"kind": "dtensor", "mesh": {"shape": [2, 2], "dims": ["dp", "tp"]},
                  "placements": [{"type": "strided_shard", "dim": 0, "split_factor": 2}, {"type": "shard", "dim": 0}]}
    assert infos[("layers.0.attention.wo.weight", "weight")].pattern["placements"] == [
        {"type": "shard", "dim": 0}, {"type": "shard", "dim": 1}]
    hsdp = {(i.name, i.state): i for i in st.checkpoint(f"hsdp@{STEPS}").tensors()}
    assert hsdp[("tok_embeddings.weight", "weight")].pattern["placements"] == [{"type": "replicate"},
                                                                                {"type": "shard", "dim": 0}]
    _cols, rows = st.query("SELECT name FROM tensors WHERE state = 'weight' AND pattern LIKE '%strided_shard%' "
                          "ORDER BY name")
    assert ("layers.1.feed_forward.w1.weight",) in rows
    out = run_python(["-m", "ucp_store.cli", "--store", store, "show", f"tpfsdp@{STEPS}"])
    assert out.returncode == 0 and "dtensor" in out.stdout, out.stderr
    # `ucp plan` says what a topology plan assumes of dtensor patterns, and plans a DTensor mesh exactly
    out = run_python(["-m", "ucp_store.cli", "--store", store, "plan", f"tpfsdp@{STEPS}", "--tp", "2"])
    assert out.returncode == 0 and "treats them as replicated" in out.stdout and "--mesh" in out.stdout, out.stderr
    out = run_python(["-m", "ucp_store.cli", "--store", store, "plan", f"tpfsdp@{STEPS}", "--mesh", "dp=2,tp=2",
                      "--json"])
    assert out.returncode == 0, out.stderr
    ranks = json.loads(out.stdout)["ranks"]
    topo = [planner.plan(list(infos.values()), Topology(tp=2, dp=2), r) for r in range(4)]
    assert [r["coords"] for r in ranks] == [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0},
                                            {"dp": 1, "tp": 1}]
    # the saving mesh itself: each rank needs its quarter of every sharded tensor, far less than the topology
    # plan's whole tensors per TP rank (the live loads' bytes equal plan_mesh's: test_resume_on_other_meshes)
    mine = [planner.plan_mesh(list(infos.values()), "dp=2,tp=2", r) for r in range(4)]
    assert [r["bytes_needed"] for r in ranks] == [p.bytes_needed for p in mine]
    assert all(r["bytes_read"] >= r["bytes_needed"] for r in ranks)
    assert 2 * sum(r["bytes_needed"] for r in ranks) < sum(p.bytes_needed for p in topo)


def _model_order(tie: bool = False) -> list[tuple[str, str]]:
    """The catalog order a save of the demo model's training state dict must list: the state dict's tensors
    in order, each tensor's states together (``records.model_order``), from a one-process state dict."""
    from ucp_store.records import model_order

    _, model, opt = _trained(steps=1, tie=tie)
    return list(model_order(leaf.key for leaf in flatten(_sd(model, opt)) if leaf.key is not None))


def _grouped(keys: list[tuple[str, str]]) -> bool:
    names = [n for n, _ in keys]
    return all(names.index(n) + names.count(n) - 1 == len(names) - 1 - names[::-1].index(n) for n in set(names))


@pytest.mark.slow
@pytest.mark.parametrize("src", ["tpfsdp", "fsdp4", "hsdp"])
def test_positions_follow_the_state_dict(sources, src):
    """A 4-rank save lists its tensor-states in the state dict's order, each tensor's states together (issue 37:
    the positions were each rank's own count over the keys it hashed, in name order, so listings interleaved)."""
    _, store = sources
    ck = ucp_store.open_store(store).checkpoint(f"{src}@{STEPS}")
    listed = [(i.name, i.state) for i in ck.tensors()]
    expected = _model_order()
    assert listed == expected
    assert _grouped(listed) and listed[0] == ("tok_embeddings.weight", "weight")
    assert {s for n, s in listed[:4] if n == "tok_embeddings.weight"} == {"weight", "step", "exp_avg", "exp_avg_sq"}
    assert len({i.position for i in ck.tensors()}) == len(listed)  # one position each
    # ucp show, stats and diff list them in that order too
    out = run_python(["-m", "ucp_store.cli", "--store", store, "show", f"{src}@{STEPS}", "--json"])
    assert out.returncode == 0, out.stderr
    assert [(t["name"], t["state"]) for t in json.loads(out.stdout)["tensors"]] == expected


@pytest.mark.slow
def test_verify_and_async_save_across_ranks(tmp_path):
    store = str(tmp_path / "store")
    jobs = [{"role": "verify", "run": "v", "target": "layers.1.feed_forward.w2.weight", "bad_rank": 3},
            {"role": "async", "run": "at", "mode": "thread"},
            {"role": "async", "run": "ap", "mode": "process"},  # first call: private staging, shared later
            {"role": "async", "run": "ap2", "mode": "process", "prepare": True}]  # shared buffers reused
    results = _ok(*_spawn(tmp_path, "misc", {"world": 4, "tp": 2, "dp": 2, "store": store, "jobs": jobs}))
    for r in results:
        v, at, ap, ap2 = r["jobs"]
        assert v["clean"]
        # one element of rank 3's shard: (dp=1, tp=1) holds rows 20..39, columns 44..87 of w2 [40, 88]
        assert len(v["mismatches"]) == 1, v["text"]
        m = v["mismatches"][0]
        assert (m["name"], m["state"], m["rank"], m["box"], m["differing"]) == (
            "layers.1.feed_forward.w2.weight", "weight", 3, [[20, 40], [44, 88]], 1)
        assert "layers.1.feed_forward.w2.weight" in v["text"]
        for a in (at, ap, ap2):
            assert a["same"] and a["n"] == 104 and a["later_differs"], a


@pytest.mark.slow
def test_bad_input_errors_on_every_rank(tmp_path):
    store = str(tmp_path / "store")
    cases = ["missing_ref", "shape", "keys", "save_keys", "split"]
    results = _ok(*_spawn(tmp_path, "bad", {"world": 2, "tp": 2, "role": "bad", "run": "b", "store": store,
                                            "cases": cases}))
    for r in results:
        got = r["cases"]
        assert got["missing_ref"]["error"] == "ReferenceNotFound" and "b@99" in got["missing_ref"]["message"]
        assert "norm.weight" in got["shape"]["message"] and "[41]" in got["shape"]["message"] \
            and "[40]" in got["shape"]["message"]
        assert got["keys"]["error"] == "ReferenceNotFound" and "extra.weight" in got["keys"]["message"]
        # a plain tensor only one rank holds is per-rank state (issue 28): stored for that rank, not refused
        assert got["save_keys"]["error"] is None, got["save_keys"]
        assert "layers.0.attention.wq.weight" in got["split"]["message"]
        assert got["split"]["error"] in ("TopologyError", "UcpError")
    st = ucp_store.open_store(store)
    assert [r["run"] for r in st.runs()] == ["b", "b-keys"]  # the failed saves listed nothing
    manifest = st.checkpoint("b-keys@0").objects()[ucpd.STATE_DICT_OBJECT]
    assert [(k["text"], [e["rank"] for e in k["entries"]]) for k in manifest["per_rank"]["keys"]] == [
        ("model.only_on_rank1", [1])]


@pytest.mark.slow
def test_killed_rank_lists_nothing_and_gc_reclaims(tmp_path):
    store = str(tmp_path / "store")
    proc, results = _spawn(tmp_path, "kill", {"world": 2, "tp": 2, "role": "kill", "run": "k", "store": store,
                                              "victim": 0})
    assert proc.returncode != 0 and results[0] is None  # rank 0 (the owner of the pending save) died hard
    assert results[1] is not None and results[1]["error"] == "UcpError", results[1]
    assert "collective" in results[1]["message"]
    st = ucp_store.open_store(store)
    assert st.list_checkpoints() == []
    pending = st.list_checkpoints(include_pending=True)
    assert len(pending) == 1 and pending[0]["status"] == "pending"
    report = st.gc()
    assert report.removed_pending == [pending[0]["id"]]
    assert st.list_checkpoints(include_pending=True) == []
    assert not any((tmp_path / "store" / "arrays").iterdir())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


_REINIT = r"""
import gc, os, sys, tempfile, datetime
import torch, torch.distributed as dist
from ucp_store.distributed import commit
def init(path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
d = tempfile.mkdtemp()
init(os.path.join(d, "a"))
first = commit.control_group(tag="t")
assert commit.control_group(tag="t") is first  # cached while the world lives
t = torch.ones(3); dist.all_reduce(t, group=first)
dist.destroy_process_group()
init(os.path.join(d, "b"))  # a job that re-initialises after a failure
second = commit.control_group(tag="t")
assert second is not first, "a destroyed group was handed out again"
t = torch.ones(3); dist.all_reduce(t, group=second)
assert t.tolist() == [1.0, 1.0, 1.0]
print("ok", len(commit._GROUPS))
"""


def test_control_groups_are_renewed_after_a_reinit_and_released_at_exit():
    """A cached control group dies with ``destroy_process_group``: after a re-init the next call makes a new
    one (not the dead one), and the cache is emptied at exit, before the interpreter is torn down."""
    proc = run_python(["-c", _REINIT], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok", "1"], proc.stdout
    assert "terminate called" not in proc.stderr
    from ucp_store.distributed import commit

    commit._GROUPS[("k",)] = object()
    commit._release_groups()
    assert commit._GROUPS == {}
