"""Train tiny models with real DeepSpeed on CPU, save checkpoints, convert, resume; record losses as JSON.

Run under torchrun (gloo), e.g.::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 -m ucp_store.demo.ds_train --jobs jobs.json

(``tools/ds_train.py`` runs the same; ``ucp demo --deepspeed`` and the DeepSpeed tests use it.)

``jobs.json`` is a list of jobs executed one after the other in the same process group (one launch
for many checkpoints keeps the test-suite fast on 2 cores). A single job can also be given inline with
``--job '{...}'``. Job keys:

- ``kind``: ``"train"`` (train ``steps`` steps from a seeded init, save ``save_dir/tag``, then keep
  training ``next_steps`` steps to record the uninterrupted continuation) or ``"resume"`` (build the
  same model, ``load_checkpoint(load_dir, tag)`` with ``{"checkpoint": {"load_universal": true}}``,
  train ``steps`` steps).
- ``model``: ``mlp`` (odd sizes: ZeRO padding, a parameter straddling the DP partitions, two param
  groups, a frozen parameter and a buffer), ``pipe`` (``PipelineModule`` with ``stages`` stages, ZeRO 0/1),
  ``tp`` (AutoTP training, ``tensor_parallel.autotp_size = tp``, fused gate/up + row-parallel down),
  ``big`` (a stack of ``layers`` Linear(``width``) layers for the benchmark).
- ``zero`` (0-3), ``dtype`` (``bf16``/``fp16``/``fp32``), ``sub_group_size`` (ZeRO-3), ``seed``,
  ``grad_accum_dtype`` (``"fp32"`` with bf16 + ZeRO-1 selects DeepSpeed's ``BF16_Optimizer``).
- ``convert``: after saving, rank 0 runs ``python -m deepspeed.checkpoint.ds_to_universal``
  into ``save_dir/<tag>_universal`` (``--inject_missing_state``).
- ``out``: where rank 0 writes ``{"losses": [...], "losses_hex": [...], ...}``.

Losses are the mean over the *global* batch (all-reduced), so the same step at DP 1 and DP 2 sees the
same data. ``losses_hex`` are ``float.hex`` strings for bit-exact comparison between two resumes at the
same topology (ours vs ds_to_universal's folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

__all__ = ["main", "run_job"]

import torch
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH = 8


# ------------------------------------------------------------------------------------------- models
class MLP(nn.Module):
    """Odd sizes: 214 trainable elements, so DP=2 pads the flat group and norm.weight straddles ranks."""

    def __init__(self, din=7, hidden=13, dout=6):
        super().__init__()
        self.fc1 = nn.Linear(din, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, dout)
        self.frozen = nn.Linear(dout, dout, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, dout))
        self.din, self.dout = din, dout

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = self.norm(h)
        h = self.fc2(h)
        return self.frozen(h) + self.shift


class Block(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.gate_up_proj = nn.Linear(d, 2 * f)
        self.down_proj = nn.Linear(f, d)

    def forward(self, x):
        g, u = self.gate_up_proj(self.norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(g) * u)


class TPNet(nn.Module):
    """For AutoTP: a fused gate/up column-parallel projection (2 sub-params), a row-parallel down
    projection, replicated norms and head."""

    def __init__(self, din=6, d=8, f=6, nblocks=2, dout=5):
        super().__init__()
        self.inp = nn.Linear(din, d)
        self.layers = nn.ModuleList([Block(d, f) for _ in range(nblocks)])
        self.head = nn.Linear(d, dout)
        self.din, self.dout = din, dout

    def forward(self, x):
        h = self.inp(x)
        for b in self.layers:
            h = b(h)
        return self.head(h)


class Big(nn.Module):
    def __init__(self, width=2048, layers=36):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.din = self.dout = width

    def forward(self, x):
        for i, lin in enumerate(self.layers):
            x = lin(x)
            if i + 1 < len(self.layers):
                x = torch.tanh(x)
        return x


def _pipe_model(job):
    from deepspeed.pipe import LayerSpec, PipelineModule

    class Act(nn.Module):
        def forward(self, x):
            return torch.tanh(x)

    class ToFloat(nn.Module):  # the loss in fp32, so resumed losses compare meaningfully
        def forward(self, x):
            return x.float()

    layers = [
        LayerSpec(nn.Linear, 7, 13),
        LayerSpec(Act),
        LayerSpec(nn.Linear, 13, 11),
        LayerSpec(Act),
        LayerSpec(nn.Linear, 11, 9),
        LayerSpec(Act),
        LayerSpec(nn.Linear, 9, 6),
        LayerSpec(ToFloat),
    ]
    model = PipelineModule(layers=layers, num_stages=job.get("stages", 2), loss_fn=nn.MSELoss(),
                           partition_method="uniform")
    model.din, model.dout = 7, 6
    return model


def build_model(job):
    torch.manual_seed(job.get("seed", 1234))
    kind = job["model"]
    if kind == "mlp":
        return MLP()
    if kind == "tp":
        return TPNet()
    if kind == "big":
        return Big(job.get("width", 2048), job.get("layers", 36))
    if kind == "pipe":
        return _pipe_model(job)
    raise SystemExit(f"unknown model {kind!r}")


def param_groups(model, job):
    if job["model"] == "pipe" or job["model"] == "big":
        return [p for p in model.parameters() if p.requires_grad]
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if (n.endswith("bias") or "norm" in n) else decay).append(p)
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def ds_config(job, world, universal=False):
    zero = job.get("zero", 1)
    tp = job.get("tp", 1) if job["model"] == "tp" else 1
    pp = job.get("stages", 2) if job["model"] == "pipe" else 1
    dp = max(1, world // (tp * pp))
    gas = 2 if job["model"] == "pipe" else 1
    micro = GLOBAL_BATCH // (dp * gas)
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 10}},
        "zero_optimization": {"stage": zero},
        "gradient_clipping": 1.0,
    }
    if zero == 3:
        cfg["zero_optimization"].update({"sub_group_size": job.get("sub_group_size", 100),
                                         "stage3_param_persistence_threshold": 0})
    if zero in (1, 2):
        cfg["zero_optimization"].update({"reduce_bucket_size": 10 ** 7, "allgather_bucket_size": 10 ** 7})
    dtype = job.get("dtype", "bf16")
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    if job["model"] == "tp":
        cfg["tensor_parallel"] = {
            "autotp_size": tp,
            "partition_config": {
                "use_default_specs": False,
                "layer_specs": [
                    {"patterns": [r".*\.down_proj\.weight$"], "partition_type": "row"},
                    {"patterns": [r".*\.gate_up_proj\.weight$"], "partition_type": "column",
                     "shape": [2, -1], "partition_dim": 0},
                ],
            },
        }
    if job.get("grad_accum_dtype"):
        # bf16 + ZeRO-1 + fp32 gradient accumulation selects DeepSpeed's BF16_Optimizer
        cfg["data_types"] = {"grad_accum_dtype": job["grad_accum_dtype"]}
    if job["model"] == "tp":
        # DeepSpeed checks train_batch_size against the full world size before AutoTP divides it by
        # the TP degree; give micro-batch and accumulation only.
        del cfg["train_batch_size"]
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg, dp, micro, gas


# --------------------------------------------------------------------------------------------- data
def global_batch(step, din, dout, seed):
    g = torch.Generator().manual_seed(seed * 100003 + step)
    x = torch.randn(GLOBAL_BATCH, din, generator=g)
    y = torch.randn(GLOBAL_BATCH, dout, generator=g)
    return x, y


def _dtype(job):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.get("dtype", "bf16"), torch.float32)


def train_steps(engine, job, start, count, dp_rank, dp, micro, gas):
    import deepspeed.comm as dist

    model = engine.module
    din, dout = model.din, model.dout
    dt = _dtype(job)
    losses = []
    for step in range(start, start + count):
        x, y = global_batch(step, din, dout, job.get("data_seed", 7))
        if job["model"] == "pipe":
            # micro-batch k of this DP rank: rows [(dp_rank * gas + k) * micro, ...)
            micro_batches = []
            for k in range(gas):
                lo = (dp_rank * gas + k) * micro
                micro_batches.append((x[lo:lo + micro].to(dt), y[lo:lo + micro]))
            loss = engine.train_batch(data_iter=iter(micro_batches))
            val = torch.tensor([float(loss)], dtype=torch.float64)
        else:
            lo = dp_rank * micro
            xb, yb = x[lo:lo + micro].to(dt), y[lo:lo + micro]
            out = engine(xb)
            loss = F.mse_loss(out.float(), yb)
            engine.backward(loss)
            engine.step()
            val = torch.tensor([loss.item()], dtype=torch.float64)
        if job["model"] != "pipe":
            dist.all_reduce(val)
            val /= dist.get_world_size()
        losses.append(float(val.item()))
    return losses


def make_engine(job, universal=False):
    import deepspeed
    import deepspeed.comm as dist

    world = dist.get_world_size()
    cfg, dp, micro, gas = ds_config(job, world, universal=universal)
    model = build_model(job)
    params = param_groups(model, job)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    if job["model"] == "pipe":
        dp_rank = engine.grid.data_parallel_id
    elif job["model"] == "tp":
        dp_rank = 0 if dp == 1 else dist.get_rank() // job.get("tp", 1)
    else:
        dp_rank = dist.get_rank()
    return engine, dp_rank, dp, micro, gas


def run_job(job):
    import deepspeed.comm as dist

    rank = dist.get_rank()
    t0 = time.time()
    result = {"job": job, "world": dist.get_world_size()}
    if job["kind"] == "train":
        engine, dp_rank, dp, micro, gas = make_engine(job)
        steps = job.get("steps", 3)
        result["losses_before"] = train_steps(engine, job, 0, steps, dp_rank, dp, micro, gas)
        save_dir, tag = job["save_dir"], job.get("tag", f"global_step{steps}")
        engine.save_checkpoint(save_dir, tag=tag, client_state=job.get("client_state", {}))
        dist.barrier()
        result["save_s"] = time.time() - t0
        if job.get("convert") and rank == 0:
            t1 = time.time()
            cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                   os.path.join(save_dir, tag), "--output_folder", os.path.join(save_dir, f"{tag}_universal"),
                   "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
                raise SystemExit(f"ds_to_universal failed for {save_dir}/{tag}")
            result["convert_s"] = time.time() - t1
        dist.barrier()
        nxt = job.get("next_steps", 0)
        result["losses"] = train_steps(engine, job, steps, nxt, dp_rank, dp, micro, gas) if nxt else []
    elif job["kind"] == "resume":
        engine, dp_rank, dp, micro, gas = make_engine(job, universal=True)
        load_path, _client = engine.load_checkpoint(job["load_dir"], tag=job.get("tag"),
                                                   load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise SystemExit(f"load_checkpoint found nothing in {job['load_dir']} tag {job.get('tag')}")
        start = int(engine.global_steps)
        result["global_steps"] = start
        result["lr"] = [g["lr"] for g in engine.optimizer.param_groups]
        result["losses"] = train_steps(engine, job, start, job.get("steps", 2), dp_rank, dp, micro, gas)
    else:
        raise SystemExit(f"unknown job kind {job['kind']!r}")
    result["losses_hex"] = [float(v).hex() for v in result.get("losses", [])]
    result["wall_s"] = time.time() - t0
    if rank == 0 and job.get("out"):
        os.makedirs(os.path.dirname(os.path.abspath(job["out"])), exist_ok=True)
        with open(job["out"], "w") as f:
            json.dump(result, f, indent=1, default=str)
    if rank == 0:
        print(json.dumps({k: result[k] for k in ("losses", "wall_s") if k in result}), flush=True)
    # release the engine (and its groups' buffers) before the next job
    del engine
    dist.barrier()
    return result


def _allow_cpu_fp16() -> None:
    """DeepSpeed's CPU accelerator offers fp16 only where oneDNN has fp16 kernels
    (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 / AMX-FP16 CPUs). Elsewhere (e.g. AMD
    EPYC) torch still computes fp16 with its reference kernels, slowly but correctly, and the small test
    models need nothing more, so the guard is lifted here, in the test harness only, to let real
    DeepSpeed write real fp16 (FP16_Optimizer, loss scaler) checkpoints on any CPU."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if not acc.is_fp16_supported():
        type(acc).is_fp16_supported = lambda self: True
        print("ds_train: this CPU has no oneDNN fp16 kernels; DeepSpeed's fp16 guard lifted for the harness",
              file=sys.stderr)


def main(argv=None, run=None):
    """Run the jobs named on the command line, each with ``run`` (default: this harness's ``run_job``).

    ``tools/ds_direct.py`` passes its own job runner and shares the rest (arguments, DeepSpeed set-up,
    tear-down)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", help="JSON file with a list of jobs")
    ap.add_argument("--job", action="append", default=[], help="one job as inline JSON (repeatable)")
    args = ap.parse_args(argv)
    jobs = []
    if args.jobs:
        with open(args.jobs) as f:
            jobs.extend(json.load(f))
    jobs.extend(json.loads(j) for j in args.job)
    if not jobs:
        ap.error("give --jobs FILE or --job JSON")

    import deepspeed

    if any(j.get("dtype") == "fp16" for j in jobs):
        _allow_cpu_fp16()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    for job in jobs:
        (run or run_job)(job)
    import deepspeed.comm as dist

    dist.barrier()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

if __name__ == "__main__":
    main()
