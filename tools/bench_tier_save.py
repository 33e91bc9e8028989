"""Blocking time of a save until it is ``replicated`` (issue 38) against a durable ``dcp.save`` of the same state.

    .venv/bin/python tools/bench_tier_save.py                     # 4 nodes x 2 ranks, 256 MiB, 3 rounds
    .venv/bin/python tools/bench_tier_save.py --nodes 2 --per-node 2 --mb 64 --rounds 2

Ranks are forked from this interpreter (torch imported once) and join one gloo group; rank ``r`` is on node
``n<r // per_node>`` (``UCP_NODE``) and that node's fast tier is its own folder under /dev/shm. The state is
one FSDP-like DTensor state dict (fp32 tensors sharded on dim 0 over every rank) of ``--mb`` MiB in all.
Each round times, on every rank between two barriers (the figure is the slowest rank's):

- ``dcp.save``: ``torch.distributed.checkpoint.save`` with its ``FileSystemWriter`` into a folder on the durable
  disk (``--durable``, default a temporary folder under /tmp), fsyncs on (DCP's default);
- ``ucp durable``: ``ucp_store.distributed.save`` into the store on that disk (for reference);
- ``ucp fast -> replicated``: ``ucp_store.distributed.save(tier="fast", replicas=1, drain=False)``: returns
  once every object is on two nodes' fast tiers and the catalog says ``replicated``;
- ``gloo all_to_all (floor)``: each rank's shard bytes to its partner in one ``all_to_all_single`` (no files):
  what the replication's transfer costs on this machine by itself;
- ``dcp.async_save``: how long its call blocks the training loop, and until its future says the files are written;
- ``ucp async fast``: ``ucp_store.distributed.async_save(tier="fast", replicas=1)``: how long the call blocks the
  training loop, and from the call until ``result().wait("replicated")`` returns (the version survives the loss
  of any one node from then on).

Every method writes new files each round (a fresh folder or step). Prints the median of each method, the ratios
to ``dcp.save`` (the issue's goal: the training loop blocked at most 0.2 of it; the version replicated within a
second of the call) and ``uptime``'s load; the times are this machine's
under its load, so only ratios from one run compare.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _state(rank: int, world: int, mesh, mb: int) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Shard

    rows_total = max(world, (mb << 20) // (4 * 4096 * 8))  # 8 tensors of [rows, 4096] fp32
    rows_total -= rows_total % world
    g = torch.Generator().manual_seed(rank)
    sd: dict = {"model": {}}
    for i in range(8):
        local = torch.randn(rows_total // world, 4096, generator=g)
        sd["model"][f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                             shape=(rows_total, 4096), stride=(4096, 1))
    return sd


def _partner_copy(sd: dict, rank: int, world: int, per_node: int, dist) -> None:
    """The bytes replication moves, alone: this rank's shards to the same local rank of the next node, in one
    ``all_to_all_single`` on the gloo group (no files, no checks): the floor of the replicated path's transfer."""
    import torch

    data = torch.cat([t.to_local().reshape(-1).view(torch.uint8) for t in sd["model"].values()])
    nodes = world // per_node
    to = ((rank // per_node + 1) % nodes) * per_node + rank % per_node
    frm = ((rank // per_node - 1) % nodes) * per_node + rank % per_node
    send = [data.numel() if r == to else 0 for r in range(world)]
    recv = [data.numel() if r == frm else 0 for r in range(world)]
    out = torch.empty(sum(recv), dtype=torch.uint8)
    dist.all_to_all_single(out, data, recv, send)


def _timed(fn, dist) -> float:
    import torch

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed_async(call, settle, dist) -> tuple[float, float]:
    """(seconds the call blocked, seconds from the call until ``settle(handle)`` returned), slowest rank each."""
    import torch

    dist.barrier()
    t0 = time.perf_counter()
    handle = call()
    blocked = time.perf_counter() - t0
    settle(handle)
    done = time.perf_counter() - t0
    dist.barrier()
    t = torch.tensor([blocked, done], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def rank_main(rank: int, world: int, port: int, args) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import ucp_store.distributed as ucpd

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      UCP_NODE=f"n{rank // args.per_node}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    sd = _state(rank, world, mesh, args.mb)
    durable, fast = Path(args.durable), Path(args.fast)
    store = str(durable / "store")
    times: dict[str, list[float]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up (plans cached, pools made, node map learnt)
        step = 10 * r
        methods = {
            "dcp.save": lambda r=r: dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(durable / f"dcp{r}"))),
            "ucp durable": lambda step=step: ucpd.save(sd, store=store, run="durable", step=step, progress=False),
            "ucp fast -> replicated": lambda step=step: ucpd.save(
                sd, store=store, run="fast", step=step, progress=False, tier="fast", replicas=1,
                fast_tier=str(fast / "{node}"), drain=False),
        }
        methods["gloo all_to_all (floor)"] = lambda: _partner_copy(sd, rank, world, args.per_node, dist)
        got = {k: _timed(fn, dist) for k, fn in methods.items()}
        # the async calls: what the training loop waits for, and when the version is safe
        got["dcp.async_save: blocked"], got["dcp.async_save: durable"] = _timed_async(
            lambda r=r: dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(str(durable / f"adcp{r}"))),
            lambda fut: fut.result(), dist)
        got["ucp async fast: blocked"], got["ucp async fast: replicated"] = _timed_async(
            lambda step=step: ucpd.async_save(sd, store=store, run="afast", step=step, tier="fast",
                                              replicas=1, fast_tier=str(fast / "{node}"), drain=False),
            lambda h: h.result().wait("replicated", timeout=600), dist)
        if rank == 0:
            from ucp_store.distributed import tiered

            last = tiered.LAST_TIMINGS
            print(f"round {r} rank 0 tiered phases: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in last.items()),
                  flush=True)
        if r:
            for k, v in got.items():
                times.setdefault(k, []).append(v)
    if rank == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def launch(args) -> dict:
    import torch  # noqa: F401 - loaded once, before the forks
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    world = args.nodes * args.per_node
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                rank_main(r, world, port, args)
                code = 0
            except BaseException:  # noqa: BLE001 - the parent reports the failed rank
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    bad = [r for r, pid in enumerate(pids) if os.waitpid(pid, 0)[1]]
    if bad:
        raise SystemExit(f"rank(s) {bad} failed (see stderr)")
    return json.loads(Path(args.out).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--mb", type=int, default=256, help="MiB of state in all (default 256)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--durable", default=None, help="folder on the durable disk (default: a temporary one)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ucp-bench-tier-", dir=args.durable))
    fast = Path(tempfile.mkdtemp(prefix="ucp-bench-tier-", dir="/dev/shm"))
    args.durable, args.fast, args.out = str(work), str(fast), str(work / "times.json")
    try:
        times = launch(args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(fast, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"{args.nodes} nodes x {args.per_node} ranks, {args.mb} MiB of state, {args.rounds} rounds (median, "
          f"slowest rank); load: {load}")
    for k, v in med.items():
        print(f"  {k:<24} {v * 1000:9.1f} ms   ({', '.join(f'{x * 1000:.0f}' for x in times[k])})")
    ratio = med["ucp fast -> replicated"] / med["dcp.save"]
    print(f"  sync: replicated / dcp.save          {ratio:9.3f}")
    ratio = med["ucp async fast: blocked"] / med["dcp.save"]
    print(f"  async: blocked / dcp.save            {ratio:9.3f}    (goal: <= 0.2)")
    blocked, replicated = med["ucp async fast: blocked"], med["ucp async fast: replicated"]
    print(f"  async: blocked / dcp.async_save's    {blocked / med['dcp.async_save: blocked']:9.3f}")
    print(f"  async: call -> replicated            {replicated * 1000:9.1f} ms (goal: under 1 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
