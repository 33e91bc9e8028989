"""Train a tiny Hugging Face MoE model with DeepSpeed AutoEP (``expert_parallel``) on CPU, save, import, resume.

Run under torchrun (gloo) like ``ds_train`` (whose argument handling and set-up it shares)::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 tools/ds_autoep.py --jobs jobs.json

The model is ``transformers``' DeepSeek-V3 built from a tiny config (2 layers, 4 routed experts of which
each token takes 2, one shared expert, sigmoid routing without noise), swapped to AutoEP by DeepSpeed's
``deepseek_v3`` preset. Mixtral and Qwen3-MoE (the ``mixtral`` / ``qwen3_moe`` presets) fail here before the
first step: DeepSpeed 0.19.8's ``TransformersTopLevelRouterLogitsAdapter`` calls
``transformers.utils.output_capturing._CAN_RECORD_REGISTRY.get(key, default)``, and transformers 5.25's
``_CanRecordRegistry.get`` takes one argument (``TypeError: _CanRecordRegistry.get() takes 2 positional
arguments but 3 were given``). The DeepSeek-V3 preset's adapter does not touch that registry.

Job keys (besides ``zero``, ``steps``, ``out``):

- ``kind``: ``"train"`` (train ``steps`` steps at ``ep``, save ``save_dir/tag``, dump the live optimizer
  state (``dump``), optionally run ``ds_to_universal`` (``convert``: exit status and last error line into
  the result), then ``next_steps`` more steps: the uninterrupted continuation), ``"import"`` (rank 0 imports
  ``save_dir/tag`` into ``store`` as ``run``; with ``distributed`` every rank imports its share) or
  ``"resume_ucp"`` (build the engine at ``ep``, ``ucp_store.deepspeed.autoep.load_engine`` from
  ``store``/``ref``, dump, train ``steps`` steps).
- ``dump``: each rank writes ``torch.save`` of ``{(name, state): (start, stop, fp32 values)}``: its ZeRO share
  of every parameter's fp32 master, ``exp_avg`` and ``exp_avg_sq`` read from the optimizer's own buffers,
  in the *logical* flat coordinates of the parameter (an expert block of ep rank ``r`` starts at
  ``r * numel(local)``, since the logical ``[E, ...]`` tensor stacks the ep ranks' blocks).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from ucp_store.demo.ds_train import finish_job

__all__ = ["tiny_model", "build", "state_dump", "run_job", "main"]

GLOBAL_BATCH, SEQ, VOCAB, EXPERTS = 4, 8, 64, 4


def tiny_model(seed: int = 1234):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                           n_routed_experts=EXPERTS, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                           topk_group=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=8,
                           qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=32)
    return DeepseekV3ForCausalLM(cfg)


def build(job):
    import deepspeed
    import deepspeed.comm as dist

    world = dist.get_world_size()
    model = tiny_model(job.get("seed", 1234))
    cfg = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": job.get("zero", 3),
                              **({"sub_group_size": job["sub_group_size"]} if job.get("sub_group_size") else {})},
        "bf16": {"enabled": True},
        "expert_parallel": {"enabled": True, "autoep_size": job.get("ep", 2), "preset_model": "deepseek_v3",
                            "use_grouped_mm": False},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, dist.get_rank(), GLOBAL_BATCH // world


def train_steps(engine, job, start, count, dp_rank, micro):
    import deepspeed.comm as dist

    losses = []
    for step in range(start, start + count):
        g = torch.Generator().manual_seed(job.get("data_seed", 7) * 100003 + step)
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)[dp_rank * micro:(dp_rank + 1) * micro]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        val = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(val)
        val /= dist.get_world_size()
        losses.append(float(val.item()))
    return losses


def _expert_offsets(engine) -> dict:
    """param -> offset of this rank's block in the logical flat tensor (ep_rank * local numel for experts)."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    out = {}
    for m in engine.module.modules():
        if isinstance(m, AutoEPMoELayer):
            for p in m.experts.parameters():
                out[p] = int(m.ep_rank) * int(getattr(p, "ds_numel", p.numel()))
    return out


