"""One rank of one demo training run: build the mesh and model, resume from the store, train, save.

`ucp demo` starts `world` of these per run (spawned processes, gloo on CPUs; NCCL with one GPU per rank
where there are enough GPUs). A run is a plain dict (`job`), so nothing but JSON-able values and the
result queue cross the process boundary:

    key, label, tp, dp        the run and its mesh ("dp", "tp"), rank = dp_rank * tp + tp_rank
    start, end                train steps start+1 .. end (the batch of a step is fixed, see `text.batch`)
    load                      a reference to resume from with `ucp_store.distributed.load`, then `verify`, or None
    saves                     {step: "sync" | "async"} saves through `ucp_store.distributed` after that step
    store, run, cfg, seed, lr, perturb, device ("cpu" or "cuda", the same for every run: `pick_device`)
    per_rank                  "same" (the mesh that saved) or "reshard": how the per-rank sampler state
                              (`text.Sampler`, each DP rank's data position) is restored

Rank 0 reports each step's loss (the mean of the data-parallel ranks' losses, in dp order, in float64:
on one mesh the same arithmetic every time) and the run's timings on the queue; any rank that fails
reports its traceback and exits non-zero, and the parent stops the others. Collectives time out after
`job["timeout_s"]`, so a dead rank gives an error, never a hang.
"""

from __future__ import annotations

import os
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

__all__ = ["entry", "perturb", "pick_device"]


