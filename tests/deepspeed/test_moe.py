"""Real DeepSpeed MoE (``deepspeed.moe.layer.MoE``, 4 experts per layer, 2 MoE layers, ZeRO-2 bf16) trained
on 2 gloo processes at ep=2, saved, imported, and resumed through ``load_shard`` into freshly built engines
at ep=2 and ep=1 (one torchrun launch, ``tools/ds_moe.py``), then at ep=4 and ep=2 on 4 processes
(a second launch). ``ds_to_universal`` runs on the same checkpoint, side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ucp_test_helpers import fork_jobs

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("deepspeed")]

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tools" / "ds_moe.py"
TAG = "global_step2"
LAYERS, EXPERTS = 2, 4


def _moe_jobs(root: Path) -> list[dict]:
    common = {"zero": 2, "dtype": "bf16", "steps": 2}
    store = str(root / "store")
    return [
        {"kind": "train", "ep": 2, **common, "save_dir": str(root / "ck"), "tag": TAG, "convert": True,
         "next_steps": 2, "out": str(root / "train.json"), "dump": str(root / "dump_src")},
        {"kind": "import", "save_dir": str(root / "ck"), "tag": TAG, "store": store, "run": "moe"},
        {"kind": "resume_ucp", "ep": 2, **common, "store": store, "ref": "moe@2", "out": str(root / "r_ep2.json"),
         "dump": str(root / "dump_ep2")},
        {"kind": "resume_ucp", "ep": 1, **common, "store": store, "ref": "moe@2", "out": str(root / "r_ep1.json"),
         "dump": str(root / "dump_ep1")},
    ]


def run_jobs(jobs: list[dict], nproc: int, where: Path, name: str) -> None:
    """``nproc`` ranks of ``tools/ds_moe.py`` running ``jobs`` in order (gloo, CPU), forked by tools/fork_ranks.py."""
    fork_jobs(jobs, nproc, where, name, timeout=900, harness="ds_moe")


class MoESession:
    def __init__(self, root: Path):
        self.root = root
        self.tag_dir = root / "ck" / TAG

    def result(self, name: str) -> dict:
        return json.loads((self.root / f"{name}.json").read_text())

    def dump(self, name: str, world: int = 2) -> dict:
        """{(global name, state): whole fp32 tensor} reassembled from every rank's ZeRO share."""
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


@pytest.fixture(scope="session")
def moe(tmp_path_factory) -> MoESession:
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("moe")
    run_jobs(_moe_jobs(root), 2, root, "moe_jobs")
    return MoESession(root)


@pytest.fixture(scope="session")
def moe4(moe) -> MoESession:
    """The same checkpoint resumed on 4 processes: ep=4 (one expert per rank and layer) and ep=2 with the
    experts ZeRO-split over 2 expert-data-parallel ranks."""
    common = {"zero": 2, "dtype": "bf16", "steps": 2, "store": str(moe.root / "store"), "ref": "moe@2"}
    jobs = [{"kind": "resume_ucp", "ep": ep, **common, "out": str(moe.root / f"r4_ep{ep}.json"),
             "dump": str(moe.root / f"dump4_ep{ep}")} for ep in (4, 2)]
    run_jobs(jobs, 4, moe.root, "moe4_jobs")
    return moe


def _experts(names):
    return sorted(n for n in names if ".deepspeed_experts." in n)


def test_import_stores_every_expert_as_deepspeed_had_it(moe):
    """fp32 master, exp_avg and exp_avg_sq of every expert (global ids), as the live optimizer held them at
    save time, bit for bit; each expert tensor is an expert_member of its layer; the gates are recorded."""
    import torch

    src = moe.dump("dump_src")
    ck = moe.store.checkpoint("moe@2")
    rows = {(i.name, i.state): i for i in ck.tensors()}
    experts = _experts({n for n, _ in src})
    assert len(experts) == LAYERS * EXPERTS * 4  # w1/w2 weight and bias
    for (name, state), want in src.items():
        got = ck.read(name, state)
        assert got.dtype == torch.float32 and torch.equal(got.reshape(-1), want), (name, state)
    for name in experts:
        pat = rows[(name, "fp32")].pattern
        e = int(name.split(".deepspeed_experts.")[1].split(".")[0])
        group = name.split(".deepspeed_experts.")[0] + ".deepspeed_experts"
        assert pat == {"kind": "expert_member", "expert": e, "num_experts": EXPERTS, "group": group,
                       "inner": {"kind": "replicated"}}
        assert {s for (n, s) in rows if n == name} >= {"fp32", "exp_avg", "exp_avg_sq", "step"}
    # every expert got its own values, so a mix-up of experts cannot pass unseen
    for layer in range(LAYERS):
        w = [src[(f"moe.{layer}.deepspeed_moe.experts.deepspeed_experts.{e}.w1.weight", "exp_avg")]
             for e in range(EXPERTS)]
        assert all(not torch.equal(w[a], w[b]) for a in range(EXPERTS) for b in range(a + 1, EXPERTS))
    moe_obj = ck.objects()["deepspeed/moe"]
    assert moe_obj["ep"] == 2 and [lay["gate"] for lay in moe_obj["layers"]] == [
        [f"moe.{i}.deepspeed_moe.gate.wg.weight"] for i in range(LAYERS)]
    assert ("moe.0.deepspeed_moe.gate.wg.weight", "exp_avg") in rows


