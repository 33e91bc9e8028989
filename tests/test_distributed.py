"""Several real torch.distributed (gloo) processes write their shards straight into one checkpoint.

Case 1, tensor parallel: each TP rank writes its TP-local slices (fused QKV with GQA, a row-parallel
weight, a replicated norm written by one rank only). Case 2, ZeRO-1 over 2 DP ranks: each rank writes
its flat fragments; a parameter straddles the two partitions, so both ranks write into the same shard
file and TensorStore's conditional read-modify-write must merge them. Rank 0 commits once; the parent
checks the logical tensors bit for bit and that nothing else was listed.
"""

import pytest
import torch

import ucp_store
from ucp_store.topology import Topology

from ucp_test_helpers import free_port, run_python

WORKER = r'''
import os, sys, torch, torch.distributed as dist
import ucp_store
from ucp_store import patterns as pat
from ucp_store.distributed.commit import distributed_begin, distributed_commit
from ucp_store.topology import Topology

store_url, case, fail_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
g = torch.Generator().manual_seed(0)
params = {
    "qkv": ((48, 16), {"kind": "fused", "dim": 0, "sizes": [32, 8, 8]}),
    "o": ((16, 32), {"kind": "partitioned", "dim": 1, "placement": {"layer": 1}}),
    "norm": ((16,), {"kind": "replicated"}),
    "odd": ((7, 13), None),
}
logical = {n: torch.randn(*shape, generator=g) for n, (shape, _) in params.items()}
store = ucp_store.open_store(store_url)
from sqlalchemy import event
writes = []  # the catalog write transactions this rank opens (SQLite: BEGIN IMMEDIATE)
event.listen(store.catalog.engine, "before_cursor_execute",
             lambda conn, cur, stmt, *a: writes.append(stmt) if stmt.startswith("BEGIN IMMEDIATE") else None)
w = distributed_begin(store, "dist", 1 if case == "tp" else 2)
if case == "tp":
    topo = Topology(tp=2)
    for name, (shape, p) in params.items():
        if p is None:
            p = {"kind": "replicated"}
        lay = pat.local_layout(p, shape, topo, rank)
        local = torch.empty(lay.shape)
        for c in lay.copies:
            local[c.local.slices()] = logical[name][c.logical.slices()]
        w.write_shard(name, "fp32", local, shape=shape, pattern=p, topology=topo, rank=rank, targets=[Topology(tp=4)])
else:
    topo = Topology(dp=2, zero_stage=1)
    names = list(params)
    group = pat.zero_group_layout([logical[n].numel() for n in names], 2, 1)
    flat = torch.cat([logical[n].reshape(-1) for n in names])
    part = torch.zeros(group.partition_numel)
    lo = rank * group.partition_numel
    for i, n in enumerate(names):
        f = group.fragment(i, rank)
        if f is None or f.slot == 0:
            continue
        part[f.buffer_start:f.buffer_start + f.slot] = logical[n].reshape(-1)[f.start:f.stop]
        if rank == fail_rank:
            raise RuntimeError("injected failure")
        w.write_shard(n, "fp32", part[f.buffer_start:f.buffer_start + f.slot], shape=logical[n].shape,
                      pattern=params[n][1], topology=topo, rank=rank, fragment=f)
cid = distributed_commit(w)
print(f"WRITE_TXNS rank={rank} n={len(writes)}", flush=True)
if rank == 0:
    print("COMMITTED", cid)
dist.destroy_process_group()
'''


def _torchrun(tmp_path, store_url, case, fail_rank=-1):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return run_python(["-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
                       str(script), store_url, case, str(fail_rank)], timeout=300)


def _logical():
    g = torch.Generator().manual_seed(0)
    shapes = {"qkv": (48, 16), "o": (16, 32), "norm": (16,), "odd": (7, 13)}
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


@pytest.mark.slow
def test_tp_and_zero_ranks_write_one_checkpoint(tmp_path):
    store_url = str(tmp_path / "store")
    store = ucp_store.open_store(store_url, create=True)
    for case, step in (("tp", 1), ("zero", 2)):
        res = _torchrun(tmp_path, store_url, case)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "COMMITTED" in res.stdout
        # one catalog write transaction to begin and ONE to record every rank's rows and commit, both on rank 0:
        # the other rank hands its rows over in the gather and writes nothing to the catalog
        assert "WRITE_TXNS rank=0 n=2" in res.stdout and "WRITE_TXNS rank=1 n=0" in res.stdout, res.stdout
        ck = store.checkpoint(f"dist@{step}")
        for name, x in _logical().items():
            assert torch.equal(ck.read(name, "fp32"), x), (case, name)
        assert not ck.verify()
        # the commit recorded o's layer: a 2-stage plan fetches its row for the second stage only
        two_stages = Topology(pp=2, layers=2)
        stage_rows = [{i.name for i in store.checkpoint(f"dist@{step}").plan_records(two_stages, r)} for r in (0, 1)]
        assert stage_rows == [{"qkv", "norm", "odd"}, {"qkv", "o", "norm", "odd"}], case
    # the ZeRO straddling parameter really shared a shard between the two writers
    assert [c["step"] for c in store.list_checkpoints("dist")] == [1, 2]


@pytest.mark.slow
def test_failure_on_one_rank_lists_nothing(tmp_path):
    store_url = str(tmp_path / "store")
    store = ucp_store.open_store(store_url, create=True)
    res = _torchrun(tmp_path, store_url, "zero", fail_rank=1)
    assert res.returncode != 0
    assert store.list_checkpoints() == []
    store.gc()  # the dead job's arrays are unreferenced: gc removes every one
    assert not any((tmp_path / "store" / "arrays").glob("*/*.zarr"))
