"""DeepSpeed AutoEP (``expert_parallel``), real training on CPU: a tiny transformers DeepSeek-V3 (2 layers,
4 routed experts, top-2, a shared expert) swapped by DeepSpeed's ``deepseek_v3`` AutoEP preset, bf16, trained on
2 gloo processes under ZeRO-3 (at ep=2 with the experts in several sub-groups, and at ep=1), ZeRO-2 (ep=2) and
ZeRO-1 (ep=1), saved, converted by ``ds_to_universal``, imported, and resumed through ``load_shard`` into
freshly built AutoEP engines at ep=2 and ep=1 (one torchrun launch, ``tools/ds_autoep.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ucp_test_helpers import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("deepspeed")]

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tools" / "ds_autoep.py"
TAG = "t"
LAYERS, EXPERTS = 2, 4
# case -> (ZeRO stage, ep it is saved at, extra job keys, the eps it is resumed at). "z3" cuts the experts into
# several ZeRO-3 sub-groups (sub_group_size); the ep=1 saves partition every expert over 2 expert-data-parallel ranks
CASES: dict[str, tuple[int, int, dict, tuple[int, ...]]] = {
    "z3": (3, 2, {"sub_group_size": 500}, (2, 1)),
    "z3e1": (3, 1, {}, (2,)),
    "z2": (2, 2, {}, (2, 1)),
    "z1e1": (1, 1, {}, (2,)),
}
DIST_IMPORT = ("z3", "z2")  # also imported by both processes at once (torchrun shares)
RESUMES = [(c, ep) for c, (_, _, _, eps) in CASES.items() for ep in eps]
EXPERT_PARAMS = [f"model.layers.{i}.mlp.experts.w{k}" for i in range(LAYERS) for k in (1, 2, 3)]


def _jobs(root: Path) -> list[dict]:
    jobs: list[dict] = []
    for case, (z, src_ep, extra, eps) in CASES.items():
        store, ck = str(root / "store"), str(root / case)
        jobs.append({"kind": "train", "zero": z, "ep": src_ep, "steps": 2, **extra, "save_dir": ck, "tag": TAG,
                     "convert": True, "next_steps": 2, "out": str(root / f"{case}_train.json"),
                     "dump": str(root / f"{case}_src")})
        jobs.append({"kind": "import", "save_dir": ck, "tag": TAG, "store": store, "run": case})
        if case in DIST_IMPORT:
            jobs.append({"kind": "import", "save_dir": ck, "tag": TAG, "store": store, "run": f"{case}_dist",
                         "distributed": True})
        jobs += [{"kind": "resume_ucp", "zero": z, "ep": ep, "steps": 2, "store": store, "ref": f"{case}@2",
                  "out": str(root / f"{case}_ep{ep}.json"), "dump": str(root / f"{case}_ep{ep}")} for ep in eps]
    return jobs


class AutoEPSession:
    def __init__(self, root: Path):
        self.root = root

    def result(self, name: str) -> dict:
        return json.loads((self.root / f"{name}.json").read_text())

    def dump(self, name: str, world: int = 2) -> dict:
        """{(name, state): whole flat fp32 tensor} reassembled from every rank's share (logical coordinates)."""
        import torch

        pieces: dict = {}
        for r in range(world):
            for key, (a, b, t) in torch.load(self.root / f"{name}.{r}.pt", weights_only=True).items():
                pieces.setdefault(key, []).append((a, b, t))
        out = {}
        for key, ps in pieces.items():
            ps.sort(key=lambda p: p[0])
            assert [p[0] for p in ps] == [0] + [p[1] for p in ps[:-1]], f"{key}: shares must tile the parameter"
            out[key] = torch.cat([p[2] for p in ps])
        return out

    @property
    def store(self):
        from ucp_store import open_store

        return open_store(str(self.root / "store"))


@pytest.fixture(scope="module")
def autoep(tmp_path_factory) -> AutoEPSession:
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("autoep")
    path = root / "jobs.json"
    path.write_text(json.dumps(_jobs(root), indent=1))
    torchrun([str(DRIVER), "--jobs", str(path)], 2, timeout=900)
    return AutoEPSession(root)


