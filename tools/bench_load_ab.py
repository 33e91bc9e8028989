"""A/B of whole loads, source trees alternated process by process: each case is one fresh process (torch
and ucp_store imported, then timed) loading bench_planner's end-to-end model (``--layers`` layers with
small dimensions: every tensor-state its own array, 100 layers = 10,008 arrays) from one store:
``load_shard`` of the last rank of each of bench_planner's topologies, and ``state_dict`` of every state.
With ``--cold`` (root) the page cache is dropped before every process, so each load also waits on the
disk. Both trees read the same store (written by this tree: the format is the same); the figure is us per
read (per tensor for state_dict), the median of ``--rounds`` processes, and before/after.

    git archive 837db11 | tar -x -C /tmp/before            # the tree to compare against
    .venv/bin/python tools/bench_load_ab.py /tmp/before --rounds 5
    .venv/bin/python tools/bench_load_ab.py /tmp/before --rounds 3 --cold --cases 1,2,4,sd
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "tools"))

CHILD = r'''
import sys, os, time, json
sys.path.insert(0, os.environ["T"]); os.environ["UCP_PROGRESS"] = "0"
import torch, ucp_store, ucp_store.io.read
from ucp_store.topology import Topology
sys.path.insert(0, os.path.join(os.environ["H"], "tools"))
from bench_planner import _topologies
store = ucp_store.open_store(os.environ["S"])
ck = store.checkpoint("real@1")
case = os.environ["K"]
if case == "sd":
    name = "state_dict, every state"
    t0 = time.perf_counter()
    n = sum(len(ck.state_dict(s)) for s in ("weight", "fp32", "exp_avg", "exp_avg_sq"))
    t1 = time.perf_counter()
else:
    name, t = _topologies(int(os.environ["L"]))[int(case)]
    t0 = time.perf_counter(); sh = ck.load_shard(t, t.world_size - 1); t1 = time.perf_counter()
    n = sh.plan.num_reads
print(json.dumps([name, (t1 - t0) / n, n]))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before", help="the source tree to compare against (a git archive of a commit)")
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every process (root)")
    ap.add_argument("--cases", default="0,1,2,3,4,5,sd", help="bench_planner topology indexes, and sd")
    args = ap.parse_args()
    import bench_store
    import torch
    from bench_planner import model_records

    import ucp_store

    os.environ["UCP_PROGRESS"] = "0"
    work = tempfile.mkdtemp(prefix="ucp-load-ab-")
    try:
        dims = dict(h=64, heads=8, kv_heads=8, head_dim=8, ffn=256, experts=8, expert_ffn=32, vocab=4096)
        store = ucp_store.open_store(os.path.join(work, "s"), create=True)
        g = torch.Generator().manual_seed(0)
        with store.begin("real", 1) as w:
            for r in model_records(args.layers, **dims):
                x = torch.randn(*r["shape"], generator=g)
                w.write(r["name"], r["state"], x.bfloat16() if r["state"] == "weight" else x, pattern=r["pattern"])
        store.catalog.close()
        if args.cold and not bench_store.drop_caches():
            raise SystemExit("--cold needs root (it drops the page cache)")
        trees = {"before": os.path.abspath(args.before), "after": HERE}
        cases = args.cases.split(",")
        res: dict[tuple[str, str], list[float]] = {}
        names: dict[str, tuple[str, int]] = {}
        for r in range(args.rounds):
            for k in cases:
                for who, tree in trees.items():
                    if args.cold:
                        bench_store.drop_caches()
                    env = {**os.environ, "T": tree, "H": HERE, "K": k, "L": str(args.layers),
                           "S": os.path.join(work, "s")}
                    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
                    if out.returncode:
                        raise SystemExit(f"{who} {k}: {out.stderr[-3000:]}")
                    name, per, n = json.loads(out.stdout.strip().splitlines()[-1])
                    names[k] = (name, n)
                    res.setdefault((k, who), []).append(per)
                    print(r, who, name, f"{per * 1e6:.1f} us", flush=True)
        mode = "cold (page cache dropped)" if args.cold else "warm"
        print(f"\n{mode}, fresh process per load, median of {args.rounds}; us per read (per tensor for state_dict)")
        print(f"{'case (last rank)':40}{'reads':>8}{'before':>9}{'after':>9}{'before/after':>14}")
        for k in cases:
            b = sorted(res[(k, "before")])[args.rounds // 2]
            a = sorted(res[(k, "after")])[args.rounds // 2]
            print(f"{names[k][0]:40}{names[k][1]:>8,}{b * 1e6:9.1f}{a * 1e6:9.1f}{b / a:14.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
