"""Resharding end to end on a real store: plan time vs load time of the same rank, read amplification.

    python tools/bench_reshard.py --layers 4 --out bench-out/reshard.json

A Llama-like model (vocab-padded embedding, fused QKV with GQA, row-parallel output, fused SwiGLU with
uneven widths for tp=3, row-parallel down projection, norms; fp32 masters, both Adam moments and bf16
weights) is written rank by rank from a source topology through ``CheckpointWriter.write_shard``, the
chunk grid aligned to the declared targets. Then for TP 1 -> 8, 8 -> 2 and 4 -> 3 (uneven) the target's
rank 0 is planned (pure, no I/O) and loaded (the local read path into preallocated tensors, and the same
plan through TensorStore beside it), and the
read amplification (bytes of whole chunks read / bytes needed) is taken from the plan. A store written
without declared targets (power-of-two policy only) shows what alignment buys for 4 -> 3.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import ucp_store
from ucp_store import config
from ucp_store import patterns as pat
from ucp_store.plan.planner import plan as make_plan
from ucp_store.topology import Topology

H, KV, F, V = 768, 192, 2000, 8000
F3 = [667, 667, 666]


def model(layers: int):
    params = [("embedding.weight", {"kind": "vocab", "dim": 0, "original_size": V}, (V, H))]
    for i in range(layers):
        p = f"layers.{i}."
        params += [
            (p + "input_norm.weight", {"kind": "replicated"}, (H,)),
            (p + "attn.qkv.weight", {"kind": "fused", "dim": 0, "sizes": [H, KV, KV]}, (H + 2 * KV, H)),
            (p + "attn.o.weight", {"kind": "partitioned", "dim": 1}, (H, H)),
            (p + "post_norm.weight", {"kind": "replicated"}, (H,)),
            (p + "mlp.gate_up.weight", {"kind": "fused", "dim": 0, "sizes": [F, F], "widths": {"3": [F3, F3]}},
             (2 * F, H)),
            (p + "mlp.down.weight", {"kind": "partitioned", "dim": 1, "widths": {"3": F3}}, (H, F)),
        ]
    params.append(("final_norm.weight", {"kind": "replicated"}, (H,)))
    return params


def write_store(path: str, source: Topology, targets: list[Topology], layers: int, *, run: str = "m",
                create: bool = True) -> tuple[float, int]:
    store = ucp_store.open_store(path, create=create)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    nbytes = 0
    with store.begin(run, 1) as w:
        for name, p, shape in model(layers):
            for state in ("fp32", "exp_avg", "exp_avg_sq", "weight"):
                full = torch.randn(*shape, generator=g)
                if state == "weight":
                    full = full.bfloat16()
                nbytes += full.numel() * full.element_size()
                for rank in range(source.world_size):  # each source rank writes its own shard
                    lay = pat.local_layout(p, shape, source, rank)
                    local = torch.zeros(lay.shape, dtype=full.dtype)
                    for c in lay.copies:
                        local[c.local.slices()] = full[c.logical.slices()]
                    w.write_shard(name, state, local, shape=shape, pattern=p, topology=source, rank=rank,
                                  targets=targets)
    return time.perf_counter() - t0, nbytes


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def measure(path: str, target: Topology, rank: int, repeats: int = 3) -> dict:
    ck = ucp_store.open_store(path).checkpoint("m@1")
    infos = ck.tensors()
    plan_times = []
    for _ in range(repeats):
        t = time.perf_counter()
        p = make_plan(infos, target, rank)
        plan_times.append(time.perf_counter() - t)
    from ucp_store.io.read import execute

    cold = None
    if drop_caches():
        t = time.perf_counter()
        execute(ck, p)
        cold = time.perf_counter() - t
    load_times, ts_times = [], []
    for _ in range(repeats):  # interleaved: the local read path, then the TensorStore path (local_read=False)
        t = time.perf_counter()
        shard = execute(ck, p)
        load_times.append(time.perf_counter() - t)
        with config.override(local_read=False):
            t = time.perf_counter()
            ts_shard = execute(ck, p)
            ts_times.append(time.perf_counter() - t)
        for key, tensor in shard.tensors.items():
            assert torch.equal(tensor.view(torch.uint8) if tensor.dim() else tensor,
                               ts_shard.tensors[key].view(torch.uint8) if tensor.dim() else ts_shard.tensors[key]), key
        for key, buf in shard.buffers.items():
            assert torch.equal(buf.view(torch.uint8), ts_shard.buffers[key].view(torch.uint8)), key
    plan_t, load_t = min(plan_times), min(load_times)
    return {"target": target.describe(), "rank": rank, "tensor_states": len(p.tensors),
            "bytes_needed": p.bytes_needed, "bytes_read": p.bytes_read,
            "read_amplification": p.read_amplification, "plan_s": plan_t, "load_warm_s": load_t,
            "load_cold_s": cold, "plan_over_load": plan_t / (cold or load_t), "bytes_loaded": shard.bytes_read,
            "load_warm_tensorstore_s": min(ts_times), "reads": p.num_reads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default="bench-out/reshard.json")
    args = ap.parse_args()
    os.environ.setdefault("UCP_PROGRESS", "0")
    work = tempfile.mkdtemp(prefix="ucp-reshard-")
    every = [Topology(tp=t) for t in (1, 2, 3, 4, 8)]
    cases = [("TP 1 -> 8", Topology(tp=1), Topology(tp=8), every),
             ("TP 8 -> 2", Topology(tp=8), Topology(tp=2), every),
             ("TP 4 -> 3 (uneven)", Topology(tp=4), Topology(tp=3), every),
             ("TP 4 -> 3, no declared targets", Topology(tp=4), Topology(tp=3), []),
             ("TP 2 -> 4 + ZeRO-1 dp=2", Topology(tp=2), Topology(tp=4, dp=2, zero_stage=1), every)]
    rows = []
    try:
        stores: dict = {}
        for label, src, tgt, targets in cases:
            key = (src, tuple(targets))
            if key not in stores:
                path = os.path.join(work, f"s{len(stores)}")
                write_s, nbytes = write_store(path, src, targets, args.layers)
                stores[key] = path
                print(f"wrote {nbytes / 2**20:.0f} MiB from {src.describe()} in {write_s:.1f} s")
            r = measure(stores[key], tgt, 0)
            r["case"] = label
            rows.append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nload: the local read path; TS load: the same plan through TensorStore (local_read=False), interleaved,"
          " best of 3; us/read: warm load time / reads")
    print(f"\n{'case':34}{'states':>7}{'reads':>6}{'needed MiB':>11}{'ampl.':>7}{'plan ms':>9}{'load ms':>9}"
          f"{'TS load ms':>11}{'us/read':>8}{'TS us/read':>11}{'cold ms':>9}{'plan/load':>10}")
    for r in rows:
        cold = f"{r['load_cold_s'] * 1e3:9.1f}" if r["load_cold_s"] else f"{'-':>9}"
        print(f"{r['case']:34}{r['tensor_states']:7d}{r['reads']:6d}{r['bytes_needed'] / 2**20:11.1f}"
              f"{r['read_amplification']:7.3f}{r['plan_s'] * 1e3:9.2f}{r['load_warm_s'] * 1e3:9.1f}"
              f"{r['load_warm_tensorstore_s'] * 1e3:11.1f}{r['load_warm_s'] / r['reads'] * 1e6:8.0f}"
              f"{r['load_warm_tensorstore_s'] / r['reads'] * 1e6:11.0f}{cold}{r['plan_over_load'] * 100:9.2f}%")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