@pytest.mark.parametrize("case", CASES)
def test_import_stores_every_expert_as_the_optimizer_held_it(autoep, case):
    """Every parameter's fp32 master, exp_avg and exp_avg_sq (the experts' as [E, ...] in global-expert order)
    equal the live optimizer's at save time, bit for bit; the experts carry the expert pattern, each expert
    has its own moments, and the router gates and shared experts are recorded with theirs."""
    import torch

    zero, src_ep, extra, _ = CASES[case]
    src = autoep.dump(f"{case}_src")
    ck = autoep.store.checkpoint(f"{case}@2")
    rows = {(i.name, i.state): i for i in ck.tensors()}
    assert {n for n, _ in src if ".experts.w" in n} == set(EXPERT_PARAMS)
    for (name, state), want in src.items():
        got = ck.read(name, state)
        assert got.dtype == torch.float32 and torch.equal(got.reshape(-1), want), (name, state)
    for name in EXPERT_PARAMS:
        row = rows[(name, "exp_avg")]
        assert row.pattern == {"kind": "expert", "dim": 0, "num_experts": EXPERTS, "inner": {"kind": "replicated"}}
        assert row.shape[0] == EXPERTS
        assert {s for (n, s) in rows if n == name} >= {"fp32", "exp_avg", "exp_avg_sq", "step"}
        m = ck.read(name, "exp_avg")
        assert all(not torch.equal(m[a], m[b]) for a in range(EXPERTS) for b in range(a + 1, EXPERTS)), name
    for i in range(LAYERS):
        assert (f"model.layers.{i}.mlp.router.gate.weight", "exp_avg") in rows
        assert (f"model.layers.{i}.mlp.shared_experts.up_proj.weight", "exp_avg_sq") in rows
    obj = ck.objects()["deepspeed/autoep"]
    assert obj["ep"] == src_ep and obj["edp"] == 2 // src_ep
    assert len(obj["expert_groups"]) == (3 if extra.get("sub_group_size") else 1)
    assert [lay["format"] for lay in obj["layers"]] == ["zero3_partitioned" if zero == 3 else "per_expert_files"] * 2
    topo = ck.provenance["source_topology"]
    assert topo["ep"] == src_ep and topo["zero_stage"] == zero and topo["dp"] == 2


@pytest.mark.parametrize("case", DIST_IMPORT)
def test_distributed_import_equals_the_single_process_one(autoep, case):
    """Both ranks import their byte-balanced share of the parameters (the fused experts included): the same
    tensor-states, byte for byte (content hashes), as the one-process import."""
    one, two = autoep.store.checkpoint(f"{case}@2"), autoep.store.checkpoint(f"{case}_dist@2")
    rows1 = {(i.name, i.state): (i.shape, i.pattern, i.content_hash) for i in one.tensors()}
    rows2 = {(i.name, i.state): (i.shape, i.pattern, i.content_hash) for i in two.tensors()}
    assert rows1 == rows2 and len(rows1) > 3 * len(EXPERT_PARAMS)


@pytest.mark.parametrize("case, ep", RESUMES)
def test_resume_through_load_shard_at_new_ep(autoep, case, ep):
    """A fresh AutoEP engine at ep (2 ranks: ep=2 -> each rank its 2 experts; ep=1 -> all 4 experts, ZeRO-split
    over 2 expert-data-parallel ranks) gets, for every expert, bit-equal fp32 master, exp_avg and exp_avg_sq;
    the next losses follow the uninterrupted run: bit for bit at the saved ep, the first step bit for bit at
    the other ep too (the same weights and moments), later steps within reduction-order noise."""
    import torch

    src, got = autoep.dump(f"{case}_src"), autoep.dump(f"{case}_ep{ep}")
    assert set(got) == set(src)
    bad = [k for k in src if not torch.equal(src[k], got[k])]
    assert not bad, f"states differ after load at ep={ep}: {bad[:5]}"
    train, resumed = autoep.result(f"{case}_train"), autoep.result(f"{case}_ep{ep}")
    assert resumed["global_steps"] == 2 and len(train["losses"]) == 2
    assert resumed["group_identity_kept"] and f"ep_size_{ep}" in resumed["group_names"]
    if ep == CASES[case][1]:
        assert resumed["losses_hex"] == train["losses_hex"]
    else:
        assert resumed["losses_hex"][0] == train["losses_hex"][0]
        assert resumed["losses"] == pytest.approx(train["losses"], rel=2e-3)


