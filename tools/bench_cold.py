"""Cold-cache whole reads, interleaved (page cache dropped before every read; needs root), best of N rounds:
ucp state_dict on the local path with and without the per-file WILLNEED prefetch (``localread._prefetch``),
a raw read of the same bytes into fresh memory (the ceiling), torch.load and safetensors' load_file.

    .venv/bin/python tools/bench_cold.py --gib 0.5 --rounds 2
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("UCP_PROGRESS", "0")

import bench_store  # noqa: E402

import ucp_store  # noqa: E402
from ucp_store import localread  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from safetensors.torch import load_file, save_file

    work = tempfile.mkdtemp(prefix="ucp-cold-")
    try:
        tensors = bench_store.make_tensors(args.gib)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        store = ucp_store.open_store(os.path.join(work, "s"), create=True)
        store.save("c", 1, tensors)
        pt, sf, raw = (os.path.join(work, n) for n in ("t.pt", "t.safetensors", "raw.bin"))
        torch.save(tensors, pt)
        save_file(tensors, sf)
        with open(raw, "wb") as f:
            for t in tensors.values():
                f.write(memoryview(t.view(torch.uint8).numpy().reshape(-1)))
        del tensors
        if not bench_store.drop_caches():
            print("cannot drop the page cache here (not root): no cold figure")
            return
        willneed = localread._WILLNEED

        def ucp(prefetch: bool):
            def run():
                localread._WILLNEED = willneed if prefetch else None
                return ucp_store.open_store(store.location.url).checkpoint("c@1").state_dict("weight")
            return run

        cases = {"ucp_state_dict (WILLNEED)": ucp(True), "ucp_state_dict (no prefetch)": ucp(False),
                 "raw read (fresh memory)": lambda: np.fromfile(raw, np.uint8),
                 "torch.load": lambda: torch.load(pt, weights_only=True), "safetensors load_file": lambda: load_file(sf)}
        best: dict[str, float] = {}
        for r in range(args.rounds):
            for k, fn in cases.items():
                bench_store.drop_caches()
                t0 = time.perf_counter()
                out = fn()
                bench_store.touch(out) if isinstance(out, dict) else None
                dt = time.perf_counter() - t0
                best[k] = min(best.get(k, 1e9), dt)
                print(r, k, f"{dt:.3f} s", flush=True)
        localread._WILLNEED = willneed
        print(f"\ncold cache, {nbytes / 2**30:.2f} GiB, best of {args.rounds} interleaved rounds, {os.cpu_count()} cores")
        print(f"{'':32}{'s':>8}{'GB/s':>8}{'vs raw':>8}{'vs torch.load':>14}")
        for k, v in best.items():
            print(f"{k:32}{v:8.3f}{nbytes / v / 1e9:8.2f}{best['raw read (fresh memory)'] / v:8.2f}x"
                  f"{best['torch.load'] / v:13.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
