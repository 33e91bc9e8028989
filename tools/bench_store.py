"""Store write/read throughput and single-row/column reads, side by side with the peers, in one run.

    python tools/bench_store.py --gib 2 --out bench-out/store.json
    python tools/bench_store.py --gib 0.5 --repeats 3 --chunk-kib 1024,256 --lean   # fits a shared 2-core box

Reads are interleaved (every reader once per round, best of ``--repeats``): ucp's local read path, the
same reads through TensorStore (``config.override(local_read=False)``), a raw read of the same bytes into fresh memory,
torch.load and safetensors; ratios are printed against torch.load, the raw read, the raw read into
page-aligned memory, and that read followed by crc32c over every 1 MiB on all cores (what a read that
checks every chunk costs at the least). ``--chunk-kib`` adds
stores with other inner-chunk targets (the chunk policy's choice).

Peers on the same tensors: torch.save / torch.load(weights_only=True), safetensors save_file /
load_file, and for the partial reads safetensors ``get_slice`` and loading the whole file.
Every write is followed by fsync of what it wrote (ucp's TensorStore writes fsync themselves), so
the figures compare durable writes. Reads run twice: with the page cache dropped (cold; needs root,
skipped otherwise) and warm. No assertion here: the figures go in the closing note.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import ucp_store
from ucp_store import config, dtypes
from ucp_store.io import format as fmt
from ucp_store.io.crc import value as crc_value
from ucp_store.io.location import Location


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def touch(out: dict) -> dict:
    for v in out.values():
        float(v.reshape(-1).view(torch.uint8)[::4096].sum())
    return out


def ceilings(tensors, work: str, cold: bool) -> dict:
    """What this machine's disk and memory allow for the same bytes: one raw file written and fsynced
    and read back into fresh memory, and the same tensors written and read through TensorStore alone
    (our layout and codecs, no catalog, no hashing)."""
    res: dict = {}
    raw = os.path.join(work, "raw.bin")

    def raw_write():
        with open(raw, "wb", buffering=0) as f:
            for t in tensors.values():
                f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
            os.fsync(f.fileno())

    res["raw_write_fsync_s"], _ = timed(raw_write)
    ctx = fmt.make_context()
    loc = Location.parse(os.path.join(work, "ts-only"))
    loc.ensure_root()

    layouts = [fmt.plan_layout(tuple(t.shape), dtypes.zarr_name(t.dtype)) for t in tensors.values()]

    def ts_write():
        futures = []
        for i, (t, layout) in enumerate(zip(tensors.values(), layouts)):
            h = fmt.create_array(loc, f"arrays/x/{i}.zarr", layout, ctx)
            futures.append(h.write(dtypes.to_numpy(t)))
        for f in futures:
            f.result()

    def ts_read():
        handles = [fmt.open_array(loc, f"arrays/x/{i}.zarr", layout, ctx) for i, layout in enumerate(layouts)]
        return [f.result() for f in [h.read() for h in handles]]

    res["tensorstore_only_write_s"], _ = timed(ts_write)
    for mode in (["cold"] if cold else []) + ["warm"]:
        for key, fn in (("raw_read_s", lambda: np.fromfile(raw, dtype=np.uint8)),
                        ("tensorstore_only_read_s", ts_read)):
            if mode == "cold":
                drop_caches()
            else:
                fn()
            res[f"{key}_{mode}"], _ = timed(fn)
    os.remove(raw)
    shutil.rmtree(os.path.join(work, "ts-only"), ignore_errors=True)
    return res


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def make_tensors(gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A training-state-like mix: 3/4 fp32 masters/moments, 1/4 bf16 weights, 64 MiB each."""
    g = torch.Generator().manual_seed(seed)
    n = max(4, int(round(gib * 16)))  # 64 MiB tensors
    out = {}
    for i in range(n):
        if i % 4 == 3:
            out[f"layers.{i}.weight.bf16"] = torch.randn(4096, 8192, generator=g).bfloat16()
        else:
            out[f"layers.{i}.weight"] = torch.randn(4096, 4096, generator=g)
    return out