def entry(rank: int, world: int, port: int, job: dict, queue) -> None:
    """Process entry point: run `job` as `rank` of `world`; report to `queue`; exit 1 on failure."""
    try:
        _run(rank, world, port, job, queue)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then the process fails
        queue.put(("error", job["key"], rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise SystemExit(1) from None


def pick_device(max_world: int) -> str:
    """"cuda" when there is one GPU per rank of the largest run (NCCL), else "cpu" (gloo), for every run alike:
    a comparison of losses across runs means something only if they all compute on the same kind of device."""
    import torch

    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= max_world else "cpu"


def _run(rank: int, world: int, port: int, job: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    from ucp_store.demo import model as M
    from ucp_store.demo import text

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # FSDP2 on the root's logits
    torch.set_num_threads(1)  # the same kernels and reduction order in every run of a mesh
    device_type = job.get("device", "cpu")
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=job["timeout_s"]))
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    try:
        tp, dp = job["tp"], job["dp"]
        cfg = M.ModelConfig(**job["cfg"])
        model = M.build_model(cfg, seed=job["seed"], device=device)
        mesh = M.make_mesh(tp=tp, dp=dp, device_type=device_type) if world > 1 else None
        model = M.parallelize(model, mesh, tp=tp, dp=dp)
        opt = M.build_optimizer(model, lr=job["lr"])
        info: dict[str, Any] = {"world": world, "device": device_type}
        dp_rank = rank // tp
        # this DP rank's data position, per-rank state saved and restored with the model (text.Sampler); a
        # resumed run builds it at step 1 and relies on the load to move it to the step it resumes at
        sampler = text.Sampler(cfg, seed=job["seed"], dp_rank=dp_rank, dp=dp,
                               next_sample=(0 if job["load"] else job["start"]) * cfg.batch_size
                               + dp_rank * (cfg.batch_size // dp))

        if job["load"]:
            t0 = time.perf_counter()
            info["bytes_read"], info["per_rank"] = _load(model, opt, sampler, job)
            info["load_s"] = time.perf_counter() - t0
            if sampler.step() != job["start"] + 1:
                raise RuntimeError(f"rank {rank}: the loaded sampler reads step {sampler.step()} next, expected "
                                   f"{job['start'] + 1}")
            info["verify"] = _verify(model, opt, sampler, job)
            if job.get("boxes_of"):
                queue.put(("boxes", job["key"], rank, _boxes(model, job["boxes_of"])))
            if job["perturb"]:
                perturb(model)
                info["perturbed"] = "output.weight scaled by 1.01 after the load and the verify"

        losses: dict[int, float] = {}
        pending = None
        info["saves"] = []
        for step in range(job["start"] + 1, job["end"] + 1):
            if sampler.step() != step:
                raise RuntimeError(f"rank {rank}: the sampler reads step {sampler.step()}, the loop is at {step}")
            inputs, targets = sampler.next_batch(device)  # text.batch(cfg, step, ...) of this rank's rows
            local = M.train_step(model, opt, inputs, targets)
            loss = _global_loss(local, world, tp, dp, device)
            if rank == 0:
                losses[step] = loss
                queue.put(("step", job["key"], step, loss))
            kind = job["saves"].get(str(step))
            if kind:
                if pending is not None:
                    pending.result()
                t0 = time.perf_counter()
                pending = _save(model, opt, sampler, job, step, kind)
                if kind == "async" and isinstance(pending, _Done):
                    kind = "sync (ucp_store.distributed has no async_save yet)"
                info["saves"].append({"step": step, "kind": kind, "blocked_s": time.perf_counter() - t0})
        if pending is not None:
            pending.result()
        if rank == 0:
            queue.put(("done", job["key"], losses, info))
    finally:
        if world > 1:
            dist.destroy_process_group()


def _global_loss(local: float, world: int, tp: int, dp: int, device) -> float:
    """The global batch's loss: dp ranks' losses (tp rank 0 of each) averaged in dp order, in float64."""
    import torch
    import torch.distributed as dist

    if world == 1:
        return float(local)
    mine = torch.tensor([local], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    vals = [float(every[d * tp].item()) for d in range(dp)]
    total = 0.0
    for v in vals:
        total += v
    return total / dp


def _state(model, opt, sampler) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sampler": sampler.state_dict()}


def _policies(job: dict) -> dict | None:
    """The per-rank restore policy of a resumed run: none on the mesh that saved (each rank gets its own
    position back), the sampler re-split over the new DP ranks elsewhere (``text.resplit``)."""
    from ucp_store import distributed as ucp_dist
    from ucp_store.demo import text

    if job.get("per_rank", "same") == "same":
        return None
    return {"sampler": ucp_dist.reshard(text.resplit)}


class _Done:
    """The handle of a synchronous save, so both kinds are waited on the same way."""

    def result(self):
        return None


def _save(model, opt, sampler, job: dict, step: int, kind: str):
    from ucp_store import distributed as ucp_dist

    state = _state(model, opt, sampler)
    if kind == "async":
        async_save = getattr(ucp_dist, "async_save", None)
        if async_save is not None:
            return async_save(state, store=job["store"], run=job["run"], step=step)
        kind = "sync"  # said in the run's report: this ucp_store.distributed has no async_save yet
    ucp_dist.save(state, store=job["store"], run=job["run"], step=step, progress=False)
    return _Done()


def _load(model, opt, sampler, job: dict) -> tuple[int, list[str]]:
    """Load job["load"] in place through ucp_store.distributed; returns the bytes this rank read and how its per-rank
    state was restored."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from ucp_store import distributed as ucp_dist

    state = _state(model, opt, sampler)
    result = ucp_dist.load(state, store=job["store"], ref=job["load"], progress=False, per_rank=_policies(job))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sampler.load_state_dict(state["sampler"])
    return int(getattr(result, "bytes_read", 0) or 0), list(result.per_rank)


def _verify(model, opt, sampler, job: dict) -> dict:
    """`ucp_store.distributed.verify` of the live state (read back through get_state_dict) against the checkpoint."""
    from ucp_store import distributed as ucp_dist

    report = ucp_dist.verify(_state(model, opt, sampler), job["load"], store=job["store"], progress=False,
                             per_rank=_policies(job))
    return {"ok": bool(report.ok), "text": str(report)}


def _boxes(model, param: str) -> dict:
    """The logical boxes of parameter `param` that this rank holds (what its load read), from the live DTensor."""
    from torch.distributed.tensor import DTensor

    from ucp_store.distributed.layout import local_regions, placement_json
    from ucp_store.errors import TopologyError

    t = dict(model.named_parameters())[param]
    if not isinstance(t, DTensor):
        return {"param": param, "boxes": [[[0, n] for n in t.shape]], "coords": {}}
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise TopologyError(f"{param}: this rank is not part of the parameter's device mesh {mesh.mesh.tolist()}")
    regions = local_regions(tuple(t.shape), tuple(mesh.mesh.shape), [placement_json(p) for p in t.placements], coord)
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return {"param": param, "boxes": [[list(b) for b in r.global_box] for r in regions],
            "coords": dict(zip(names, coord)), "placements": [str(p) for p in t.placements]}


def perturb(model) -> None:
    """Scale this rank's share of the output projection by 1.01: a resumed state that is no longer what was
    saved. (Not the embedding: the LayerNorm after it hides most of a uniform scaling.)"""
    import torch
    from torch.distributed.tensor import DTensor

    w = model.output.weight if model.output is not None else model.tok_embeddings.weight
    with torch.no_grad():
        (w.to_local() if isinstance(w, DTensor) else w).mul_(1.01)
