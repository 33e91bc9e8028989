"""Per-read cost of load_shard (bench_planner.per_read_seconds: 1000 arrays of 64 KiB, a ZeRO-3 rank), interleaved:
the local path with small reads overlapped, the local path one read at a time, TensorStore (UCP_LOCAL_READ=0).

    .venv/bin/python tools/bench_perread.py 3     # rounds; best of each kept
"""
import os, sys
from concurrent.futures import ThreadPoolExecutor
_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_here, "..")); sys.path.insert(0, _here)
import bench_planner
from ucp_store import io
res = {}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    for mode in ("local-pool", "local-serial", "tensorstore"):
        os.environ.pop("UCP_LOCAL_READ", None)
        if mode == "tensorstore":
            os.environ["UCP_LOCAL_READ"] = "0"
        io._SMALL_INFLIGHT_BYTES = 0 if mode == "local-serial" else (64 << 20)  # 0: each read completes before the next
        s = bench_planner.per_read_seconds(1000)
        res[mode] = min(res.get(mode, 1e9), s)
        print(r, mode, f"{s * 1e6:.1f} us/read", flush=True)
print({k: round(v * 1e6, 1) for k, v in res.items()})
print("ts/local-pool", round(res["tensorstore"] / res["local-pool"], 2), " local-serial/local-pool", round(res["local-serial"] / res["local-pool"], 2))
