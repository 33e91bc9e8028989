"""Benchmark: ucp_store's DCP storage backend against DCP's FileSystemWriter / FileSystemReader (issue 29).

    .venv/bin/python tools/bench_dcp_storage.py [--mb 128,1024] [--tensors 16] [--world 2] [--repeat 3] [--dir DIR]

``world`` gloo ranks (plain processes) hold the same state: ``tensors`` 2-D fp32 DTensors of ``mb`` MiB in
all, sharded by rows (``Shard(0)``). In one run, each figure the best of ``repeat``, every rank timed
between barriers (the slowest rank counts):

- ``ceiling``: each rank writes its shard bytes to its own file with ``write`` + ``fsync``;
- ``checked ceiling``: the same, plus the work the format asks of every byte (each chunk gathered from
  the source in the store's chunk shape, its crc32c, the content hash's unit digests), in one thread;
- ``save``: ``dcp.save`` through ``FileSystemWriter`` and through ``UcpStorageWriter`` (a new version
  each time), as a fraction of the ceiling;
- ``resharded load``: into the same tensors sharded by columns (``Shard(1)``), with ``FileSystemReader``
  and ``UcpStorageReader``: time, and read amplification = bytes the rank read (``/proc/self/io``
  ``rchar``: every read system call, page cache included) / bytes of its shards; and the reverse (a save
  sharded by columns, loaded by rows): read amplification of both readers;
- ``async_save``: how long ``dcp.async_save`` (thread executor) blocks the caller, for both writers.

Page cache: warm (each figure the best of several runs); the ceiling writes and fsyncs as the saves do.
Every method, the ceiling included, writes new files each time, after its previous save was removed
(untimed): the steady state of a job with retention. A file rewritten in place (``O_TRUNC``) frees its
pages inside the timed write and got them back at once, which made the ceiling cheaper than any save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _timed(fn, dist) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _state(spec, mesh, placement):
    import torch
    from torch.distributed.tensor import distribute_tensor

    rows = 1024
    cols = max(1, spec["mb"] * (1 << 20) // 4 // spec["tensors"] // rows)
    out = {}
    for i in range(spec["tensors"]):
        g = torch.Generator().manual_seed(i)
        full = torch.rand(rows, cols, generator=g) if placement is not None else torch.zeros(rows, cols)
        out[f"layers.{i}.weight"] = distribute_tensor(full, mesh, [placement] if placement is not None else None)
    return out


def _rank(rank, spec, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(spec["world"]))
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from ucp_store.formats.dcp.storage import UcpStorageReader, UcpStorageWriter
    from ucp_store.io import format as fmt
    from ucp_store.io.crc import value as crc32c

    dist.init_process_group("gloo", rank=rank, world_size=spec["world"])
    mesh = init_device_mesh("cpu", (spec["world"],))
    sd = {"model": _state(spec, mesh, Shard(0))}
    local = [t.to_local() for t in sd["model"].values()]
    local_np = {k: v.to_local().numpy() for k, v in sd["model"].items()}
    offsets = [rank * (v.shape[0] // spec["world"]) for v in sd["model"].values()]
    mine = sum(t.numel() * t.element_size() for t in local)
    d = spec["dir"]
    store = os.path.join(d, "store")
    res: dict = {"bytes_per_rank": mine}
    step = iter(range(1, 10_000))

    def ceiling():
        with open(os.path.join(d, f"ceil{rank}.bin"), "xb") as f:
            for t in local:
                f.write(memoryview(t.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    scratch = np.empty(mine, np.uint8)
    chunks: dict[str, tuple[int, ...]] = {}  # the chunk shape the store chose for each tensor (after a ucp save)

    def checked_ceiling():
        """The ceiling plus the work the format asks of every byte: each chunk gathered from the source, its
        crc32c, the content hash's unit digests (``format.box_unit_digests``, the writers' own); one file,
        one write, one fsync."""
        pos, digests = 0, {}
        for (name, t), row0 in zip(sd["model"].items(), offsets):
            a = local_np[name]
            c0, c1 = chunks[name]
            for i in range(0, a.shape[0], c0):
                for j in range(0, a.shape[1], c1):
                    tile = a[i:i + c0, j:j + c1]
                    dst = scratch[pos:pos + tile.nbytes].view(a.dtype).reshape(tile.shape)
                    np.copyto(dst, tile)
                    crc32c(dst)
                    pos += tile.nbytes
            fmt.box_unit_digests("float32", tuple(t.shape), (row0, 0), a, digests)
        with open(os.path.join(d, f"ceil{rank}.bin"), "xb") as f:
            f.write(memoryview(scratch[:pos]))
            f.flush()
            os.fsync(f.fileno())

    def fs_save():
        dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(d, "fs")))

    def ucp_save():
        dcp.save(sd, storage_writer=UcpStorageWriter(store, run="b", step=next(step)))

    def drop_last(fn):
        """Untimed, before each save: remove the method's previous save. A training job with retention runs
        in this steady state, and every method, the ceiling included, then writes new files into pages
        just freed (a file rewritten in place, or written while old ones pile up, costs another amount)."""
        if rank != 0:
            return
        if fn is ceiling or fn is checked_ceiling:
            for p in (os.path.join(d, f"ceil{r}.bin") for r in range(spec["world"])):
                if os.path.exists(p):
                    os.unlink(p)
        elif fn is fs_save:
            shutil.rmtree(os.path.join(d, "fs"), ignore_errors=True)
        elif os.path.isdir(store):
            from ucp_store import open_store

            s = open_store(store)
            for v in s.list_checkpoints("b"):
                s.rm(v["id"], force=True)
            s.gc()

    def timed(fn):
        if fn is not checked_ceiling:  # it runs after the ucp saves: the state must stay their last one's
            fresh()
        drop_last(fn)
        return _timed(fn, dist)

    def fresh():  # a training step changes the state: no save is deduplicated against the last one
        for t in local:
            t.view(-1)[0] += 1.0

    rep = range(spec["repeat"])
    res["ceiling_s"] = min(timed(ceiling) for _ in rep)
    res["dcp_save_s"] = min(timed(fs_save) for _ in rep)
    res["ucp_save_s"] = min(timed(ucp_save) for _ in rep)
    from ucp_store import open_store

    chunks.update({i.name: tuple(i.chunk_shape) for i in open_store(store).checkpoint("b@latest").tensors()})
    res["checked_ceiling_s"] = min(timed(checked_ceiling) for _ in rep)
    target = {"model": _state(spec, mesh, None)}
    target = {"model": {k: v.redistribute(mesh, [Shard(1)]) for k, v in target["model"].items()}}
    need = sum(t.to_local().numel() * 4 for t in target["model"].values())
    for name, make in (("dcp", lambda: FileSystemReader(os.path.join(d, "fs"))),
                       ("ucp", lambda: UcpStorageReader(store, "b@latest"))):
        best, amp = None, None
        for _ in rep:
            r0 = _rchar()
            t = _timed(lambda make=make: dcp.load(target, storage_reader=make()), dist)
            if best is None or t < best:
                best, amp = t, (_rchar() - r0) / need
        res[f"{name}_load_s"], res[f"{name}_load_amp"] = best, amp
    check = {k: v.full_tensor() for k, v in target["model"].items()}
    res["load_exact"] = all(torch.equal(check[k], sd["model"][k].full_tensor()) for k in check)
    # the reverse: saved by columns (TP Shard(1)), loaded by rows (FSDP Shard(0))
    cols = {"model": {k: v.redistribute(mesh, [Shard(1)]) for k, v in sd["model"].items()}}
    fs_cols = os.path.join(d, "fs_cols")
    dcp.save(cols, storage_writer=FileSystemWriter(fs_cols))
    dcp.save(cols, storage_writer=UcpStorageWriter(store, run="c", step=1))
    rows = {"model": {k: v.redistribute(mesh, [Shard(0)]) for k, v in target["model"].items()}}
    for name, make in (("dcp", lambda: FileSystemReader(fs_cols)), ("ucp", lambda: UcpStorageReader(store, "c@1"))):
        r0 = _rchar()
        dcp.load(rows, storage_reader=make())
        res[f"{name}_reverse_amp"] = (_rchar() - r0) / need
    for name in ("dcp", "ucp"):
        blocks = []
        for _ in rep:
            w = (FileSystemWriter(os.path.join(d, f"async{next(step)}")) if name == "dcp"
                 else UcpStorageWriter(store, run="a", step=next(step)))
            for t in local:
                t.view(-1)[0] += 1.0
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, storage_writer=w, async_checkpointer_type=AsyncCheckpointerType.THREAD)
            blocks.append(time.perf_counter() - t0)
            fut.result()
            dist.barrier()
        res[f"{name}_async_block_s"] = min(blocks)
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def _one_size(args, mb: int, d: str) -> dict:
    """Run the ranks for one state size; the slowest rank's figures."""
    from ucp_test_helpers import free_port

    os.makedirs(d, exist_ok=True)
    spec = {"mb": mb, "tensors": args.tensors, "world": args.world, "repeat": args.repeat, "dir": d,
            "out": os.path.join(d, "out")}
    os.makedirs(spec["out"], exist_ok=True)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), json.dumps(spec), str(port)])
             for r in range(args.world)]
    rcs = [p.wait() for p in procs]
    if any(rcs):
        raise SystemExit(f"ranks failed: {rcs}")
    ranks = [json.load(open(os.path.join(spec["out"], f"rank{r}.json"))) for r in range(args.world)]
    worst = {k: max(r[k] for r in ranks) for k in ranks[0] if k.endswith("_s") or k.endswith("_amp")}
    worst["exact"] = all(r["load_exact"] for r in ranks)
    worst["total_mb"] = sum(r["bytes_per_rank"] for r in ranks) / (1 << 20)
    return worst


