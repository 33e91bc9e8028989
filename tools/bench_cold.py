"""Cold-cache whole reads, interleaved (page cache dropped before every read; needs root), best of N rounds:

- ucp ``state_dict`` on the local path: the large arrays read several at once on localread's stream
  pool, each shard file read in file order as one stream (``read_streamed``),
- the ceilings: a raw read of the same bytes from ONE file into fresh memory; a raw read of ucp's own shard
  files (same files, same extents on disk) into fresh memory, one after another and 8 at once; and the
  job's own ceiling, those 8-at-once reads each followed by a crc32c over the file's bytes (what checking
  every chunk costs on top of the raw read, nothing else),
- ``torch.load`` and safetensors' ``load_file`` of the same tensors,

with ratios against the raw read of one file and ``torch.load``, each case's round-to-round spread
(slowest / fastest round), median, and the disk's read requests (count, mean size) in the median round.
The disk here is shared: absolute figures swing 2-4x from round to round, so read best-of and medians side
by side, never one round.

    .venv/bin/python tools/bench_cold.py --gib 0.5 --rounds 8
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("UCP_PROGRESS", "0")

import bench_store  # noqa: E402

import ucp_store
from ucp_store.io.crc import value as _crc


def _diskstats() -> tuple[int, int]:
    """(read requests completed, sectors read) summed over whole disks (not partitions)."""
    reqs = sectors = 0
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                p = line.split()
                name = p[2]
                if os.path.exists(f"/sys/block/{name}") and not name.startswith(("loop", "ram")):
                    reqs += int(p[3])
                    sectors += int(p[5])
    except OSError:
        pass
    return reqs, sectors


def _read_and_crc(path: str) -> np.ndarray:
    """The job's ceiling per file: its bytes into fresh memory and one crc32c over them (the same bytes
    every chunk's check covers, plus the small index), nothing else."""
    data = np.fromfile(path, np.uint8)
    _crc(data)
    return data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    from safetensors.torch import load_file, save_file

    work = tempfile.mkdtemp(prefix="ucp-cold-")
    try:
        tensors = bench_store.make_tensors(args.gib)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        store = ucp_store.open_store(os.path.join(work, "s"), create=True)
        store.save("c", 1, tensors)
        shards = sorted(glob.glob(os.path.join(work, "s", "arrays", "*", "*.zarr", "c", "**"), recursive=True))
        shards = [p for p in shards if os.path.isfile(p)]
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
        pool = ThreadPoolExecutor(8)

        def ucp():
            return ucp_store.open_store(store.location.url).checkpoint("c@1").state_dict("weight")

        cases = {"ucp state_dict": ucp,
                 "raw read, one file": lambda: np.fromfile(raw, np.uint8),
                 "raw read, ucp's files": lambda: [np.fromfile(p, np.uint8) for p in shards],
                 "raw read, ucp's files, 8 thr": lambda: list(pool.map(lambda p: np.fromfile(p, np.uint8), shards)),
                 "raw read + crc32c, 8 thr": lambda: list(pool.map(_read_and_crc, shards)),
                 "torch.load": lambda: torch.load(pt, weights_only=True),
                 "safetensors load_file": lambda: load_file(sf)}
        times: dict[str, list[float]] = {k: [] for k in cases}
        io: dict[str, list[tuple[int, int]]] = {k: [] for k in cases}
        for r in range(args.rounds):
            for k, fn in cases.items():
                bench_store.drop_caches()
                d0 = _diskstats()
                t0 = time.perf_counter()
                out = fn()
                bench_store.touch(out) if isinstance(out, dict) else None
                dt = time.perf_counter() - t0
                d1 = _diskstats()
                del out
                times[k].append(dt)
                io[k].append((d1[0] - d0[0], d1[1] - d0[1]))
                print(r, k, f"{dt:.3f} s", flush=True)
        pool.shutdown()
        best = {k: min(v) for k, v in times.items()}
        raw_best, torch_best = best["raw read, one file"], best["torch.load"]
        print(f"\ncold cache, {nbytes / 2**30:.2f} GiB, best of {args.rounds} interleaved rounds, "
              f"{os.cpu_count()} cores; spread = slowest / fastest round;\n"
              "reqs, KiB/req: the disk's read requests and their mean size (the median round)")
        print(f"{'':30}{'best s':>8}{'GB/s':>7}{'vs raw':>8}{'vs torch.load':>14}{'median s':>9}{'spread':>8}"
              f"{'reqs':>6}{'KiB/req':>8}")
        for k, v in times.items():
            med = sorted(v)[len(v) // 2]
            reqs, sectors = sorted(io[k])[len(v) // 2]
            print(f"{k:30}{best[k]:8.3f}{nbytes / best[k] / 1e9:7.2f}{raw_best / best[k]:7.2f}x"
                  f"{torch_best / best[k]:13.2f}x{med:9.3f}{max(v) / min(v):7.2f}x{reqs:6d}"
                  f"{sectors * 512 / 1024 / max(reqs, 1):8.0f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
