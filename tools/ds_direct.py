#!/usr/bin/env python
"""Real DeepSpeed (CPU, gloo) jobs for the direct ucp engine (issue 14); run under torchrun.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 tools/ds_direct.py --jobs jobs.json

Builds on ``ucp_store/demo/ds_train.py`` (models, configs, data, ``train_steps``). Job kinds:

- ``save``: train ``steps`` steps; if ``save_dir``: ``save_checkpoint`` to files with DeepSpeed's own engine
  (and ``convert``: rank 0 runs ``ds_to_universal``); then ``attach`` the ucp engine and ``save_checkpoint``
  the same step into ``store`` as ``run`` (``background``: also time the blocked part); then train
  ``next_steps`` more (the uninterrupted continuation). ``kill_rank``: that rank dies (``os._exit``) after its
  first array write of the ucp save (the others must abort; nothing may be listed). ``perturb``
  (``{"rank", "params", "delta"}``): before the saves, that rank's copies of those parameters drift (fp32 master
  and exp_avg); ``bad_run`` (``{"run", "perturb"}``): after the ucp save, drift more and save into that run,
  recording the error (``bad_error``) the save must raise. ``bg_run``: then save the
  same step once more in background mode into that run (``bg_blocked_s``: what training waited for).
- ``resume_direct``: build the engine (``model``, ``zero``, ``dtype``: the target), ``ucp_store.deepspeed.load``
  ``ref`` from ``store``, train ``steps`` steps.
- ``resume_ds``: the same from DeepSpeed's ``load_universal`` of ``load_dir``/``tag``.

Both resumes dump every rank's optimizer state (flat fp32 partitions, moments, step) to
``<state_prefix>_rank<r>.pt`` for bit-exact comparison, with ``param_states_out`` every parameter's full fp32
master and moments as DeepSpeed's ``safe_get_full_*`` accessors see them, and rank 0 writes ``out`` (losses,
``losses_hex``). A save job with ``background`` and ``next_steps`` trains those steps right after
``save_checkpoint`` returns, before waiting for the save (``stage_delay_s`` holds the staging back so that
the next optimizer step certainly has to wait for it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch

from ucp_store.demo import ds_train


def optimizer_state(engine) -> dict:
    """Every rank's optimizer state as plain tensors: {"g<i>.<state>": tensor}."""
    from ucp_store.deepspeed.load import optimizer_groups

    _, _, hp_flats, inner = optimizer_groups(engine)
    out = {}
    for g, hp in enumerate(hp_flats):
        out[f"g{g}.fp32"] = hp.detach().clone()
        for k, v in inner.state.get(hp, {}).items():
            out[f"g{g}.{k}"] = (v.detach().clone() if isinstance(v, torch.Tensor)
                                else torch.tensor(float(v), dtype=torch.float64))
    return out


