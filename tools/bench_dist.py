"""Benchmark: ucp_store.distributed against torch.distributed.checkpoint (DCP) on the same sharded state, in one run.

    python tools/bench_dist.py --gib 1.0 --ranks 2 --dir /tmp/bench_dist

Starts ``--ranks`` gloo processes. Each holds its ``Shard(0)`` share of ``--tensors`` fp32 DTensors that add
up to ``--gib`` GiB, and both libraries, side by side, with their default settings, ``--reps`` times
interleaved (the first of each pair alternates; the best repetition counts, and every figure is kept):

1. save it synchronously (throughput = logical bytes / slowest rank's time; each repetition changes the
   state, so nothing is deduplicated);
2. load it into the same mesh (``Shard(0)``) and into a *different* layout (``Shard(1)``: every rank needs
   half the columns of every saved chunk), timing each load and counting the bytes each rank reads
   (``rchar`` from /proc/self/io: every read syscall of the process, TensorStore's threads included)
   against the bytes its shard needs (read amplification); the two libraries' loads must agree bit for bit;
3. ``async_save`` in thread and process mode, each library in turn: how long the call blocks. Call 1 is
   the first in the process (staging buffers, writer processes and groups are created then); the later
   calls are the steady state.

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
    parts = set(args.parts.split(","))

    import ucp_store.distributed as ucpd
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
    results: dict = {"rank": rank, "logical_bytes": logical, "shape": list(shape), "tensors": args.tensors,
                     "reps": args.reps}
    store = os.path.join(args.dir, "store")
    sync = lambda: dist.barrier()

    def timed(fn):
        sync()
        r0, t0 = _rchar(), time.perf_counter()
        out = fn()
        t1, r1 = time.perf_counter(), _rchar()
        sync()
        return out, t1 - t0, r1 - r0

    def best(key: str, value: float) -> None:
        results[key] = min(results.get(key, float("inf")), value)
        results.setdefault(key + "_all", []).append(round(value, 4))

    def bump(r: int) -> None:  # a new state per repetition (no dedup of an identical save)
        for t in sd["model"].values():
            t.to_local()[0, 0] += 1.0 + r

    def raw_save(path: str) -> None:
        """The durable ceiling: this rank's bytes into one file of its own, write + fsync (no format)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in sd["model"].values():
                mv = memoryview(t.to_local().numpy()).cast("B")
                done = 0
                while done < len(mv):
                    done += os.write(fd, mv[done:done + (64 << 20)])
            os.fsync(fd)
        finally:
            os.close(fd)

    # 1. synchronous saves, interleaved (the order rotates); the last DCP save and ucp version are loaded below
    dcp_dir = ""
    raw_dir = os.path.join(args.dir, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    peers = ("ucp", "dcp", "raw")
    if "save" in parts:
        for r in range(args.reps):
            bump(r)
            for who in peers[r % 3:] + peers[:r % 3]:
                if who == "ucp":
                    _, t, _ = timed(lambda r=r: ucpd.save(sd, store=store, run="bench", step=r + 1, progress=False))
                    if r and rank == 0:  # keep only the newest version (disk space), outside the timing
                        st = open_store(store)
                        st.rm(st.resolve(f"bench@{r}"))
                        st.gc()
                    sync()
                elif who == "dcp":
                    if dcp_dir and rank == 0:
                        shutil.rmtree(dcp_dir, ignore_errors=True)
                    sync()
                    dcp_dir = os.path.join(args.dir, f"dcp{r}")
                    _, t, _ = timed(lambda d=dcp_dir: dcp.save(sd, checkpoint_id=d))
                else:
                    path = os.path.join(raw_dir, f"rank{rank}.bin")
                    if os.path.exists(path):
                        os.unlink(path)
                    _, t, _ = timed(lambda p=path: raw_save(p))
                best(f"{who}_save_s", t)
        shutil.rmtree(raw_dir, ignore_errors=True)
    ref = f"bench@{args.reps}"

    # 2. loads into the same mesh (Shard(0)) and into a different one (Shard(1): every rank needs half the
    #    columns of every saved chunk), interleaved; bytes read are the process's read syscalls (rchar)
    for label, dim in (("same", 0), ("reshard", 1)) if "load" in parts and "save" in parts else ():
        tu, td = state(False, dim), state(False, dim)
        for r in range(args.reps):
            for who in (("ucp", "dcp") if r % 2 == 0 else ("dcp", "ucp")):
                target = tu if who == "ucp" else td
                for t in target["model"].values():
                    t.to_local().zero_()
                if who == "ucp":
                    res, t, nbytes = timed(lambda sd_=target: ucpd.load(sd_, store=store, ref=ref, progress=False))
                    results[f"ucp_{label}_requested_bytes"] = res.bytes_read
                else:
                    _, t, nbytes = timed(lambda sd_=target: dcp.load(sd_, checkpoint_id=dcp_dir))
                best(f"{who}_{label}_load_s", t)
                results[f"{who}_{label}_read_bytes"] = nbytes
        results[f"{label}_loads_equal"] = all(torch.equal(tu["model"][k].to_local(), td["model"][k].to_local())
                                              for k in tu["model"])
        full = sd["model"]["layers.0.weight"].full_tensor()
        mine = full.chunk(world, dim=dim)[rank]
        results[f"{label}_load_correct"] = torch.equal(tu["model"]["layers.0.weight"].to_local(), mine)
        tu = td = full = mine = None  # free the load targets before the async saves
    results["needed_bytes"] = local_bytes
    sync()
    if rank == 0 and dcp_dir:
        shutil.rmtree(dcp_dir, ignore_errors=True)

    # the staging ceiling: copying this rank's bytes into host memory, into fresh memory (what any first
    # async call that allocates pays at least) and into memory already mapped (any later call's floor)
    if "async" in parts:
        srcs = [t.to_local() for t in sd["model"].values()]
        for _ in range(max(args.reps, 2)):
            sync()
            t0 = time.perf_counter()
            fresh = [torch.empty_like(x).copy_(x) for x in srcs]
            best("copy_fresh_s", time.perf_counter() - t0)
            sync()
            t0 = time.perf_counter()
            for b, x in zip(fresh, srcs):
                b.copy_(x)
            best("copy_warm_s", time.perf_counter() - t0)
            fresh = None

    # 3. async saves: how long the call blocks (the write finishes in the background). Call 1 is the first
    #    of its kind in the process (staging buffers, writer processes, groups are created); calls 2.. are
    #    the steady state (best of them). ucp and DCP alternate call by call.
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    kinds = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}

    def drop(ref: str) -> None:
        st = open_store(store)
        st.rm(st.resolve(ref))
        st.gc()
    for mode in ("thread", "process") if "async" in parts else ():
        for k in range(1, max(args.reps, 2) + 1):
            for who in (("ucp", "dcp") if k % 2 else ("dcp", "ucp")):
                d = os.path.join(args.dir, f"dcp-async-{mode}-{k}")
                sync()
                t1 = time.perf_counter()
                if who == "ucp":
                    h = ucpd.async_save(sd, store=store, run=f"async-{mode}", step=k, mode=mode)
                    blocked = time.perf_counter() - t1
                    h.result()
                else:
                    fut = dcp.async_save(sd, checkpoint_id=d, async_checkpointer_type=kinds[mode])
                    blocked = time.perf_counter() - t1
                    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
                total = time.perf_counter() - t1
                step = "1" if k == 1 else "n"
                best(f"{who}_async_{mode}_{step}_blocked_s", blocked)
                best(f"{who}_async_{mode}_{step}_total_s", total)
                sync()
                if who == "ucp" and rank == 0:  # disk space: drop it (outside the timing)
                    drop(f"async-{mode}@{k}")
                if who == "dcp" and rank == 0:
                    shutil.rmtree(d, ignore_errors=True)
        # the first call of a new layout after ``prepare_async`` at setup (the same tensors under other keys)
        sd2 = {"model": {k.replace("layers.", "other."): v for k, v in sd["model"].items()}}
        sync()
        t0 = time.perf_counter()
        ucpd.prepare_async(sd2, mode=mode)
        best(f"ucp_async_{mode}_prepare_s", time.perf_counter() - t0)
        sync()
        t0 = time.perf_counter()
        h = ucpd.async_save(sd2, store=store, run=f"async-{mode}", step=100, mode=mode)
        best(f"ucp_async_{mode}_p_blocked_s", time.perf_counter() - t0)
        h.result()
        sync()
        if rank == 0:
            drop(f"async-{mode}@100")
        sync()
    ucpd.close()
    sync()
    if rank == 0:
        st = open_store(store)
        for run in ("async-thread", "async-process") if "async" in parts else ():
            for v in st.list_checkpoints(run) if run in {r["run"] for r in st.runs()} else ():
                st.rm(v["id"])
        st.gc()
    with open(os.path.join(args.dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _dcp_fsyncs() -> bool:
    """Whether DCP's default FileSystemWriter fsyncs its files (``sync_files``), read from its signature."""
    import inspect

    from torch.distributed.checkpoint import FileSystemWriter

    return bool(inspect.signature(FileSystemWriter.__init__).parameters["sync_files"].default)


def _table(rs: list[dict]) -> str:
    worst = {k: max(r[k] for r in rs) for k in rs[0] if k.endswith("_s")}
    gib = rs[0]["logical_bytes"] / (1 << 30)
    need = sum(r["needed_bytes"] for r in rs)
    lines = [(f"state: {rs[0]['tensors']} x {rs[0]['shape']} fp32 = {gib:.2f} GiB on {len(rs)} gloo ranks "
              f"(Shard(0)); times: the slowest rank's, best of {rs[0]['reps']} interleaved repetitions"),
             f"{'measure':50} {'ucp_store':>10} {'DCP':>10} {'ucp/DCP':>9}"]

    def row(label, u, d, fmt="{:.2f}", better="higher"):
        ratio = (u / d if better == "higher" else d / u) if u and d else float("nan")
        lines.append(f"{label:50} {fmt.format(u):>10} {fmt.format(d):>10} {ratio:>8.2f}x")

    if "ucp_save_s" in worst:
        row("save throughput (GiB/s)", gib / worst["ucp_save_s"], gib / worst["dcp_save_s"])
        row("save time (s)", worst["ucp_save_s"], worst["dcp_save_s"], better="lower")
    for label, text in (("same", "load, same mesh Shard(0) (s)"), ("reshard", "resharded load Shard(0)->Shard(1) (s)")):
        if f"ucp_{label}_load_s" not in worst:
            continue
        row(text, worst[f"ucp_{label}_load_s"], worst[f"dcp_{label}_load_s"], better="lower")
        read_u = sum(r[f"ucp_{label}_read_bytes"] for r in rs)
        read_d = sum(r[f"dcp_{label}_read_bytes"] for r in rs)
        row("  bytes read by all ranks (GiB)", read_u / (1 << 30), read_d / (1 << 30), better="lower")
        row("  read amplification (read / needed)", read_u / need, read_d / need, better="lower")
    modes = [m for m in ("thread", "process") if f"ucp_async_{m}_1_blocked_s" in worst]
    for mode in modes:
        for step, text in (("1", "first call"), ("n", "later calls")):
            row(f"async_save {mode}, {text}: blocked (s)", worst[f"ucp_async_{mode}_{step}_blocked_s"],
                worst[f"dcp_async_{mode}_{step}_blocked_s"], fmt="{:.3f}", better="lower")
            row(f"async_save {mode}, {text}: until durable (s)", worst[f"ucp_async_{mode}_{step}_total_s"],
                worst[f"dcp_async_{mode}_{step}_total_s"], better="lower")
        row(f"async_save {mode}, first call after prepare_async (s)", worst[f"ucp_async_{mode}_p_blocked_s"],
            worst[f"dcp_async_{mode}_1_blocked_s"], fmt="{:.3f}", better="lower")
    if "ucp_save_s" in worst:
        raw = worst["raw_save_s"]
        lines.append(f"ceiling, save: each rank writes its bytes to its own file, write + fsync: {raw:.2f} s "
                     f"({gib / raw:.2f} GiB/s); ucp reaches {100 * raw / worst['ucp_save_s']:.0f}% of it, DCP "
                     f"{100 * raw / worst['dcp_save_s']:.0f}%; 1.5x DCP would need {worst['dcp_save_s'] / 1.5:.2f} s "
                     f"({'within' if worst['dcp_save_s'] / 1.5 >= raw else 'BELOW'} the ceiling); DCP's "
                     f"FileSystemWriter fsyncs by default: sync_files={_dcp_fsyncs()}")
    if modes:
        lines.append(f"ceiling, staging: copying each rank's bytes into fresh memory {worst['copy_fresh_s']:.3f} s, "
                     f"into mapped memory {worst['copy_warm_s']:.3f} s")
    for mode in modes:
        if "ucp_save_s" not in worst:
            break
        sync_s = worst["ucp_save_s"]
        f1, fn, fp = (worst[f"ucp_async_{mode}_{k}_blocked_s"] / sync_s for k in ("1", "n", "p"))
        lines.append(f"ucp async_save {mode} blocks {100 * f1:.1f}% (first call) / {100 * fp:.1f}% (first call after "
                     f"prepare_async, which took {worst[f'ucp_async_{mode}_prepare_s']:.3f} s) / {100 * fn:.1f}% "
                     f"(later calls) of ucp's synchronous save; the copy alone is "
                     f"{100 * worst['copy_fresh_s'] / sync_s:.1f}% (fresh) / "
                     f"{100 * worst['copy_warm_s'] / sync_s:.1f}% (mapped) of it")
    for label in ("same", "reshard"):
        if label + "_loads_equal" in rs[0]:
            lines.append(f"{label} loads agree bit for bit: {all(r[label + '_loads_equal'] for r in rs)}; "
                         f"ucp load matches the saved tensor: {all(r[label + '_load_correct'] for r in rs)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="logical size of the state (default 1.0)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions; the best one counts (default 3)")
    ap.add_argument("--dir", default="/tmp/bench_dist", help="scratch folder (emptied first)")
    ap.add_argument("--json", default=None, help="also write the per-rank figures here")
    ap.add_argument("--parts", default="save,load,async",
                    help="what to measure, comma-separated: save, load (needs save), async (default: all)")
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
