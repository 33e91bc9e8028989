"""Train a tiny mixture-of-experts model with real DeepSpeed (``deepspeed.moe.layer.MoE``) on CPU.

Run under torchrun (gloo) like ``ds_train`` (whose argument handling and set-up it shares)::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 tools/ds_moe.py --jobs jobs.json

Job keys (besides ``ds_train``'s ``zero``, ``dtype``, ``steps``, ``out``):

- ``kind``: ``"train"`` (train ``steps`` steps, save ``save_dir/tag``, optionally run ``ds_to_universal``
  on it (``convert``: its exit status and last error line go into the result, a failure is recorded,
  not raised), then ``next_steps`` more steps: the uninterrupted continuation), ``"resume_ucp"``
  (build the engine at expert-parallel degree ``ep``, ``ucp_store.deepspeed.moe.load_engine``
  from ``store``/``ref``, dump the optimizer state per expert, train ``steps`` steps) or
  ``"resume_universal"`` (``load_checkpoint(load_dir, tag)`` with ``load_universal``).
- ``ep``: expert-parallel degree (default 2); ``experts`` (default 4); ``moe_layers`` (default 2).
- ``tp``: tensor-parallel degree of the dense part (default 1: ``MoENet``). With ``tp`` given, the model is
  ``MoETPNet`` (Megatron-style column/row-parallel MLP blocks from ``ds_train`` between the MoE layers) and
  the engine gets an mpu (DeepSpeed's ``PipelineParallelGrid`` over ``num_mp=tp``, tp fastest); the
  experts are not tensor-parallel, so DeepSpeed's MoE builds its groups the default (E+D) way over the
  whole tp x dp world: ep rank = global rank % ep, the expert ZeRO group every ep-th rank.
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

from ucp_store.demo.ds_train import finish_job

GLOBAL_BATCH = 16  # 4 tokens per rank at dp=4: DeepSpeed's gate needs at least min_capacity tokens

__all__ = ["MoENet", "MoETPNet", "run_job", "expert_state_dump", "main"]

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


# what ds_to_universal and the reader need to know about MoETPNet's TP layout (as Megatron-DeepSpeed passes it);
# the other TP-split parameters (dense_h_to_4h) are column-parallel (cat dim 0)
MOE_TP_UCI = {
    "universal_checkpoint_version": 0.2,
    "tp_replicated_parameter_patterns": [r"^inp\.(weight|bias)$", r"^head\.(weight|bias)$",
                                         r"^norms\.\d+\.(weight|bias)$", r".*\.dense_4h_to_h\.bias$",
                                         r".*\.gate\.wg\.weight$"],
    "parameter_with_row_parallelism_patterns": [r".*\.dense_4h_to_h\.weight$"],
}


class MoETPNet(nn.Module):
    """``inp`` -> ``moe_layers`` x (a residual tensor-parallel MLP block: LayerNorm, column-parallel
    ``dense_h_to_4h``, row-parallel ``dense_4h_to_h``; then a residual MoE layer) -> ``head``. Every
    TP-split weight is a slice of the same full tensor, so the model is the same function at every TP degree;
    the replicated parameters are seeded alike on every rank."""

    def __init__(self, tp: int, tp_rank: int, ep: int, experts: int = 4, moe_layers: int = 2, din: int = 8,
                 dout: int = 6, seed: int = 1234):
        from deepspeed.moe.layer import MoE

        from ucp_store.demo.ds_train import ParallelMLP, _Linear

        super().__init__()
        self.inp = _Linear(din, HIDDEN, seed)
        self.norms = nn.ModuleList()
        self.blocks = nn.ModuleList()
        for i in range(moe_layers):
            torch.manual_seed(seed + 100 * (i + 1))
            norm = nn.LayerNorm(HIDDEN)
            with torch.no_grad():
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.1, 0.1)
            self.norms.append(norm)
            self.blocks.append(ParallelMLP(HIDDEN, 2 * HIDDEN, tp, tp_rank, seed + 100 * (i + 1) + 10))
        torch.manual_seed(seed + 1)
        self.moe = nn.ModuleList([
            MoE(hidden_size=HIDDEN, expert=ExpertMLP(), num_experts=experts, ep_size=ep, k=1,
                capacity_factor=float(experts), eval_capacity_factor=float(experts), min_capacity=1)
            for _ in range(moe_layers)])
        self.head = _Linear(HIDDEN, dout, seed + 7)
        self.din, self.dout = din, dout
        self.universal_checkpoint_info = MOE_TP_UCI

    def set_tp_group(self, group) -> None:
        from ucp_store.demo.ds_train import ColumnParallelLinear, RowParallelLinear

        for m in self.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                m.group = group

    def forward(self, x):
        h = self.inp(x)
        aux = h.new_zeros((), dtype=torch.float32)
        for norm, block, layer in zip(self.norms, self.blocks, self.moe):
            h = h + block(norm(h))
            out, l_aux, _ = layer(h)
            h = h + out
            aux = aux + l_aux.float()
        return self.head(h), aux


def _distinct_experts(model: nn.Module, ep_rank: int, seed: int) -> None:
    """Give every expert its own values, seeded by (layer, global expert id)."""
    with torch.no_grad():
        layers: Any = model.moe
        for li, layer in enumerate(layers):
            local: Any = layer.deepspeed_moe.experts.deepspeed_experts
            for j, expert in enumerate(local):
                g = torch.Generator().manual_seed(seed * 1000 + li * 100 + ep_rank * len(local) + j)
                for p in expert.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _gloo_gather_tokens() -> None:
    """DeepSpeed's ``moe.mappings._gather_tokens`` all-gathers an ``[e, c, m]`` tensor into a flat buffer of
    ``tp`` times its elements; gloo's ``all_gather_into_tensor`` splits the output along dim 0 and refuses
    that ("invalid tensor size at index 0 (expected (4, 4, 16), got (256))"). Gather the flattened input
    instead (the same bytes in the same order), for the harness on CPU only."""
    import deepspeed
    from deepspeed.moe import mappings

    if getattr(mappings, "_ucp_gloo_patch", False) or torch.distributed.get_backend() != "gloo":
        return
    orig = mappings._gather_tokens

    def gather(input_, dim=0):
        mpu = deepspeed.utils.groups.mpu
        world = mappings.bwc_tensor_model_parallel_world_size(mpu)
        if world == 1:
            return input_.contiguous()
        flat = input_.contiguous().reshape(-1)
        buf = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
        deepspeed.comm.all_gather_into_tensor(buf, flat, group=mappings.bwc_tensor_model_parallel_group(mpu))
        parts = [buf.narrow(0, flat.numel() * i, flat.numel()).view_as(input_) for i in range(world)]
        return torch.cat(parts, dim=dim).contiguous()

    gather.__wrapped__ = orig  # type: ignore[attr-defined]
    mappings._gather_tokens = gather
    mappings._ucp_gloo_patch = True


def _fresh_groups() -> None:
    """Forget the process groups (and mpu) an earlier job's engine registered in DeepSpeed's process-global
    ``groups`` module: its MoE groups are keyed by ``ep_size_<ep>`` only, so a later engine of the same ep but
    another mesh would reuse them. (References only: nothing is destroyed.)"""
    from deepspeed.utils import groups

    groups._release_process_group_references(None)


def build(job):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    _fresh_groups()
    _gloo_gather_tokens()
    world, rank = dist.get_world_size(), dist.get_rank()
    ep = job.get("ep", 2)
    seed = job.get("seed", 1234)
    torch.manual_seed(seed)
    mpu, dp_rank, dp = None, rank, world
    if "tp" in job:
        from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

        tp = job["tp"]
        if world % tp:
            raise SystemExit(f"ds_moe: world size {world} is not a multiple of tp={tp}")
        dp = world // tp
        mpu = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=tp, num_dp=dp))
        dp_rank = mpu.get_data_parallel_id()
        model: nn.Module = MoETPNet(tp, mpu.get_slice_parallel_rank(), ep, job.get("experts", 4),
                                    job.get("moe_layers", 2), seed=seed)
        model.set_tp_group(mpu.get_slice_parallel_group())  # type: ignore[operator]
    else:
        model = MoENet(ep, job.get("experts", 4), job.get("moe_layers", 2))
    # DeepSpeed's default (E+D) expert groups: consecutive global ranks form an expert-parallel group
    _distinct_experts(model, rank % ep, seed)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "main"})
    micro = GLOBAL_BATCH // dp
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
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg, mpu=mpu)
    from ucp_store.deepspeed.moe import ep_of

    if ep_of(engine)[1] != rank % ep:
        raise SystemExit(f"ds_moe: rank {rank} is ep rank {ep_of(engine)[1]} in DeepSpeed's groups, expected "
                         f"{rank % ep}")
    return engine, dp_rank, world, micro


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
    from ucp_store.deepspeed.moe import engine_param_shares

    out = {}
    for name, pieces in engine_param_shares(engine).items():
        for state, (start, stop, tensor) in pieces.items():
            out[(name, state)] = (start, stop, tensor.clone())
    return out


def _universal_experts(folder: str) -> dict:
    """``{expert parameter: [shape of its fp32]}`` of what ds_to_universal wrote under ``folder/zero``."""
    from ucp_store import safe_pickle

    zero = os.path.join(folder, "zero")
    out = {}
    for name in sorted(os.listdir(zero)) if os.path.isdir(zero) else []:
        path = os.path.join(zero, name, "fp32.pt")
        if ".deepspeed_experts." in name and os.path.exists(path):
            obj = safe_pickle.load(path, mmap=False)
            t = obj["param"] if isinstance(obj, dict) else obj
            out[name] = list(t.shape)
    return out


def run_job(job):
    import deepspeed.comm as dist

    rank = dist.get_rank()
    t0 = time.time()
    result = {"job": job, "world": dist.get_world_size()}
    if job["kind"] == "import":  # rank 0 imports save_dir/tag into store as run (one process, no collectives)
        if rank == 0:
            from ucp_store import open_store
            from ucp_store.deepspeed.source import import_deepspeed

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
            result["convert"] = {"returncode": proc.returncode, "error": errs[-1] if errs else None,
                                 "experts": _universal_experts(os.path.join(save_dir, f"{tag}_universal"))}
        dist.barrier()
        nxt = job.get("next_steps", 0)
        result["losses"] = train_steps(engine, job, steps, nxt, dp_rank, micro) if nxt else []
    elif job["kind"] in ("resume_ucp", "resume_universal"):
        if job["kind"] == "resume_ucp":
            from ucp_store.deepspeed.moe import load_engine

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
    from ucp_store.demo.ds_train import main as ds_main

    ds_main(argv, run=run_job)


if __name__ == "__main__":
    main()
