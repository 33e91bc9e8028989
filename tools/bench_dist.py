"""Benchmark: ucp_store.dist against torch.distributed.checkpoint (DCP) on the same sharded state, in one run.

    python tools/bench_dist.py --gib 1.0 --ranks 2 --dir /tmp/bench_dist

Starts ``--ranks`` gloo processes. Each holds its ``Shard(0)`` share of ``--tensors`` fp32 DTensors that add
up to ``--gib`` GiB, and both libraries, side by side, with their default settings:

1. save it synchronously (throughput = logical bytes / slowest rank's time);
2. load it into a *different* mesh layout (``Shard(1)``: every rank needs half the columns of every saved
   chunk), timing the load and counting the bytes each rank reads (``rchar`` from /proc/self/io: every
   read syscall of the process, TensorStore's threads included) against the bytes its shard needs
   (read amplification); the two loads must agree bit for bit;
3. ``async_save`` twice each (ucp thread mode, ucp process mode, DCP thread, DCP process), recording how long
   the call blocks (the second call is the steady state: staging buffers and writer processes exist).

Prints one table; ``--json FILE`` writes the figures. Numbers on a shared machine are noisy: compare the
ratios of this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ucp_store.dist as ucpd
    from ucp_store import open_store

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.ranks))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    world = args.ranks
    mesh = init_device_mesh("cpu", (world,))
    rows = args.rows
    cols = int(args.gib * (1 << 30)) // (4 * rows * args.tensors)
    cols -= cols % (world * 64)
    shape = (rows, cols)
    gen = torch.Generator().manual_seed(1000 + rank)
    local_rows = rows // world

    def state(fill: bool, dim: int) -> dict:
        out = {}
        for i in range(args.tensors):
            local_shape = (local_rows, cols) if dim == 0 else (rows, cols // world)
            t = torch.randn(local_shape, generator=gen) if fill else torch.zeros(local_shape)
            out[f"layers.{i}.weight"] = DTensor.from_local(t, mesh, [Shard(dim)], run_check=False, shape=shape,
                                                           stride=(cols, 1))
        return {"model": out}

    sd = state(True, 0)
    logical = args.tensors * rows * cols * 4
    local_bytes = logical // world
    results: dict = {"rank": rank, "logical_bytes": logical, "shape": list(shape), "tensors": args.tensors}
    store = os.path.join(args.dir, "store")
    sync = lambda: dist.barrier()

    def timed(fn):
        sync()
        r0, t0 = _rchar(), time.perf_counter()
        out = fn()
        t1, r1 = time.perf_counter(), _rchar()
        sync()
        return out, t1 - t0, r1 - r0

    # 1. synchronous save
    _, results["ucp_save_s"], _ = timed(lambda: ucpd.save(sd, store=store, run="bench", step=1, progress=False))
    dcp_dir = os.path.join(args.dir, "dcp1")
    _, results["dcp_save_s"], _ = timed(lambda: dcp.save(sd, checkpoint_id=dcp_dir))

    # 2. resharded load into Shard(1)
    tu = state(False, 1)
    res, results["ucp_load_s"], results["ucp_read_bytes"] = timed(
        lambda: ucpd.load(tu, store=store, ref="bench@1", progress=False))
    results["ucp_requested_bytes"] = res.bytes_read
    td = state(False, 1)
    _, results["dcp_load_s"], results["dcp_read_bytes"] = timed(lambda: dcp.load(td, checkpoint_id=dcp_dir))
    results["needed_bytes"] = local_bytes
    results["loads_equal"] = all(torch.equal(tu["model"][k].to_local(), td["model"][k].to_local()) for k in tu["model"])
    # the loaded columns are the saved rows' columns: spot-check against a full gather of one tensor
    full = sd["model"]["layers.0.weight"].full_tensor()
    results["load_correct"] = torch.equal(tu["model"]["layers.0.weight"].to_local(),
                                          full[:, rank * (cols // world):(rank + 1) * (cols // world)])
    tu = td = full = None  # free the load targets before the async saves

    # 3. async saves (blocking time of the call; the write finishes in the background)
    for mode in ("thread", "process"):
        for k in (1, 2):
            t0 = time.perf_counter()
            sync()
            t1 = time.perf_counter()
            h = ucpd.async_save(sd, store=store, run=f"async-{mode}", step=k, mode=mode)
            blocked = time.perf_counter() - t1
            h.result()
            results[f"ucp_async_{mode}_{k}_blocked_s"] = blocked
            results[f"ucp_async_{mode}_{k}_total_s"] = time.perf_counter() - t1
            del t0
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    for name, kind in (("thread", AsyncCheckpointerType.THREAD), ("process", AsyncCheckpointerType.PROCESS)):
        for k in (1, 2):
            d = os.path.join(args.dir, f"dcp-async-{name}-{k}")
            sync()
            t1 = time.perf_counter()
            fut = dcp.async_save(sd, checkpoint_id=d, async_checkpointer_type=kind)
            blocked = time.perf_counter() - t1
            (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
            results[f"dcp_async_{name}_{k}_blocked_s"] = blocked
            results[f"dcp_async_{name}_{k}_total_s"] = time.perf_counter() - t1
            sync()
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
    ucpd.close()
    sync()
    if rank == 0:
        st = open_store(store)
        for run in ("async-thread", "async-process"):
            for v in st.list_checkpoints(run):
                st.rm(v["id"])
        st.gc()
    with open(os.path.join(args.dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _table(rs: list[dict]) -> str:
    worst = {k: max(r[k] for r in rs) for k in rs[0] if k.endswith("_s")}
    gib = rs[0]["logical_bytes"] / (1 << 30)
    read_u = sum(r["ucp_read_bytes"] for r in rs)
    read_d = sum(r["dcp_read_bytes"] for r in rs)
    need = sum(r["needed_bytes"] for r in rs)
    lines = [(f"state: {rs[0]['tensors']} x {rs[0]['shape']} fp32 = {gib:.2f} GiB on {len(rs)} gloo ranks "
              "(Shard(0)); times are the slowest rank's"),
             f"{'measure':44} {'ucp_store':>12} {'DCP':>12} {'ratio':>10}"]

    def row(label, u, d, fmt="{:.2f}", better="higher"):
        ratio = (u / d if better == "higher" else d / u) if u and d else float("nan")
        lines.append(f"{label:44} {fmt.format(u):>12} {fmt.format(d):>12} {ratio:>9.2f}x")

    row("save throughput (GiB/s)", gib / worst["ucp_save_s"], gib / worst["dcp_save_s"])
    row("save time (s)", worst["ucp_save_s"], worst["dcp_save_s"], better="lower")
    row("resharded load Shard(0)->Shard(1) (s)", worst["ucp_load_s"], worst["dcp_load_s"], better="lower")
    row("bytes read by all ranks (GiB)", read_u / (1 << 30), read_d / (1 << 30), better="lower")
    row("read amplification (read / needed)", read_u / need, read_d / need, better="lower")
    for mode in ("thread", "process"):
        for k in (1, 2):
            row(f"async_save {mode} call {k}: blocked (s)", worst[f"ucp_async_{mode}_{k}_blocked_s"],
                worst[f"dcp_async_{mode}_{k}_blocked_s"], fmt="{:.3f}", better="lower")
            row(f"async_save {mode} call {k}: until durable (s)", worst[f"ucp_async_{mode}_{k}_total_s"],
                worst[f"dcp_async_{mode}_{k}_total_s"], better="lower")
    for mode in ("thread", "process"):
        frac = worst[f"ucp_async_{mode}_2_blocked_s"] / worst["ucp_save_s"]
        lines.append(f"ucp async_save {mode} (call 2) blocks {100 * frac:.1f}% of ucp's synchronous save")
    lines.append(f"loads agree bit for bit: {all(r['loads_equal'] for r in rs)}; "
                 f"ucp load matches the saved columns: {all(r['load_correct'] for r in rs)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="logical size of the state (default 1.0)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--dir", default="/tmp/bench_dist", help="scratch folder (emptied first)")
    ap.add_argument("--json", default=None, help="also write the per-rank figures here")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        _rank_main(args.rank, args, args.port)
        return
    if args.rows % (args.ranks * 64):
        sys.exit(f"--rows {args.rows} must divide by 64 x ranks")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    port = _free_port()
    env = {**os.environ, "UCP_PROGRESS": "0"}
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(r), "--port", str(port)],
                              env=env) for r in range(args.ranks)]
    rc = [p.wait() for p in procs]
    if any(rc):
        sys.exit(f"a rank failed: exit codes {rc}")
    rs = []
    for r in range(args.ranks):
        with open(os.path.join(args.dir, f"rank{r}.json")) as f:
            rs.append(json.load(f))
    print(_table(rs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rs, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
