"""Does compression pay on training state? Ratio and write/read throughput per codec, in one run.

    python tools/bench_compression.py --mib 256 --out bench-out/compression.json

The state imitates real training tensors: bf16 weights ~ N(0, 0.02), fp32 masters of the same values,
exp_avg ~ N(0, 1e-3) and exp_avg_sq ~ (N(0, 1e-3))^2 (small positive, narrow exponents: the case
compression likes best). Codecs: none, zstd(3), blosc(zstd, byte shuffle). The store's default is
chosen from these figures (see the closing note / README).
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


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def states(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = max(1, (mib << 20) // (4 * 4096 * 4))
    w = torch.randn(rows, 4096, generator=g) * 0.02
    m = torch.randn(rows, 4096, generator=g) * 1e-3
    return {"weight.bf16": w.bfloat16(), "fp32": w, "exp_avg": m, "exp_avg_sq": m * m}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--out", default="bench-out/compression.json")
    args = ap.parse_args()
    os.environ.setdefault("UCP_PROGRESS", "0")
    tensors = states(args.mib)
    work = tempfile.mkdtemp(prefix="ucp-comp-")
    rows = []
    try:
        for comp in ("none", "zstd", "blosc"):
            for name, t in tensors.items():
                path = os.path.join(work, f"{comp}-{name}")
                store = ucp_store.open_store(path, create=True, compression=comp)
                t0 = time.perf_counter()
                store.save("c", 1, {name: t})
                wt = time.perf_counter() - t0
                ck = store.checkpoint("c@1")
                t0 = time.perf_counter()
                back = ck.read(name, "weight")
                rt = time.perf_counter() - t0
                assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))
                nbytes = t.numel() * t.element_size()
                stored = du(os.path.join(path, "arrays"))
                rows.append({"codec": comp, "tensor": name, "dtype": str(t.dtype).removeprefix("torch."),
                             "bytes": nbytes, "stored": stored, "ratio": nbytes / stored,
                             "write_GBps": nbytes / wt / 1e9, "read_GBps": nbytes / rt / 1e9})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'codec':7}{'tensor':13}{'dtype':10}{'ratio':>7}{'write GB/s':>12}{'read GB/s':>11}")
    for r in rows:
        print(f"{r['codec']:7}{r['tensor']:13}{r['dtype']:10}{r['ratio']:7.3f}{r['write_GBps']:12.2f}{r['read_GBps']:11.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