@pytest.mark.parametrize("ep", [2, 1])
def test_resume_through_load_shard_at_new_ep(moe, ep):
    """A fresh engine at ep (2 ranks: ep=2 -> 1 expert-data-parallel rank, ep=1 -> experts ZeRO-split over 2)
    gets, for every expert, bit-equal fp32 master, exp_avg and exp_avg_sq; the next losses follow the
    uninterrupted run (bit for bit on the same topology; ep=1 reduces in another order)."""
    import torch

    src, got = moe.dump("dump_src"), moe.dump(f"dump_ep{ep}")
    assert set(got) == set(src)
    bad = [k for k in src if not torch.equal(src[k], got[k])]
    assert not bad, f"states differ after load at ep={ep}: {bad[:5]}"
    train, resumed = moe.result("train"), moe.result(f"r_ep{ep}")
    assert resumed["global_steps"] == 2
    if ep == 2:
        assert resumed["losses_hex"] == train["losses_hex"]
    else:
        assert resumed["losses"] == pytest.approx(train["losses"], rel=2e-3)


@pytest.mark.parametrize("ep", [4, 2])
def test_resume_on_four_processes(moe4, ep):
    """4 processes: ep=4 gives each rank one expert per layer; ep=2 splits each ep rank's experts over 2
    ZeRO ranks. Every expert's fp32 master, exp_avg and exp_avg_sq are DeepSpeed's, bit for bit."""
    import torch

    src, got = moe4.dump("dump_src"), moe4.dump(f"dump4_ep{ep}", world=4)
    assert set(got) == set(src)
    bad = [k for k in src if not torch.equal(src[k], got[k])]
    assert not bad, f"states differ after load at ep={ep} on 4 ranks: {bad[:5]}"
    train, resumed = moe4.result("train"), moe4.result(f"r4_ep{ep}")
    assert resumed["global_steps"] == 2 and resumed["world"] == 4
    assert resumed["losses"] == pytest.approx(train["losses"], rel=2e-3)


def test_ds_to_universal_side_by_side(moe):
    """DeepSpeed's converter crashes on this checkpoint (both ep ranks use the same local expert names, so it
    joins them as DP pieces); ucp imported all 4 experts per layer with their own moments."""
    conv = moe.result("train")["convert"]
    assert conv["returncode"] != 0
    assert conv["error"].startswith("RuntimeError: shape '[") and "is invalid for input of size" in conv["error"]
    zero = moe.root / "ck" / f"{TAG}_universal" / "zero"
    assert not (zero / "moe.0.deepspeed_moe.experts.deepspeed_experts.3.w1.weight").exists()
    names = {i.name for i in moe.store.checkpoint("moe@2").tensors()}
    assert len(_experts(names)) == LAYERS * EXPERTS * 4


