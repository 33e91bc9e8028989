"""DeepSpeed MoE with a tensor-parallel dense part: real training on 4 gloo processes (TP=2 x DP=2, ep=2,
ZeRO-2, bf16; ``MoETPNet`` in ``tools/ds_moe.py``: Megatron-style column/row-parallel MLP blocks
between ``deepspeed.moe.layer.MoE`` layers, an mpu), imported, and resumed through ``load_shard`` into
freshly built engines at TP=2 x DP=2 x ep=2 (the same mesh), TP=2 x DP=2 x ep=1 and TP=1 x DP=4 x ep=1, all in
the one 4-process launch that trained (a second launch would cost more than the three resumes).
``ds_to_universal`` runs on the same checkpoint, side by side.

DeepSpeed builds the expert groups of whole (not tensor-parallel) experts over the whole tp x dp world, tp
fastest: ep rank = global rank % ep, so at TP=2 x DP=2 x ep=2 TP rank 0 holds experts 0-1 and TP rank 1 experts
2-3, each ZeRO-split over its 2 DP ranks, and the expert files are ``layer_L_expert_{0,1}_mp_rank_00`` and
``layer_L_expert_{2,3}_mp_rank_01``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("deepspeed")]

TAG = "global_step2"
LAYERS, EXPERTS = 2, 4
COMMON = {"zero": 2, "dtype": "bf16", "steps": 2}
# resume target name -> (processes, tp, ep)
TARGETS = {"tp2_ep2": (4, 2, 2), "tp2_ep1": (4, 2, 1), "tp1_ep1": (4, 1, 1)}
TIMEOUT = 1200  # 4 DeepSpeed processes on 2 shared cores: a bound against a hang, not a timing check


class Session:
    def __init__(self, root: Path):
        self.root = root
        self.tag_dir = root / "ck" / TAG
        self.timings: dict[str, float] = {}

    def result(self, name: str) -> dict:
        return json.loads((self.root / f"{name}.json").read_text())

    def checkpoint(self):
        from ucp_store import open_store

        return open_store(str(self.root / "store")).checkpoint("moetp@2")

    def logical(self, name: str, world: int, tp: int) -> dict:
        """``{(name, state): whole logical fp32 tensor}`` from every rank's dumped ZeRO shares
        (``ds_moe.expert_state_dump``): a dense parameter's shares per TP rank (rank % tp) tile its TP slice,
        the slices joined by the stored pattern; an expert's shares (on the ranks of its ep rank) tile it."""
        import torch

        patterns = {i.name: i.pattern or {"kind": "replicated"} for i in self.checkpoint().tensors()
                    if i.state == "fp32"}
        shapes = {i.name: tuple(i.shape) for i in self.checkpoint().tensors() if i.state == "fp32"}
        pieces: dict = {}
        for r in range(world):
            for (n, st), (a, b, t) in torch.load(self.root / f"{name}.{r}.pt", weights_only=True).items():
                expert = patterns[n]["kind"] == "expert_member"
                pieces.setdefault((n, st), {}).setdefault(0 if expert else r % tp, []).append((a, b, t))
        out = {}
        for (n, st), per_tp in pieces.items():
            slices = []
            for t_rank in sorted(per_tp):
                ps = sorted(per_tp[t_rank], key=lambda p: p[0])
                assert [p[0] for p in ps] == [0] + [p[1] for p in ps[:-1]], f"{n} {st}: shares must tile it"
                slices.append(torch.cat([p[2] for p in ps]))
            pat = patterns[n]
            if pat["kind"] == "partitioned":
                full = list(shapes[n])
                full[pat["dim"]] //= len(slices)
                out[(n, st)] = torch.cat([s.reshape(full) for s in slices], dim=pat["dim"])
            else:
                assert all(torch.equal(s, slices[0]) for s in slices[1:]), f"{n} {st}: replicas differ"
                out[(n, st)] = slices[0].reshape(shapes[n])
        return out


