"""Train a tiny mixture-of-experts model with real DeepSpeed (``deepspeed.moe.layer.MoE``) on CPU.

Run under torchrun (gloo) like ``ds_train`` (whose argument handling and set-up it shares)::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 -m ucp_store.demo.ds_moe --jobs jobs.json

Job keys (besides ``ds_train``'s ``zero``, ``dtype``, ``steps``, ``out``):

- ``kind``: ``"train"`` (train ``steps`` steps, save ``save_dir/tag``, optionally run ``ds_to_universal``
  on it (``convert``: its exit status and last error line go into the result, a failure is recorded,
  not raised), then ``next_steps`` more steps: the uninterrupted continuation), ``"resume_ucp"``
  (build the engine at expert-parallel degree ``ep``, ``ucp_store.adapters.deepspeed_moe.load_engine``
  from ``store``/``ref``, dump the optimizer state per expert, train ``steps`` steps) or
  ``"resume_universal"`` (``load_checkpoint(load_dir, tag)`` with ``load_universal``).
- ``ep``: expert-parallel degree (default 2); ``experts`` (default 4); ``moe_layers`` (default 2).
- ``dump``: where each rank writes ``torch.save`` of its per-expert fp32 / exp_avg / exp_avg_sq (global
  names), read straight from the optimizer's flat buffers, for the bit-equality checks.

The model: ``inp`` Linear -> ``moe_layers`` x (MoE of ``experts`` two-layer MLP experts, top-1 gate) -> ``head``.
``Experts`` deep-copies one expert, so every expert gets its own values here (seeded by its *global* id),
or a mix-up of experts could not show. The gate's random token selection draws from the global RNG,
which no checkpoint saves: every step reseeds it (``seed + step``), so a resumed run sees the same noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.nn.functional as F
from torch import nn

from .ds_train import finish_job

GLOBAL_BATCH = 16  # 4 tokens per rank at dp=4: DeepSpeed's gate needs at least min_capacity tokens

__all__ = ["MoENet", "run_job", "expert_state_dump", "main"]

HIDDEN = 16
FFN = 24


def global_batch(step, din, dout, seed):
    g = torch.Generator().manual_seed(seed * 100003 + step)
    return torch.randn(GLOBAL_BATCH, din, generator=g), torch.randn(GLOBAL_BATCH, dout, generator=g)


class ExpertMLP(nn.Module):
    def __init__(self, d=HIDDEN, f=FFN):
        super().__init__()
        self.w1 = nn.Linear(d, f)
        self.w2 = nn.Linear(f, d)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class MoENet(nn.Module):
    def __init__(self, ep: int, experts: int = 4, moe_layers: int = 2, din: int = 8, dout: int = 6):
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.inp = nn.Linear(din, HIDDEN)
        self.moe = nn.ModuleList([
            # capacity_factor = experts: an expert can take every token, so no token is dropped at any ep/dp
            # and a resumed run at another topology routes exactly the same tokens
            MoE(hidden_size=HIDDEN, expert=ExpertMLP(), num_experts=experts, ep_size=ep, k=1,
                capacity_factor=float(experts), eval_capacity_factor=float(experts), min_capacity=1)
            for _ in range(moe_layers)])
        self.head = nn.Linear(HIDDEN, dout)
        self.din, self.dout = din, dout

    def forward(self, x):
        h = self.inp(x)
        aux = h.new_zeros((), dtype=torch.float32)
        for layer in self.moe:
            out, l_aux, _ = layer(h)
            h = h + out
            aux = aux + l_aux.float()
        return self.head(h), aux


def _distinct_experts(model: MoENet, ep_rank: int, seed: int) -> None:
    """Give every expert its own values, seeded by (layer, global expert id)."""
    with torch.no_grad():
        for li, layer in enumerate(model.moe):
            local: Any = layer.deepspeed_moe.experts.deepspeed_experts  # type: ignore[union-attr]
            for j, expert in enumerate(local):
                g = torch.Generator().manual_seed(seed * 1000 + li * 100 + ep_rank * len(local) + j)
                for p in expert.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def build(job):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    world, rank = dist.get_world_size(), dist.get_rank()
    ep = job.get("ep", 2)
    torch.manual_seed(job.get("seed", 1234))
    model = MoENet(ep, job.get("experts", 4), job.get("moe_layers", 2))
    _distinct_experts(model, rank % ep, job.get("seed", 1234))
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "main"})
    micro = GLOBAL_BATCH // world
    cfg = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": job.get("zero", 2), "reduce_bucket_size": 10 ** 7,
                              "allgather_bucket_size": 10 ** 7},
        "gradient_clipping": 1.0,
    }
    if job.get("dtype", "bf16") == "bf16":
        cfg["bf16"] = {"enabled": True}
    if job.get("universal"):
        cfg["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    return engine, rank, world, micro


def train_steps(engine, job, start, count, dp_rank, micro):
    import deepspeed.comm as dist

    dt = torch.bfloat16 if job.get("dtype", "bf16") == "bf16" else torch.float32
    model = engine.module
    losses = []
    for step in range(start, start + count):
        x, y = global_batch(step, model.din, model.dout, job.get("data_seed", 7))
        lo = dp_rank * micro
        torch.manual_seed(job.get("seed", 1234) * 7 + step)  # the gate's random token selection
        out, aux = engine(x[lo:lo + micro].to(dt))
        loss = F.mse_loss(out.float(), y[lo:lo + micro]) + 0.01 * aux
        engine.backward(loss)
        engine.step()
        val = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(val)
        val /= dist.get_world_size()
        losses.append(float(val.item()))
    return losses


def expert_state_dump(engine) -> dict:
    """``{(global name, state): fp32 tensor}`` of this rank's ZeRO share, read from the optimizer's flat
    buffers (``single_partition_of_fp32_groups`` and its Adam state), for every parameter whose share is
    not empty. Expert names are made global (``deepspeed_experts.<local>`` -> ``<global>``); the share of
    a parameter is the whole parameter when its group is not partitioned (edp = 1)."""
    from ..adapters.deepspeed_moe import engine_param_shares

    out = {}
    for name, pieces in engine_param_shares(engine).items():
        for state, (start, stop, tensor) in pieces.items():
            out[(name, state)] = (start, stop, tensor.clone())
    return out


def run_job(job):
    import deepspeed.comm as dist

    rank = dist.get_rank()
    t0 = time.time()
    result = {"job": job, "world": dist.get_world_size()}
    if job["kind"] == "import":  # rank 0 imports save_dir/tag into store as run (one process, no collectives)
        if rank == 0:
            from .. import open_store
            from ..adapters.deepspeed import import_deepspeed

            store = open_store(job["store"], create=True)
            result["checkpoint"] = import_deepspeed(store, os.path.join(job["save_dir"], job["tag"]), job["run"],
                                                    progress=False, distributed=False,
                                                    experts=job.get("experts", "separate"))
            result["wall_s"] = time.time() - t0
            if job.get("out"):
                with open(job["out"], "w") as f:
                    json.dump(result, f, indent=1, default=str)
        dist.barrier()
        return result
    engine, dp_rank, world, micro = build({**job, "universal": job["kind"] == "resume_universal"})
    if job["kind"] == "train":
        steps = job.get("steps", 2)
        result["losses_before"] = train_steps(engine, job, 0, steps, dp_rank, micro)
        save_dir, tag = job["save_dir"], job.get("tag", f"global_step{steps}")
        engine.save_checkpoint(save_dir, tag=tag)
        dist.barrier()
        if job.get("dump"):
            torch.save(expert_state_dump(engine), f"{job['dump']}.{rank}.pt")
        if job.get("convert") and rank == 0:
            cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                   os.path.join(save_dir, tag), "--output_folder", os.path.join(save_dir, f"{tag}_universal"),
                   "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            errs = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "Error" in ln]
            result["convert"] = {"returncode": proc.returncode, "error": errs[-1] if errs else None}
        dist.barrier()
        nxt = job.get("next_steps", 0)
        result["losses"] = train_steps(engine, job, steps, nxt, dp_rank, micro) if nxt else []
    elif job["kind"] in ("resume_ucp", "resume_universal"):
        if job["kind"] == "resume_ucp":
            from ..adapters.deepspeed_moe import load_engine

            load_engine(engine, job["ref"], store=job["store"])
        else:
            path, _ = engine.load_checkpoint(job["load_dir"], tag=job.get("tag"), load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
            if path is None:
                raise SystemExit(f"load_checkpoint found nothing in {job['load_dir']} tag {job.get('tag')}")
        if job.get("dump"):
            torch.save(expert_state_dump(engine), f"{job['dump']}.{rank}.pt")
        start = int(engine.global_steps)
        result["global_steps"] = start
        result["losses"] = train_steps(engine, job, start, job.get("steps", 2), dp_rank, micro)
    else:
        raise SystemExit(f"unknown job kind {job['kind']!r}")
    finish_job(result, job, rank, t0)
    del engine
    dist.barrier()
    return result


def main(argv=None):
    from .ds_train import main as ds_main

    ds_main(argv, run=run_job)


if __name__ == "__main__":
    main()
