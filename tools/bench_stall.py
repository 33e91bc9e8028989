"""How long training stops for a checkpoint (issue 31): blocked time and whole stall per save, 2 gloo ranks.

A training loop (an FSDP2 MLP over 2 CPU ranks, AdamW; sized so that forward plus backward take at least as
long as copying the state) saves every ``--every`` steps with each method:

- ``sync``: ``ucp_store.distributed.save``;
- ``dcp_thread`` / ``dcp_process``: DCP's ``async_save`` (thread and process executors, DCP's own staging);
- ``ucp_eager``: ``ucp_store.distributed.async_save(lazy=False)`` after ``prepare_async`` (copies at the call);
- ``ucp_lazy``: the lazy snapshot (``optimizer=`` gate), writer at niceness 10; ``ucp_lazy_nice0``: the same
  with the writer at the trainer's priority.

Per method (rank 0's clock; the FSDP collectives keep the ranks in step):

- **blocked**: the save call plus what the pre-step gate adds to the next step (``handle.gate_wait_s``);
- **whole stall**: everything the steps around a save took beyond the no-save step time (the median of a
  loop without saves run right before that method's saves), plus the call and the final wait for the save
  to finish, per save.

Output: the per-method figures and the ratios the issue's goals name (lazy blocked / sync save, lazy blocked
/ DCP's blocked, whole stall beside DCP's). The machine may be shared: ratios of one run are what to read.

    .venv/bin/python tools/bench_stall.py                 # defaults: width 1024, 8 layers, batch 64
    .venv/bin/python tools/bench_stall.py --methods sync,ucp_lazy --saves 2
    .venv/bin/python tools/bench_stall.py --isolate --saves 5   # a fresh pair of ranks per method
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
import time

METHODS = ("none", "sync", "dcp_thread", "dcp_process", "ucp_eager", "ucp_lazy", "ucp_lazy_nice0")


def _model(args):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    return model, opt


def _step(model, opt, x) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    return time.perf_counter() - t0


def _sd(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = get_state_dict(model, opt)
    return {"model": m, "optim": o}


def _saver(method, args, store, model, opt):
    """(call(step) -> (blocked call seconds, waiter)): ``waiter()`` returns (gate wait, final wait) seconds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import ucp_store.distributed as ucpd

    def call(step):
        sd = _sd(model, opt)
        t0 = time.perf_counter()
        if method == "sync":
            ucpd.save(sd, store=store, run=method, step=step, progress=False)
            return time.perf_counter() - t0, lambda: (0.0, 0.0)
        if method.startswith("dcp"):
            kind = AsyncCheckpointerType.THREAD if method == "dcp_thread" else AsyncCheckpointerType.PROCESS
            # its own gloo group: DCP's background collectives must not interleave with FSDP's on the default one
            fut = dcp.async_save(sd, checkpoint_id=os.path.join(args.dir, f"{method}-{step}"),
                                 async_checkpointer_type=kind, process_group=dcp_group)
            blocked = time.perf_counter() - t0

            def dcp_wait():
                t1 = time.perf_counter()
                getattr(fut, "upload_completion", fut).result()
                return 0.0, time.perf_counter() - t1
            return blocked, dcp_wait
        lazy = method.startswith("ucp_lazy")
        h = ucpd.async_save(sd, store=store, run=method, step=step, lazy=lazy, optimizer=opt if lazy else None,
                            writer_nice=0 if method in ("ucp_eager", "ucp_lazy_nice0") else 10)
        blocked = time.perf_counter() - t0

        def ucp_wait():
            t1 = time.perf_counter()
            h.result()
            return h.gate_wait_s, time.perf_counter() - t1
        return blocked, ucp_wait

    dcp_group = None
    if method.startswith("dcp"):
        import torch.distributed as dist

        dcp_group = dist.new_group(backend="gloo")
    if method.startswith("ucp"):
        ucpd.prepare_async(_sd(model, opt), optimizer=opt if method.startswith("ucp_lazy") else None)
    return call


def _run_method(method, args, store, model, opt, x, base) -> dict:
    """Warm-up save, then ``--saves`` saves, each followed by ``--every`` steps and a wait for the save."""
    call = _saver(method, args, store, model, opt)
    blocked, calls, whole, steps_after = [], [], [], []
    for k in range(args.saves + 1):
        step = 1000 * (METHODS.index(method) + 1) + k
        b, waiter = call(step)
        times = [_step(model, opt, x) for _ in range(args.every)]
        gate, final = waiter()
        if k == 0:
            continue  # the first save of a method pays its one-time costs (buffers, groups, processes)
        blocked.append(b + gate)
        calls.append(b)
        whole.append(b + final + sum(t - base for t in times))
        steps_after.append(times[0])
    return {"blocked_s": statistics.median(blocked), "call_s": statistics.median(calls),
            "whole_s": statistics.median(whole), "first_step_s": statistics.median(steps_after)}


