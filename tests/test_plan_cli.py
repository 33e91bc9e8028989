"""``ucp plan``: per-rank totals, JSON plans, the picture, and clear errors for impossible splits."""

import json

import torch

import ucp_store
from ucp_store.plan.planner import plan


def _store(tmp_path):
    store = ucp_store.open_store(str(tmp_path / "store"), create=True)
    with store.begin("m", 1) as w:
        w.write("qkv", "fp32", torch.randn(96, 32), pattern={"kind": "fused", "dim": 0, "sizes": [64, 16, 16]})
        w.write("down", "fp32", torch.randn(32, 64), pattern={"kind": "partitioned", "dim": 1})
        w.write("norm", "fp32", torch.randn(32), pattern={"kind": "replicated"})
    return store


def test_plan_totals_match_planner(tmp_path, ucp):
    store = _store(tmp_path)
    rc, out, err = ucp("--store", tmp_path / "store", "plan", "m@1", "--tp", "2", "--dp", "2", "--zero", "1", "--json")
    assert rc == 0, err
    rows = json.loads(out)["ranks"]
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    infos = store.checkpoint("m@1").tensors()
    for r in rows:
        p = plan(infos, {"tp": 2, "dp": 2, "zero_stage": 1}, r["rank"])
        assert r["bytes_needed"] == p.bytes_needed and r["bytes_read"] == p.bytes_read
    # ZeRO-1 over dp=2 splits every TP-local tensor between the two DP ranks of a TP rank
    assert sum(r["bytes_needed"] for r in rows) == sum(i.nbytes for i in infos if i.name != "norm") + 2 * 32 * 4


def test_plan_one_rank_json_and_plot(tmp_path, ucp):
    _store(tmp_path)
    png = tmp_path / "plan.png"
    rc, out, err = ucp("plan", "m@1", "--store", tmp_path / "store", "--tp", "4", "--rank", "3", "--json",
                       "--plot", png, "--param", "qkv")
    assert rc == 0, err
    doc = json.loads(out[: out.rindex("}") + 1])
    qkv = next(t for t in doc["tensors"] if t["name"] == "qkv")
    assert qkv["local_shape"] == [24, 32]  # [q_3; k_3; v_3] = 16 + 4 + 4 rows
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_refuses_impossible_split(tmp_path, ucp):
    _store(tmp_path)
    rc, out, err = ucp("plan", "m@1", "--store", tmp_path / "store", "--tp", "3")
    assert rc == 1
    assert "qkv" in err and "cannot be split 3 ways" in err and err.count("\n") == 1


def test_plan_refuses_an_unknown_state(tmp_path, ucp):
    _store(tmp_path)
    rc, out, err = ucp("plan", "m@1", "--store", tmp_path / "store", "--tp", "2", "--states", "fp32,exp_avgg")
    assert rc == 1
    assert "no state 'exp_avgg'" in err and err.count("\n") == 1
