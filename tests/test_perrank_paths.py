"""Per-rank state on every path besides ``ucp_store.dist`` itself (issue 28 item 4): ``ucp import dcp`` /
``ucp export dcp`` keep DCP's per-rank entries (torchtitan's ``dataloader.dp_rank_<i>``) with their saving
rank and topology, ``ucp export dcp`` of a ``ucp_store.dist`` save writes every rank's entry, the DeepSpeed
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
from ucp_store.rank_record import read_record

from ucp_test_helpers import torchrun

JOB = r'''
import json, os, pickle, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from ucp_store import cli
import ucp_store.dist as ucpd

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

# a ucp_store.dist save whose per-rank values share one key: the export names each rank's entry
ucpd.save({"w": torch.ones(2), "pos": 100 + rank, "rng": torch.full((3,), rank, dtype=torch.uint8)}, store=store,
          run="d", step=1, progress=False)
dist.barrier()
if rank == 0:
    ucp("export", "dcp", "d@1", f"{out}/exp_dist")
dist.barrier()
got = {"model": {"w": torch.zeros(2)}, "pos": {f"rank_{rank}": 0}, "rng": {f"rank_{rank}": torch.zeros(3, dtype=torch.uint8)}}
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
    assert shown["saved_on"] == "2 ranks, no mesh" and shown["source"] == "ucp_store.dist"
    assert [(k["text"], [e["rank"] for e in k["entries"]]) for k in shown["keys"]] == [("pos", [0, 1]),
                                                                                     ("rng", [0, 1])]
