"""Train tiny models with real DeepSpeed on CPU, save checkpoints, convert, resume; record losses as JSON.

Run under torchrun (gloo), e.g.::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 -m ucp_store.demo.ds_train --jobs jobs.json

(``ucp demo --deepspeed``, the DeepSpeed tests and the harnesses in ``tools/`` use it.)

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
  ``big`` (a stack of ``layers`` Linear(``width``) layers for the benchmark), ``pipe3d`` (Megatron-style
  tensor x pipeline x data parallelism: a ``PipelineModule`` over ``PipeModelDataParallelTopology`` with
  ``stages`` stages and ``tp`` tensor ranks; ``blocks`` MLP blocks of hand-written column/row-parallel
  linears (Megatron's names ``mlp.dense_h_to_4h`` / ``mlp.dense_4h_to_h``) whose collectives run on the
  grid's tensor group, width ``hidden``; the model records its ``universal_checkpoint_info``;
  ``average_norms``: its layer norms listed as averaged over the TP ranks instead of replicated; ``extras``: the
  norm biases frozen and a buffer in every block).
- ``zero`` (0-3), ``dtype`` (``bf16``/``fp16``/``fp32``), ``sub_group_size`` (ZeRO-3), ``seed``,
  ``grad_accum_dtype`` (``"fp32"`` with bf16 + ZeRO-1 selects DeepSpeed's ``BF16_Optimizer``).
- ``convert``: after saving, rank 0 runs ``python -m deepspeed.checkpoint.ds_to_universal``
  into ``save_dir/<tag>_universal`` (``--inject_missing_state``).
- ``dump`` (resume jobs): a path prefix; after loading, every rank writes ``<dump>_rank<R>.pt`` with the
  ZeRO partitions DeepSpeed's loader put into its optimizer (``fp32``, ``exp_avg``, ``exp_avg_sq`` per
  parameter group, the group's parameter names, and the rank's tp/pp/dp coordinates), so a test can
  compare them with what ``load_shard`` plans for that rank.
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

__all__ = ["finish_job", "main", "run_job"]

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


# ----------------------------------------------------------------- Megatron-style TP x PP x DP model
class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, gradient all-reduced over the tensor group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: output all-reduced over the tensor group forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _full_init(seed: int, out_f: int, in_f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full (TP=1) weight and bias of a parallel linear: each TP rank takes its slice of the same
    tensors, so the model is the same function at every TP degree."""
    g = torch.Generator().manual_seed(seed)
    bound = 1.0 / in_f ** 0.5
    return ((torch.rand(out_f, in_f, generator=g) * 2 - 1) * bound, (torch.rand(out_f, generator=g) * 2 - 1) * bound)


def _mark_tp(p: torch.Tensor, dim: int) -> None:
    # DeepSpeed's gradient norm counts a parameter with these attributes on every TP rank, the others once
    p.tensor_model_parallel = True  # type: ignore[attr-defined]
    p.model_parallel = True  # type: ignore[attr-defined]
    p.partition_dim = dim  # type: ignore[attr-defined]
    p.partition_stride = 1  # type: ignore[attr-defined]


