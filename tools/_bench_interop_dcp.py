"""The DCP half of ``tools/bench_interop.py``: ``ucp import dcp`` side by side with DCP's own
``dcp_to_torch_save`` of the same folder, and with the fastest way by hand with the same libraries.

    python tools/bench_interop.py --skip-hf --gib 1.1 --repeats 2      # through the shared driver
    python tools/_bench_interop_dcp.py --gib 1.1 --repeats 2           # this half alone

The source is a real multi-rank DCP folder: four gloo processes (``torch.distributed.run``) on a 2 x 2
(dp x tp) mesh save ``--gib`` GiB of fp32 DTensors (a model's weights and AdamW's two moments, each
sharded ``[Shard(0), Shard(1)]`` so every tensor is four boxes in four rank files) plus non-tensor state,
in the nested ``model.*`` / ``optim.state.*`` layout, with the default ``torch.save`` serialization.

Ways, each repeat on fresh stores and alternating the order (a second import into one store would
deduplicate every array):

- ``ucp import dcp``: ``cli.main(["import", "dcp", ...])``, what the command runs;
- ``dcp_to_torch_save + fsync``: DCP's own converter of the same folder into one ``torch.save`` file;
- ``DCP load + store.save`` (by hand): ``_load_state_dict`` with ``_EmptyStateDictLoadPlanner`` (the
  loading half of ``dcp_to_torch_save``) into memory, then ``store.save`` of the flattened tensors --
  the fastest way to get the folder into a store with the same libraries;
- the ceilings: the folder's data files copied into one file and fsynced, through an 8 MiB buffer and by
  ``copy_file_range`` (``bench_interop.raw_copy`` / ``kernel_copy``): what this machine allows for moving
  these bytes durably, measured in the same run.

Every writer's output is durable (TensorStore fsyncs; the torch file is fsynced). The source was just
written, so all ways read it from the page cache. The table reports the best of the repeats and the
ratio to the fastest way; no assertion here, the figures go in the closing note.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_store import fsync_tree  # noqa: E402  (one copy, beside the store benchmark)

__all__ = ["bench_dcp", "main", "make_source"]

SAVER = r'''
import datetime, math, sys, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
folder, gib = sys.argv[1], float(sys.argv[2])
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
rows, cols = 2048, 4096
per = rows * cols * 4
layers = max(1, math.ceil(gib * (1 << 30) / (3 * per)))
rank = dist.get_rank()
dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
model, state = {}, {}
for i in range(layers):
    for kind in ("weight", "exp_avg", "exp_avg_sq"):
        g = torch.Generator().manual_seed(i * 10 + len(kind) * 100 + rank)
        local = torch.randn(rows // 2, cols // 2, generator=g)
        dt = DTensor.from_local(local, mesh, [Shard(0), Shard(1)], run_check=False)
        if kind == "weight":
            model[f"layers.{i}.w"] = dt
        else:
            state.setdefault(f"layers.{i}.w", {})[kind] = dt
sd = {"model": model, "optim": {"state": state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95),
                                                                  "params": list(model)}]},
      "train_state": {"step": 1000, "tokens": 123456789}}
dcp.save(sd, checkpoint_id=folder)
dist.barrier()
if rank == 0:
    print("LAYERS", layers)
dist.destroy_process_group()
'''


def make_source(folder: str, gib: float) -> int:
    """Write the multi-rank DCP folder with 4 gloo processes; returns its tensor bytes."""
    script = os.path.join(os.path.dirname(folder), "dcp_saver.py")
    with open(script, "w") as f:
        f.write(SAVER)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--master_port",
                          str(29000 + os.getpid() % 900), script, folder, str(gib)], capture_output=True, text=True,
                         env=env, timeout=1200, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"writing the DCP source failed:\n{res.stderr[-3000:]}")
    fsync_tree(folder)
    from ucp_store.formats.dcp.adapter import read_dcp_metadata

    md = read_dcp_metadata(folder)
    return sum(v.size.numel() * 4 for v in md.state_dict_metadata.values() if hasattr(v, "size"))


def _timed(fn):
    """(wall seconds, process CPU seconds of all threads, result); dirty pages of earlier steps are flushed
    first (``os.sync``), so no way pays for another's writeback."""
    gc.collect()
    os.sync()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def bench_dcp(args) -> list[dict]:
    """Rows ``{"job": "import dcp", "way", "seconds", "all", "bytes"}`` for ``tools/bench_interop.py``."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import (
        _EmptyStateDictLoadPlanner,
        dcp_to_torch_save,
    )
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    import ucp_store
    from ucp_store import cli

    work = getattr(args, "workdir_dcp", None) or tempfile.mkdtemp(prefix="bench-dcp-")
    os.makedirs(work, exist_ok=True)
    src = os.path.join(work, "src")
    shutil.rmtree(src, ignore_errors=True)
    t0 = time.perf_counter()
    nbytes = make_source(src, args.gib)
    files = sorted(f for f in os.listdir(src) if f.endswith(".distcp"))
    print(f"DCP source: {nbytes / (1 << 30):.2f} GiB of tensors in {len(files)} rank files, written by 4 gloo "
          f"processes in {time.perf_counter() - t0:.1f} s", flush=True)
    times: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}

    def rec(way, t, cpu):
        times.setdefault(way, []).append(t)
        cpus.setdefault(way, []).append(cpu)
        print(f"  import dcp  {way:<44} {t:8.2f} s  (cpu {cpu:.2f} s)  load {os.getloadavg()[0]:.1f}", flush=True)

    def ucp_import():
        rc = cli.main(["import", "dcp", src, "--run", "ucp", "--step", "1", "--store", os.path.join(work, "s1"),
                       "--no-progress"])
        assert rc == 0

    def to_torch_save():
        out = os.path.join(work, "out.pt")
        dcp_to_torch_save(src, out)
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def by_hand():
        sd: dict = {}
        _load_state_dict(sd, storage_reader=FileSystemReader(src), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        flat: dict = {}

        def walk(o, p):
            if isinstance(o, dict):
                for k, v in o.items():
                    walk(v, f"{p}{k}.")
            elif isinstance(o, torch.Tensor):
                flat[p[:-1]] = o

        walk(sd, "")
        store = ucp_store.open_store(os.path.join(work, "s2"), create=True)
        store.save("hand", 1, flat)

    from bench_interop import CEILINGS, kernel_copy, raw_copy

    def data_files():
        return [os.path.join(src, f) for f in sorted(os.listdir(src)) if f.endswith(".distcp")] + \
            [os.path.join(src, ".metadata")]

    ways = [("ucp import dcp", ucp_import), ("dcp_to_torch_save + fsync", to_torch_save),
            ("DCP load + store.save (by hand)", by_hand),
            (CEILINGS[0], lambda: raw_copy(data_files(), os.path.join(work, "raw.bin"))),
            (CEILINGS[1], lambda: kernel_copy(data_files(), os.path.join(work, "raw.bin")))]
    left = {"ucp import dcp": "s1", "dcp_to_torch_save + fsync": "out.pt", "DCP load + store.save (by hand)": "s2",
            CEILINGS[0]: "raw.bin", CEILINGS[1]: "raw.bin"}

    def remove(name):  # a way's output goes once its clock stopped: the disk holds one at a time
        p = os.path.join(work, name)
        shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else (os.path.exists(p) and os.remove(p))

    # warm-up, untimed: every way once on a tiny folder, so lazy imports and first-use set-up (TensorStore
    # context, catalog migrations, DCP planners) are not charged to whichever way happens to run first
    real_src, src = src, os.path.join(work, "warm")
    shutil.rmtree(src, ignore_errors=True)
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(8, 8)}, "optim": {"state": {"w": {"exp_avg": torch.ones(8, 8)}}}},
                 checkpoint_id=src, no_dist=True)
        for way, fn in ways:
            fn()
            remove(left[way])
    src = real_src
    for r in range(args.repeats):
        for d in set(left.values()):  # fresh stores: a second import into one store would dedup everything
            remove(d)
        order = ways[r % len(ways):] + ways[:r % len(ways)]  # rotate: no way always runs first
        for way, fn in order:
            t, cpu, _ = _timed(fn)
            rec(way, t, cpu)
            remove(left[way])
    remove("src")
    remove("warm")
    if not getattr(args, "workdir_dcp", None):
        shutil.rmtree(work, ignore_errors=True)
    return [{"job": "import dcp", "way": w, "seconds": min(ts), "all": ts, "bytes": nbytes,
             "cpu_seconds": min(cpus[w]), "cpu_all": cpus[w]} for w, ts in times.items()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.1, help="tensor bytes of the DCP source in GiB (default 1.1)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    os.environ.setdefault("UCP_PROGRESS", "0")
    rows = bench_dcp(args)
    print()
    best = min(r["seconds"] for r in rows)
    print(f"{'job':<12} {'way':<44} {'best s':>8} {'GiB/s':>7} {'vs fastest':>10}")
    for r in sorted(rows, key=lambda r: r["seconds"]):
        print(f"{r['job']:<12} {r['way']:<44} {r['seconds']:8.2f} {r['bytes'] / (1 << 30) / r['seconds']:7.2f} "
              f"{r['seconds'] / best:9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