def bench_full(tensors, work: str, cold: bool, repeats: int = 3, chunk_targets: tuple[int, ...] = ()) -> dict:
    from safetensors.torch import load_file, save_file

    total = sum(t.numel() * t.element_size() for t in tensors.values())
    res: dict = {"bytes": total}

    # ucp
    store_dir = os.path.join(work, "store")
    store = ucp_store.open_store(store_dir, create=True)
    t_w, ck = timed(lambda: store.save("bench", 1, tensors))
    res["ucp_write_s"] = t_w

    def ucp_read():
        c = store.checkpoint("bench@1")
        return c.state_dict("weight")

    # torch
    pt = os.path.join(work, "state.pt")

    def torch_save():
        torch.save(tensors, pt)
        fd = os.open(pt, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    res["torch_save_s"], _ = timed(torch_save)

    # safetensors
    sf = os.path.join(work, "state.safetensors")

    def st_save():
        save_file(tensors, sf)
        fd = os.open(sf, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    res["safetensors_save_s"], _ = timed(st_save)

    # the same bytes as one raw file, read back into fresh memory: the ceiling a reader that checks
    # nothing could reach
    raw = os.path.join(work, "raw.bin")
    with open(raw, "wb", buffering=0) as f:
        for t in tensors.values():
            f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))

    def ucp_read_tensorstore():
        with config.override(local_read=False):  # localread.open_reader then picks TensorStore
            return ucp_read()

    # the same state saved with other inner-chunk targets (the chunk policy's choice), read the same way
    others = {}
    for target in chunk_targets:
        if target == store.settings["chunk_target_bytes"]:
            continue
        other = ucp_store.open_store(os.path.join(work, f"store-{target}"), create=True, chunk_target_bytes=target)
        t_w, _ = timed(lambda other=other: other.save("bench", 1, tensors))
        res[f"ucp_write_chunks_{target >> 10}KiB_s"] = t_w
        others[f"ucp_read_chunks_{target >> 10}KiB_s"] = (lambda o=other: o.checkpoint("bench@1").state_dict("weight"))

    def raw_aligned():
        # the same raw read into fresh memory placed on a page boundary: the kernel's copy runs at full
        # speed (np.fromfile's buffer sits 16 bytes into a page, a distance at which this CPU's copy is
        # 20-30x slower: localread._BAD_DISTANCE)
        n = os.path.getsize(raw)
        buf = np.empty(n + 4096, np.uint8)
        skip = -buf.ctypes.data % 4096
        with open(raw, "rb", buffering=0) as f:
            f.readinto(memoryview(buf[skip:skip + n]))
        return {"raw": torch.from_numpy(buf[skip:skip + n])}

    def raw_aligned_crc():
        # the page-aligned raw read, then crc32c over every 1 MiB of it (the default inner chunk), on the
        # machine's cores: what a read that checks every chunk's crc32c costs at the least
        out = raw_aligned()
        flat = out["raw"].numpy()
        step = 1 << 20
        pieces = [flat[i:i + step] for i in range(0, flat.size, step)]
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(crc_value, pieces))
        return out

    readers = {
        "ucp_read_s": ucp_read,
        **others,
        "ucp_read_tensorstore_s": ucp_read_tensorstore,
        "raw_read_fresh_s": lambda: {"raw": torch.from_numpy(np.fromfile(raw, dtype=np.uint8))},
        "raw_read_fresh_aligned_s": raw_aligned,
        "raw_read_fresh_aligned_crc32c_s": raw_aligned_crc,
        "torch_load_s": lambda: torch.load(pt, weights_only=True),
        "safetensors_load_s": lambda: load_file(sf),
    }
    # interleaved (every reader once per round), best of ``repeats`` rounds: the machine is shared
    for mode in (["cold"] if cold else []) + ["warm"]:
        for _ in range(repeats if mode == "warm" else max(1, repeats // 2)):
            for key, fn in readers.items():
                if mode == "cold":
                    drop_caches()
                elif f"{key}_{mode}" not in res:
                    fn()  # warm the page cache
                # touch every 4 KiB page inside the timed region, so lazily mapped readers (safetensors
                # mmap) pay for all of their bytes too
                t, out = timed(lambda fn=fn: touch(fn()))
                res[f"{key}_{mode}"] = min(t, res.get(f"{key}_{mode}", math.inf))
                del out
    os.remove(raw)
    ref = ucp_store.open_store(store_dir).checkpoint("bench@1")
    for name, t in list(tensors.items())[:3]:
        assert torch.equal(ref.read(name, "weight").view(torch.uint8), t.view(torch.uint8)), name
    res["disk_bytes"] = {"ucp": _du(store_dir), "torch": os.path.getsize(pt), "safetensors": os.path.getsize(sf)}
    return res


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def bench_partial(work: str, cold: bool, repeats: int = 5, chunk_targets: tuple[int, ...] = (1 << 20,),
                  calls: int = 50, lean: bool = False) -> dict:
    """One row and one column of a 256 MiB fp32 parameter; held handles timed per call (mean of ``calls``
    calls, best of ``repeats`` interleaved rounds)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = torch.randn(8192, 8192)
    name = "big.weight"
    store = ucp_store.open_store(os.path.join(work, "store-partial"), create=True)
    store.save("p", 1, {name: w}, state="fp32")
    sf = os.path.join(work, "big.safetensors")
    save_file({name: w}, sf)
    pt = os.path.join(work, "big.pt")
    torch.save({name: w}, pt)
    row, col = 4097, 4097
    info = store.checkpoint("p@1").info(name, "fp32")
    layout = fmt.ArrayLayout.from_catalog(info.dtype, info.shape, info.chunk_shape, info.shard_shape, info.codecs)
    chunk_bytes = math.prod(layout.chunk_shape) * layout.itemsize
    row_box = ((row, row + 1), (0, 8192))
    col_box = ((0, 8192), (col, col + 1))

    def ucp_row():
        return ucp_store.open_store(store.location.url).checkpoint("p@1").tensor(name, "fp32")[row]

    def ucp_col():
        return ucp_store.open_store(store.location.url).checkpoint("p@1").tensor(name, "fp32")[:, col]

    # the same reads through a handle that is already open (catalog looked up, array opened once), as a
    # training job or an inspection loop holds it; the case above pays open_store + catalog query per read
    handle = ucp_store.open_store(store.location.url).checkpoint("p@1").tensor(name, "fp32")
    with config.override(local_read=False):  # the same handle on the TensorStore path (localread.open_reader)
        ts_handle = ucp_store.open_store(store.location.url).checkpoint("p@1").tensor(name, "fp32")
        ts_handle.ts()

    # the same parameter saved with other inner-chunk targets (the chunk policy's choice)
    by_target = {}
    for target in chunk_targets:
        if target == store.settings["chunk_target_bytes"]:
            continue
        s = ucp_store.open_store(os.path.join(work, f"store-partial-{target}"), create=True, chunk_target_bytes=target)
        s.save("p", 1, {name: w}, state="fp32")
        by_target[target] = s.checkpoint("p@1").tensor(name, "fp32")

    # a store held open (engine and compiled SQL cached), each read resolving the reference again
    held = ucp_store.open_store(store.location.url)

    def ucp_row_held():
        return held.checkpoint("p@1").tensor(name, "fp32")[row]

    # TensorStore alone on the same array (no ucp code), and on a copy whose inner chunks are single
    # rows (32 KiB): the per-read floor of TensorStore, whatever the chunking
    ctx = fmt.make_context()
    ts_same = fmt.open_array(store.location, info.array, layout, ctx)
    row_layout = fmt.ArrayLayout(layout.dtype, layout.shape, (1, 8192), layout.shard_shape, "none")
    ts_rows = None if lean else fmt.create_array(store.location, "arrays/x/rows.zarr", row_layout, ctx)
    if ts_rows is not None:
        ts_rows.write(w.numpy()).result()

    def ts_row_same():
        return torch.from_numpy(ts_same[row].read().result())

    def ts_row_1row_chunks():
        return torch.from_numpy(ts_rows[row].read().result())

    def st_row():
        with safe_open(sf, "pt") as f:
            return f.get_slice(name)[row:row + 1, :].clone()

    def st_col():
        with safe_open(sf, "pt") as f:
            return f.get_slice(name)[:, col:col + 1].clone()

    st_file = safe_open(sf, "pt")  # held open, as the 0.04 ms figure

    def st_row_held():
        return st_file.get_slice(name)[row:row + 1, :]

    def st_col_held():
        return st_file.get_slice(name)[:, col:col + 1]

    def whole_row():
        return torch.load(pt, weights_only=True)[name][row].clone()

    def whole_col():
        return torch.load(pt, weights_only=True)[name][:, col].clone()

    cases = {"ucp_row": ucp_row, "ucp_col": ucp_col, "ucp_row_held_store": ucp_row_held,
             "ucp_row_open": lambda: handle[row], "ucp_col_open": lambda: handle[:, col],
             "ucp_row_open_tensorstore_path": lambda: ts_handle[row],
             "ucp_col_open_tensorstore_path": lambda: ts_handle[:, col],
             **{f"ucp_row_open_chunks_{t >> 10}KiB": (lambda h=h: h[row]) for t, h in by_target.items()},
             **{f"ucp_col_open_chunks_{t >> 10}KiB": (lambda h=h: h[:, col]) for t, h in by_target.items()},
             "tensorstore_only_row": ts_row_same, "tensorstore_only_row_32KiB_chunks": ts_row_1row_chunks,
             "safetensors_row": st_row, "safetensors_col": st_col,
             "safetensors_row_held": st_row_held, "safetensors_col_held": st_col_held,
             "torch_load_row": whole_row, "torch_load_col": whole_col}
    if lean:  # the goal's cases only: held handles on both read paths and held safetensors
        cases = {k: v for k, v in cases.items() if "open" in k or k.endswith("_held") or k == "tensorstore_only_row"}
    cheap = {k for k in cases if "open" in k or "held" in k or "tensorstore_only" in k}
    res: dict = {"param_bytes": w.numel() * 4, "chunk_shape": list(layout.chunk_shape),
                 "chunk_shapes_by_target": {t >> 10: list(h.info.chunk_shape) for t, h in by_target.items()}}
    for mode in (["cold"] if cold else []) + ["warm"]:
        for _ in range(repeats if mode == "warm" else 2):
            for key, fn in cases.items():  # interleaved rounds: every case once per round
                if mode == "cold":
                    drop_caches()
                    n = 1
                else:
                    fn()
                    n = calls if key in cheap else 1
                t0 = time.perf_counter()
                for _ in range(n):
                    out = fn()
                t = (time.perf_counter() - t0) / n
                res[f"{key}_{mode}_s"] = min(t, res.get(f"{key}_{mode}_s", math.inf))
                expect = w[row] if "row" in key else w[:, col]
                assert torch.equal(out.reshape(-1), expect.reshape(-1)), key
    res["bytes_read"] = {
        "ucp_row": sum(1 for _ in layout.chunks_touching(row_box)) * chunk_bytes,
        "ucp_col": sum(1 for _ in layout.chunks_touching(col_box)) * chunk_bytes,
        "safetensors_row": 8192 * 4,
        "safetensors_col_pages": 8192 * 4096,  # one 4 KiB page per row through mmap
        "torch_load": os.path.getsize(pt),
    }
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--out", default="bench-out/store.json")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the best of each is kept")
    ap.add_argument("--chunk-kib", default="1024", help="inner-chunk targets to compare, e.g. 1024,256,128")
    ap.add_argument("--lean", action="store_true",
                    help="partial reads: only held handles (both ucp paths) and held safetensors, 20 calls each")
    args = ap.parse_args()
    os.environ.setdefault("UCP_PROGRESS", "0")
    targets = tuple(int(k) << 10 for k in args.chunk_kib.split(","))
    work = tempfile.mkdtemp(prefix="ucp-bench-", dir=args.workdir)
    cold = not args.no_cold and drop_caches()
    try:
        tensors = make_tensors(args.gib)
        full = bench_full(tensors, work, cold, repeats=args.repeats, chunk_targets=targets)
        full.update(ceilings(tensors, work, cold))
        del tensors
        partial = bench_partial(work, cold, repeats=max(args.repeats, 5), chunk_targets=targets,
                                calls=20 if args.lean else 50, lean=args.lean)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = full["bytes"] / 1e9
    print(f"\n== full state: {full['bytes'] / 2**30:.2f} GiB, {os.cpu_count()} cores, cold cache: "
          f"{'yes' if cold else 'no (cannot drop caches here)'} ==")
    print(f"{'':34}{'seconds':>9}{'GB/s':>8}{'vs torch':>10}")
    for key in [k for k in full if k.endswith("_s") and ("write" in k or "save" in k)]:
        base = full["torch_save_s"]
        print(f"{key:34}{full[key]:9.2f}{gb / full[key]:8.2f}{base / full[key]:9.2f}x")
    for mode in ("cold", "warm"):
        if f"ucp_read_s_{mode}" not in full:
            continue
        print(f"-- reads, {mode} cache (interleaved, best of {args.repeats}); ratios: vs torch.load, vs raw read, "
              "vs raw read page-aligned, vs that + crc32c of every 1 MiB (the checked-read ceiling)")
        for k in [k for k in full if k.endswith(f"_s_{mode}")]:
            print(f"{k:38}{full[k]:9.2f}{gb / full[k]:8.2f}{full[f'torch_load_s_{mode}'] / full[k]:9.2f}x"
                  f"{full[f'raw_read_fresh_s_{mode}'] / full[k]:9.2f}x"
                  f"{full[f'raw_read_fresh_aligned_s_{mode}'] / full[k]:9.2f}x"
                  f"{full[f'raw_read_fresh_aligned_crc32c_s_{mode}'] / full[k]:9.2f}x")
    print(f"disk bytes: {full['disk_bytes']}")
    print(f"\n== one row / one column of a 256 MiB fp32 parameter (chunks {partial['chunk_shape']}, others "
          f"{partial['chunk_shapes_by_target']}); ratio vs safetensors' held get_slice ==")
    for k, v in partial.items():
        if k.endswith("_s"):
            mode = "cold" if k.endswith("_cold_s") else "warm"
            peer = partial.get(f"safetensors_{'col' if '_col' in k else 'row'}_held_{mode}_s")
            print(f"{k:46}{v * 1e6:11.1f} us{v / peer:9.2f}x")
    print(f"bytes read: {partial['bytes_read']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"full": full, "partial": partial, "cores": os.cpu_count(), "cold_cache": cold}, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