class ColumnParallelLinear(nn.Module):
    """Rows of the weight (and the bias) split over the tensor ranks; input replicated, output split."""

    def __init__(self, in_f, out_f, tp, tp_rank, seed):
        super().__init__()
        w, b = _full_init(seed, out_f, in_f)
        part = out_f // tp
        self.weight = nn.Parameter(w[tp_rank * part:(tp_rank + 1) * part].clone())
        self.bias = nn.Parameter(b[tp_rank * part:(tp_rank + 1) * part].clone())
        _mark_tp(self.weight, 0)
        _mark_tp(self.bias, 0)
        self.tp, self.group = tp, None

    def forward(self, x):
        if self.tp > 1:
            x = _CopyToTP.apply(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Columns of the weight split over the tensor ranks; input split, output all-reduced, then the
    (replicated) bias added."""

    def __init__(self, in_f, out_f, tp, tp_rank, seed):
        super().__init__()
        w, b = _full_init(seed, out_f, in_f)
        part = in_f // tp
        self.weight = nn.Parameter(w[:, tp_rank * part:(tp_rank + 1) * part].clone())
        self.bias = nn.Parameter(b.clone())
        _mark_tp(self.weight, 1)
        self.tp, self.group = tp, None

    def forward(self, x):
        y = F.linear(x, self.weight)
        if self.tp > 1:
            y = _ReduceFromTP.apply(y, self.group)
        return y + self.bias


class ParallelMLP(nn.Module):
    def __init__(self, d, f, tp, tp_rank, seed):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(d, f, tp, tp_rank, seed)
        self.dense_4h_to_h = RowParallelLinear(f, d, tp, tp_rank, seed + 1)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class ParallelBlock(nn.Module):
    def __init__(self, d, f, tp, tp_rank, seed, extras=False):
        super().__init__()
        torch.manual_seed(seed)
        self.input_layernorm = nn.LayerNorm(d)
        with torch.no_grad():  # not the default ones/zeros, so a mix-up of blocks would show
            self.input_layernorm.weight.uniform_(0.5, 1.5)
            self.input_layernorm.bias.uniform_(-0.1, 0.1)
        self.mlp = ParallelMLP(d, f, tp, tp_rank, seed + 10)
        if extras:  # a frozen norm bias and a (TP-replicated) buffer: weights outside the optimizer
            self.input_layernorm.bias.requires_grad_(False)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x + self.mlp(self.input_layernorm(x))


class _Linear(nn.Linear):
    def __init__(self, din, dout, seed):
        torch.manual_seed(seed)
        super().__init__(din, dout)


class _ToFloat(nn.Module):  # the loss in fp32, so resumed losses compare meaningfully
    def forward(self, x):
        return x.float()


# what ds_to_universal and DeepSpeed's universal loader need to know about the TP layout (Megatron-DeepSpeed
# passes the same in its model states); the other TP-split parameters are column-parallel (cat dim 0)
PIPE3D_UCI = {
    "universal_checkpoint_version": 0.2,
    "tp_replicated_parameter_patterns": [r".*\.input_layernorm\.(weight|bias)$", r".*\.dense_4h_to_h\.bias$",
                                         r"^\d+\.(weight|bias)$"],
    "parameter_with_row_parallelism_patterns": [r".*\.dense_4h_to_h\.weight$"],
}


# the same, with the layer norms averaged over the TP ranks (Megatron-DeepSpeed's parameter_to_average_patterns,
# e.g. for sequence-parallel norms) instead of required equal: ``average_norms`` in a pipe3d job
PIPE3D_UCI_AVERAGED = {
    "universal_checkpoint_version": 0.2,
    "tp_replicated_parameter_patterns": [r".*\.dense_4h_to_h\.bias$", r"^\d+\.(weight|bias)$"],
    "parameter_to_average_patterns": [r".*\.input_layernorm\.(weight|bias)$"],
    "parameter_with_row_parallelism_patterns": [r".*\.dense_4h_to_h\.weight$"],
}


def _pipe3d_model(job):
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    world = torch.distributed.get_world_size()
    tp, pp = job.get("tp", 1), job.get("stages", 2)
    if world % (tp * pp):
        raise SystemExit(f"pipe3d: world size {world} is not a multiple of tp={tp} x stages={pp}")
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (tp * pp))
    tp_rank = topo.get_coord(torch.distributed.get_rank()).model
    d, f, seed = job.get("hidden", 32), 2 * job.get("hidden", 32), job.get("seed", 1234)
    din, dout = 7, 6
    layers = [LayerSpec(_Linear, din, d, seed)]
    layers += [LayerSpec(ParallelBlock, d, f, tp, tp_rank, seed + 100 * (i + 1), bool(job.get("extras")))
               for i in range(job.get("blocks", 4))]
    layers += [LayerSpec(_Linear, d, dout, seed + 7), LayerSpec(_ToFloat)]
    model = PipelineModule(layers=layers, topology=topo, loss_fn=nn.MSELoss(), partition_method="uniform")
    group = model._grid.get_slice_parallel_group()
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m.group = group
    # DeepSpeed saves a module's universal_checkpoint_info into every model-state file
    model.universal_checkpoint_info = PIPE3D_UCI_AVERAGED if job.get("average_norms") else PIPE3D_UCI
    model.din, model.dout = din, dout
    return model


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
    if kind == "pipe3d":
        return _pipe3d_model(job)
    raise SystemExit(f"unknown model {kind!r}")


def param_groups(model, job):
    if job["model"] in ("pipe", "pipe3d", "big"):
        return [p for p in model.parameters() if p.requires_grad]
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if (n.endswith("bias") or "norm" in n) else decay).append(p)
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def ds_config(job, world, universal=False):
    zero = job.get("zero", 1)
    tp = job.get("tp", 1) if job["model"] in ("tp", "pipe3d") else 1
    pp = job.get("stages", 2) if job["model"] in ("pipe", "pipe3d") else 1
    dp = max(1, world // (tp * pp))
    gas = 2 if _piped(job) else 1
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
def _piped(job) -> bool:
    return job["model"] in ("pipe", "pipe3d")


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
        if _piped(job):
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
        if not _piped(job):
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
    if _piped(job):
        dp_rank = engine.grid.data_parallel_id
    elif job["model"] == "tp":
        dp_rank = 0 if dp == 1 else dist.get_rank() // job.get("tp", 1)
    else:
        dp_rank = dist.get_rank()
    return engine, dp_rank, dp, micro, gas


def _dump_partitions(engine, prefix: str) -> None:
    """This rank's optimizer partitions as DeepSpeed loaded them (see the module docstring's ``dump``)."""
    from ucp_store.deepspeed.load import optimizer_groups, param_names

    _kind, lp_groups, hp_flats, inner = optimizer_groups(engine)
    names = param_names(engine)
    out: dict = {"groups": [[names[p] for p in group] for group in lp_groups],
                 "fp32": [t.detach().clone() for t in hp_flats]}
    for st in ("exp_avg", "exp_avg_sq"):
        out[st] = [inner.state[t][st].detach().clone() for t in hp_flats]
    grid = getattr(engine, "grid", None)
    if grid is not None:
        out["coords"] = {"tp": grid.get_slice_parallel_rank(), "pp": grid.get_stage_id(),
                         "dp": grid.get_data_parallel_id()}
    torch.save(out, f"{prefix}_rank{torch.distributed.get_rank()}.pt")


def finish_job(result: dict, job: dict, rank: int, t0: float) -> None:
    """Close a job's result (every harness's ``run_job``): the losses as ``float.hex`` strings, the wall time,
    and on rank 0 the JSON file ``job["out"]`` names."""
    result["losses_hex"] = [float(v).hex() for v in result.get("losses", [])]
    result["wall_s"] = time.time() - t0
    if rank == 0 and job.get("out"):
        os.makedirs(os.path.dirname(os.path.abspath(job["out"])), exist_ok=True)
        with open(job["out"], "w") as f:
            json.dump(result, f, indent=1, default=str)


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
        if job.get("dump"):
            _dump_partitions(engine, job["dump"])
        start = int(engine.global_steps)
        result["global_steps"] = start
        result["lr"] = [g["lr"] for g in engine.optimizer.param_groups]
        result["losses"] = train_steps(engine, job, start, job.get("steps", 2), dp_rank, dp, micro, gas)
    else:
        raise SystemExit(f"unknown job kind {job['kind']!r}")
    finish_job(result, job, rank, t0)
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
