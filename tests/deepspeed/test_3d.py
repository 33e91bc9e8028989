"""TP x PP x DP: a real DeepSpeed checkpoint written by 8 gloo processes (TP=2 x PP=2 x DP=2, ZeRO-1, bf16).

The model is Megatron-style (``pipe3d`` in ``ucp_store/demo/ds_train.py``): a ``PipelineModule`` over
DeepSpeed's ``PipeModelDataParallelTopology`` whose MLP blocks are hand-written column-/row-parallel linears
(collectives on the grid's tensor group), with the ``universal_checkpoint_info`` DeepSpeed saves from the
module. All ranks are forked by ``tools/fork_ranks.py`` from one interpreter with torch and
DeepSpeed loaded, in one launcher run (train, ds_to_universal, import, export, resume), instead of two
torchrun launches where every rank imported torch, DeepSpeed and the 1500 modules its engine pulls in.
The checkpoint is imported with ``ucp import deepspeed``, checked against ``ds_to_universal``'s
output bit for bit, exported with ``ucp export deepspeed-universal`` and resumed by DeepSpeed
(``load_universal``) on 2 processes at TP=1 x PP=1 x DP=2, TP=2 x PP=1 x DP=1 and TP=1 x PP=2 x DP=1:
the ZeRO partitions DeepSpeed's loader builds on every rank equal what ``load_shard`` plans for that rank,
and the next-step losses continue the uninterrupted run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from ucp_store import safe_pickle as sp

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ds3d")]

STEPS = 3
TAG = f"global_step{STEPS}"
UTAG = f"{TAG}_universal"
SOURCE = {"model": "pipe3d", "tp": 2, "stages": 2, "zero": 1, "dtype": "bf16", "hidden": 32, "blocks": 4}
TRAIN_PROCS = 8
RESUME_PROCS = 2  # 2 processes start in a fraction of 4's time on a 2-core machine
# target name -> (tp, pp); DP = RESUME_PROCS // (tp * pp)
TARGETS = {"tp1_pp1_dp2": (1, 1), "tp2_pp1_dp1": (2, 1), "tp1_pp2_dp1": (1, 2)}
LAYERS = 7  # PipelineModule layers: input linear, 4 blocks, head, fp32 cast
RUN = "ds3d"
# 8 processes on 2 shared cores: minutes when the machine is busy (a bound against a hang, not a timing check)
TIMEOUT = 1800


class Session:
    def __init__(self, root: Path):
        self.root = root
        self.tag_dir = root / "ck" / TAG
        self.ds_universal = root / "ck" / UTAG
        self.export_root = root / "export"
        self.store_path = root / "store"
        self.timings: dict[str, float] = {}

    def result(self, name: str) -> dict:
        return json.loads((self.root / f"{name}.json").read_text())

    def checkpoint(self):
        from ucp_store import open_store

        return open_store(str(self.store_path)).checkpoint(f"{RUN}@{STEPS}")


@pytest.fixture(scope="module")
def ds3d(tmp_path_factory) -> Session:
    """One launcher run: train and save on 8 ranks (and run ds_to_universal), import and export with the
    CLI, then resume every target from our export and from ds_to_universal's folder on 2 ranks."""
    pytest.importorskip("deepspeed")
    s = Session(tmp_path_factory.mktemp("ds3d"))
    train = {"kind": "train", **SOURCE, "steps": STEPS, "next_steps": 2, "save_dir": str(s.root / "ck"), "tag": TAG,
             "out": str(s.root / "train.json")}
    resumes = []
    for name, (tp, pp) in TARGETS.items():
        for who, root in (("ucp", s.export_root), ("ds", s.root / "ck")):
            job = {"kind": "resume", **SOURCE, "tp": tp, "stages": pp, "load_dir": str(root), "tag": UTAG,
                   "steps": 2, "out": str(s.root / f"resume_{name}_{who}.json")}
            if who == "ucp":
                job["dump"] = str(s.root / f"dump_{name}")
            resumes.append(job)
    store = ["--store", str(s.store_path), "--no-progress"]
    # ds_to_universal as ds_train's "convert" runs it, but forked from the launcher: no fresh interpreter
    convert = ["--input_folder", str(s.tag_dir), "--output_folder", str(s.ds_universal), "--inject_missing_state",
               "--num_extract_workers", "1", "--num_merge_workers", "1"]
    phases = [{"ranks": TRAIN_PROCS, "jobs": [train]},
              {"module": "deepspeed.checkpoint.ds_to_universal", "argv": convert},
              {"ucp": ["import", "deepspeed", str(s.tag_dir), "--run", RUN, *store]},
              {"ucp": ["export", "deepspeed-universal", f"{RUN}@{STEPS}", str(s.export_root), "--tag", UTAG, *store]},
              {"ranks": RESUME_PROCS, "jobs": resumes}]
    t0 = time.time()
    from ucp_test_helpers import tools_on_path

    tools_on_path()
    from fork_ranks import launch

    try:
        s.timings = launch(phases, s.root, TIMEOUT)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    s.timings["total"] = time.time() - t0
    print(f"\nTP x PP x DP fixture wall times (s): {json.dumps({k: round(v, 1) for k, v in s.timings.items()})}")
    return s


