"""Per-read cost of load_shard (bench_planner.per_read_seconds: 1000 arrays of 64 KiB, a ZeRO-3 rank), interleaved:
the local path with small reads batched onto the pool, the same with the per-process held readers dropped
before every load (a process's first load: every array's read state built, every shard index read), the
local path one read at a time, and TensorStore (``config.override(local_read=False)``).

    .venv/bin/python tools/bench_perread.py 3     # rounds; best of each kept
"""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_here, ".."))
sys.path.insert(0, _here)
import bench_planner

from ucp_store import config
from ucp_store.io import read as io

res = {}
real_per_read = bench_planner.per_read_seconds
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    for mode in ("local", "local-first-load", "local-serial", "tensorstore"):
        config.set(local_read=mode != "tensorstore")
        io._SMALL_INFLIGHT_BYTES = 0 if mode == "local-serial" else (64 << 20)  # 0: each batch completes at once
        io._BATCH_READS = 1 if mode == "local-serial" else 64
        io._held.clear()
        s = bench_planner.per_read_seconds(1000, fresh=mode == "local-first-load")
        res[mode] = min(res.get(mode, 1e9), s)
        print(r, mode, f"{s * 1e6:.1f} us/read", flush=True)
print({k: round(v * 1e6, 1) for k, v in res.items()})
print("tensorstore/local", round(res["tensorstore"] / res["local"], 2),
      " tensorstore/local-first-load", round(res["tensorstore"] / res["local-first-load"], 2),
      " local-serial/local", round(res["local-serial"] / res["local"], 2))