def param_states(engine) -> dict:
    """Every trainable parameter's full fp32 master and moments through DeepSpeed's own accessors
    (``deepspeed.utils.safe_get_full_*``; collective under ZeRO-3): {"<name>.<state>": tensor}."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # DeepSpeed links the moments to the parameters at the first step; before it, now
        link()
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out[f"{name}.fp32"] = safe_get_full_fp32_param(p).detach().cpu().clone()
        for st in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{st}"] = safe_get_full_optimizer_state(p, st).detach().cpu().clone()
    return out


def _perturb(engine, spec: dict, rank: int) -> None:
    """On global rank(s) ``spec["rank"]`` (an int or a list) only, move the fp32 master and exp_avg of
    ``spec["params"]`` (a TP replica drifts away from the other TP ranks' copies) through DeepSpeed's own
    accessors."""
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    for name, p in engine.module.named_parameters():
        if name in spec["params"]:
            # the getters are collective over the DP group: every rank reads, one rank writes
            fp32, exp_avg = safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg")
            if rank in (spec["rank"] if isinstance(spec["rank"], list) else [spec["rank"]]):
                safe_set_full_fp32_param(p, fp32 + spec.get("delta", 1e-3))
                safe_set_full_optimizer_state(p, exp_avg * 1.5, "exp_avg")


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _reset_peak_rss() -> float | None:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: clear_refs 5); returns the RSS in MB."""
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return None
    return _status_mb("VmRSS")


def _peak_rss_mb() -> float | None:
    return _status_mb("VmHWM")


def _sync_files(paths) -> None:
    for f in paths:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def _blocking_reps(engine, job, result, steps, rank, dp_rank, dp, micro, gas) -> int:
    """The time training is blocked by one synchronous save, ``job['repeat']`` times, each after a new training
    step (so nothing deduplicates): DeepSpeed's torch.save engine, the same + an fsync of the files it wrote
    (every rank its own, then a barrier), a raw write + fsync of the same bytes per rank (the durable ceiling:
    one buffer per file, written and fsynced, no serialisation), and the ucp engine. The order rotates every
    repetition; the file folders are removed after each one."""
    import deepspeed.comm as dist

    import ucp_store.deepspeed as ucpds

    reps: dict[str, list[float]] = {"torch_save": [], "torch_save_fsync": [], "raw_write_fsync": [], "ucp": [],
                                    "ucp_background": [], "ucp_durability_background": []}
    stats, stats_others = [], []
    stager = None  # the background engine's host buffers: allocated by its first save, reused (attached once)
    base = os.path.join(job["save_dir"], "reps")
    for i in range(int(job["repeat"])):
        ds_train.train_steps(engine, job, steps, 1, dp_rank, dp, micro, gas)
        steps += 1

        def files(i=i):
            dist.barrier()
            t1 = time.perf_counter()
            engine.save_checkpoint(base, tag=f"rep{i}")
            saved = time.perf_counter() - t1
            folder = os.path.join(base, f"rep{i}")
            mine = [os.path.join(folder, f) for f in sorted(os.listdir(folder))
                    if f.endswith(".pt") and (f"_rank_{dp_rank}_" in f or (rank == 0 and f.startswith("mp_rank_")))]
            _sync_files(mine)
            dist.barrier()
            reps["torch_save"].append(saved)
            reps["torch_save_fsync"].append(time.perf_counter() - t1)
            # the ceiling: the same bytes, already in memory, written once each and fsynced (new files)
            blobs = []
            for f in mine:
                with open(f, "rb") as fh:
                    blobs.append(fh.read())
            dist.barrier()
            t1 = time.perf_counter()
            for j, b in enumerate(blobs):
                with open(os.path.join(folder, f"raw_{rank}_{j}"), "wb", buffering=0) as fh:
                    fh.write(b)
                    os.fsync(fh.fileno())
            dist.barrier()
            reps["raw_write_fsync"].append(time.perf_counter() - t1)
            del blobs
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder)

        def ucp(i=i):
            ce = ucpds.attach(engine, store=job["store"], run=f"{job['run']}-reps", progress=False,
                              timeout_s=job.get("timeout_s", 120))
            dist.barrier()
            prof = None
            if os.environ.get("UCP_BENCH_PROFILE") and i == int(job["repeat"]) - 1:  # the main thread, last rep
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            t1 = time.perf_counter()
            engine.save_checkpoint(tag=f"rep{i}")
            reps["ucp"].append(time.perf_counter() - t1)
            if prof is not None:
                prof.disable()
                prof.dump_stats(f"{os.environ['UCP_BENCH_PROFILE']}.rank{rank}")
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, dict(ce.stats))  # after the measured save: rank 0's and the others'
            stats.append(every[0])
            stats_others.append(every[1:])
            ucpds.detach(engine)

        def durability_background(i=i, step=steps):
            # blocked = the save_checkpoint call: it returns once the bytes are written and the ranks agreed; the
            # fsync pass and the commit finish on a thread while the next step trains (joined, not timed)
            ce = ucpds.attach(engine, store=job["store"], run=f"{job['run']}-reps-dur", progress=False,
                              timeout_s=job.get("timeout_s", 120), durability="background")
            dist.barrier()
            t1 = time.perf_counter()
            engine.save_checkpoint(tag=f"rep{i}")
            reps["ucp_durability_background"].append(time.perf_counter() - t1)
            ds_train.train_steps(engine, job, step, 1, dp_rank, dp, micro, gas)
            ce.wait()
            ucpds.detach(engine)

        def background(i=i, step=steps):
            # blocked = the save_checkpoint call + what the next optimizer step waited for the staging
            ce = ucpds.attach(engine, store=job["store"], run=f"{job['run']}-reps-bg", background=True,
                              progress=False, timeout_s=job.get("timeout_s", 120))
            nonlocal stager
            if stager is not None:
                ce._stager = stager
            stager = ce._stager
            dist.barrier()
            t1 = time.perf_counter()
            engine.save_checkpoint(tag=f"rep{i}")
            call = time.perf_counter() - t1
            ds_train.train_steps(engine, job, step, 1, dp_rank, dp, micro, gas)
            reps["ucp_background"].append(call + ce.stats.get("step_wait_s", 0.0))
            ce.wait()
            ucpds.detach(engine)

        for f in ((files, ucp, durability_background, background) if i % 2 == 0
                  else (background, durability_background, ucp, files)):
            f()
    result["blocking_reps"] = reps
    result["blocking_best"] = {k: min(v) for k, v in reps.items()}
    result["blocking_ucp_stats"] = stats
    result["blocking_ucp_stats_other_ranks"] = stats_others
    return steps