def test_source_is_tp2_pp2_dp2(ds3d):
    """DeepSpeed wrote 2 DP x 4 model-parallel (pp x tp) optimizer files and per-TP layer files, and the
    reader takes the mesh and the Megatron patterns (column, row, replicated; layer placement) from them."""
    from ucp_store.deepspeed.source import DeepSpeedReader

    r = DeepSpeedReader(ds3d.tag_dir)
    assert r.topology == {"tp": 2, "pp": 2, "dp": 2, "zero_stage": 1}
    assert len(r.optim_files) == 8 and {mp for mp, _ in r.optim_files} == {0, 1, 2, 3}
    assert {tp for _, tp in r.layer_files} == {0, 1}
    assert {p["name"]: p["stage"] for p in r.params if ".mlp." in p["name"] and p["name"].endswith("weight")} == {
        "1.mlp.dense_h_to_4h.weight": 0, "2.mlp.dense_h_to_4h.weight": 0, "3.mlp.dense_h_to_4h.weight": 0,
        "4.mlp.dense_4h_to_h.weight": 1, "1.mlp.dense_4h_to_h.weight": 0, "2.mlp.dense_4h_to_h.weight": 0,
        "3.mlp.dense_4h_to_h.weight": 0, "4.mlp.dense_h_to_4h.weight": 1}
    ck = ds3d.checkpoint()
    pat = {i.name: i.pattern for i in ck.tensors() if i.state == "fp32"}
    assert pat["2.mlp.dense_h_to_4h.weight"] == {"kind": "partitioned", "dim": 0, "placement": {"layer": 2}}
    assert pat["4.mlp.dense_h_to_4h.bias"] == {"kind": "partitioned", "dim": 0, "placement": {"layer": 4}}
    assert pat["4.mlp.dense_4h_to_h.weight"] == {"kind": "partitioned", "dim": 1, "placement": {"layer": 4}}
    assert pat["4.mlp.dense_4h_to_h.bias"] == {"kind": "replicated", "placement": {"layer": 4}}
    assert pat["1.input_layernorm.weight"] == {"kind": "replicated", "placement": {"layer": 1}}
    assert pat["5.weight"] == {"kind": "replicated", "placement": {"layer": 5}}
    assert tuple(ck.info("3.mlp.dense_4h_to_h.weight", "fp32").shape) == (32, 64)
    assert ck.provenance["source_topology"] == {"tp": 2, "pp": 2, "dp": 2, "zero_stage": 1}


def test_stored_states_equal_ds_to_universal(ds3d, cmp):
    """Every tensor-state in the store is bit for bit what ds_to_universal wrote for the same checkpoint,
    and the store holds nothing ds_to_universal left out."""
    ck = ds3d.checkpoint()
    files = cmp.files(ds3d.ds_universal)
    stored = {(i.name, i.state) for i in ck.tensors()}
    seen = set()
    for rel, path in files.items():
        name, fname = rel[len("zero/"):].rsplit("/", 1)
        state = fname[:-3]
        obj = sp.load(path, mmap=False)
        theirs = obj if state == "step" else obj["param"]
        mine = ck.read(name, state)
        assert cmp.equal(mine, theirs), f"{rel}: stored {mine.dtype} {tuple(mine.shape)} differs"
        seen.add((name, state))
    assert {n for n, _ in seen} == {n for n, _ in stored}
    assert {(n, s) for n, s in stored if s != "weight"} == seen  # weight: bf16 copies equal to fp32 are not kept


def test_tp_replicated_slices_are_identical(ds3d):
    """The hand-written TP layers keep replicated parameters (norms, row-parallel bias, input/head) equal on
    both TP ranks in every DP partition, so storing them once loses nothing."""
    from ucp_store.deepspeed.source import DeepSpeedReader

    r = DeepSpeedReader(ds3d.tag_dir)
    checked = 0
    for spec in r.params:
        name = spec["name"]
        if not (name.endswith("input_layernorm.weight") or name.endswith("dense_4h_to_h.bias") or name[0] in "05"):
            continue
        per_tp = []
        for tp in range(2):
            parts = []
            for dp in range(2):
                flat, _step, mapping = r._flat_states((spec["stage"] * 2 + tp, dp), spec["group"])
                if name in mapping:
                    a = mapping[name]
                    parts.append(torch.cat([flat[k].narrow(0, int(a.start), int(a.numel)) for k in sorted(flat)]))
            per_tp.append(torch.cat(parts))
        assert torch.equal(per_tp[0], per_tp[1]), name
        checked += 1
    assert checked == 4 * 2 + 4


