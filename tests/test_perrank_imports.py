"""Issue 28 on the remaining import and DeepSpeed paths: per-rank state is never silently collapsed.

* ``import_source`` over torch.distributed: objects whose content differs across the importing ranks (or
  that only some ranks hold) are stored per rank with the saving topology (``ucp/per_rank``), equal ones once.
* ``ds_load.load(restore_rng=True)``: the per-rank RNG states follow the ``per_rank`` policies (``rng_state``).
* A universal folder's client state: every rank's model-states file is read, differing keys kept per rank.
"""

from __future__ import annotations

import base64
import json

import pytest
import torch

from ucp_store.errors import ConfigurationError

from ucp_test_helpers import TOOLS, torchrun


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _rng_objs(tp: int, pp: int, dp: int, ranks=None) -> dict:
    """What the ucp DeepSpeed engine records: one CPU RNG state per saving global rank, and the layout."""
    world = tp * pp * dp
    ranks = range(world) if ranks is None else ranks
    return {"deepspeed/layout": {"tp": tp, "pp": pp, "dp": dp},
            "deepspeed/rng": {"torch_cpu": {str(r): _b64(torch.full((6,), 10 + r, dtype=torch.uint8)) for r in ranks}}}


def test_restore_rng_follows_per_rank_policies():
    from ucp_store.deepspeed.load import rng_state
    from ucp_store.deepspeed.perrank import topology

    objs = _rng_objs(tp=1, pp=1, dp=2)
    saved = topology(tp=1, pp=1, dp=2)
    # the saving topology: each rank its own state, bit for bit
    assert [rng_state(objs, saved, r, None, what="t").tolist() for r in (0, 1)] == [[10] * 6, [11] * 6]
    # another world size: rank 2 has no saved state; without a policy that is an error naming the key and
    # both topologies (it used to skip the restore silently)
    wider = topology(tp=1, pp=1, dp=4)
    with pytest.raises(ConfigurationError, match=r"'rng'.*2 ranks, mesh pp=1 x dp=2 x tp=1.*4 ranks"):
        rng_state(objs, wider, 2, None, what="t")
    # ... and even rank 0, which has a saved state, does not take it without a policy on another topology
    with pytest.raises(ConfigurationError, match=r"'rng'"):
        rng_state(objs, wider, 0, None, what="t")
    assert rng_state(objs, wider, 3, {"rng": "rank0"}, what="t").tolist() == [10] * 6
    assert rng_state(objs, wider, 3, {"rng": "fresh"}, what="t") is None
    by_tp = topology(tp=2, pp=1, dp=2)  # TP added: rank 2 is dp 1
    assert [rng_state(objs, by_tp, r, {"rng": "by-coordinate:dp"}, what="t").tolist()[0]
            for r in range(4)] == [10, 10, 11, 11]

    def mix(states, target):
        return states[target.rank % len(states)].value + 100

    assert rng_state(objs, wider, 3, {"r*": mix}, what="t").tolist() == [111] * 6
    # a rank that saved no state on the same topology: an error, not a skip
    partial = _rng_objs(tp=1, pp=1, dp=2, ranks=[0])
    with pytest.raises(ConfigurationError, match=r"rank 1 did not hold it"):
        rng_state(partial, saved, 1, None, what="t")
    with pytest.raises(ConfigurationError, match=r"no RNG state"):
        rng_state({"deepspeed/layout": {"tp": 1, "pp": 1, "dp": 1}}, saved, 0, None, what="t")


def _universal_folder(root, clients: list[dict]) -> str:
    """A small ds_to_universal folder saved at TP=len(clients): one parameter, and one model-states file per
    model-parallel rank carrying that rank's client state."""
    import os

    tp = len(clients)
    os.makedirs(root / "zero" / "w")
    w = torch.arange(8.0).reshape(2, 4)
    for st, t in (("fp32", w), ("exp_avg", w / 10), ("exp_avg_sq", w / 100)):
        torch.save({"param": t}, root / "zero" / "w" / f"{st}.pt")
    torch.save(torch.tensor(3), root / "zero" / "w" / "step.pt")
    torch.save({"zero_stage": 1, "optimizer_state_dict": {"state": {}, "param_groups": [{"lr": 0.1}]}},
               root / "zero" / "optimizer_state.pt")
    for mp, client in enumerate(clients):
        torch.save({"module": None, "param_shapes": [{"w": torch.Size([2, 4])}], "buffer_names": [],
                    "dp_world_size": 1, "mp_world_size": tp, "global_steps": 3, "ds_version": "0.16.0",
                    "checkpoint_parallel_dimensions": {"tp_degree": tp, "pp_degree": 1, "dp_degree": 1},
                    **client}, root / f"mp_rank_{mp:02d}_model_states.pt")
    return str(root)


