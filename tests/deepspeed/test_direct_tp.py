"""Issue 14 at TP=2: the direct ucp engine saves a tensor-parallel DeepSpeed engine and resumes it on any TP.

One launcher run (``tools/fork_ranks.py``: ranks forked from one interpreter with torch and DeepSpeed
loaded) on real DeepSpeed over gloo:

1. 2 ranks, TP=2 x DP=1, ZeRO-1, bf16, the Megatron-style ``pipe3d`` model on one pipeline stage (column- and
   row-parallel MLPs; output linears and row-parallel biases TP-replicated; its layer norms listed in
   ``parameter_to_average_patterns``). After 3 steps, TP rank 1's copy of one norm is made to drift (fp32
   master and exp_avg), the same step is saved to files by DeepSpeed's own engine and through the ucp engine;
   then a TP-*replicated* bias drifts too and a second ucp save must fail (the importer refuses such files);
   4 ranks, TP=2 x DP=2 (ZeRO fragments of TP slices straddling the DP partitions; frozen norm biases and
   buffers), the same save and import;
2. ``ds_to_universal`` of the files; ``ucp import deepspeed`` of them;
3. 2 ranks at TP=2 and 4. 1 rank at TP=1: ``ucp_store.deepspeed.load`` of the direct version, and
   DeepSpeed's ``load_universal`` of the converted folder into the same engines.

Checks: every stored tensor-state of the direct save is bit-equal (bytes, dtype, shape, pattern) to the import of
the files, the drifted norm stored as their mean with the ``averaged`` pattern and its deviation; the objects
are equal; the refused save lists nothing; both loads give the same optimizer state on every rank, bit for bit,
and the same next-step losses.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("deepspeed")]

REPO = Path(__file__).resolve().parents[2]
TAG = "global_step3"
UTAG = f"{TAG}_universal"
MODEL = {"model": "pipe3d", "stages": 1, "zero": 1, "dtype": "bf16", "hidden": 16, "blocks": 2,
         "average_norms": True}
AVERAGED = "1.input_layernorm.weight"
REPLICATED = "1.mlp.dense_4h_to_h.bias"
RUN = "tp2"
RUN_DP2 = "tp2dp2"
TIMEOUT = 900  # a bound against a hang on a loaded 2-core machine, not a timing check


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> Path:
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("dstp")
    store = str(root / "store")
    save = {"kind": "save", **MODEL, "tp": 2, "steps": 3, "save_dir": str(root / "ck"), "tag": TAG, "store": store,
            "run": RUN, "out": str(root / "save.json"), "perturb": {"rank": 1, "params": [AVERAGED]},
            "bad_run": {"run": "bad", "perturb": {"rank": 1, "params": [REPLICATED]}}}

    def resumes(tp: int) -> list[dict]:
        key = f"tp{tp}"
        return [{"kind": "resume_direct", **MODEL, "tp": tp, "store": store, "ref": f"{RUN}@3", "steps": 2,
                 "out": str(root / f"direct_{key}.json"), "state_prefix": str(root / f"direct_{key}")},
                {"kind": "resume_ds", **MODEL, "tp": tp, "load_dir": str(root / "ck"), "tag": UTAG, "steps": 2,
                 "out": str(root / f"ds_{key}.json"), "state_prefix": str(root / f"ds_{key}")}]

    convert = ["--input_folder", str(root / "ck" / TAG), "--output_folder", str(root / "ck" / UTAG),
               "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]
    harness = "tools.ds_direct"
    # TP=2 x DP=2: ZeRO fragments of TP slices (odd width: parameters straddle the DP partitions), frozen norm biases
    # and buffers (``extras``), saved and imported
    dp2 = {"kind": "save", **MODEL, "hidden": 12, "blocks": 3, "extras": True, "tp": 2, "steps": 3,
           "save_dir": str(root / "ck_dp2"), "tag": TAG, "store": store, "run": RUN_DP2,
           "out": str(root / "save_dp2.json"),
           "perturb": {"rank": [1, 3], "params": [AVERAGED]}}  # TP rank 1 (both DP ranks hold a part of it)
    phases = [{"ranks": 2, "jobs": [save], "harness": harness},
              {"ranks": 4, "jobs": [dp2], "harness": harness},
              {"ucp": ["import", "deepspeed", str(root / "ck_dp2" / TAG), "--run", RUN_DP2, "--store",
                       str(root / "imported"), "--no-progress"]},
              {"module": "deepspeed.checkpoint.ds_to_universal", "argv": convert},
              {"ucp": ["import", "deepspeed", str(root / "ck" / TAG), "--run", RUN, "--store", str(root / "imported"),
                       "--no-progress"]},
              {"ranks": 2, "jobs": resumes(2), "harness": harness},
              {"ranks": 1, "jobs": resumes(1), "harness": harness}]
    from ucp_test_helpers import tools_on_path

    tools_on_path()
    from fork_ranks import launch

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")  # the harness: tools/ds_direct.py
    t0 = time.time()
    try:
        timings = launch(phases, root, TIMEOUT, env=env)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    timings["total"] = time.time() - t0
    print(f"\nTP=2 direct fixture wall times (s): {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
    return root


@pytest.mark.parametrize("run", [RUN, RUN_DP2])
def test_tp2_direct_save_is_bit_equal_to_import_of_the_files(tp2, run):
    import torch

    from ucp_store import open_store

    a = open_store(str(tp2 / "store")).checkpoint(f"{run}@3")
    b = open_store(str(tp2 / "imported")).checkpoint(f"{run}@3")
    ta = {(t.name, t.state): t for t in a.tensors()}
    tb = {(t.name, t.state): t for t in b.tensors()}
    assert set(ta) == set(tb)
    for key in ta:
        x, y = ta[key], tb[key]
        assert (x.dtype, tuple(x.shape), x.pattern) == (y.dtype, tuple(y.shape), y.pattern), key
        assert a.read(*key).view(-1).view(torch.uint8).equal(b.read(*key).view(-1).view(torch.uint8)), key
    pat = {n: ta[(n, "fp32") if (n, "fp32") in ta else (n, "weight")].pattern for n, _ in ta}
    # the layouts the importer gives a Megatron model: column-parallel rows, row-parallel columns, replicas
    assert pat["1.mlp.dense_h_to_4h.weight"] == {"kind": "partitioned", "dim": 0, "placement": {"layer": 1}}
    assert pat["1.mlp.dense_h_to_4h.bias"] == {"kind": "partitioned", "dim": 0, "placement": {"layer": 1}}
    assert pat["1.mlp.dense_4h_to_h.weight"] == {"kind": "partitioned", "dim": 1, "placement": {"layer": 1}}
    assert pat[REPLICATED] == {"kind": "replicated", "placement": {"layer": 1}}
    hidden, dp = (16, 1) if run == RUN else (12, 2)
    if run == RUN_DP2:  # a column-parallel weight (written by write_shard) straddles the DP partitions
        from ucp_store import safe_pickle

        for tp in range(2):
            maps = [safe_pickle.load(tp2 / "ck_dp2" / TAG / f"bf16_zero_pp_rank_{d}_mp_rank_{tp:02d}_optim_states.pt",
                                     what="test")["optimizer_state_dict"]["param_slice_mappings"][0] for d in range(2)]
            assert "2.mlp.dense_h_to_4h.weight" in set(maps[0]) & set(maps[1])
    assert tuple(ta[("1.mlp.dense_4h_to_h.weight", "fp32")].shape) == (hidden, 2 * hidden)
    # the drifted norm: the mean of the two TP copies, its deviation recorded
    assert pat[AVERAGED]["kind"] == "averaged" and pat[AVERAGED]["max_deviation"] > 0
    assert pat["2.input_layernorm.weight"]["kind"] == "averaged"
    assert pat["2.input_layernorm.weight"]["max_deviation"] == 0.0
    assert a.provenance["source_topology"] == {"tp": 2, "pp": 1, "dp": dp, "zero_stage": 1}
    kinds = a.objects()["deepspeed/kinds"]
    if run == RUN_DP2:  # weights outside the optimizer, merged over the TP ranks: one copy each
        assert kinds["2.input_layernorm.bias"] == "frozen" and kinds["2.scale"] == "buffer"
        assert pat["2.scale"] == {"kind": "replicated", "placement": {"layer": 2}}
        assert set(a.states("2.input_layernorm.bias")) == {"weight"}
    assert a.verify() == []
    oa, ob = a.objects(), b.objects()
    assert set(ob) <= set(oa)
    for k in ob:
        if k == "deepspeed/layout":
            assert {**oa[k], "import_seconds": 0} == {**ob[k], "import_seconds": 0}
        else:
            assert oa[k] == ob[k], k


def test_tp2_save_of_a_drifted_replica_fails_and_lists_nothing(tp2):
    from ucp_store import open_store

    err = json.loads((tp2 / "save.json").read_text())["bad_error"]
    # the importer's rule for a TP-replicated parameter: the copies must be equal
    assert err is not None and REPLICATED in err and "TP slices differ" in err, err
    store = open_store(str(tp2 / "store"))
    assert [c for c in store.list_checkpoints() if c["run"] == "bad"] == []
    assert sorted(c["run"] for c in store.list_checkpoints()) == [RUN, RUN_DP2]


@pytest.mark.parametrize("tp", [2, 1])
def test_load_at_tp_equals_load_universal(tp2, tp):
    """ucp_store.deepspeed.load of the TP=2 version gives every rank the optimizer state DeepSpeed's
    load_universal gives from ds_to_universal of the same step's files, bit for bit, and the same losses."""
    import torch

    for rank in range(tp):
        mine = torch.load(tp2 / f"direct_tp{tp}_rank{rank}.pt", weights_only=True)
        theirs = torch.load(tp2 / f"ds_tp{tp}_rank{rank}.pt", weights_only=True)
        assert set(mine) == set(theirs)
        for k in theirs:
            assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]), (tp, rank, k)
    d = json.loads((tp2 / f"direct_tp{tp}.json").read_text())
    u = json.loads((tp2 / f"ds_tp{tp}.json").read_text())
    assert d["global_steps"] == u["global_steps"] == 3
    assert len(d["losses"]) == 2 and d["losses_hex"] == u["losses_hex"]
    assert d["lr"] == u["lr"]
