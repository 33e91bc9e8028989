#!/usr/bin/env python
"""Benchmark: DeepSpeed's offline ``ds_to_universal`` vs ucp_store's direct import, side by side.

1. Builds (or reuses, with the same --workdir) a real DeepSpeed checkpoint: a stack of big Linear
   layers (default 36 x 2048^2 = 151M parameters), bf16, ZeRO-2, DP=2, trained 1 step on CPU under
   torchrun (ucp_store/demo/ds_train.py).
2. Runs, each in its own subprocess with wall time and peak RSS measured (the whole process tree,
   polled with psutil, plus ``ru_maxrss`` of the largest process):
   - ``python -m deepspeed.checkpoint.ds_to_universal --input_folder TAG --output_folder OUT``
     (its default worker counts);
   - ``python -m ucp_store.deepspeed.source STORE TAG --run bench`` (our import, source hashing on);
   - our export of that checkpoint to a universal folder (for the full round trip).
3. Measures the raw rate of the same bytes: copy every input file into one scratch file, without and with
   fsync (the durable rate; ds_to_universal never fsyncs, so it is also run followed by `sync`).

Prints a table and writes JSON to --out. The page cache is warm for every row (every run reads the
same files right after the previous one); nothing drops caches, the machine is shared.

    python tools/bench_deepspeed.py --workdir bench-out/ds --out bench-out/ds.json

``--roundtrip`` (issue 14) measures instead the whole round trip both ways, side by side in one run, on a
``--width`` x ``--layers`` model (bf16, ZeRO-2, saved at DP=2, resumed at DP=1):

- today: ``save_checkpoint`` to files (DeepSpeed's torch.save engine), ``ds_to_universal``, ``load_checkpoint``
  with ``load_universal`` on the new topology;
- direct: ``save_checkpoint`` through the ucp engine (``ucp_store.deepspeed.attach``), then
  ``ucp_store.deepspeed.load``; plus the same save in background mode (time training is blocked:
  the ``save_checkpoint`` call plus what the next training step's optimizer step waited for the staging).

Each engine saves once before the measured saves (a warm-up: imports, thread pools, the store's first open,
paid once per job), then the job trains one more step so that no measured save deduplicates against it.
``torch.save`` never fsyncs while the store commits durably, so the save row also shows DeepSpeed's save
followed by an fsync of the files it wrote (every rank its own, then a barrier): the durable ceiling.

The blocking save is also measured ``--repeat`` times (default 3) after the round-trip saves, each
repetition after a new training step, the peers interleaved in a rotating order, best of N and the median
of the paired ratios printed: DeepSpeed's torch.save engine, the same + fsync of its files, a raw write +
fsync of the same bytes per rank (the durable ceiling: no serialisation), the ucp engine (durable and
committed), and the ucp engine in background mode (call + the next optimizer step's wait), plus the ucp
save's phases (cumulative seconds on rank 0). The loads run ``--load-repeat`` times each, interleaved; each
reports the launch's peak RSS and the load's own peak (VmHWM reset just before the load, over the RSS then).
``--save-only`` stops after the save job (the blocking table alone).

Save and load times are measured inside the jobs (around ``save_checkpoint`` / the load call); the
conversion as a process; peak RSS per process tree for each launch (training included, the same for both).

    python tools/bench_deepspeed.py --roundtrip --width 1024 --layers 16 --workdir bench-out/rt
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = dict(os.environ)
    env.update({"DS_ACCELERATOR": "cpu", "UCP_PROGRESS": "0", "PYTHONWARNINGS": "ignore",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


REPEAT = 1


def measure(cmd: list[str], label: str, env: dict | None = None, before_each=None) -> dict:
    """The fastest of REPEAT runs (peak memory: the highest seen)."""
    runs = []
    for _ in range(REPEAT):
        if before_each is not None:
            before_each()
        runs.append(_measure_once(cmd, label, env))
    best = min(runs, key=lambda r: r["wall_s"])
    best["runs_wall_s"] = [r["wall_s"] for r in runs]
    best["peak_rss_tree_mb"] = max(r["peak_rss_tree_mb"] for r in runs)
    return best


def _measure_once(cmd: list[str], label: str, env: dict | None = None) -> dict:
    """Run ``cmd``; wall seconds, peak RSS of the process tree (sum, polled) and of its largest process."""
    import psutil

    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.Popen(cmd, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]
    stop = threading.Event()

    def poll():
        try:
            p = psutil.Process(proc.pid)
        except psutil.Error:
            return
        while not stop.is_set():
            try:
                procs = [p] + p.children(recursive=True)
                rss = 0
                for q in procs:
                    try:
                        rss += q.memory_info().rss
                    except psutil.Error:
                        pass
                peak[0] = max(peak[0], rss)
            except psutil.Error:
                pass
            stop.wait(0.02)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode != 0:
        sys.stderr.write(out[-4000:] + err[-8000:])
        raise SystemExit(f"{label} failed with exit code {proc.returncode}")
    return {"label": label, "cmd": " ".join(cmd), "wall_s": round(wall, 3),
            "peak_rss_tree_mb": round(peak[0] / 2**20, 1),
            "max_rss_largest_process_mb": round(max(after, before) / 1024, 1) if after > before else None,
            "stdout_tail": out[-400:]}


def build_checkpoint(workdir: Path, width: int, layers: int) -> Path:
    save = workdir / "ckpt"
    tag = save / "global_step1"
    if (tag / "mp_rank_00_model_states.pt").exists():
        return tag
    job = {"kind": "train", "model": "big", "width": width, "layers": layers, "zero": 2, "dtype": "bf16",
           "steps": 1, "save_dir": str(save), "tag": "global_step1", "out": str(workdir / "train.json")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_port()}",
           "-m", "ucp_store.demo.ds_train", "--job", json.dumps(job)]
    t0 = time.time()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit("building the DeepSpeed checkpoint failed")
    print(f"built {tag} in {time.time() - t0:.1f} s", flush=True)
    return tag


def raw_rate(files: list[Path], scratch: Path) -> dict:
    """Copy every input file's bytes into one scratch file (8 MiB reads and writes): the raw rate of the
    same bytes. The bytes written are the real ones: this disk writes repeated or zero buffers far faster
    than real data, so writing one buffer over and over would overstate it. Then fsync: the durable rate."""
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    total, t_read, t_write = 0, 0.0, 0.0
    with open(scratch, "wb", buffering=0) as out:
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while True:
                    t0 = time.perf_counter()
                    n = fh.readinto(buf)
                    t1 = time.perf_counter()
                    t_read += t1 - t0
                    if not n:
                        break
                    out.write(view[:n])
                    t_write += time.perf_counter() - t1
                    total += n
        t0 = time.perf_counter()
        os.fsync(out.fileno())  # what it takes to make those bytes durable, as a store commit needs
        t_sync = time.perf_counter() - t0
    scratch.unlink()
    t_durable = t_write + t_sync
    return {"bytes": total, "read_s": round(t_read, 3), "write_s": round(t_write, 3),
            "read_plus_write_s": round(t_read + t_write, 3), "gb_per_s": round(total / 1e9 / (t_read + t_write), 3),
            "durable_write_s": round(t_durable, 3), "read_plus_durable_write_s": round(t_read + t_durable, 3),
            "durable_gb_per_s": round(total / 1e9 / (t_read + t_durable), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=str(REPO / "bench-out" / "deepspeed"))
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--skip-ds", action="store_true", help="do not run ds_to_universal (ours only)")
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--output-dir", default=None,
                    help="where every run writes (default: --workdir); /dev/shm takes the disk out of the figures")
    ap.add_argument("--repeat", type=int, default=1, help="run every row N times, keep the fastest (shared machines)")
    ap.add_argument("--load-repeat", type=int, default=3, help="--roundtrip: each load N times, interleaved")
    ap.add_argument("--save-only", action="store_true",
                    help="--roundtrip: only the training job's saves (the blocking-save table), no convert or load")
    ap.add_argument("--roundtrip", action="store_true",
                    help="issue 14: save -> (convert) -> load on a new topology, DeepSpeed's files vs the ucp engine")
    args = ap.parse_args(argv)
    if args.roundtrip:
        return roundtrip(args)
    global REPEAT
    REPEAT = max(1, args.repeat)
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tag = build_checkpoint(work, args.width, args.layers)
    files = sorted(p for p in tag.iterdir() if p.suffix == ".pt")
    in_bytes = sum(p.stat().st_size for p in files)
    params = args.layers * (args.width * args.width + args.width)
    results: dict = {"checkpoint": str(tag), "parameters": params, "input_bytes": in_bytes,
                     "files": [p.name for p in files], "cpus": os.cpu_count(), "rows": []}
    print(f"checkpoint {tag}: {params / 1e6:.1f}M parameters, {in_bytes / 1e9:.2f} GB in {len(files)} files",
          flush=True)
    # warm the page cache once, the same for everyone
    outdir = Path(args.output_dir).resolve() if args.output_dir else work
    outdir.mkdir(parents=True, exist_ok=True)
    results["output_dir"] = str(outdir)
    raw_runs = [raw_rate(files, outdir / "raw_write.tmp") for _ in range(1 + REPEAT)]
    results["raw"] = min(raw_runs[1:], key=lambda r: r["read_plus_write_s"])  # the first one warms the cache
    rows = results["rows"]
    if not args.skip_ds:
        out = outdir / "ds_universal"
        rows.append(measure([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
                             "--output_folder", str(out), "--inject_missing_state"], "ds_to_universal",
                            before_each=lambda: (shutil.rmtree(out, ignore_errors=True), os.sync())))
        # ds_to_universal never fsyncs; the store's commit waits until its arrays are durable. The same
        # conversion followed by a sync of what it wrote is the like-for-like figure.
        rows.append(measure(["sh", "-c", f'"{sys.executable}" -m deepspeed.checkpoint.ds_to_universal --input_folder '
                             f'"{tag}" --output_folder "{out}" --inject_missing_state && sync'],
                            "ds_to_universal + sync",
                            before_each=lambda: (shutil.rmtree(out, ignore_errors=True), os.sync())))
        shutil.rmtree(out, ignore_errors=True)
    store = outdir / "store"
    # every row starts with no dirty pages of an earlier row still being written back
    fresh = lambda: (shutil.rmtree(store, ignore_errors=True), os.sync())  # noqa: E731
    rows.append(measure([sys.executable, "-m", "ucp_store.deepspeed.source", str(store), str(tag), "--run", "bench"],
                        "ucp import", before_each=fresh))
    rows.append(measure([sys.executable, "-m", "ucp_store.deepspeed.source", str(store), str(tag), "--run", "bench",
                         "--no-hash"], "ucp import, no source hashing", before_each=fresh))
    # the ceiling: the store writing the same tensor-states from memory (no DeepSpeed files involved)
    ceil_store = outdir / "store_ceiling"
    shutil.rmtree(ceil_store, ignore_errors=True)
    code = ("import sys, torch, time; from ucp_store import open_store; s=open_store(sys.argv[1], create=True); "
            f"W, L = {args.width}, {args.layers}; ts=[torch.randn(W, W) for _ in range(3)]; bs=torch.randn(W); "
            "w=s.begin('c', 1)\n"
            "for i in range(L):\n"
            "    for j, st in enumerate(('fp32', 'exp_avg', 'exp_avg_sq')):\n"
            "        w.write(f'layers.{i}.weight', st, ts[j] + i); w.write(f'layers.{i}.bias', st, bs + i + j)\n"
            "w.commit()")
    rows.append(measure([sys.executable, "-c", code, str(ceil_store)], "store write ceiling (same states)",
                        before_each=lambda: (shutil.rmtree(ceil_store, ignore_errors=True), os.sync())))
    shutil.rmtree(ceil_store, ignore_errors=True)
    if not args.no_export:
        exp = outdir / "ucp_universal"
        code = ("import sys; from ucp_store import open_store; from ucp_store.deepspeed.universal import "
                "export_universal; s=open_store(sys.argv[1]); print(export_universal(s.checkpoint('bench@1'), "
                "sys.argv[2], progress=False))")
        rows.append(measure([sys.executable, "-c", code, str(store), str(exp)], "ucp export (universal folder)",
                            before_each=lambda: (shutil.rmtree(exp, ignore_errors=True), os.sync())))
        shutil.rmtree(exp, ignore_errors=True)
    raw = results["raw"]
    for r in rows:
        r["gb_per_s"] = round(in_bytes / 1e9 / r["wall_s"], 3)
        r["fraction_of_raw_rate"] = round(r["gb_per_s"] / raw["gb_per_s"], 3)
    by = {r["label"]: r for r in rows}
    if "ds_to_universal" in by:
        ds, ours = by["ds_to_universal"], by["ucp import"]
        results["speedup_vs_ds_to_universal"] = round(ds["wall_s"] / ours["wall_s"], 2)
        if "ds_to_universal + sync" in by:
            results["speedup_vs_ds_to_universal_plus_sync"] = round(by["ds_to_universal + sync"]["wall_s"] /
                                                                    ours["wall_s"], 2)
        results["peak_rss_ratio_ours_over_ds"] = round(ours["peak_rss_tree_mb"] / ds["peak_rss_tree_mb"], 3)
        results["goals"] = {"speedup>=5": results["speedup_vs_ds_to_universal"] >= 5,
                            "lower_peak_memory": ours["peak_rss_tree_mb"] < ds["peak_rss_tree_mb"]}
    hdr = f"{'step':34s} {'wall s':>8s} {'GB/s':>7s} {'x raw':>6s} {'peak RSS MB (tree)':>19s} {'largest proc MB':>16s}"
    print(hdr)
    print("-" * len(hdr))
    print(f"{'raw read+write of the same bytes':34s} {raw['read_plus_write_s']:8.2f} {raw['gb_per_s']:7.2f} {1:6.2f}")
    print(f"{'raw read + durable write (fsync)':34s} {raw['read_plus_durable_write_s']:8.2f} "
          f"{raw['durable_gb_per_s']:7.2f} {raw['durable_gb_per_s'] / raw['gb_per_s']:6.2f}")
    for r in rows:
        print(f"{r['label']:34s} {r['wall_s']:8.2f} {r['gb_per_s']:7.2f} {r['fraction_of_raw_rate']:6.2f} "
              f"{r['peak_rss_tree_mb']:19.1f} {str(r['max_rss_largest_process_mb']):>16s}")
    for k in ("speedup_vs_ds_to_universal", "speedup_vs_ds_to_universal_plus_sync", "peak_rss_ratio_ours_over_ds",
              "goals"):
        if k in results:
            print(f"{k}: {results[k]}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def _blocking_table(saved: dict) -> dict:
    """The blocking synchronous save, best of N with the peers interleaved (tools/ds_direct.py _blocking_reps):
    DeepSpeed's torch.save engine, + fsync of its files, the raw write + fsync ceiling, the ucp engine."""
    best, reps = saved["blocking_best"], saved["blocking_reps"]
    rows = [("torch.save engine (not durable)", "torch_save"),
            ("torch.save engine + fsync of its files", "torch_save_fsync"),
            ("raw write + fsync, same bytes (ceiling)", "raw_write_fsync"), ("ucp engine (durable, committed)", "ucp")]
    print(f"blocking save, best of {len(reps['ucp'])} (interleaved, order rotating); seconds, and ucp / row")
    paired = {k: statistics.median(u / x for u, x in zip(reps["ucp"], reps[k])) for _, k in rows}
    print(f"  {'':44s} {'best':>7s}  {'ucp/this best':>13s} {'median of paired ucp/this':>26s}   all")
    for label, k in rows:
        print(f"  {label:44s} {best[k]:7.3f}  {best['ucp'] / best[k]:13.2f} {paired[k]:26.2f}   "
              + " ".join(f"{x:.3f}" for x in reps[k]))
    print(f"  ratios (best of N): ucp/torch.save {best['ucp'] / best['torch_save']:.2f}, ucp/ceiling "
          f"{best['ucp'] / best['raw_write_fsync']:.2f}, "
          f"ceiling/torch.save {best['raw_write_fsync'] / best['torch_save']:.2f}"
          f" (what durability alone costs), ucp/(torch.save + fsync) {best['ucp'] / best['torch_save_fsync']:.2f}")
    if reps.get("ucp_durability_background"):
        dur = reps["ucp_durability_background"]
        dur_paired = statistics.median(d / x for d, x in zip(dur, reps["torch_save"]))
        print(f"  {'ucp engine, durability=background (call)':44s} {best['ucp_durability_background']:7.3f}  "
              f"{'dur/torch.save':>13s} {best['ucp_durability_background'] / best['torch_save']:5.3f} (best)  "
              f"{dur_paired:5.3f} (paired median)   " + " ".join(f"{x:.3f}" for x in dur))
    bg = reps["ucp_background"]
    bg_paired = statistics.median(b / x for b, x in zip(bg, reps["torch_save"]))
    print(f"  {'ucp engine, background (call + step wait)':44s} {best['ucp_background']:7.3f}  "
          f"{'bg/torch.save':>13s} {best['ucp_background'] / best['torch_save']:5.3f} (best)  {bg_paired:5.3f} (paired "
          "median)   " + " ".join(f"{x:.3f}" for x in bg))
    all_phases = saved["blocking_ucp_stats"]
    fastest = min(range(len(all_phases)), key=lambda i: all_phases[i].get("write_s", 1e9))
    phases = all_phases[fastest]
    print("  ucp phases of its fastest save, rank 0 (cumulative s): " + ", ".join(
        f"{k}={v:.3f}" for k, v in phases.items() if k.endswith("_s")))
    others = saved.get("blocking_ucp_stats_other_ranks") or []
    for r, st in enumerate(others[fastest] if fastest < len(others) else [], start=1):
        print(f"  the same save, rank {r} (cumulative s): " + ", ".join(
            f"{k}={v:.3f}" for k, v in st.items() if k.endswith("_s")))
    return {"best_s": best, "all_s": reps, "ucp_phases": phases, "paired_median_ratio_ucp_over": paired,
            "ratio_vs_torch_save": round(best["ucp"] / best["torch_save"], 3),
            "ratio_vs_torch_save_fsync": round(best["ucp"] / best["torch_save_fsync"], 3),
            "ratio_vs_raw_ceiling": round(best["ucp"] / best["raw_write_fsync"], 3),
            "durability_background_ratio_vs_torch_save": (
                round(best["ucp_durability_background"] / best["torch_save"], 3)
                if "ucp_durability_background" in best else None),
            "background_ratio_vs_torch_save": round(best["ucp_background"] / best["torch_save"], 3),
            "background_paired_median_ratio": round(bg_paired, 3)}


