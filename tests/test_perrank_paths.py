"""Per-rank state on every path besides ``ucp_store.distributed`` itself (issue 28 item 4): ``ucp import dcp`` /
``ucp export dcp`` keep DCP's per-rank entries (torchtitan's ``dataloader.dp_rank_<i>``) with their saving
rank and topology, ``ucp export dcp`` of a ``ucp_store.distributed`` save writes every rank's entry, the DeepSpeed
import keeps each model-states file's client state, and ``ucp show`` lists the per-rank keys with the
saving topology (text and ``--json``).

The DCP test runs one real 2-rank gloo job (torchrun): DCP saves, rank 0 imports and exports through the
CLI, then ``dcp.load`` on each rank reads the export.
"""

from __future__ import annotations

import json

import pytest

import ucp_store
from ucp_store import cli
from ucp_store.catalog.rank_record import read_record

from ucp_test_helpers import torchrun

JOB = r'''
import json, os, pickle, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from ucp_store import cli
import ucp_store.distributed as ucpd

dist.init_process_group("gloo")
rank = dist.get_rank()
out = sys.argv[1]
store = f"{out}/store"


def ucp(*argv):
    assert cli.main([*argv, "--store", store, "--no-progress"]) == 0, argv


# torchtitan's layout: model FQNs at the top, each rank's dataloader state under a key naming its rank
# (pickled bytes, as torchtitan writes it), and a per-rank RNG tensor the same way
sd = {"w": torch.arange(4.0), "dataloader": {f"dp_rank_{rank}": pickle.dumps({"pos": 100 + rank, "rank": rank})},
      "rng": {f"rank_{rank}": torch.full((8,), 10 + rank, dtype=torch.uint8)}, "train_state": {"step": 7}}
dcp.save(sd, checkpoint_id=f"{out}/src")
dist.barrier()
if rank == 0:
    ucp("import", "dcp", f"{out}/src", "--run", "t", "--step", "1")
    ucp("export", "dcp", "t@1", f"{out}/exp")
dist.barrier()
got = {"w": torch.zeros(4), "dataloader": {f"dp_rank_{rank}": b""},
       "rng": {f"rank_{rank}": torch.zeros(8, dtype=torch.uint8)}, "train_state": {"step": 0}}
dcp.load(got, checkpoint_id=f"{out}/exp")
res = {"loader": pickle.loads(got["dataloader"][f"dp_rank_{rank}"]), "rng": got["rng"][f"rank_{rank}"].tolist(),
       "step": got["train_state"]["step"]}

# a ucp_store.distributed save whose per-rank values share one key: the export names each rank's entry
ucpd.save({"w": torch.ones(2), "pos": 100 + rank, "rng": torch.full((3,), rank, dtype=torch.uint8)}, store=store,
          run="d", step=1, progress=False)
dist.barrier()
if rank == 0:
    ucp("export", "dcp", "d@1", f"{out}/exp_dist")
dist.barrier()
got = {"model": {"w": torch.zeros(2)}, "pos": {f"rank_{rank}": 0},
       "rng": {f"rank_{rank}": torch.zeros(3, dtype=torch.uint8)}}
dcp.load(got, checkpoint_id=f"{out}/exp_dist")
res["dist_pos"] = got["pos"][f"rank_{rank}"]
res["dist_rng"] = got["rng"][f"rank_{rank}"].tolist()
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(res, f)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_dcp_per_rank_entries_round_trip_on_two_ranks(tmp_path, capsys):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    torchrun([str(script), str(tmp_path)], 2, timeout=300)
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # dcp.load of the export gives each rank its own bytes
        assert res["loader"] == {"pos": 100 + rank, "rank": rank}
        assert res["rng"] == [10 + rank] * 8
        assert res["step"] == 7
        assert res["dist_pos"] == 100 + rank and res["dist_rng"] == [rank] * 3

    st = ucp_store.open_store(str(tmp_path / "store"))
    rec = read_record(st.checkpoint("t@1"))
    assert rec is not None and rec["source"] == "dcp" and rec["topology"]["world"] == 2
    held = {k["text"]: [(e["rank"], e["kind"]) for e in k["entries"]] for k in rec["keys"]}
    assert held == {"dataloader.dp_rank_0": [(0, "opaque")], "dataloader.dp_rank_1": [(1, "opaque")],
                    "rng.rank_0": [(0, "tensor")], "rng.rank_1": [(1, "tensor")]}  # train_state is replicated

    # ucp show lists the per-rank keys and the saving topology, as text and as JSON
    capsys.readouterr()
    assert cli.main(["show", "t@1", "--store", str(tmp_path / "store")]) == 0
    text = capsys.readouterr().out
    assert "per-rank keys: 4, saved on 2 ranks, no mesh (source dcp)" in text
    assert "dataloader.dp_rank_1 [opaque]: rank 1; 1 distinct content" in text
    assert cli.main(["show", "d@1", "--store", str(tmp_path / "store"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["per_rank"]
    assert shown["saved_on"] == "2 ranks, no mesh" and shown["source"] == "ucp_store.distributed"
    assert [(k["text"], [e["rank"] for e in k["entries"]]) for k in shown["keys"]] == [("pos", [0, 1]),
                                                                                     ("rng", [0, 1])]


DS_JOB = r'''
import json, sys
import torch, deepspeed, deepspeed.comm as dist
import ucp_store
import ucp_store.deepspeed as ucpds
from ucp_store.deepspeed.source import import_deepspeed

deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
out = sys.argv[1]
store = f"{out}/store"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9,
       "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
loss = engine(torch.randn(2, 8)).square().mean()
engine.backward(loss)
engine.step()
# per-rank client state (a sampler position and an RNG state) beside a replicated key
torch.manual_seed(100 + rank)
client = {"sampler": {"pos": 100 + rank, "rank": rank}, "rng": torch.get_rng_state()[:16], "epoch": 3}
engine.save_checkpoint(f"{out}/ds", tag="t", client_state=client)  # DeepSpeed's own files (ZeRO-3: one per rank)
ucpds.attach(engine, store=store, run="eng")
engine.save_checkpoint(client_state=client)  # the ucp engine
dist.barrier()
if rank == 0:
    import_deepspeed(ucp_store.open_store(store, create=True), f"{out}/ds/t", "imp", step=1, progress=False,
                     distributed=False)
dist.barrier()
res = {}
for ref in ("imp@1", "eng@1"):
    got = ucpds.load(engine, ref, store=store)
    res[ref] = {"sampler": got["sampler"], "rng": got["rng"].tolist(), "epoch": got["epoch"]}
res["rng"] = client["rng"].tolist()
with open(f"{out}/ds_rank{rank}.json", "w") as f:
    json.dump(res, f)
'''


@pytest.mark.slow
def test_deepspeed_per_rank_client_state_kept_per_rank(tmp_path, capsys):
    """ZeRO-3 on 2 ranks: ``ucp import deepspeed`` of DeepSpeed's folder and the ucp engine's save both keep
    each rank's client state; ``ds_load.load`` on the same topology returns each rank its own."""
    pytest.importorskip("deepspeed")
    script = tmp_path / "ds_job.py"
    script.write_text(DS_JOB)
    torchrun([str(script), str(tmp_path)], 2, timeout=400)
    results = [json.loads((tmp_path / f"ds_rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["rng"] != results[1]["rng"]
    for rank, res in enumerate(results):
        for ref in ("imp@1", "eng@1"):
            assert res[ref] == {"sampler": {"pos": 100 + rank, "rank": rank}, "rng": res["rng"], "epoch": 3}, ref
    st = ucp_store.open_store(str(tmp_path / "store"))
    for ref in ("imp@1", "eng@1"):
        rec = read_record(st.checkpoint(ref))
        assert rec is not None and rec["source"] == "deepspeed", ref
        assert [k["text"] for k in rec["keys"]] == ["client_state.rng", "client_state.sampler"]
        assert all([e["rank"] for e in k["entries"]] == [0, 1] for k in rec["keys"])
        assert (rec["topology"]["dims"], rec["topology"]["shape"]) == (["pp", "dp", "tp"], [1, 2, 1])
    capsys.readouterr()
    assert cli.main(["show", "imp@1", "--store", str(tmp_path / "store")]) == 0
    text = capsys.readouterr().out
    assert "per-rank keys: 2, saved on 2 ranks, mesh pp=1 x dp=2 x tp=1 (source deepspeed)" in text
    assert "client_state.sampler [value]: ranks 0 (pp=0, dp=0, tp=0), 1 (pp=0, dp=1, tp=0)" in text


def test_deepspeed_client_state_policies():
    """``ds_perrank``: the saving topology gives each rank its own; another topology needs a policy (error
    naming the key and both topologies without one); by-coordinate, rank0, fresh and reshard."""
    from ucp_store.deepspeed.perrank import restore_client, split_client, topology
    from ucp_store.errors import ConfigurationError

    saved = topology(tp=1, pp=1, dp=2)
    common, objs = split_client({0: {"pos": 100, "epoch": 3}, 1: {"pos": 101, "epoch": 3}}, saved)
    assert common == {"epoch": 3}
    objs["client_state"] = common
    assert [restore_client(objs, saved, r, None, what="t")["pos"] for r in (0, 1)] == [100, 101]
    wider = topology(tp=2, pp=1, dp=2)  # TP added: rank 2 is dp 1, tp 0
    with pytest.raises(ConfigurationError, match=r"2 ranks, mesh pp=1 x dp=2 x tp=1 .*4 ranks.*client_state\.pos"):
        restore_client(objs, wider, 2, None, what="t")
    by_dp = {"client_state.pos": "by-coordinate:dp"}
    assert [restore_client(objs, wider, r, by_dp, what="t")["pos"] for r in range(4)] == [100, 100, 101, 101]
    assert restore_client(objs, wider, 3, {"client_state*": "rank0"}, what="t")["pos"] == 100
    assert "pos" not in restore_client(objs, wider, 3, {"client_state.pos": "fresh"}, what="t")

    def resplit(states, target):
        return sum(s.value for s in states) + target.rank

    assert restore_client(objs, wider, 3, {"client_state.pos": resplit}, what="t")["pos"] == 204


def test_demo_sampler_resplit_repeats_and_skips_nothing():
    """``ucp demo``'s per-rank sampler: the positions saved on DP=2 re-split over DP=4 (or 1) continue the
    sample stream where it stopped, every sample read once; saved ranks at different steps are refused."""
    from ucp_store.demo import text
    from ucp_store.demo.model import ModelConfig
    from ucp_store.distributed import RankTarget, RankTopology, SavedRankState
    from ucp_store.errors import ConfigurationError

    cfg = ModelConfig(seq=8)
    old = [text.Sampler(cfg, dp_rank=d, dp=2, next_sample=d * cfg.batch_size // 2) for d in range(2)]
    for s in old:
        for _ in range(3):
            s.next_batch()
    saved_topo = RankTopology.from_mesh(("dp", "tp"), (2, 2), range(4))
    saved = [SavedRankState(r, saved_topo.coords(r), ("sampler",), old[r // 2].state_dict()) for r in range(4)]
    for dp in (4, 1):
        topo = RankTopology.from_mesh(("dp",), (dp,), range(dp))
        rows = []
        for r in range(dp):
            state = text.resplit(saved, RankTarget(r, topo.coords(r), ("sampler",), dp, topo, saved_topo))
            new = text.Sampler(cfg, dp_rank=r, dp=dp)
            new.load_state_dict(state)
            assert new.step() == 4
            rows.append(new.next_batch()[0])
        assert text.torch.equal(text.torch.cat(rows), text.batch(cfg, 4)[0])  # step 4 whole, once
    stale = [saved[0], SavedRankState(2, {"dp": 1, "tp": 0}, ("sampler",), {**saved[2].value, "next": 7})]
    with pytest.raises(ConfigurationError, match="different steps"):
        text.resplit(stale, RankTarget(0, {"dp": 0}, ("sampler",), 1, RankTopology.from_mesh(("dp",), (1,), [0]),
                                       saved_topo))