@pytest.fixture(scope="module")
def moetp(tmp_path_factory) -> Session:
    """Train, save, dump, ds_to_universal, import and resume at every target in one 4-process launch."""
    pytest.importorskip("deepspeed")
    s = Session(tmp_path_factory.mktemp("moetp"))
    root, store = s.root, str(s.root / "store")

    def resume(target: str) -> dict:
        _n, tp, ep = TARGETS[target]
        return {"kind": "resume_ucp", "tp": tp, "ep": ep, **COMMON, "store": store, "ref": "moetp@2",
                "out": str(root / f"r_{target}.json"), "dump": str(root / f"dump_{target}")}

    jobs = [{"kind": "train", "tp": 2, "ep": 2, **COMMON, "save_dir": str(root / "ck"), "tag": TAG, "convert": True,
             "next_steps": 2, "out": str(root / "train.json"), "dump": str(root / "dump_src")},
            {"kind": "import", "save_dir": str(root / "ck"), "tag": TAG, "store": store, "run": "moetp"}]
    jobs += [resume(t) for t in TARGETS]
    from ucp_test_helpers import tools_on_path

    tools_on_path()
    from fork_ranks import launch

    t0 = time.time()
    try:  # 4 ranks forked from one interpreter with torch and DeepSpeed loaded (tools/ds_moe.py's jobs)
        s.timings.update(launch([{"ranks": 4, "jobs": jobs, "harness": "ds_moe"}], root, TIMEOUT))
    except RuntimeError as exc:
        pytest.fail(str(exc))
    s.timings["launch_4"] = time.time() - t0
    print(f"\nMoE x TP fixture wall times (s): {json.dumps({k: round(v, 1) for k, v in s.timings.items()})}")
    return s


def _experts(names):
    return sorted(n for n in names if ".deepspeed_experts." in n)


def test_deepspeed_wrote_one_file_per_expert_on_its_writers_tp_rank(moetp):
    files = sorted(p.name for p in moetp.tag_dir.glob("layer_*_expert_*"))
    assert files == [f"layer_{lay}_expert_{e}_mp_rank_{e // 2:02d}_model_states.pt"
                     for lay in range(LAYERS) for e in range(EXPERTS)]
    assert sorted(p.name for p in moetp.tag_dir.glob("*optim_states.pt")) == [
        f"bf16_zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt" for dp in range(2) for tp in range(2)]


def test_import_stores_dense_tp_slices_and_every_expert_as_deepspeed_had_them(moetp):
    """Every stored fp32 master, exp_avg and exp_avg_sq equals, bit for bit, what the live optimizers held at
    save time: dense TP slices joined by their patterns (column-parallel rows, row-parallel columns,
    replicated norms/biases/gates), experts by global id from their ep rank's ZeRO shares."""
    import torch

    src = moetp.logical("dump_src", 4, 2)
    ck = moetp.checkpoint()
    rows = {(i.name, i.state): i for i in ck.tensors()}
    assert {n for n, _ in src} == {n for n, _ in rows}
    assert len(_experts({n for n, _ in src})) == LAYERS * EXPERTS * 4
    for (name, state), want in src.items():
        got = ck.read(name, state)
        assert got.dtype == torch.float32 and torch.equal(got, want), (name, state)
    pat = {n: rows[(n, "fp32")].pattern for n, _ in rows}
    assert pat["blocks.0.dense_h_to_4h.weight"] == {"kind": "partitioned", "dim": 0}
    assert pat["blocks.1.dense_4h_to_h.weight"] == {"kind": "partitioned", "dim": 1}
    assert pat["blocks.1.dense_4h_to_h.bias"] == pat["moe.0.deepspeed_moe.gate.wg.weight"] == {"kind": "replicated"}
    assert tuple(rows[("blocks.0.dense_h_to_4h.weight", "fp32")].shape) == (32, 16)
    for name in _experts({n for n, _ in rows}):
        e = int(name.split(".deepspeed_experts.")[1].split(".")[0])
        assert pat[name]["kind"] == "expert_member" and pat[name]["expert"] == e
        assert pat[name]["inner"] == {"kind": "replicated"}
    for layer in range(LAYERS):  # every expert its own values: a mix-up of experts cannot pass unseen
        w = [src[(f"moe.{layer}.deepspeed_moe.experts.deepspeed_experts.{e}.w1.weight", "exp_avg")]
             for e in range(EXPERTS)]
        assert all(not torch.equal(w[a], w[b]) for a in range(EXPERTS) for b in range(a + 1, EXPERTS))
    moe = ck.objects()["deepspeed/moe"]
    assert (moe["ep"], moe["tp"], moe["expert_groups"]) == (2, 2, "rank % ep")
    assert ck.provenance["source_topology"] == {"tp": 2, "pp": 1, "dp": 2, "zero_stage": 2, "ep": 2, "ep_over": "stage"}