@pytest.mark.parametrize("case", CASES)
def test_ds_to_universal_side_by_side(autoep, case):
    """DeepSpeed 0.19.8's converter handles these AutoEP checkpoints (ZeRO-3, and ZeRO-2 through its AutoEP
    ZeRO-1/2 consolidation step, the DeepSpeed#8147 fix): every state it writes equals ucp's import bit for
    bit, and the experts' moments equal the live optimizer's (none stale)."""
    import torch

    zero = CASES[case][0]
    conv = autoep.result(f"{case}_train")["convert"]
    assert conv["returncode"] == 0, conv
    assert any("AutoEP" in s and (("ZeRO-3" in s) if zero == 3 else ("ZeRO-1/2" in s)) for s in conv["steps"])
    ck = autoep.store.checkpoint(f"{case}@2")
    zdir = autoep.root / case / f"{TAG}_universal" / "zero"
    compared = same = 0
    for info in ck.tensors():
        path = zdir / info.name / f"{info.state}.pt"
        if info.state == "weight" or not path.exists():
            continue
        theirs = torch.load(path, weights_only=False)
        theirs = torch.as_tensor(theirs["param"] if isinstance(theirs, dict) else theirs)
        ours = ck.read(info.name, info.state)
        compared += 1
        same += torch.equal(theirs.reshape(ours.shape).to(ours.dtype), ours)
    src = autoep.dump(f"{case}_src")
    ds_live = ucp_live = 0
    for name in EXPERT_PARAMS:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            theirs = torch.load(zdir / name / f"{state}.pt", weights_only=False)
            theirs = theirs["param"] if isinstance(theirs, dict) else theirs
            ds_live += torch.equal(theirs.reshape(-1).float(), src[(name, state)])
            ucp_live += torch.equal(ck.read(name, state).reshape(-1), src[(name, state)])
    n = 3 * len(EXPERT_PARAMS)
    # the side-by-side row (pytest -s shows it)
    print(f"\n[autoep side by side] {case}: ZeRO-{zero} saved at ep={CASES[case][1]} | ds_to_universal exit "
          f"{conv['returncode']} | expert states equal to the live optimizer: ds_to_universal {ds_live}/{n}, "
          f"ucp {ucp_live}/{n} | ds_to_universal == ucp: {same}/{compared} states")
    assert compared >= n + 3 * 2 * LAYERS and same == compared
    assert ds_live == n and ucp_live == n


