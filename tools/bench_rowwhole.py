"""Row read (held handle) at 1 MiB / 256 KiB / 128 KiB inner chunks vs safetensors held get_slice, and whole warm
reads (state_dict) of the same 256 MiB fp32 param vs torch.load and raw reads; interleaved, best of N rounds.

    .venv/bin/python tools/bench_rowwhole.py . 6             # this tree
    .venv/bin/python tools/bench_rowwhole.py /tmp/old-tree 6 # another checkout (git archive REV ucp_store), same files
"""

import os
import sys
import time

sys.path.insert(0, sys.argv[1])
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ucp_store

os.environ["UCP_PROGRESS"] = "0"
W = "/tmp/rd/focus"
ROW = 4097


def make_files(w: torch.Tensor) -> tuple[str, str, str, dict]:
    """The param as safetensors, torch.save and raw bytes, and as a store per chunk size (made once)."""
    os.makedirs(W, exist_ok=True)
    sf, pt, raw = f"{W}/w.safetensors", f"{W}/w.pt", f"{W}/raw.bin"
    if not os.path.exists(raw):
        save_file({"w": w}, sf)
        torch.save({"w": w}, pt)
        w.numpy().tofile(raw)
    handles = {}
    for kib in (1024, 256, 128):
        d = f"{W}/s{kib}"
        if not os.path.exists(d + "/done"):
            s = ucp_store.open_store(d, create=True, chunk_target_bytes=kib << 10)
            s.save("p", 1, {"w": w}, state="fp32")
            open(d + "/done", "w").close()
        handles[kib] = ucp_store.open_store(d).checkpoint("p@1").tensor("w", "fp32")
    return sf, pt, raw, handles


def raw_aligned(raw: str) -> np.ndarray:
    n = os.path.getsize(raw)
    buf = np.empty(n + 4096, np.uint8)
    k = -buf.ctypes.data % 4096
    with open(raw, "rb", buffering=0) as f:
        f.readinto(memoryview(buf[k:k + n]))
    return buf[k:k + n]


def main() -> None:
    w = torch.randn(8192, 8192, generator=torch.Generator().manual_seed(0))
    sf, pt, raw, hs = make_files(w)
    stf = safe_open(sf, "pt")
    rows = {f"ucp_row_{k}K": (lambda h=h: h[ROW]) for k, h in hs.items()}
    rows["safetensors_row_held"] = lambda: stf.get_slice("w")[ROW:ROW + 1, :]
    whole = {f"ucp_whole_{k}K": (lambda k=k: ucp_store.open_store(f"{W}/s{k}").checkpoint("p@1").state_dict("fp32"))
             for k in hs}
    whole.update({"torch_load": lambda: torch.load(pt, weights_only=True),
                  "raw_fromfile": lambda: np.fromfile(raw, np.uint8), "raw_aligned": lambda: raw_aligned(raw)})
    res: dict[str, float] = {}
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 5):
        for k, fn in rows.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(200):
                out = fn()
            res[k] = min(res.get(k, 1e9), (time.perf_counter() - t0) / 200)
            assert torch.equal(out.reshape(-1), w[ROW])
        for k, fn in whole.items():
            fn()
            t0 = time.perf_counter()
            out = fn()
            res[k] = min(res.get(k, 1e9), time.perf_counter() - t0)
            del out
    st = res["safetensors_row_held"]
    for k in rows:
        print(f"{k:24} {res[k] * 1e6:9.1f} us  {res[k] / st:5.2f}x safetensors held")
    for k in whole:
        print(f"{k:24} {res[k] * 1e3:9.1f} ms  {0.25 / res[k] * 1.074:5.2f} GB/s  "
              f"torch.load/this {res['torch_load'] / res[k]:5.2f}  "
              f"raw_fromfile/this {res['raw_fromfile'] / res[k]:5.2f}  "
              f"raw_aligned/this {res['raw_aligned'] / res[k]:5.2f}")


if __name__ == "__main__":
    main()