@pytest.mark.parametrize("target", list(TARGETS))
def test_resume_through_load_shard(moetp, target):
    """A fresh engine at the target mesh gets, for every parameter (every expert by global id), bit-equal fp32
    master, exp_avg and exp_avg_sq, and continues the uninterrupted run: bit for bit on the same mesh,
    within bf16 reduction-order noise elsewhere (TP=1 joins the slices' matmuls, ep=1 computes every expert on
    every rank, DP=4 routes 4 tokens per rank, so the gate's auxiliary loss averages over another grouping)."""
    import torch

    nproc, tp, _ep = TARGETS[target]
    src, got = moetp.logical("dump_src", 4, 2), moetp.logical(f"dump_{target}", nproc, tp)
    assert set(got) == set(src)
    bad = [k for k in src if not torch.equal(src[k], got[k])]
    assert not bad, f"states differ after load at {target}: {bad[:5]}"
    train, resumed = moetp.result("train"), moetp.result(f"r_{target}")
    assert resumed["global_steps"] == 2 and resumed["world"] == nproc
    assert len(train["losses"]) == len(resumed["losses"]) == 2
    if target == "tp2_ep2":
        assert resumed["losses_hex"] == train["losses_hex"]
    else:
        assert resumed["losses"] == pytest.approx(train["losses"], rel=5e-3)  # 1.3e-3 seen; a mix-up: ~6%
    assert resumed["losses"][0] != pytest.approx(train["losses_before"][0], rel=1e-2)


def test_ds_to_universal_side_by_side(moetp):
    """DeepSpeed's converter exits 0 on this checkpoint but writes wrong experts: both TP ranks' expert groups
    use the local names 0-1 (global 0-1 on TP rank 0, 2-3 on TP rank 1), so it joins global experts 0 and 2
    (1 and 3) as two TP slices of one parameter ([48, 16] for a [24, 16] w1) and writes no experts 2-3.
    ucp stores all 4 experts per layer at their shapes with their own state."""
    import torch

    conv = moetp.result("train")["convert"]
    prefix = "moe.0.deepspeed_moe.experts.deepspeed_experts"
    ck = moetp.checkpoint()
    table = [("ds_to_universal", conv["returncode"], len(conv["experts"]), conv["experts"].get(f"{prefix}.0.w1.weight"),
              f"{prefix}.2.w1.weight" in conv["experts"]),
             ("ucp import", 0, len(_experts(ck.names())), list(ck.info(f"{prefix}.0.w1.weight", "fp32").shape),
              f"{prefix}.2.w1.weight" in ck.names())]
    print("\nMoE x TP checkpoint (TP=2 x DP=2, ep=2): tool, exit, expert params, expert 0 w1 shape, has expert 2")
    for row in table:
        print("  " + " | ".join(str(c) for c in row))
    assert conv["returncode"] == 0 and conv["error"] is None
    assert len(conv["experts"]) == LAYERS * (EXPERTS // 2) * 4
    assert conv["experts"][f"{prefix}.0.w1.weight"] == [48, 16]
    assert not any(f".deepspeed_experts.{e}." in n for n in conv["experts"] for e in (2, 3))
    assert table[1][1:] == (0, LAYERS * EXPERTS * 4, [24, 16], True)
    # ds_to_universal's [48, 16] is global experts 0 and 2 stacked, as ucp stores them
    from ucp_store import safe_pickle

    theirs = safe_pickle.load(moetp.root / "ck" / f"{TAG}_universal" / "zero" / f"{prefix}.0.w1.weight" / "fp32.pt",
                              mmap=False)["param"]
    assert torch.equal(theirs, torch.cat([ck.read(f"{prefix}.{e}.w1.weight", "fp32") for e in (0, 2)]))


def test_expert_tensor_parallel_files_are_refused_by_name(moetp, tmp_path):
    """A folder where one expert has files for two model-parallel ranks (what enable_expert_tensor_parallelism
    writes) is refused, naming the expert and the files."""
    import shutil

    from ucp_store.deepspeed.moe import DeepSpeedMoEReader
    from ucp_store.errors import SourceFormatError

    bad = tmp_path / TAG
    shutil.copytree(moetp.tag_dir, bad)
    one = bad / "layer_0_expert_0_mp_rank_00_model_states.pt"
    shutil.copy(one, bad / "layer_0_expert_0_mp_rank_01_model_states.pt")
    with pytest.raises(SourceFormatError, match=r"expert 0 of MoE layer 0 has files for model-parallel ranks \[0, 1\].*"
                                                r"enable_expert_tensor_parallelism"):
        DeepSpeedMoEReader(bad)
    # an expert of ep rank 1 written by mp rank 0 (as use_data_before_expert_parallelism places it)
    (bad / "layer_0_expert_0_mp_rank_01_model_states.pt").unlink()
    (bad / "layer_0_expert_2_mp_rank_01_model_states.pt").rename(bad / "layer_0_expert_2_mp_rank_00_model_states.pt")
    with pytest.raises(SourceFormatError, match=r"layer_0_expert_2_mp_rank_00_model_states\.pt: expert 2 is on ep "
                                                r"rank 1, whose writer \(global rank 1\) is model-parallel rank 1, "
                                                r"not 0"):
        DeepSpeedMoEReader(bad)


def test_cli_show_places_experts_on_global_ranks(moetp, ucp):
    """``ucp show`` says where DeepSpeed had the experts: ep rank r on the global ranks g with g % ep == r of
    the tp x dp world (not on dp ranks, as without TP)."""
    rc, out, err = ucp("--store", moetp.root / "store", "show", "moetp@2")
    assert rc == 0, err
    assert "experts: 2 group(s), saved at ep=2 over tp=2 x dp=2 ranks (tp fastest)" in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("moe.0.deepspeed_moe.experts.deepspeed_experts ")]
    assert [r[1:] for r in rows] == [["separate", "0", "0-1", "0,2"], ["separate", "1", "2-3", "1,3"]]