@pytest.mark.parametrize("ep, dp", [(1, 2), (2, 2), (4, 4), (2, 4)])
def test_load_shard_gives_each_rank_its_expert_block(autoep, ep, dp):
    """load_shard on a ZeRO-3 topology with ep: each rank's fp32 partition of a fused expert parameter is
    its ep rank's [E/ep, ...] block, split ceil(numel/edp) over the expert-data-parallel ranks."""
    import math

    import torch

    from ucp_store import Topology, load_shard

    ck = autoep.store.checkpoint("z3@2")
    name = "model.layers.1.mlp.experts.w2"
    whole = ck.read(name, "fp32")
    per, edp = EXPERTS // ep, dp // ep
    for rank in range(dp):
        shard = load_shard(ck, Topology(dp=dp, ep=ep, zero_stage=3), rank, states=["fp32"])
        block = whole[(rank % ep) * per:(rank % ep + 1) * per].reshape(-1)
        part = math.ceil(block.numel() / edp)
        mine = block[(rank // ep) * part:(rank // ep + 1) * part]
        tp = next(t for t in shard.plan.tensors if (t.name, t.state) == (name, "fp32"))
        frag = tp.fragment
        assert (frag.start, frag.stop) == ((rank // ep) * part, (rank // ep) * part + mine.numel())
        got = shard.buffers[tp.buffer][frag.buffer_start:frag.buffer_start + mine.numel()]
        assert torch.equal(got, mine)


def test_cli_show_and_plan_show_expert_placement(autoep, ucp):
    rc, out, err = ucp("--store", autoep.root / "store", "show", "z3@2")
    assert rc == 0, err
    assert "saved at ep=2" in out
    rows = [r for r in map(str.split, out.splitlines()) if r[:2] == ["model.layers.0.mlp.experts.w1", "fused"]]
    assert [r[1:4] for r in rows] == [["fused", "0", "0-1"], ["fused", "1", "2-3"]]
    rc, out, err = ucp("--store", autoep.root / "store", "plan", "z2@2", "--dp", "4", "--ep", "4", "--zero", "2")
    assert rc == 0, err
    rows = [r for r in map(str.split, out.splitlines()) if r[:2] == ["model.layers.1.mlp.experts.w3", "fused"]]
    assert [r[2:4] for r in rows] == [[str(e), str(e)] for e in range(EXPERTS)]


def test_missing_expert_file_is_named(autoep, tmp_path):
    from ucp_store.deepspeed.autoep import DeepSpeedAutoEPReader
    from ucp_store.errors import SourceFormatError

    bad = tmp_path / "t"
    shutil.copytree(autoep.root / "z2" / TAG, bad)
    (bad / "layer_1_expert_3_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(SourceFormatError, match=r"AutoEP layer 1 \(model\.layers\.1\.mlp\.experts\) lacks the expert "
                                                r"files of experts \[3\]"):
        DeepSpeedAutoEPReader(bad)


def test_universal_export_of_autoep_is_refused_with_the_reason(autoep, ucp, tmp_path):
    rc, out, err = ucp("--store", autoep.root / "store", "export", "deepspeed-universal", "z3@2", tmp_path / "u")
    assert rc != 0
    assert "an AutoEP checkpoint is not exported as a universal folder" in err and "load_engine" in err
    assert not (tmp_path / "u").exists() or not any((tmp_path / "u").iterdir())


def test_low_precision_expert_weights_come_from_the_expert_files(autoep, tmp_path):
    """lp_weights="all": each fused expert's bf16 weight is stacked from DeepSpeed's per-expert files
    (``<name>.<e>`` keys), expert e at row e: the bf16 cast of the imported fp32 master."""
    import torch

    from ucp_store.deepspeed.autoep import DeepSpeedAutoEPReader

    reader = DeepSpeedAutoEPReader(autoep.root / "z2" / TAG, lp_weights="all")
    name = "model.layers.1.mlp.experts.w2"
    rec = next(reader.records(names=[name], include_weights=False))
    assert rec.states["weight"].dtype == torch.bfloat16 and rec.states["weight"].shape == (EXPERTS, 16, 12)
    assert torch.equal(rec.states["weight"], rec.states["fp32"].to(torch.bfloat16))
    one = torch.load(autoep.root / "z2" / TAG / "layer_1_expert_3_mp_rank_00_model_states.pt", weights_only=False)
    assert torch.equal(rec.states["weight"][3], one[f"{name}.3"])


def test_a_placement_other_than_contiguous_is_refused(autoep, tmp_path):
    """The reader stacks ep rank r's block at experts r*E/ep...; a placement descriptor saying otherwise
    (here: ep rank 0 holds experts 2-3) is refused with the file and both placements named."""
    import torch

    from ucp_store.deepspeed.autoep import DeepSpeedAutoEPReader
    from ucp_store.errors import SourceFormatError

    bad = tmp_path / "t"
    shutil.copytree(autoep.root / "z2" / TAG, bad)
    f = bad / "mp_rank_00_model_states.pt"
    ms = torch.load(f, weights_only=False)
    ms["ds_autoep_layers"][0]["expert_placement"]["ranks"] = [{"rank": 0, "experts": [2, 3]},
                                                              {"rank": 1, "experts": [0, 1]}]
    torch.save(ms, f)
    with pytest.raises(SourceFormatError, match=r"mp_rank_00_model_states\.pt: ds_autoep_layers\[0\]: expert_placement "
                                                r"\{0: \[2, 3\], 1: \[0, 1\]\} is not the contiguous placement"):
        DeepSpeedAutoEPReader(bad)
