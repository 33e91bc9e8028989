"""A small GPT-style model, its synthetic data and its parallelisation, shared by the tests, benchmarks and `ucp demo`.

`ucp_store.distributed` must prove that a training state saved on one DeviceMesh resumes bit-exactly on another.
That needs a model whose parameters take every placement the stacks produce: tensor parallelism
(`parallelize_module`: column-wise ``Shard(0)``, row-wise ``Shard(1)``, vocabulary-sharded embedding),
FSDP2 (`fully_shard`: ``Shard(0)`` over data parallel, ``_StridedShard`` when stacked over TP) and HSDP
(replicate x shard). The widths are chosen so that an FSDP split over 3 ranks does not divide evenly
(``dim=40``, ``ffn=88``, ``vocab=64``), while every TP and 2x2 split does (``_StridedShard`` needs even splits).

Everything is deterministic: `build_model(cfg, seed)` initialises from a seed on the CPU (so every rank and
every mesh starts from the same full weights), `batch(cfg, step, ...)` draws the token batch of a step from
a seeded generator, and `parallelize(model, mesh, tp=..., dp=...)` shards an already-initialised model.
The model runs on whatever device the mesh has (CPU with gloo here, CUDA with NCCL on GPUs).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ucp_store.errors import ConfigurationError

__all__ = [
    "GPT",
    "ModelConfig",
    "batch",
    "build_model",
    "build_optimizer",
    "make_mesh",
    "parallelize",
    "train_step",
]


@dataclass(frozen=True)
class ModelConfig:
    """Widths of the demo model and of its synthetic batches.

    `batch_size` is the global batch (split over data-parallel ranks, so it must divide by dp);
    `tie` shares the embedding with the output projection.
    """

    vocab: int = 64
    dim: int = 40
    heads: int = 4
    layers: int = 2
    ffn: int = 88
    seq: int = 16
    batch_size: int = 12
    tie: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ConfigurationError(
                f"ModelConfig: dim={self.dim} must be divisible by heads={self.heads}"
            )
        for field in ("vocab", "dim", "heads", "layers", "ffn", "seq", "batch_size"):
            if getattr(self, field) < 1:
                raise ConfigurationError(
                    f"ModelConfig: {field} must be >= 1, got {getattr(self, field)}"
                )

    def to_json(self) -> dict:
        """The configuration as a JSON-able dict (for provenance and demo manifests)."""
        return asdict(self)


class Attention(nn.Module):
    """Causal multi-head self-attention; heads split over TP ranks through column-wise q/k/v."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under TP each rank holds heads // tp of them (the projections return local tensors).
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: w1 (gate) and w3 (up) column-wise, w2 (down) row-wise under TP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block (LayerNorm with bias, so norms give replicated 1-D tensors)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim)
        self.feed_forward = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Token embedding, `layers` blocks, final norm and an output projection (tied to the embedding if asked)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm = nn.LayerNorm(cfg.dim)
        self.output = None if cfg.tie else nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h)
        if self.output is not None:
            return self.output(h)
        return _tied_logits(h, self.tok_embeddings.weight)


def _tied_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits through the embedding matrix; under TP the (vocab-sharded) weight gives vocab-sharded logits."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        h_dt = DTensor.from_local(h, mesh, [Replicate()] * mesh.ndim, run_check=False)
        logits = cast(DTensor, F.linear(h_dt, weight))  # DTensor in, DTensor out (torch types it as Tensor)
        return logits.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
    return F.linear(h, weight)


def build_model(
    cfg: ModelConfig | None = None, seed: int = 0, device: str | torch.device = "cpu"
) -> GPT:
    """The model with deterministic weights: initialised on the CPU from `seed`, then moved to `device`.

    The same (cfg, seed) gives the same full weights on every rank and every mesh.
    """
    cfg = cfg or ModelConfig()
    gen = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        model = GPT(cfg)
    for name, p in sorted(model.named_parameters()):
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("norm.bias"):
                p.zero_()
            else:
                std = (
                    0.02
                    if p.dim() == 2 and "embeddings" in name
                    else 1.0 / math.sqrt(p.shape[-1])
                )
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.to(device)