def test_universal_import_keeps_every_rank_client_state(tmp_path):
    import ucp_store
    from ucp_store.catalog.rank_record import RECORD_OBJECT, read_record, show_lines
    from ucp_store.deepspeed.perrank import restore_client, topology
    from ucp_store.deepspeed.universal import import_universal

    folder = _universal_folder(tmp_path / "uni", [{"epoch": 2, "sampler": {"pos": 100}, "only0": 1},
                                                  {"epoch": 2, "sampler": {"pos": 101}}])
    store = ucp_store.open_store(str(tmp_path / "store"), create=True)
    ck = store.checkpoint(import_universal(store, folder, "u", progress=False))
    objs = ck.objects()
    # the key equal on both files once; the differing one (and the one only rank 0 holds) per rank, never
    # rank 0's alone
    assert objs["client_state"] == {"epoch": 2}
    rec = objs[RECORD_OBJECT]
    assert rec["source"] == "deepspeed"
    keys = {k["text"]: [(e["rank"], objs[e["object"]]) for e in k["entries"]] for k in rec["keys"]}
    assert keys == {"client_state.sampler": [(0, {"pos": 100}), (1, {"pos": 101})], "client_state.only0": [(0, 1)]}
    assert read_record(ck)["topology"]["world"] == 2
    assert any("client_state.sampler [value]: ranks 0 (pp=0, dp=0, tp=0), 1 (pp=0, dp=0, tp=1)" in line
               for line in show_lines(read_record(ck)))
    saved = topology(tp=2, pp=1, dp=1)
    assert restore_client(objs, saved, 0, None, what="t") == {"epoch": 2, "sampler": {"pos": 100}, "only0": 1}
    assert restore_client(objs, saved, 1, {"client_state.only0": "fresh"}, what="t") == {"epoch": 2,
                                                                                         "sampler": {"pos": 101}}
    # equal client state on every file: stored once, no per-rank record
    same = _universal_folder(tmp_path / "same", [{"epoch": 2, "sampler": {"pos": 5}}] * 2)
    objs = store.checkpoint(import_universal(store, same, "s", progress=False)).objects()
    assert objs["client_state"] == {"epoch": 2, "sampler": {"pos": 5}} and RECORD_OBJECT not in objs