def _rank_main(rank, args, port) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, opt = _model(args)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    for _ in range(2):
        _step(model, opt, x)
    from torch.distributed.tensor import DTensor

    sd = _sd(model, opt)
    state_bytes = sum((v.to_local() if isinstance(v, DTensor) else v).nbytes
                      for v in _flat(sd) if isinstance(v, torch.Tensor))
    t0 = time.perf_counter()
    for v in _flat(sd):  # what one snapshot copy of this rank's state costs
        if isinstance(v, torch.Tensor):
            (v.to_local() if isinstance(v, DTensor) else v).clone()
    copy_s = time.perf_counter() - t0
    base = statistics.median([_step(model, opt, x) for _ in range(args.base_steps)])
    out = {"rank": rank, "state_bytes": state_bytes, "copy_s": copy_s, "step_s": base, "methods": {}}
    store = os.path.join(args.dir, "store")
    for method in args.methods.split(","):
        if method != "none":
            dist.barrier()
            # the no-save step time next to each method's saves: a shared host drifts over a run
            near = statistics.median([_step(model, opt, x) for _ in range(args.base_steps)])
            out["methods"][method] = {**_run_method(method, args, store, model, opt, x, near), "base_s": near}
    with open(os.path.join(args.dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    import ucp_store.distributed as ucpd

    ucpd.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _flat(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _flat(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flat(v)
    else:
        yield obj


def _report(r: dict) -> str:
    ms = r["methods"]
    lines = [f"state per rank {r['state_bytes'] / 2**20:.0f} MiB, one copy {r['copy_s'] * 1e3:.1f} ms, "
             f"no-save step (forward+backward+step) {r['step_s'] * 1e3:.0f} ms "
             f"({'>=' if r['step_s'] >= r['copy_s'] else '<'} the copy)",
             f"{'method':<16}{'blocked ms':>12}{'(call ms)':>11}{'whole stall ms':>16}{'step after ms':>15}"]
    for m, v in ms.items():
        lines.append(f"{m:<16}{v['blocked_s'] * 1e3:>12.1f}{v['call_s'] * 1e3:>11.1f}{v['whole_s'] * 1e3:>16.1f}"
                     f"{v['first_step_s'] * 1e3:>15.0f}")
    sync = ms.get("sync", {}).get("blocked_s")
    lines.append("ratios (goals: lazy blocked <= 1% of sync, <= 1/10 of DCP's):")
    for lazy in ("ucp_lazy", "ucp_lazy_nice0"):
        if lazy not in ms:
            continue
        b = ms[lazy]["blocked_s"]
        if sync:
            lines.append(f"  {lazy} blocked / sync save       = {b / sync:.4f}")
        for d in ("dcp_thread", "dcp_process"):
            if d in ms:
                lines.append(f"  {lazy} blocked / {d} blocked = {b / ms[d]['blocked_s']:.4f}")
    if sync:
        for m, v in ms.items():
            lines.append(f"  whole stall / sync save: {m:<16}{v['whole_s'] / sync:.3f}")
    return "\n".join(lines)


def _launch(args, methods: str) -> dict:
    """Two rank processes running ``methods`` in order; rank 0's figures."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "UCP_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    common = ["--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch), "--every",
              str(args.every), "--saves", str(args.saves), "--base-steps", str(args.base_steps), "--dir", args.dir,
              "--methods", methods]
    procs = [subprocess.Popen([sys.executable, __file__, *common, "--rank", str(r), "--port", str(port)], env=env)
             for r in range(2)]
    rc = [p.wait() for p in procs]
    if any(rc):
        sys.exit(f"bench_stall: error: a rank failed: exit codes {rc}")
    with open(os.path.join(args.dir, "rank0.json")) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--every", type=int, default=4, help="training steps after each save (default 4)")
    ap.add_argument("--saves", type=int, default=3, help="measured saves per method, after one warm-up (default 3)")
    ap.add_argument("--base-steps", type=int, default=8, help="steps of the no-save loop (default 8)")
    ap.add_argument("--methods", default=",".join(METHODS[1:]))
    ap.add_argument("--dir", default="/tmp/bench_stall", help="scratch folder (emptied first)")
    ap.add_argument("--json", default=None, help="also write rank 0's figures here")
    ap.add_argument("--isolate", action="store_true",
                    help="run each method in its own pair of rank processes (else all in one pair, in order)")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    bad = [m for m in args.methods.split(",") if m not in METHODS]
    if bad:
        sys.exit(f"bench_stall: error: --methods {','.join(bad)}: expected some of {', '.join(METHODS)}")
    if args.rank is not None:
        _rank_main(args.rank, args, args.port)
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    if args.isolate:  # each method in a fresh pair of ranks: what one method leaves behind cannot tax another
        r0: dict = {}
        for m in args.methods.split(","):
            got = _launch(args, m)
            r0 = {**got, "methods": {**r0.get("methods", {}), **got["methods"]}} if r0 else got
    else:
        r0 = _launch(args, args.methods)
    print(_report(r0))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r0, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
