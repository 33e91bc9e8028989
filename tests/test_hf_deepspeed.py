"""A DeepSpeed-trained fused-QKV Llama goes out as a Hugging Face Llama through the shipped name map.

The training job is this file run as a script under torchrun (2 gloo processes, real DeepSpeed on CPU,
ZeRO-1, fp32): a Llama-style model written in plain torch whose attention holds one fused ``qkv_proj``
(GQA: 4 query heads, 2 key/value heads, so the K and V blocks are half the size of Q) and whose MLP
holds one fused ``gate_up_proj``. It trains a few steps, saves with ``engine.save_checkpoint``, and
rank 0 records the trained weights and the model's logits on a fixed batch.

The test imports the DeepSpeed folder (``import_deepspeed``), exports the fp32 master weights with
``ucp export hf --map llama --config config.json``, loads the folder with
``LlamaForCausalLM.from_pretrained`` and checks:

- every exported tensor equals the matching slice of DeepSpeed's trained weights, bit for bit;
- the logits equal, bit for bit, those of an HF Llama into which the test itself loaded those slices;
- the logits match the fused training model's own logits (to float32 rounding: the fused model
  multiplies by one [q; k; v] matrix where HF multiplies by three, and uses its own RoPE/attention code).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ucp_test_helpers import free_port

REPO = Path(__file__).resolve().parents[1]
CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_theta=10000.0)
STEPS = 3


# ------------------------------------------------------------------------------- the training model
class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class FusedAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c["hidden_size"] // self.nh
        self.qkv_proj = nn.Linear(c["hidden_size"], (self.nh + 2 * self.nkv) * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c["hidden_size"], bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = q.view(b, t, self.nh, self.hd).transpose(1, 2)
        k = k.view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = v.view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class FusedMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_up_proj = nn.Linear(c["hidden_size"], 2 * c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], c["hidden_size"], bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = FusedAttention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = FusedMLP(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class FusedLlama(nn.Module):
    """Llama with fused projections, HF Llama's parameter names otherwise (``model.layers.N...``)."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Body(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, ids):
        c = self.c
        hd = c["hidden_size"] // c["num_attention_heads"]
        inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        pos = torch.arange(ids.shape[1], dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def batch(step: int, n: int = 8, t: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, CONFIG["vocab_size"], (n, t), generator=g)


def probe() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(99))


def train(out: str) -> None:
    """Under torchrun: DeepSpeed ZeRO-1, fp32, DP = world size; save, then rank 0 writes weights + logits."""
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = FusedLlama(CONFIG)
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8 // world, "gradient_accumulation_steps": 1,
           "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for step in range(STEPS):
        ids = batch(step)
        lo = rank * (8 // world)
        mine = ids[lo:lo + 8 // world]
        logits = engine(mine[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(out, tag=f"global_step{STEPS}")
    dist.barrier()
    if rank == 0:
        module = engine.module.eval()
        with torch.no_grad():
            logits = module(probe())
        torch.save({"state_dict": {k: v.detach().clone() for k, v in module.state_dict().items()},
                    "logits": logits, "losses": losses}, os.path.join(out, "trained.pt"))
    dist.barrier()


# ------------------------------------------------------------------------------- the test
def split_like_hf(sd: dict) -> dict:
    """What an HF Llama holds, sliced by hand from the fused weights (the test's own reference split)."""
    nh, nkv = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    hd = CONFIG["hidden_size"] // nh
    out = {}
    for name, t in sd.items():
        if name.endswith("qkv_proj.weight"):
            base = name[:-len("qkv_proj.weight")]
            q, k, v = t.split([nh * hd, nkv * hd, nkv * hd])
            out.update({base + "q_proj.weight": q, base + "k_proj.weight": k, base + "v_proj.weight": v})
        elif name.endswith("gate_up_proj.weight"):
            base = name[:-len("gate_up_proj.weight")]
            g, u = t.chunk(2)
            out.update({base + "gate_proj.weight": g, base + "up_proj.weight": u})
        else:
            out[name] = t
    return out


@pytest.mark.slow
def test_deepspeed_fused_qkv_model_exports_to_hf_llama(tmp_path, store, store_path, ucp):
    pytest.importorskip("deepspeed")
    transformers = pytest.importorskip("transformers")
    from ucp_store.deepspeed.source import import_deepspeed

    run_dir = tmp_path / "ds"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", UCP_PROGRESS="0", PYTHONWARNINGS="ignore",
               TORCH_CPP_LOG_LEVEL="ERROR", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           __file__, "--train", str(run_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    trained = torch.load(run_dir / "trained.pt", weights_only=True)
    assert trained["losses"][-1] < trained["losses"][0]  # it really trained

    cid = import_deepspeed(store, run_dir / f"global_step{STEPS}", "fused", progress=False)
    ck = store.checkpoint(cid)
    assert ck.step == STEPS
    qkv = ck.info("model.layers.1.self_attn.qkv_proj.weight", "fp32")
    assert tuple(qkv.shape) == (4 * 8 + 2 * 2 * 8, 32)
    assert torch.equal(ck.read(qkv.name, "fp32"), trained["state_dict"][qkv.name])

    config = tmp_path / "config.json"
    hf_cfg = transformers.LlamaConfig(**CONFIG).to_dict()
    hf_cfg.pop("head_dim", None)  # the map computes it from hidden_size / num_attention_heads
    config.write_text(json.dumps(hf_cfg))
    dest = tmp_path / "hf"
    rc, out, err = ucp("export", "hf", "fused@latest", dest, "--state", "fp32", "--map", "llama", "--config", config,
                       "--max-shard-size", "30KB", "--store", store_path)
    assert rc == 0, err
    assert (dest / "model.safetensors.index.json").exists()

    hf = transformers.LlamaForCausalLM.from_pretrained(str(dest)).eval()
    want = split_like_hf(trained["state_dict"])
    got = hf.state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name

    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    ref.load_state_dict(want)
    with torch.no_grad():
        logits, ref_logits = hf(probe()).logits, ref(probe()).logits
    assert torch.equal(logits, ref_logits)
    torch.testing.assert_close(logits, trained["logits"], rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True, help="output folder")
    train(ap.parse_args().train)