IMPORT_JOB = r'''
import sys
import numpy as np
import torch, torch.distributed as dist
import ucp_store
from ucp_store.formats.base import TensorRecord, import_source

dist.init_process_group("gloo")
rank = dist.get_rank()


class Share:
    """A user's source under torchrun: each rank its share of the tensors and its own objects."""
    kind = "user"

    def describe(self):
        return "two-rank source"

    def provenance(self):
        return {"source_kind": self.kind}

    def records(self):
        yield TensorRecord(f"p{rank}", "weight", torch.full((4,), float(rank)))

    def objects(self):
        objs = {"cfg": {"lr": 0.1}, "sampler": {"pos": 100 + rank}, "rng": np.full(3, rank, dtype=np.uint8),
                "seed": 7, f"dataloader.dp_rank_{rank}": {"pos": 10 + rank}}
        if rank == 1:
            objs["only1"] = [1, 2]
        return objs


store = ucp_store.open_store(sys.argv[1], create=rank == 0) if rank == 0 else None
dist.barrier()
if store is None:
    store = ucp_store.open_store(sys.argv[1])
import_source(store, Share(), "u", 1, progress=False)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_torchrun_import_keeps_objects_that_differ_per_rank(tmp_path):
    import ucp_store
    from ucp_store.catalog.rank_record import RECORD_OBJECT, read_record, show_lines


    script = tmp_path / "job.py"
    script.write_text(IMPORT_JOB)
    torchrun([str(script), str(tmp_path / "store")], 2, timeout=300)
    ck = ucp_store.open_store(str(tmp_path / "store")).checkpoint("u@1")
    objs = ck.objects()
    # equal on both ranks: once, as before
    assert objs["cfg"] == {"lr": 0.1} and objs["seed"] == 7
    # different (or held by one rank): never rank 0's alone -- every rank's content, with its rank
    for k in ("sampler", "rng", "only1", "dataloader.dp_rank_0", "dataloader.dp_rank_1"):
        assert k not in objs, k
    rec = objs[RECORD_OBJECT]
    assert rec["source"] == "import" and rec["topology"]["world"] == 2
    keys = {k["text"]: k["entries"] for k in rec["keys"]}
    assert set(keys) == {"sampler", "rng", "only1", "dataloader.dp_rank_0", "dataloader.dp_rank_1"}
    assert [(e["rank"], objs[e["object"]]) for e in keys["sampler"]] == [(0, {"pos": 100}), (1, {"pos": 101})]
    assert [(e["rank"], e["kind"], objs[e["object"]].tolist()) for e in keys["rng"]] == [
        (0, "tensor", [0, 0, 0]), (1, "tensor", [1, 1, 1])]
    assert [(e["rank"], objs[e["object"]]) for e in keys["only1"]] == [(1, [1, 2])]
    assert [(e["rank"], objs[e["object"]]) for e in keys["dataloader.dp_rank_1"]] == [(1, {"pos": 11})]
    assert "per-rank keys: 5, saved on 2 ranks, no mesh (source import)" in show_lines(read_record(ck))[0]
    assert {(n, s) for n, s in ((t.name, t.state) for t in ck.tensors())} >= {("p0", "weight"), ("p1", "weight")}


DS_JOB = r'''
import json, sys
import torch, deepspeed, deepspeed.comm as dist
import ucp_store
import ucp_store.deepspeed as ucpds
from ucp_store.deepspeed.universal import import_universal
sys.path.insert(0, sys.argv[2])
from ds_autoep import convert_universal

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
engine.backward(engine(torch.randn(2, 8)).square().mean())
engine.step()
client = {"sampler": {"pos": 100 + rank}, "epoch": 3}
engine.save_checkpoint(f"{out}/ds", tag="t", client_state=client)  # ZeRO-3: one model-states file per rank
torch.manual_seed(100 + rank)
ucpds.attach(engine, store=store, run="eng")
saved = torch.get_rng_state().clone()
engine.save_checkpoint(client_state=client)
dist.barrier()
res = {}
torch.rand(16)  # the stream moves on after the save
ucpds.load(engine, "eng@1", store=store, restore_rng=True)
res["own"] = torch.equal(torch.get_rng_state(), saved)
ucpds.load(engine, "eng@1", store=store, restore_rng=True, per_rank={"rng": "rank0"})
res["rank0"] = torch.rand(4).tolist()
if rank == 0:
    conv = convert_universal(f"{out}/ds/t", f"{out}/uni")
    assert conv["returncode"] == 0, conv
    import_universal(ucp_store.open_store(store), f"{out}/uni", "uni", step=1, progress=False)
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(res, f)
'''


@pytest.mark.slow
def test_deepspeed_rng_policy_and_universal_client_state(tmp_path):
    """A real ZeRO-3 run on 2 ranks: ``restore_rng`` gives each rank its own RNG state on the saving topology
    and follows ``per_rank={"rng": "rank0"}``; DeepSpeed's own folder, converted by ``ds_to_universal``,
    imports with each rank's client state (``sampler`` per rank, ``epoch`` once)."""
    pytest.importorskip("deepspeed")
    import ucp_store
    from ucp_store.catalog.rank_record import RECORD_OBJECT

    script = tmp_path / "job.py"
    script.write_text(DS_JOB)
    torchrun([str(script), str(tmp_path), str(TOOLS)], 2, timeout=400)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert res[0]["own"] and res[1]["own"]
    assert res[0]["rank0"] == res[1]["rank0"]  # both ranks draw rank 0's stream
    objs = ucp_store.open_store(str(tmp_path / "store")).checkpoint("uni@1").objects()
    assert objs["client_state"] == {"epoch": 3}
    keys = {k["text"]: [(e["rank"], objs[e["object"]]) for e in k["entries"]] for k in objs[RECORD_OBJECT]["keys"]}
    assert keys == {"client_state.sampler": [(0, {"pos": 100}), (1, {"pos": 101})]}
