"""Held-handle row read of a 256 MiB fp32 parameter (the writing tree's default chunks), before (main) vs after, side by
side: processes alternate between the two trees on ONE store; in each, every case is timed interleaved
(mean of 200 calls, best of 7 rounds): ucp held handle h[row], safetensors held get_slice, and the ceiling
of a crc-checked row read at this chunking (the store's CRC32C library over the row's chunk, already in
memory; crc32c where installed, else google_crc32c).

    git archive 2d4a9d7 | tar -x -C /tmp/before          # the tree to compare against
    BEFORE=/tmp/before .venv/bin/python tools/bench_row_ab.py 3   # rounds (processes per tree)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

py = sys.executable
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
trees = {"before": os.environ["BEFORE"], "after": HERE}
child = r'''
import sys, os, time, json
sys.path.insert(0, os.environ["T"]); os.environ["UCP_PROGRESS"] = "0"
import numpy as np, torch, google_crc32c, ucp_store
try:
    import crc32c
    crc = crc32c.crc32c
except ImportError:
    crc = google_crc32c.value
from safetensors import safe_open
S = os.environ["S"]
store = ucp_store.open_store(S + "/store")
h = store.checkpoint("p@1").tensor("w", "fp32")
stf = safe_open(S + "/w.safetensors", "pt")
row = 4097
w = stf.get_tensor("w")
cb = 4 * int(np.prod(h.info.chunk_shape))  # the row's chunk: its bytes in memory, as the ceiling reads them
mib = np.fromfile(S + "/w.safetensors", np.uint8, cb, offset=4096)
cases = {"ucp_row_held": lambda: h[row], "safetensors_row_held": lambda: stf.get_slice("w")[row:row + 1, :],
         "ceiling_crc32c_chunk": lambda: crc(mib)}
res = {}
for r in range(7):
    for k, f in cases.items():
        f(); n = 200
        t = time.perf_counter()
        for _ in range(n): out = f()
        res[k] = min(res.get(k, 1e9), (time.perf_counter() - t) / n)
        if k != "ceiling_crc32c_chunk":
            assert torch.equal(out.reshape(-1), w[row])
print(json.dumps(res))
'''
S = tempfile.mkdtemp()
mk = r'''
import sys, os, torch
sys.path.insert(0, os.environ["T"]); os.environ["UCP_PROGRESS"] = "0"
import ucp_store
from safetensors.torch import save_file
w = torch.randn(8192, 8192, generator=torch.Generator().manual_seed(0))
s = ucp_store.open_store(sys.argv[1] + "/store", create=True); s.save("p", 1, {"w": w}, state="fp32")
save_file({"w": w}, sys.argv[1] + "/w.safetensors")
print(s.checkpoint("p@1").tensor("w", "fp32").info.chunk_shape)
'''
made = subprocess.run([py, "-c", mk, S], check=True, capture_output=True, text=True, env={**os.environ, "T": HERE})
print("chunks", made.stdout.strip())
res = {}
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for r in range(rounds):
    for name, t in trees.items():
        out = subprocess.run([py, "-c", child], env={"T": t, "S": S, "PATH": "/usr/bin:/bin"}, capture_output=True,
                             text=True)
        if out.returncode:
            print(out.stderr)
            sys.exit(1)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        print(r, name, {k: round(v * 1e6, 1) for k, v in got.items()}, flush=True)
        for k, v in got.items():
            res[(name, k)] = min(res.get((name, k), 1e9), v)
        res.setdefault((name, "ratios"), []).append(got["ucp_row_held"] / got["safetensors_row_held"])
print(f"\nheld row read, us (best over {rounds} process rounds); ratio = ucp / safetensors held, in the same process")
print(f"{'tree':24}{'ucp row':>10}{'st held':>10}{'crc chunk':>10}{'ucp/st':>8}{'ceiling/st':>11}")
for name in trees:
    u, st, c = (res[(name, k)] for k in ("ucp_row_held", "safetensors_row_held", "ceiling_crc32c_chunk"))
    print(f"{name:24}{u*1e6:10.1f}{st*1e6:10.1f}{c*1e6:10.1f}{u/st:8.2f}{c/st:11.2f}   per-process ucp/st: "
          + ", ".join(f"{x:.2f}" for x in res[(name, "ratios")]))
shutil.rmtree(S, ignore_errors=True)