def _report(args, w: dict) -> None:
    print(f"{args.world} gloo ranks, {w['total_mb']:.0f} MiB of fp32 in {args.tensors} row-sharded tensors, best of "
          f"{args.repeat}, slowest rank:")
    print(f"  ceiling (write+fsync per rank) {w['ceiling_s']:.3f} s; with the format's checks (chunk gather, "
          f"crc32c, unit digests) {w['checked_ceiling_s']:.3f} s = {w['ceiling_s'] / w['checked_ceiling_s']:.2f}x")
    for name in ("dcp", "ucp"):
        print(f"  {name} save {w[f'{name}_save_s']:.3f} s = {w['ceiling_s'] / w[f'{name}_save_s']:.2f}x of the "
              f"ceiling, {w['checked_ceiling_s'] / w[f'{name}_save_s']:.2f}x of the checked one")
    print(f"  resharded load (rows -> columns): dcp {w['dcp_load_s']:.3f} s (read amplification "
          f"{w['dcp_load_amp']:.2f}), ucp {w['ucp_load_s']:.3f} s ({w['ucp_load_amp']:.2f}): "
          f"ucp {w['dcp_load_s'] / w['ucp_load_s']:.2f}x DCP; bit-exact: {w['exact']}")
    print(f"  reverse (columns -> rows) read amplification: dcp {w['dcp_reverse_amp']:.2f}, "
          f"ucp {w['ucp_reverse_amp']:.2f}")
    print(f"  async_save (thread) blocks: dcp {w['dcp_async_block_s'] * 1e3:.1f} ms, ucp "
          f"{w['ucp_async_block_s'] * 1e3:.1f} ms", flush=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        _rank(int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", default="128,1024", help="state size in MiB; a comma list runs each size in turn and "
                                                     "ends with a table (default: a small and a 1 GiB state)")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed)")
    args = ap.parse_args()
    sizes = [int(x) for x in str(args.mb).split(",") if x.strip()]
    d = args.dir or tempfile.mkdtemp(prefix="ucp-bench-dcp-")
    rows = []
    try:
        for mb in sizes:
            w = _one_size(args, mb, os.path.join(d, f"{mb}mb"))
            _report(args, w)
            rows.append((mb, w))
            if not args.dir:  # the next size starts from pages this one freed, as each save does
                shutil.rmtree(os.path.join(d, f"{mb}mb"), ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(d, ignore_errors=True)
    if len(rows) > 1:
        print("\n| state | ceiling | checked ceiling / ceiling | DCP save / ceiling | ucp save / ceiling | "
              "ucp save / checked ceiling | resharded load: ucp vs DCP | read amplification (DCP, ucp) | "
              "async_save blocks (DCP, ucp) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for mb, w in rows:
            print(f"| {mb} MiB | {w['ceiling_s']:.3f} s | {w['ceiling_s'] / w['checked_ceiling_s']:.2f}x | "
                  f"{w['ceiling_s'] / w['dcp_save_s']:.2f}x | {w['ceiling_s'] / w['ucp_save_s']:.2f}x | "
                  f"{w['checked_ceiling_s'] / w['ucp_save_s']:.2f}x | {w['dcp_load_s'] / w['ucp_load_s']:.2f}x | "
                  f"{w['dcp_load_amp']:.2f}, {w['ucp_load_amp']:.2f} | {w['dcp_async_block_s'] * 1e3:.0f} ms, "
                  f"{w['ucp_async_block_s'] * 1e3:.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