def roundtrip(args) -> int:
    """Issue 14: the whole round trip both ways, side by side (see the module docstring)."""
    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    store, save_dir, tag = work / "store", work / "ckpt", "global_step2"
    model = {"model": "big", "width": args.width, "layers": args.layers, "zero": 2, "dtype": "bf16"}
    driver = str(REPO / "tools" / "ds_direct.py")

    def launch(jobs: list[dict], nproc: int, label: str) -> dict:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_port()}",
               driver, "--job", json.dumps(jobs[0])]
        env = dict(_env(), OMP_NUM_THREADS="1")
        return _measure_once(cmd, label, env)

    # one training process group saves the same step three ways, one after the other
    # 1 step, a warm-up save through each engine, 1 step, the measured saves of step 2 (files, then the ucp
    # engine), 1 step, the background save of step 3 and one more step right after it
    save_job = {"kind": "save", **model, "steps": 1, "warm": True, "save_dir": str(save_dir), "tag": tag,
                "store": str(store), "run": "sync", "bg_run": "background", "out": str(work / "save.json"),
                "repeat": max(1, args.repeat if args.repeat > 1 else 3)}
    m_save = launch([save_job], 2, "train 1 step + three saves (DP=2)")
    saved = json.loads((work / "save.json").read_text())
    blocking = _blocking_table(saved)
    if args.save_only:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"model": model, "blocking": blocking, "save": saved}, indent=1))
        return 0
    m_conv = _measure_once([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                            str(save_dir / tag), "--output_folder", str(save_dir / f"{tag}_universal"),
                            "--inject_missing_state"], "ds_to_universal", dict(_env(), OMP_NUM_THREADS="1"))
    # the loads, best of N with the two paths interleaved (peak RSS is noisy on a shared machine): the launch's
    # process-tree peak, and the load's own peak over the RSS it started from (VmHWM reset just before it)
    loads: dict[str, list] = {"ds": [], "ucp": []}
    for i in range(max(1, args.load_repeat)):
        for which in (("ds", "ucp") if i % 2 == 0 else ("ucp", "ds")):
            if which == "ds":
                m = launch([{"kind": "resume_ds", **model, "load_dir": str(save_dir), "tag": f"{tag}_universal",
                             "steps": 1, "out": str(work / "load_ds.json")}], 1, "load_universal (DP=1)")
                loads["ds"].append((m, json.loads((work / "load_ds.json").read_text())))
            else:
                m = launch([{"kind": "resume_direct", **model, "store": str(store), "ref": "sync@2", "steps": 1,
                             "out": str(work / "load_ucp.json")}], 1, "ucp load (DP=1)")
                loads["ucp"].append((m, json.loads((work / "load_ucp.json").read_text())))

    def best(which):
        runs = loads[which]
        m = dict(min((r[0] for r in runs), key=lambda m_: m_["peak_rss_tree_mb"]))
        j = dict(min((r[1] for r in runs), key=lambda j_: j_["load_s"]))
        j["load_peak_extra_mb"] = min(r[1].get("load_peak_extra_mb", float("inf")) for r in runs)
        j["all_peak_rss_tree_mb"] = [r[0]["peak_rss_tree_mb"] for r in runs]
        j["all_load_peak_extra_mb"] = [r[1].get("load_peak_extra_mb") for r in runs]
        j["all_load_s"] = [r[1]["load_s"] for r in runs]
        return m, j

    (m_lds, lds), (m_lucp, lucp) = best("ds"), best("ucp")
    print(f"loads, best of {len(loads['ds'])} interleaved: peak RSS of the launch (MB) ds {m_lds['peak_rss_tree_mb']} "
          f"{lds['all_peak_rss_tree_mb']} | ucp {m_lucp['peak_rss_tree_mb']} {lucp['all_peak_rss_tree_mb']}")
    print(f"  the load's own peak over its starting RSS (MB): ds {lds['load_peak_extra_mb']} "
          f"{lds['all_load_peak_extra_mb']} | ucp {lucp['load_peak_extra_mb']} {lucp['all_load_peak_extra_mb']}")
    print(f"  load seconds: ds {min(lds['all_load_s']):.3f} {lds['all_load_s']} | ucp {min(lucp['all_load_s']):.3f} "
          f"{lucp['all_load_s']}")
    files_bytes = sum(p.stat().st_size for p in (save_dir / tag).iterdir() if p.is_file())
    today = saved["files_save_s"] + m_conv["wall_s"] + lds["load_s"]
    direct = saved["ucp_save_s"] + lucp["load_s"]
    res = {
        "model": model, "parameters": args.layers * (args.width ** 2 + args.width), "files_bytes": files_bytes,
        "today": {"save_blocked_s": saved["files_save_s"], "save_plus_fsync_s": saved["files_save_fsync_s"],
                  "ds_to_universal_s": m_conv["wall_s"],
                  "load_universal_s": lds["load_s"], "round_trip_s": today,
                  "peak_rss_mb": {"save": m_save["peak_rss_tree_mb"], "convert": m_conv["peak_rss_tree_mb"],
                                  "load": m_lds["peak_rss_tree_mb"]},
                  "load_peak_extra_mb": lds["load_peak_extra_mb"], "load_all": {k: lds[k] for k in (
                      "all_peak_rss_tree_mb", "all_load_peak_extra_mb", "all_load_s")}},
        "direct": {"save_blocked_s": saved["ucp_blocked_s"], "save_s": saved["ucp_save_s"],
                   "background_blocked_s": saved["bg_blocked_s"], "background_save_s": saved["bg_save_s"],
                   "background_call_s": saved["bg_call_s"], "background_step_wait_s": saved["bg_step_wait_s"],
                   "background_next_step_s": saved["bg_next_step_s"], "background_stats": saved.get("bg_stats"),
                   "sync_stats": saved.get("ucp_stats"),
                   "load_s": lucp["load_s"], "round_trip_s": direct,
                   "peak_rss_mb": {"save": m_save["peak_rss_tree_mb"], "load": m_lucp["peak_rss_tree_mb"]},
                   "load_peak_extra_mb": lucp["load_peak_extra_mb"], "load_all": {k: lucp[k] for k in (
                       "all_peak_rss_tree_mb", "all_load_peak_extra_mb", "all_load_s")}},
        "next_loss_equal": lds["losses_hex"] == lucp["losses_hex"],
    }
    res["blocking"] = blocking
    res["round_trip_speedup"] = round(today / direct, 2)
    res["blocked_ratio_sync"] = round(saved["ucp_blocked_s"] / saved["files_save_s"], 3)
    res["blocked_ratio_sync_vs_durable_torch_save"] = round(saved["ucp_blocked_s"] / saved["files_save_fsync_s"], 3)
    res["blocked_ratio_background"] = round(saved["bg_blocked_s"] / saved["files_save_s"], 3)
    res["blocked_ratio_background_best_of_n"] = blocking["background_ratio_vs_torch_save"]
    res["blocked_ratio_sync_best_of_n"] = blocking["ratio_vs_torch_save"]
    res["blocked_ratio_sync_vs_raw_ceiling_best_of_n"] = blocking["ratio_vs_raw_ceiling"]
    res["goals"] = {"round_trip>=3x": res["round_trip_speedup"] >= 3,
                    "sync_blocked<=torch.save": res["blocked_ratio_sync_best_of_n"] <= 1,
                    "background_blocked<10%": res["blocked_ratio_background_best_of_n"] < 0.1,
                    "peak_load<=ds": m_lucp["peak_rss_tree_mb"] <= max(m_lds["peak_rss_tree_mb"],
                                                                       m_conv["peak_rss_tree_mb"]),
                    "load_own_peak<=ds": lucp["load_peak_extra_mb"] <= lds["load_peak_extra_mb"]}
    print(f"model: {res['parameters'] / 1e6:.1f}M parameters, bf16 ZeRO-2, saved at DP=2, loaded at DP=1; "
          f"files {files_bytes / 1e9:.2f} GB")
    hdr = f"{'step':44s} {'today s':>9s} {'direct s':>9s} {'peak MB today':>14s} {'peak MB direct':>15s}"
    print(hdr)
    print("-" * len(hdr))
    print(f"{'save_checkpoint (training blocked)':44s} {saved['files_save_s']:9.2f} {saved['ucp_blocked_s']:9.2f}")
    print(f"{'  + fsync of its files (durable ceiling)':44s} {saved['files_save_fsync_s']:9.2f}")
    bg_call, bg_wait = saved["bg_call_s"], saved["bg_step_wait_s"]
    print(f"{'  background: call + next step waited':44s} {'':9s} {bg_call:4.3f}+{bg_wait:4.3f}")
    print(f"{'  background: next train step / durable':44s} {'':9s} "
          f"{saved['bg_next_step_s']:4.2f}/{saved['bg_save_s']:4.2f}")
    print(f"{'ds_to_universal':44s} {m_conv['wall_s']:9.2f} {'-':>9s} {m_conv['peak_rss_tree_mb']:14.1f} {'-':>15s}")
    print(f"{'load on the new topology':44s} {lds['load_s']:9.2f} {lucp['load_s']:9.2f} "
          f"{m_lds['peak_rss_tree_mb']:14.1f} {m_lucp['peak_rss_tree_mb']:15.1f}")
    print(f"{'round trip':44s} {today:9.2f} {direct:9.2f}")
    print(f"{'save launch (training + all three saves)':44s} {'':9s} {'':9s} {m_save['peak_rss_tree_mb']:14.1f}")
    for k in ("round_trip_speedup", "blocked_ratio_sync", "blocked_ratio_sync_vs_durable_torch_save",
              "blocked_ratio_background", "blocked_ratio_sync_best_of_n", "blocked_ratio_sync_vs_raw_ceiling_best_of_n",
              "blocked_ratio_background_best_of_n", "next_loss_equal", "goals"):
        print(f"{k}: {res[k]}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