def run_job(job):
    import deepspeed.comm as dist

    import ucp_store.deepspeed as ucpds

    rank = dist.get_rank()
    result = {"job": job, "world": dist.get_world_size()}
    t0 = time.time()
    if job["kind"] == "save":
        engine, dp_rank, dp, micro, gas = ds_train.make_engine(job)
        steps = job.get("steps", 3)
        result["losses_before"] = ds_train.train_steps(engine, job, 0, steps, dp_rank, dp, micro, gas)
        if job.get("warm"):
            # benchmark: both engines save once before the measured saves (imports, thread pools, the store's
            # first open), then one more step so that nothing measured deduplicates against the warm-up
            if job.get("save_dir"):
                engine.save_checkpoint(os.path.join(job["save_dir"], "warm"), tag="warm")
            ucpds.attach(engine, store=job["store"], run=f"{job['run']}-warm", progress=False)
            engine.save_checkpoint(tag="warm")
            ucpds.detach(engine)
            result["losses_before"] += ds_train.train_steps(engine, job, steps, 1, dp_rank, dp, micro, gas)
            steps += 1
        tag = job.get("tag", f"global_step{steps}")
        if job.get("perturb"):
            _perturb(engine, job["perturb"], rank)
        if job.get("save_dir"):
            dist.barrier()
            t1 = time.perf_counter()
            engine.save_checkpoint(job["save_dir"], tag=tag, client_state=job.get("client_state", {}))
            result["files_save_s"] = time.perf_counter() - t1
            # torch.save never fsyncs; the store commits durably. The same files made durable (every rank
            # its own files, then the slowest rank): the durable ceiling of DeepSpeed's engine
            folder = os.path.join(job["save_dir"], tag)
            mine = [os.path.join(folder, f) for f in sorted(os.listdir(folder))
                    if f.endswith(".pt") and (f"_rank_{dp_rank}_" in f or (rank == 0 and f.startswith("mp_rank_"))
                                              or f.startswith("layer_"))]
            for f in mine:
                fd = os.open(f, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            dist.barrier()
            result["files_save_fsync_s"] = time.perf_counter() - t1
            if job.get("convert") and rank == 0:
                cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                       os.path.join(job["save_dir"], tag), "--output_folder",
                       os.path.join(job["save_dir"], f"{tag}_universal"), "--inject_missing_state",
                       "--num_extract_workers", "1", "--num_merge_workers", "1"]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
                    raise SystemExit("ds_to_universal failed")
            dist.barrier()
        ce = ucpds.attach(engine, store=job["store"], run=job["run"], background=job.get("background", False),
                          timeout_s=job.get("timeout_s", 120), progress=False,
                          durability=job.get("durability", "blocking"))
        if job.get("stage_delay_s"):  # the training step right after the save must wait for the staging
            ce._before_stage = lambda: time.sleep(job["stage_delay_s"])
        if job.get("kill_rank") is not None and rank == job["kill_rank"]:
            def die(name, state):
                os._exit(9)
            ce._on_write = die
        dist.barrier()
        t1 = time.perf_counter()
        engine.save_checkpoint(tag=tag, client_state=job.get("client_state", {}))
        result["ucp_blocked_s"] = time.perf_counter() - t1
        nxt = job.get("next_steps", 0)
        if (job.get("background") or job.get("durability") == "background") and nxt:
            # mutate the state right away: the next steps run while the save is staged and written (background), or
            # made durable and committed (durability="background")
            result["losses"] = ds_train.train_steps(engine, job, steps, nxt, dp_rank, dp, micro, gas)
        result["version"] = ce.wait()
        result["ucp_save_s"] = time.perf_counter() - t1
        result["ucp_stats"] = dict(ce.stats)
        ucpds.detach(engine)
        if job.get("bad_run"):  # a replica the importer refuses (job["bad_run"]["perturb"]): the save must fail
            _perturb(engine, job["bad_run"]["perturb"], rank)
            ce = ucpds.attach(engine, store=job["store"], run=job["bad_run"]["run"],
                              timeout_s=job.get("timeout_s", 120), progress=False)
            try:
                engine.save_checkpoint(tag=f"bad{steps}")
                result["bad_error"] = None
            except Exception as exc:  # noqa: BLE001 - recorded for the test
                cause = exc.__cause__ or exc
                result["bad_error"] = f"{type(exc).__name__}: {exc} <- {type(cause).__name__}: {cause}"
            ucpds.detach(engine)
        if job.get("bg_run"):  # in background mode (benchmark: the blocked time)
            if job.get("warm"):  # a new step: the background save must not deduplicate against the sync one
                ds_train.train_steps(engine, job, steps, 1, dp_rank, dp, micro, gas)
                steps += 1
            ce = ucpds.attach(engine, store=job["store"], run=job["bg_run"], background=True,
                              timeout_s=job.get("timeout_s", 120), progress=False)
            dist.barrier()
            t1 = time.perf_counter()
            engine.save_checkpoint(tag=f"global_step{steps}")
            result["bg_call_s"] = time.perf_counter() - t1
            # the next training step runs at once; its optimizer step waits until the save is staged
            t2 = time.perf_counter()
            ds_train.train_steps(engine, job, steps, 1, dp_rank, dp, micro, gas)
            result["bg_next_step_s"] = time.perf_counter() - t2
            result["bg_step_wait_s"] = ce.stats.get("step_wait_s", 0.0)
            result["bg_blocked_s"] = result["bg_call_s"] + result["bg_step_wait_s"]
            ce.wait()
            result["bg_save_s"] = time.perf_counter() - t1
            result["bg_stats"] = dict(ce.stats)
            ucpds.detach(engine)
        if job.get("repeat"):  # benchmark: the blocking save, best of N, the peers interleaved
            steps = _blocking_reps(engine, job, result, steps, rank, dp_rank, dp, micro, gas)
        if "losses" not in result:
            result["losses"] = ds_train.train_steps(engine, job, steps, nxt, dp_rank, dp, micro, gas) if nxt else []
    elif job["kind"] in ("resume_direct", "resume_ds"):
        universal = job["kind"] == "resume_ds"
        engine, dp_rank, dp, micro, gas = ds_train.make_engine(job, universal=universal)
        rss_before = _reset_peak_rss()
        t1 = time.perf_counter()
        if universal:
            path, client = engine.load_checkpoint(job["load_dir"], tag=job.get("tag"), load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
            if path is None:
                raise SystemExit(f"load_checkpoint found nothing in {job['load_dir']}")
        else:
            client = ucpds.load(engine, job["ref"], store=job["store"])
        result["load_s"] = time.perf_counter() - t1
        # the load's own peak: the process's high-water mark, reset just before the load, over its RSS then
        peak = _peak_rss_mb()
        if rss_before is not None and peak is not None:
            result["load_rss_before_mb"], result["load_peak_rss_mb"] = rss_before, peak
            result["load_peak_extra_mb"] = round(peak - rss_before, 1)
            result["rss_after_load_mb"] = _status_mb("VmRSS")
        result["client_state"] = {k: v for k, v in (client or {}).items() if isinstance(v, (int, float, str))}
        if job.get("state_prefix"):
            torch.save(optimizer_state(engine), f"{job['state_prefix']}_rank{rank}.pt")
        if job.get("param_states_out"):
            full = param_states(engine)
            if rank == 0:
                torch.save(full, job["param_states_out"])
        start = int(engine.global_steps)
        result["global_steps"] = start
        result["lr"] = [g["lr"] for g in engine.optimizer.param_groups]
        result["losses"] = ds_train.train_steps(engine, job, start, job.get("steps", 2), dp_rank, dp, micro, gas)
        result["peak_rss_since_load_mb"] = _peak_rss_mb()  # the load and the training steps after it
    else:
        raise SystemExit(f"unknown job kind {job['kind']!r}")
    ds_train.finish_job(result, job, rank, t0)
    del engine
    dist.barrier()
    return result


def main(argv=None):
    """The harness's command line and set-up (``ucp_store.demo.ds_train.main``) with this file's jobs."""
    ds_train.main(argv, run=run_job)

if __name__ == "__main__":
    main()