def test_plan_ep_names_the_experts_deepspeed_held_per_rank(moetp, ucp):
    """``ucp plan --tp 2 --dp 2 --ep 2 --zero 2`` (the version's recorded rule, ep_over=stage: DeepSpeed's expert
    groups) plans on every rank exactly the experts, and the ZeRO range of each, that the live DeepSpeed
    engine held at save time (its optimizer's flat partitions, dumped by ``engine_param_shares``), and puts
    each expert's writer on the model-parallel rank of its DeepSpeed expert file. ep carved out of dp
    (``--ep-over dp``, Megatron's rule) would give TP rank 1 experts 0-1 instead."""
    import torch

    from ucp_store.patterns import is_writer
    from ucp_store.topology import Topology

    store = moetp.root / "store"
    held = {}
    for rank in range(4):
        rc, out, err = ucp("--store", store, "plan", "moetp@2", "--tp", "2", "--dp", "2", "--ep", "2", "--zero", "2",
                           "--rank", rank, "--states", "fp32", "--json")
        assert rc == 0, err
        plan = json.loads(out)
        assert plan["topology"]["ep_over"] == "stage"
        planned = {t["name"]: (t["fragment"]["start"], t["fragment"]["stop"]) for t in plan["tensors"]
                   if ".deepspeed_experts." in t["name"]}
        engine = {n: (a, b) for (n, st), (a, b, _t) in torch.load(moetp.root / f"dump_src.{rank}.pt",
                                                                   weights_only=True).items()
                  if st == "fp32" and ".deepspeed_experts." in n}
        assert planned and planned == engine, rank
        held[rank] = sorted({int(n.split(".deepspeed_experts.")[1].split(".")[0]) for n in planned})
    assert held == {0: [0, 1], 1: [2, 3], 2: [0, 1], 3: [2, 3]}
    rc, out, err = ucp("--store", store, "plan", "moetp@2", "--tp", "2", "--dp", "2", "--ep", "2", "--zero", "2")
    assert rc == 0, err
    assert "expert placement: ep_over=stage: DeepSpeed's expert groups" in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("moe.1.deepspeed_moe.experts.deepspeed_experts ")]
    assert [r[2:] for r in rows] == [["0", "0-1", "0,2"], ["1", "2-3", "1,3"]]
    rc, out, err = ucp("--store", store, "plan", "moetp@2", "--tp", "2", "--dp", "2", "--ep", "2", "--ep-over", "dp")
    assert rc == 0, err
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("moe.1.deepspeed_moe.experts.deepspeed_experts ")]
    assert [r[2:] for r in rows] == [["0", "0-1", "0-1"], ["1", "2-3", "2-3"]]
    # the writer rule names the rank whose mp rank wrote each expert file
    topo = Topology(tp=2, dp=2, ep=2, ep_over="stage")
    ck = moetp.checkpoint()
    for f in moetp.tag_dir.glob("layer_*_expert_*_mp_rank_*_model_states.pt"):
        layer, e, mp = (int(x) for x in re.fullmatch(r"layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt",
                                                      f.name).groups())
        pattern = ck.info(f"moe.{layer}.deepspeed_moe.experts.deepspeed_experts.{e}.w1.weight", "fp32").pattern
        writers = [r for r in range(4) if is_writer(pattern, topo, r)]
        assert [topo.coords(r)["tp"] for r in writers] == [mp], f.name