def build_optimizer(model: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    """AdamW over the (possibly sharded) parameters; `foreach=False` keeps DTensor op coverage simple."""
    return torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=0.01, foreach=False
    )


def batch(
    cfg: ModelConfig,
    step: int,
    *,
    seed: int = 0,
    dp_rank: int = 0,
    dp: int = 1,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) of `step` for data-parallel rank `dp_rank` of `dp`.

    The global batch depends only on (cfg, seed, step); each dp rank takes its contiguous rows, so the
    same step on any mesh sees the same global data.
    """
    if dp < 1 or not 0 <= dp_rank < dp:
        raise ConfigurationError(f"batch: dp_rank={dp_rank} must lie in [0, dp={dp})")
    if cfg.batch_size % dp:
        raise ConfigurationError(
            f"batch: batch_size={cfg.batch_size} must be divisible by dp={dp}"
        )
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch_size, cfg.seq + 1), generator=gen)
    per = cfg.batch_size // dp
    rows = tokens[dp_rank * per : (dp_rank + 1) * per].to(device)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def make_mesh(
    *, tp: int = 1, dp: int = 1, replicate: int = 1, device_type: str | None = None
):
    """A DeviceMesh for the demo layouts (needs an initialised process group of tp*dp*replicate ranks).

    Dim names: ``("dp", "tp")`` for TP x FSDP, ``("dp",)`` or ``("tp",)`` alone, ``("replicate", "dp")``
    for HSDP. Returns None for a single rank.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if replicate > 1 and tp > 1:
        raise ConfigurationError(
            "make_mesh: HSDP (replicate>1) together with tp>1 is not a demo layout"
        )
    shape, names = [], []
    for size, name in ((replicate, "replicate"), (dp, "dp"), (tp, "tp")):
        if size < 1:
            raise ConfigurationError(f"make_mesh: {name} must be >= 1, got {size}")
        if size > 1:
            shape.append(size)
            names.append(name)
    if not shape:
        return None
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


def parallelize(
    model: GPT, mesh, *, tp: int = 1, dp: int = 1, replicate: int = 1
) -> GPT:
    """Shard `model` in place over `mesh`: TP (`parallelize_module`) on the "tp" dim, then FSDP2 (`fully_shard`).

    `mesh` comes from `make_mesh` (or None / a single rank: the model is returned unchanged). tp, dp and
    replicate must match the mesh's named dims. FSDP shards each block and then the root; with a
    "replicate" dim it is HSDP over the 2-D (replicate, dp) mesh.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if mesh is None:
        if tp * dp * replicate != 1:
            raise ConfigurationError(
                f"parallelize: no mesh given for tp={tp}, dp={dp}, replicate={replicate}"
            )
        return model
    names = tuple(mesh.mesh_dim_names or ())
    sizes = dict(zip(names, mesh.mesh.shape))
    for name, want in (("tp", tp), ("dp", dp), ("replicate", replicate)):
        have = sizes.get(name, 1)
        if have != want:
            raise ConfigurationError(
                f"parallelize: {name}={want} but the mesh {dict(sizes)} has {name}={have} (dims {names})"
            )
    if tp > 1:
        tp_mesh = mesh["tp"]
        parallelize_module(
            model,
            tp_mesh,
            {
                "tok_embeddings": RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=Replicate()
                )
            },
        )
        for block in model.layers.values():
            parallelize_module(
                block,
                tp_mesh,
                {
                    "attention.wq": ColwiseParallel(),
                    "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(),
                    "attention.wo": RowwiseParallel(),
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w3": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(),
                },
            )
        if model.output is not None:
            parallelize_module(
                model, tp_mesh, {"output": ColwiseParallel(output_layouts=Replicate())}
            )
    if dp > 1 or replicate > 1:
        fsdp_mesh = mesh["replicate", "dp"] if replicate > 1 else mesh["dp"]
        for block in model.layers.values():
            fully_shard(block, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    return model


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
):
    """One forward/backward/optimizer step; returns this rank's (local batch) loss as a float.

    FSDP averages the gradients over data-parallel ranks; the returned loss is not reduced.
    """
    optimizer.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
    )
    loss.backward()
    optimizer.step()
    return float(loss.detach().item())