def state_dump(engine) -> dict:
    """``{(name, state): (start, stop, fp32 values)}``: this rank's share, from the optimizer's flat buffers
    (ZeRO-1/2: ``_hp_mapping`` addresses into ``single_partition_of_fp32_groups`` and its Adam state; ZeRO-3:
    the parameter's partition, ``safe_get_local_*``), in logical flat coordinates (module docstring)."""
    import deepspeed.comm as dist

    opt = engine.optimizer
    offsets = _expert_offsets(engine)
    names = {p: n for n, p in engine.module.named_parameters()}
    out = {}
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        for p, name in names.items():
            part = p.ds_tensor.ds_numel
            start = dist.get_rank(group=p.ds_process_group) * part
            stop = min(start + part, p.ds_numel)
            if stop <= start:
                continue
            base = offsets.get(p, 0)
            got = {"fp32": safe_get_local_fp32_param(p)}
            for k in ("exp_avg", "exp_avg_sq"):
                got[k] = safe_get_local_optimizer_state(p, k)
            for k, t in got.items():
                out[(name, k)] = (base + start, base + stop, t.detach().reshape(-1)[:stop - start].float().clone())
        return out
    for g, group in enumerate(opt.bit16_groups):
        hp = opt.single_partition_of_fp32_groups[g]
        st = opt.optimizer.state.get(hp, {})
        for p in group:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                continue
            lo, n = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
            h0 = mapping.hp_fragment_address.start
            base = offsets.get(p, 0)
            out[(names[p], "fp32")] = (base + lo, base + lo + n, hp.detach()[h0:h0 + n].clone())
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    out[(names[p], k)] = (base + lo, base + lo + n, st[k].detach()[h0:h0 + n].clone())
    return out


def convert_universal(tag_dir: str, out_dir: str) -> dict:
    """DeepSpeed's ``ds_to_universal`` on ``tag_dir``, in this process (one worker: serial, as its own tests
    run it; saves a second interpreter's DeepSpeed import): its outcome (error line, the steps it printed)."""
    import contextlib
    import io
    import sys as _sys

    from deepspeed.checkpoint import ds_to_universal

    argv = ["ds_to_universal", "--input_folder", tag_dir, "--output_folder", out_dir, "--inject_missing_state",
            "--num_extract_workers", "1", "--num_merge_workers", "1"]
    buf = io.StringIO()
    old, _sys.argv = _sys.argv, argv
    error = None
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            ds_to_universal.main(ds_to_universal.parse_arguments())
    except Exception as exc:  # noqa: BLE001 - the converter's failure is the recorded outcome
        error = f"{type(exc).__name__}: {exc}"
    finally:
        _sys.argv = old
    steps = [ln.strip() for ln in buf.getvalue().splitlines() if ln.startswith("***")]
    return {"returncode": 0 if error is None else 1, "error": error, "steps": steps}


def run_job(job):
    import deepspeed.comm as dist

    rank = dist.get_rank()
    t0 = time.time()
    result = {"job": job, "world": dist.get_world_size()}
    if job["kind"] == "import":  # rank 0 imports save_dir/tag into store as run; "distributed": every rank its share
        from ucp_store import open_store
        from ucp_store.deepspeed.source import import_deepspeed

        if job.get("distributed"):
            if rank == 0:
                open_store(job["store"], create=True)
            dist.barrier()
            result["checkpoint"] = import_deepspeed(open_store(job["store"]), os.path.join(job["save_dir"], job["tag"]),
                                                    job["run"], progress=False, distributed=True)
        elif rank == 0:
            store = open_store(job["store"], create=True)
            result["checkpoint"] = import_deepspeed(store, os.path.join(job["save_dir"], job["tag"]), job["run"],
                                                    progress=False, distributed=False)
        finish_job(result, job, rank, t0)
        dist.barrier()
        return result
    engine, dp_rank, micro = build(job)
    if job["kind"] == "train":
        steps = job.get("steps", 2)
        result["losses_before"] = train_steps(engine, job, 0, steps, dp_rank, micro)
        save_dir, tag = job["save_dir"], job.get("tag", f"global_step{steps}")
        engine.save_checkpoint(save_dir, tag=tag)
        dist.barrier()
        if job.get("dump"):
            torch.save(state_dump(engine), f"{job['dump']}.{rank}.pt")
        if job.get("convert") and rank == 0:
            result["convert"] = convert_universal(os.path.join(save_dir, tag),
                                                  os.path.join(save_dir, f"{tag}_universal"))
        dist.barrier()
        nxt = job.get("next_steps", 0)
        result["losses"] = train_steps(engine, job, steps, nxt, dp_rank, micro) if nxt else []
    elif job["kind"] == "resume_ucp":
        from ucp_store.deepspeed.autoep import load_engine

        names = [(pg.get("name"), pg.get("moe")) for pg in engine.optimizer.optimizer.param_groups]
        load_engine(engine, job["ref"], store=job["store"])
        result["group_identity_kept"] = names == [(pg.get("name"), pg.get("moe"))
                                                  for pg in engine.optimizer.optimizer.param_groups]
        result["group_names"] = [str(n) for n, _ in names]
        if job.get("dump"):
            torch.save(state_dump(engine), f"{job['dump']}.{rank}.pt")
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