@pytest.mark.parametrize("ep, dp", [(1, 1), (2, 2), (4, 4), (2, 4)])
def test_load_shard_gives_each_rank_its_experts(moe, ep, dp):
    """Planned from the catalog: each rank gets exactly the experts of its ep rank (all experts at ep=1),
    in DeepSpeed's order (layer by layer, expert by expert), and the expert ZeRO group spans dp / ep ranks."""
    from ucp_store import Topology
    from ucp_store.plan.planner import plan as make_plan

    ck = moe.store.checkpoint("moe@2")
    topo = Topology(dp=dp, ep=ep, zero_stage=2, zero_alignment=2)
    per = EXPERTS // ep
    for rank in range(dp):
        plan = make_plan(ck.plan_records(topo, rank), topo, rank, states=["fp32"])
        names = [t.name for t in plan.tensors]
        mine = _experts(names)
        er = rank % ep
        want = [f"moe.{layer}.deepspeed_moe.experts.deepspeed_experts.{e}.{p}" for layer in range(LAYERS)
                for e in range(er * per, (er + 1) * per) for p in ("w1.weight", "w1.bias", "w2.weight", "w2.bias")]
        if dp // ep == 1:
            assert [n for n in names if ".deepspeed_experts." in n] == want
        else:
            assert set(mine) <= set(want)
        expert_buf = next(b for b in plan.buffers if b.group == "expert")
        total = sum(16 * 24 * 2 + 24 + 16 for _ in range(LAYERS * per))
        unit = 2 * (dp // ep)
        assert expert_buf.numel == -(-total // unit) * unit // (dp // ep)


def test_fused_form_stacks_the_same_experts(moe, tmp_path):
    """experts="fused": one [E, ...] tensor per layer and parameter with the expert pattern, equal to the
    separate tensors stacked."""
    import torch

    from ucp_store import open_store
    from ucp_store.deepspeed.source import import_deepspeed

    store = open_store(str(tmp_path / "fused"), create=True)
    ck = store.checkpoint(import_deepspeed(store, str(moe.tag_dir), "fused", progress=False, experts="fused"))
    sep = moe.store.checkpoint("moe@2")
    name = "moe.1.deepspeed_moe.experts.deepspeed_experts.w2.weight"
    rows = {(i.name, i.state): i for i in ck.tensors()}
    assert rows[(name, "exp_avg")].pattern == {"kind": "expert", "dim": 0, "num_experts": EXPERTS,
                                               "inner": {"kind": "replicated"}}
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        want = torch.stack([sep.read(f"moe.1.deepspeed_moe.experts.deepspeed_experts.{e}.w2.weight", state)
                            for e in range(EXPERTS)])
        assert torch.equal(ck.read(name, state), want)
    assert not _experts({n for n, _ in rows if n.split(".deepspeed_experts.")[-1][0].isdigit()})


def test_dense_reader_refuses_expert_files_by_name(moe):
    from ucp_store.deepspeed.reader import DeepSpeedReader
    from ucp_store.errors import SourceFormatError

    with pytest.raises(SourceFormatError, match=r"layer_0_expert_0_mp_rank_00_model_states\.pt: a DeepSpeed MoE "
                                                r"expert file; read MoE checkpoints with .*DeepSpeedMoEReader"):
        DeepSpeedReader(moe.tag_dir)


def test_cli_show_and_plan_display_expert_placement(moe, ucp, tmp_path):
    store = moe.root / "store"
    rc, out, err = ucp("--store", store, "show", "moe@2")
    assert rc == 0, err
    assert "experts: 2 group(s), saved at ep=2 (dp=2)" in out
    lines = [ln.split() for ln in out.splitlines() if ln.startswith("moe.0.deepspeed_moe.experts.deepspeed_experts ")]
    assert [ln[1:] for ln in lines] == [["separate", "0", "0-1", "0"], ["separate", "1", "2-3", "1"]]
    png = tmp_path / "plan.png"
    rc, out, err = ucp("--store", store, "plan", "moe@2", "--dp", "4", "--ep", "4", "--zero", "2", "--plot", png)
    assert rc == 0, err
    assert "experts at ep=4 (expert ZeRO over 1 rank(s) per ep rank):" in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("moe.1.deepspeed_moe.experts.deepspeed_experts ")]
    assert [r[2:] for r in rows] == [[str(e), str(e), str(e)] for e in range(4)]
    assert png.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, out, err = ucp("--store", store, "plan", "moe@2", "--dp", "3", "--ep", "3")
    assert rc != 0 and "4 experts cannot be split over ep=3" in err


def test_universal_export_of_moe_is_refused_with_the_reason(moe, ucp, tmp_path):
    rc, out, err = ucp("--store", moe.root / "store", "export", "deepspeed-universal", "moe@2", tmp_path / "u")
    assert rc != 0
    assert "looks up each expert parameter by its local name" in err and "load_engine" in err
    assert not (tmp_path / "u").exists() or not any((tmp_path / "u").iterdir())
