"""Benchmark: the content hash's throughput (``format.py``, "content hashes": tiles of an N-d grid).

    python tools/bench_hash.py                      # a whole 256 MiB fp32 tensor [8192, 8192]
    python tools/bench_hash.py --shape 4096,4096 --dtype bfloat16 --reps 7

Every figure is GB/s of the tensor's bytes, best of ``--reps``, by wall clock and by the thread's CPU time
(the steadier figure on a busy host):

- ``xxh3 stream``: one xxh3-128 over the C-order bytes (the ceiling: no units at all);
- ``contiguous units``: xxh3-128 of every 256 KiB piece of the C-order stream, digests combined: what a whole
  tensor cost under the replaced ``xxh3-128-units:`` scheme (its units were contiguous whole rows);
- ``tiles, whole``: ``content_hash`` of the whole array (tiles gathered a few MiB at a time);
- ``tiles, 4 MiB pieces``: ``ContentHasher`` fed flat 4 MiB pieces (blocks split across pieces are buffered;
  ``verify`` and the read-back feed slabs like this);
- ``write() snapshot``: the writer's copy of the tensor hashed piece by piece (``CheckpointWriter._snapshot``),
  next to ``copy only`` (the copy without a hash);
- ``TP column shards``: ``box_unit_digests`` of the 4 column shards (``Shard(1)``, tp=4), each from a
  contiguous local tensor as a rank holds it; every tile is digested, none is left to read back.

``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import xxhash

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ucp_store.io import format as fmt

_CARRIERS = {1: np.uint8, 2: np.uint16, 4: np.float32, 8: np.float64}


def _best(fn, reps: int, nbytes: int) -> tuple[float, float]:
    wall = cpu = math.inf
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.thread_time() - c0)
    return nbytes / wall / 1e9, nbytes / max(cpu, 1e-9) / 1e9


def _contiguous_units(a: np.ndarray, dtype: str) -> str:
    b = a.reshape(-1).view(np.uint8).data
    h = xxhash.xxh3_128(f"{dtype}:{','.join(map(str, a.shape))};".encode())
    for i in range(0, len(b), fmt.UNIT_BYTES):
        h.update(xxhash.xxh3_128_digest(b[i:i + fmt.UNIT_BYTES]))
    return h.hexdigest()


def _pieces(a: np.ndarray, dtype: str, piece: int) -> str:
    h = fmt.ContentHasher(dtype, a.shape)
    flat = a.reshape(-1)
    step = max(1, piece // a.itemsize)
    for lo in range(0, flat.size, step):
        h.update(flat[lo:lo + step])
    return h.hexdigest()


def _snapshot(a: np.ndarray, dtype: str, copy: np.ndarray, hashed: bool) -> None:
    h = fmt.ContentHasher(dtype, a.shape)
    src, dst = a.reshape(-1), copy.reshape(-1)
    step = h.piece((4 << 20) // a.itemsize) if hashed else (4 << 20) // a.itemsize
    for lo in range(0, src.size, step):
        np.copyto(dst[lo:lo + step], src[lo:lo + step])
        if hashed:
            h.update(dst[lo:lo + step])


def _columns(shards: list[np.ndarray], dtype: str, shape: tuple[int, ...]) -> dict:
    out: dict = {}
    width = shards[0].shape[-1]
    for r, s in enumerate(shards):
        fmt.box_unit_digests(dtype, shape, (0,) * (len(shape) - 1) + (r * width,), s, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8192,8192")
    ap.add_argument("--dtype", default="float32", help="a zarr dtype name (float32, bfloat16, float16, ...)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tp", type=int, default=4, help="column shards for the TP case")
    ap.add_argument("--json")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    from ucp_store import dtypes

    itemsize = dtypes.itemsize(args.dtype)
    rng = np.random.default_rng(0)
    a = rng.integers(0, 255, math.prod(shape) * itemsize, dtype=np.uint8).view(_CARRIERS[itemsize]).reshape(shape)
    nbytes = a.nbytes
    tiles = fmt._Tiles.of(args.dtype, shape)
    print(f"{args.dtype} {list(shape)} ({nbytes / 2**20:.0f} MiB): tile {list(tiles.tile)}, {tiles.count} units, "
          f"block {tiles.tile[tiles.j] * tiles.row_bytes / 2**20:.2f} MiB")
    copy = np.empty_like(a)
    shards = [np.ascontiguousarray(s) for s in np.split(a, args.tp, axis=-1)]
    cases = {
        "xxh3 stream": lambda: xxhash.xxh3_128_digest(a.reshape(-1).view(np.uint8).data),
        "contiguous units": lambda: _contiguous_units(a, args.dtype),
        "tiles, whole": lambda: fmt.content_hash(a, args.dtype),
        "tiles, 4 MiB pieces": lambda: _pieces(a, args.dtype, 4 << 20),
        "copy only": lambda: _snapshot(a, args.dtype, copy, False),
        "write() snapshot": lambda: _snapshot(a, args.dtype, copy, True),
        f"TP column shards (tp={args.tp})": lambda: _columns(shards, args.dtype, shape),
    }
    want = fmt.content_hash(a, args.dtype)
    assert _pieces(a, args.dtype, 4 << 20) == want
    digests = _columns(shards, args.dtype, shape)
    assert not fmt.missing_units(args.dtype, shape, digests) and fmt.units_hash(args.dtype, shape, digests) == want
    out = {}
    for name, fn in cases.items():
        wall, cpu = _best(fn, args.reps, nbytes)
        out[name] = {"wall_gbs": round(wall, 2), "cpu_gbs": round(cpu, 2)}
        print(f"  {name:28s} {wall:6.2f} GB/s wall  {cpu:6.2f} GB/s cpu")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": list(shape), "dtype": args.dtype, "tile": list(tiles.tile), "units": tiles.count,
                       "cases": out}, f, indent=1)


if __name__ == "__main__":
    main()
