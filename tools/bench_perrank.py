"""Benchmark: what the per-rank content check (issue 28) adds to a ``ucp_store.distributed.save`` of the demo's state.

    python tools/bench_perrank.py --ranks 4 --reps 5 --dir /tmp/bench_perrank

Starts ``--ranks`` gloo processes holding the state ``ucp demo`` saves (its GPT, ``ModelConfig(seq=32,
vocab=8192)``, on a TP=2 x DP=2 mesh for 4 ranks, DP for other counts: FSDP2/TP DTensors, the optimizer's
step counters as plain tensors) plus per-rank RNG states and a dataloader position. Each repetition trains
one step (so nothing is deduplicated) and saves twice, with the content check on and off
(``perrank.CONTENT_CHECK``), the first of the pair alternating. Reported:

- ``digest``: seconds each rank spends digesting its plain tensors and values, wall and thread CPU time
  (the check's own work; its digests ride in save's existing planning gather, so it adds no collective);
- ``save on`` / ``save off``: the slowest rank's save time, best of the repetitions;
- the ratios ``digest / save off`` (medians; the goal: under 1%) and ``save on / save off`` (best of each;
  noisy on a busy host, where descheduling inflates the digest's wall time too: its CPU time is the steadier
  figure).

``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    import ucp_store.distributed as ucpd
    from ucp_store.demo import model as M
    from ucp_store.distributed import perrank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    tp = 2 if args.ranks % 2 == 0 and args.ranks >= 4 else 1
    dp = args.ranks // tp
    cfg = M.ModelConfig(seq=32, vocab=8192)
    model = M.build_model(cfg, seed=0)
    mesh = M.make_mesh(tp=tp, dp=dp, device_type="cpu")
    model = M.parallelize(model, mesh, tp=tp, dp=dp)
    opt = M.build_optimizer(model)
    gen = torch.Generator().manual_seed(1000 + rank)

    spent = {"digest": 0.0, "digest_cpu": 0.0}
    real_t, real_v = perrank.digest_tensor, perrank.digest_value

    def timed(fn):
        def wrapper(x):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(x)
            finally:
                spent["digest"] += time.perf_counter() - t0
                spent["digest_cpu"] += time.thread_time() - c0
        return wrapper

    perrank.digest_tensor, perrank.digest_value = timed(real_t), timed(real_v)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rows = []
    for rep in range(args.reps):
        M.train_step(model, opt, *M.batch(cfg, rep + 1, dp_rank=rank // tp, dp=dp))
        torch.rand(3, generator=gen)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "rng": {"cpu": torch.get_rng_state(), "gen": gen.get_state()},
                 "dataloader": {"pos": (rep + 1) * cfg.batch_size // dp, "dp_rank": rank // tp}}
        times = {}
        for check in ((True, False) if rep % 2 == 0 else (False, True)):
            perrank.CONTENT_CHECK = check
            spent["digest"] = spent["digest_cpu"] = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            ucpd.save(state, store=args.store, run="on" if check else "off", step=rep, progress=False, mesh=mesh)
            times[check] = (time.perf_counter() - t0, spent["digest"], spent["digest_cpu"])
        rows.append({"on": times[True][0], "off": times[False][0], "digest": times[True][1],
                     "digest_cpu": times[True][2]})
    every: list = [None] * args.ranks
    dist.all_gather_object(every, rows)
    if rank == 0:
        queue.put(every)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default="/tmp/bench_perrank")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    args.store = os.path.join(args.dir, "store")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, args, port, queue)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    every = queue.get(timeout=1800)
    for proc in procs:
        proc.join()
    reps = len(every[0])
    on = [max(every[r][i]["on"] for r in range(args.ranks)) for i in range(reps)]
    off = [max(every[r][i]["off"] for r in range(args.ranks)) for i in range(reps)]
    digest = [max(every[r][i]["digest"] for r in range(args.ranks)) for i in range(reps)]
    cpu = [max(every[r][i]["digest_cpu"] for r in range(args.ranks)) for i in range(reps)]
    out = {"ranks": args.ranks, "save_on_s": on, "save_off_s": off, "digest_s": digest, "digest_cpu_s": cpu,
           "digest_over_save": statistics.median(digest) / statistics.median(off),
           "digest_cpu_over_save": statistics.median(cpu) / statistics.median(off),
           "save_on_over_off": min(on) / min(off)}
    print(f"{args.ranks} ranks, demo state, {reps} repetitions (slowest rank each)")
    print(f"  save, content check on : best {min(on) * 1e3:8.2f} ms  median {statistics.median(on) * 1e3:8.2f} ms")
    print(f"  save, content check off: best {min(off) * 1e3:8.2f} ms  median {statistics.median(off) * 1e3:8.2f} ms")
    print(f"  digests (the check)    : median {statistics.median(digest) * 1e3:8.3f} ms wall, "
          f"{statistics.median(cpu) * 1e3:8.3f} ms CPU (thread time: without the waits a busy host adds)")
    print(f"  digest / save (medians): {out['digest_over_save'] * 100:.3f}% wall, "
          f"{out['digest_cpu_over_save'] * 100:.3f}% CPU   (goal < 1%)")
    print(f"  save on / save off     : {out['save_on_over_off']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    sys.exit(0)


if __name__ == "__main__":
    main()