def test_export_equals_ds_to_universal(ds3d, cmp):
    ours, theirs = ds3d.export_root / UTAG, ds3d.ds_universal
    a, b = cmp.files(ours), cmp.files(theirs)
    assert set(a) == set(b) and len(b) == 28 * 4
    for rel in b:
        assert cmp.equal(torch.load(a[rel], weights_only=True), sp.load(b[rel], mmap=False)), rel
    ms = sorted(p.name for p in theirs.glob("*model_states.pt"))
    assert ms == [f"mp_rank_{i:02d}_model_states.pt" for i in range(4)]
    assert ms == sorted(p.name for p in ours.glob("*model_states.pt"))
    for f in ms:
        mine, other = torch.load(ours / f, weights_only=True), sp.load(theirs / f, mmap=False)
        assert set(mine) == set(other), f
        for k in other:
            assert cmp.equal(mine[k], other[k]), f"{f}: {k}"


@pytest.mark.parametrize("target", list(TARGETS))
def test_load_shard_equals_deepspeed_loader(ds3d, target):
    """On every rank of the target, the ZeRO partitions of fp32, exp_avg and exp_avg_sq that DeepSpeed's
    universal loader built from our export equal, bit for bit, the buffers ``load_shard`` plans and reads
    from the store for that rank (same rank order: tp fastest, then dp, then pp)."""
    from ucp_store.io.read import load_shard
    from ucp_store.topology import Topology

    tp, pp = TARGETS[target]
    dp = RESUME_PROCS // (tp * pp)
    topo = Topology(tp=tp, pp=pp, dp=dp, zero_stage=1, layers=LAYERS)
    ck = ds3d.checkpoint()
    for rank in range(RESUME_PROCS):
        dump = torch.load(ds3d.root / f"dump_{target}_rank{rank}.pt", weights_only=True)
        assert dump["coords"] == {"tp": rank % tp, "dp": (rank // tp) % dp, "pp": rank // (tp * dp)}
        group_of = {n: f"g{g}" for g, names in enumerate(dump["groups"]) for n in names}
        shard = load_shard(ck, topo, rank, states=["fp32", "exp_avg", "exp_avg_sq"],
                           zero_groups=lambda n, m=group_of: m.get(n, "g_other"))  # type: ignore[misc]
        by_key = {(b.group, b.state): b for b in shard.plan.buffers}
        assert {g for g, _ in by_key} == set(group_of.values())
        for g in range(len(dump["groups"])):
            for st in ("fp32", "exp_avg", "exp_avg_sq"):
                got, want = shard.buffers[by_key[(f"g{g}", st)].key], dump[st][g]
                assert got.dtype == want.dtype and torch.equal(got, want), f"{target} rank {rank} group {g} {st}"


@pytest.mark.parametrize("target", list(TARGETS))
def test_resume_continues_uninterrupted_run(ds3d, target):
    """DeepSpeed resumes from our export exactly as from ds_to_universal's folder, and both continue the
    8-process TP=2 x PP=2 x DP=2 run (another TP degree sums in another order: approximately equal)."""
    ours, theirs = ds3d.result(f"resume_{target}_ucp"), ds3d.result(f"resume_{target}_ds")
    assert ours["world"] == RESUME_PROCS and ours["global_steps"] == theirs["global_steps"] == STEPS
    assert ours["lr"] == theirs["lr"]
    assert ours["losses_hex"] == theirs["losses_hex"], (ours["losses"], theirs["losses"])
    cont = ds3d.result("train")["losses"]
    assert len(cont) == len(ours["losses"]) == 2
    assert ours["losses"] == pytest.approx(cont, rel=1e-2)
    before = ds3d.result("train")["losses_before"]
    assert ours["losses"][0] != pytest.approx(before[0], rel=1e-2)  # not a restart from the initial weights


def test_ucp_plan_cli_for_targets(ds3d, capsys):
    """``ucp plan`` plans every target: each rank reads the fp32 master and moments of exactly its pipeline
    stage's layers, in its TP share (column-parallel rows, row-parallel columns), and its coordinates follow
    DeepSpeed's rank order."""
    from ucp_store import cli

    stage_layers = {1: [range(0, LAYERS)], 2: [range(0, 4), range(4, LAYERS)]}  # DeepSpeed's partition_uniform
    for target, (tp, pp) in TARGETS.items():
        dp = RESUME_PROCS // (tp * pp)
        for rank in range(RESUME_PROCS):
            capsys.readouterr()
            assert cli.main(["plan", f"{RUN}@{STEPS}", "--store", str(ds3d.store_path), "--tp", str(tp), "--pp",
                             str(pp), "--dp", str(dp), "--zero", "1", "--layers", str(LAYERS), "--rank", str(rank),
                             "--states", "fp32,exp_avg,exp_avg_sq", "--json"]) == 0
            out = json.loads(capsys.readouterr().out)
            stage = rank // (tp * dp)
            assert out["coords"]["tp"] == rank % tp and out["coords"]["pp"] == stage
            layers = {int(t["name"].split(".")[0]) for t in out["tensors"]}
            layers |= {int(m.split(".")[0]) for b in out["buffers"] for m in b["members"]}
            assert layers and layers <= set(stage_layers[pp][stage]), (target, rank, layers)
            for t in out["tensors"]:
                if t["name"].endswith("dense_h_to_4h.weight"):
                    assert t["local_shape"] == [64 // tp, 32]
                if t["name"].endswith("dense_4h_to_h.weight"):
                    assert t["local_shape"] == [32, 64 // tp]
