"""Megatron-DeepSpeed style tensor parallelism: a layout imitation, checked against ds_to_universal.

Megatron-DeepSpeed does not run here (no CUDA), so this test writes a TP=2, DP=2, ZeRO-1 (bf16 prefix)
tag folder with the file layout and keys Megatron-DeepSpeed + DeepSpeed write: ``mp_rank_0X_model_states.pt``
holding ``universal_checkpoint_info`` regex lists (vocabulary padding, 2-sub-parameter SwiGLU, row-parallel,
TP-replicated, averaged, GQA ``SubparamShape`` with uneven ``sub_param_shard_widths``), Megatron's ``args``
(``argparse.Namespace``) and numpy RNG state, and ``bf16_zero_pp_rank_<dp>_mp_rank_0X_optim_states.pt`` with
flat, padded, DP-partitioned groups and real DeepSpeed objects (``LossScaler``, ``ZeroStageEnum``,
``fragment_address``, pickled by DeepSpeed's own classes in a subprocess). Then DeepSpeed's real
``ds_to_universal`` converts it, and our reader must agree bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ucp_store import safe_pickle as sp
from ucp_store.deepspeed.source import DeepSpeedReader, read_zero_checkpoint

REPO = Path(__file__).resolve().parents[2]

WRITER = r'''
import argparse, collections, math, os, sys
import numpy as np, torch
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
g = torch.Generator().manual_seed(0)
TP, DP, ORIG_VOCAB = 2, 2, 10
def r(*shape):
    return torch.randn(*shape, generator=g)
# per-TP slices of each parameter (what each mp rank holds)
full_vocab = torch.cat([r(ORIG_VOCAB, 4), torch.zeros(2, 4)])          # padded to 12 rows = 2 x 6
qkv_w = [[4, 2], [1, 1], [1, 1]]                                      # GQA: q=6, k=2, v=2, uneven TP widths
qkv = r(10, 4)
def qkv_slice(rank):
    parts, off = [], 0
    for ws in qkv_w:
        parts.append(qkv[off + sum(ws[:rank]): off + sum(ws[:rank + 1])]); off += sum(ws)
    return torch.cat(parts)
ln = r(4)
params = collections.OrderedDict()
params["language_model.embedding.word_embeddings.weight"] = [full_vocab[0:6], full_vocab[6:12]]
params["layers.0.mlp.dense_h_to_4h.weight"] = [r(8, 4), r(8, 4)]      # [gate_i; up_i]
params["layers.0.self_attention.query_key_value.weight"] = [qkv_slice(0), qkv_slice(1)]
params["layers.0.self_attention.dense.weight"] = [r(4, 4), r(4, 4)]   # row parallel: cat on dim 1
params["layers.0.input_layernorm.weight"] = [ln.clone(), ln.clone()]  # TP-replicated
params["layers.0.mlp.drifted.weight"] = [ln + 1e-3 * r(4), ln - 1e-3 * r(4)]  # averaged
params["layers.0.mlp.column.weight"] = [r(3, 5), r(3, 5)]             # unlisted: column parallel, cat dim 0
groups = [list(params)[:4], list(params)[4:]]
# Adam moments per TP slice; a TP-replicated parameter has identical moments on every TP rank
moments = {}
for n, slices in params.items():
    ea = [r(*t.shape) for t in slices]
    eas = [r(*t.shape).abs() for t in slices]
    if "layernorm" in n:
        ea, eas = [ea[0]] * TP, [eas[0]] * TP
    moments[n] = (ea, eas)
uci = {
    "universal_checkpoint_version": 0.4, "original_vocab_size": ORIG_VOCAB, "padded_vocab_size": 12,
    "vocabulary_parameter_patterns": [r"language_model\.embedding\.word_embeddings\.weight"],
    "parameter_with_2_sub_params_cat_dim_0": [r"layers\.\d+\.mlp\.dense_h_to_4h\.weight"],
    "parameter_with_row_parallelism_patterns": [r"layers\.\d+\.self_attention\.dense\.weight"],
    "tp_replicated_parameter_patterns": [r"layers\.\d+\.input_layernorm\.weight"],
    "parameter_to_average_patterns": [r"layers\.\d+\.mlp\.drifted\.weight"],
    "parameter_with_sub_params": [{"patterns": [r"layers\.\d+\.self_attention\.query_key_value\.weight"],
                                   "shape": ((6, 2, 2), -1), "partition_dim": 0}],
    "sub_param_shard_widths": {r"layers\.\d+\.self_attention\.query_key_value\.weight": qkv_w},
}
args = argparse.Namespace(tensor_model_parallel_size=TP, hidden_size=4, params_dtype=torch.bfloat16, seq_length=8)
for tp in range(TP):
    shapes = [collections.OrderedDict((n, params[n][tp].shape) for n in grp) for grp in groups]
    module = collections.OrderedDict((n, params[n][tp].to(torch.bfloat16)) for n in params)
    torch.save({"module": module, "buffer_names": [], "optimizer": None, "param_shapes": shapes,
                "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
                "lr_scheduler": {"last_batch_iteration": 4}, "data_sampler": None, "random_ltd": None,
                "skipped_steps": 0, "global_steps": 5, "global_samples": 40, "dp_world_size": DP,
                "mp_world_size": TP, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": TP},
                "ds_config": {"train_batch_size": 8, "bf16": {"enabled": True}}, "ds_version": "0.19.8",
                "universal_checkpoint_info": uci, "iteration": 5, "args": args,
                "rng_state": [{"random_rng_state": (3, tuple(range(5)), None), "np_rng_state": np.random.get_state(),
                               "torch_rng_state": torch.get_rng_state()}]},
               os.path.join(out, f"mp_rank_{tp:02d}_model_states.pt"))
    # flat groups, padded to a multiple of 2 * DP, split into DP partitions
    flats, maps, pads = [], [], []
    for grp in groups:
        data = torch.cat([params[n][tp].reshape(-1) for n in grp])
        numel = data.numel()
        align = 2 * DP
        padded = math.ceil(numel / align) * align
        ea = torch.cat([moments[n][0][tp].reshape(-1) for n in grp])
        eas = torch.cat([moments[n][1][tp].reshape(-1) for n in grp])
        flats.append({"fp32": torch.cat([data, torch.zeros(padded - numel)]),
                      "exp_avg": torch.cat([ea, torch.zeros(padded - numel)]),
                      "exp_avg_sq": torch.cat([eas, torch.zeros(padded - numel)])})
        pads.append(padded - numel)
        offs, off = {}, 0
        for n in grp:
            offs[n] = (off, params[n][tp].numel()); off += params[n][tp].numel()
        maps.append(offs)
    for dp in range(DP):
        single, state, mapping, gpads = [], {}, [], []
        for gi, (fl, offs) in enumerate(zip(flats, maps)):
            part = fl["fp32"].numel() // DP
            lo, hi = dp * part, (dp + 1) * part
            gpad = pads[gi] if dp == DP - 1 else 0
            single.append(fl["fp32"][lo:hi - gpad].clone())                    # stripped, like ZeRO-1/2
            state[gi] = {"step": torch.tensor(5.0), "exp_avg": fl["exp_avg"][lo:hi].clone(),
                         "exp_avg_sq": fl["exp_avg_sq"][lo:hi].clone()}          # padded, like ZeRO-1/2
            m = collections.OrderedDict()
            for n, (start, numel) in offs.items():
                a, b = max(start, lo), min(start + numel, hi)
                if b > a:
                    m[n] = fragment_address(numel=b - a, start=a - lo)
            mapping.append(m)
            gpads.append(gpad)
        osd = {"loss_scaler": LossScaler(1.0), "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
               "base_optimizer_state": {"state": state, "param_groups": [
                   {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": wd, "params": [i]}
                   for i, wd in enumerate((0.1, 0.0))]},
               "single_partition_of_fp32_groups": single, "zero_stage": ZeroStageEnum.optimizer_states,
               "group_paddings": gpads, "param_alignment_paddings": [[0] * len(gr) for gr in groups],
               "partition_count": [DP, DP], "ds_version": "0.19.8", "param_slice_mappings": mapping}
        torch.save({"optimizer_state_dict": osd, "ds_config": {}, "ds_version": "0.19.8"},
                   os.path.join(out, f"bf16_zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt"))
print("written")
'''


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("megatron")
    tag = root / "global_step5"
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    subprocess.run([sys.executable, "-c", WRITER, str(tag)], check=True, env=env, capture_output=True)
    uni = root / "global_step5_universal"
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
                           "--output_folder", str(uni), "--num_extract_workers", "1", "--num_merge_workers", "1"],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return tag, uni


@pytest.mark.slow
def test_reader_equals_ds_to_universal(megatron, cmp):
    tag, uni = megatron
    recs = {r.name: r for r in read_zero_checkpoint(tag)}
    files = cmp.files(uni)
    assert len(files) == 7 * 4
    for rel, path in files.items():
        name, fname = rel[len("zero/"):].rsplit("/", 1)
        state = fname[:-3]
        obj = sp.load(path, mmap=False)
        rec = recs[name]
        if state == "step":
            assert cmp.equal(obj, rec.states["step"])
            continue
        assert cmp.equal(obj["param"], rec.states[state]), rel
        assert sp.to_jsonable({k: v for k, v in obj.items() if k != "param"}) == rec.meta, rel


@pytest.mark.slow
def test_patterns_from_universal_checkpoint_info(megatron):
    tag, _ = megatron
    recs = {r.name: r for r in read_zero_checkpoint(tag)}
    p = {n: r.pattern for n, r in recs.items()}
    assert p["language_model.embedding.word_embeddings.weight"] == {"kind": "vocab", "dim": 0, "original_size": 10}
    assert recs["language_model.embedding.word_embeddings.weight"].states["fp32"].shape == (10, 4)
    assert p["layers.0.mlp.dense_h_to_4h.weight"] == {"kind": "fused", "dim": 0, "sizes": [8, 8]}
    assert p["layers.0.self_attention.query_key_value.weight"] == {
        "kind": "fused", "dim": 0, "sizes": [6, 2, 2], "widths": {"2": [[4, 2], [1, 1], [1, 1]]}}
    assert p["layers.0.self_attention.dense.weight"] == {"kind": "partitioned", "dim": 1}
    assert p["layers.0.input_layernorm.weight"] == {"kind": "replicated"}
    assert p["layers.0.mlp.column.weight"] == {"kind": "partitioned", "dim": 0}
    drifted = recs["layers.0.mlp.drifted.weight"]
    assert drifted.pattern_for("fp32")["kind"] == "averaged" and drifted.pattern_for("fp32")["max_deviation"] > 0
    r = DeepSpeedReader(tag)
    assert r.topology == {"tp": 2, "pp": 1, "dp": 2, "zero_stage": 1}
    objs = r.objects()
    assert objs["client_state"]["args"]["__object__"] == "argparse.Namespace"
    assert objs["client_state"]["args"]["state"]["hidden_size"] == 4
    assert objs["universal_checkpoint_info"]["original_vocab_size"] == 10


@pytest.mark.slow
def test_store_round_trip_and_export(megatron, cmp, tmp_path):
    """Import into a store, export: tensors and keys equal ds_to_universal's (the unequal GQA sub-params
    need DeepSpeed's SubparamShape class, written only with deepspeed_objects=True)."""
    from ucp_store import open_store
    from ucp_store.deepspeed.source import import_deepspeed
    from ucp_store.deepspeed.universal import export_universal

    tag, uni = megatron
    store = open_store(str(tmp_path / "store"), create=True)
    cid = import_deepspeed(store, str(tag), "meg", progress=False)
    ck = store.checkpoint(cid)
    assert ck.step == 5
    qkv = "layers.0.self_attention.query_key_value.weight"
    assert ck.info(qkv, "fp32").pattern["kind"] == "fused"
    for objects in (False, True):
        out = Path(export_universal(ck, str(tmp_path / f"exp{objects}"), progress=False, deepspeed_objects=objects))
        ours, theirs = cmp.files(out), cmp.files(uni)
        assert set(ours) == set(theirs)
        for rel in theirs:
            a = sp.load(ours[rel], mmap=False) if objects else torch.load(ours[rel], weights_only=True)
            b = sp.load(theirs[rel], mmap=False)
            if not objects and qkv in rel and not rel.endswith("step.pt"):
                assert "sub_param_shape" in b and "sub_param_shape" not in a
                assert cmp.equal(a["param"], b["param"])
                continue
            assert cmp.equal(a, b), rel
        if not objects:
            assert "SubparamShape" in (out / "ucp_export_warnings.txt").read_text()
