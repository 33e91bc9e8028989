"""Hugging Face folders in and out (``ucp import hf`` / ``ucp export hf``), with real transformers models.

Tiny Llama models with GQA are built from a config (no hub), saved by ``save_pretrained``, imported,
exported and loaded back by ``from_pretrained``; their logits must equal the source model's bit for bit.
Bad folders (truncated shard, offsets past the end, a shard the index names but the folder lacks, a
dtype the store cannot hold) must fail with a clear one-line error and leave nothing listed. Fused
checkpoints (QKV with GQA, SwiGLU gate/up) go out through the shipped Llama name map.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from ucp_store import config
from ucp_store.errors import ConfigurationError, DTypeError, SourceFormatError, UcpError
from ucp_store.formats.hf.adapter import HfSource, export_hf, import_hf, parse_size, read_header
from ucp_store.formats.hf.names import NameMap, load_map

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

SHARD = "40KB"  # small enough that the tiny models below need several shards


def tiny_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    base.update(kw)
    return LlamaConfig(**base)


def tiny_llama(dtype=torch.float32, seed=0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**kw)).eval()
    with torch.no_grad():  # Llama initialises norms to 1: make every tensor distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(dtype)


def logits(model, seed=1) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def load(path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(str(path)).eval()


def listed(store) -> list:
    return store.list_checkpoints(include_pending=True)


# ------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_import_export_from_pretrained_equal_logits(tmp_path, store, store_path, ucp, dtype):
    model = tiny_llama(dtype)
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size=SHARD)
    assert (src / "model.safetensors.index.json").exists()  # sharded: the index path is exercised

    rc, out, err = ucp("import", "hf", src, "--run", "llama", "--store", store_path)
    assert rc == 0, err
    ck = store.checkpoint("llama@0")
    sd = model.state_dict()
    infos = {i.name: i for i in ck.tensors(state="weight")}
    assert set(infos) == set(sd)
    want_dtype = "float32" if dtype == torch.float32 else "bfloat16"
    for name, t in sd.items():
        assert tuple(infos[name].shape) == tuple(t.shape) and infos[name].dtype == want_dtype, name
        assert torch.equal(ck.read(name, "weight"), t), name
    objects = ck.objects()
    assert objects["hf.config"] == json.loads((src / "config.json").read_text())
    assert objects["hf.generation_config"] == json.loads((src / "generation_config.json").read_text())
    prov = ck.provenance
    assert prov["source_kind"] == "hf" and all(v.startswith("xxh3-128:") for v in prov["source_hashes"].values())
    assert "config.json" in prov["source_hashes"]
    import xxhash

    for f in os.listdir(src):  # every source file, hashed whole (from its memory map)
        assert prov["source_hashes"][f] == "xxh3-128:" + xxhash.xxh3_128((src / f).read_bytes()).hexdigest(), f

    dest = tmp_path / "out"
    rc, out, err = ucp("export", "hf", "llama@0", dest, "--max-shard-size", SHARD, "--store", store_path)
    assert rc == 0, err
    # save_pretrained's layout: numbered shards, the index (total_size, weight_map), config files
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    ref = json.loads((src / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == ref["metadata"]["total_size"]
    assert set(index["weight_map"]) == set(ref["weight_map"])
    shards = sorted(f for f in os.listdir(dest) if f.endswith(".safetensors"))
    assert shards == sorted(set(index["weight_map"].values()))
    assert all(f == f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k, f in enumerate(shards))
    limit = parse_size(SHARD)
    for f in shards:  # every shard under the limit unless it holds a single larger tensor
        h = read_header(str(dest / f))
        data = sum(e[3] - e[2] for e in h.entries.values())
        assert data <= limit or len(h.entries) == 1, f
        assert h.metadata == {"format": "pt"}
    assert json.loads((dest / "config.json").read_text()) == objects["hf.config"]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".out.tmp")]

    back = load(dest)
    assert back.dtype == dtype
    got = back.state_dict()
    assert all(torch.equal(got[n], t) for n, t in sd.items())
    # the same logits as the source folder loaded the same way (a bf16 model built in memory differs
    # from a loaded one by its rotary buffer, which is not a weight: .to(bf16) rounds inv_freq)
    assert torch.equal(logits(back), logits(load(src)))
    if dtype == torch.float32:
        assert torch.equal(logits(back), logits(model))


def test_single_file_and_cast_on_export(tmp_path, store):
    model = tiny_llama(torch.float32, seed=3)
    src = tmp_path / "src"
    model.save_pretrained(src)  # one model.safetensors, no index
    assert (src / "model.safetensors").exists() and not (src / "model.safetensors.index.json").exists()
    cid = import_hf(store, src, "one", step=7, progress=False)
    ck = store.checkpoint(cid)
    assert ck.step == 7

    dest = tmp_path / "bf16"
    summary = export_hf(ck, dest, dtype="bf16", progress=False)
    assert summary["shards"] == 1 and sorted(os.listdir(dest)) == ["config.json", "generation_config.json",
                                                                    "model.safetensors"]
    assert json.loads((dest / "config.json").read_text())["dtype"] == "bfloat16"
    back = load(dest)
    assert back.dtype == torch.bfloat16
    got = back.state_dict()
    assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in model.state_dict().items())
    ref = LlamaForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()  # the source, cast on load
    assert torch.equal(logits(back), logits(ref))


def test_export_is_byte_identical_to_save_pretrained(tmp_path, store, small_chunks, monkeypatch):
    """The export writes the very bytes ``save_pretrained`` writes (header layout, ``{"format":"pt"}``, data),
    also when every tensor spans many stored chunks and shard files and is written in many blocks by many
    threads, and when ``--dtype`` casts on the way out."""
    from ucp_store.formats.hf import adapter as hf

    small_chunks(lambda shape: ((2,) + shape[1:], (6,) + shape[1:]))  # a shard file ends mid-block
    monkeypatch.setattr(hf, "_TASK_BYTES", 300)  # blocks of a few chunk rows: offsets inside every tensor
    monkeypatch.setattr(hf, "_CAST_PIECE", 7)  # the --dtype cast of a block goes in many pieces
    model = tiny_llama(torch.float32, seed=4)
    src = tmp_path / "src"
    model.save_pretrained(src)
    ck = store.checkpoint(import_hf(store, src, "b", progress=False))
    assert any(i.chunk_shape[0] == 2 and i.shape[0] > 6 for i in ck.tensors())
    with config.override(export_threads=3):
        assert hf._export_threads() == 3
        export_hf(ck, tmp_path / "fp32", progress=False)
        assert (tmp_path / "fp32" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
        export_hf(ck, tmp_path / "bf16", dtype="bf16", progress=False)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "ref16")
    got = (tmp_path / "bf16" / "model.safetensors").read_bytes()
    assert got == (tmp_path / "ref16" / "model.safetensors").read_bytes()


def test_export_of_a_corrupt_store_names_the_chunk_and_leaves_nothing(tmp_path, store, store_path, ucp):
    from ucp_test_helpers import flip_chunk_byte

    src = _saved(tmp_path, shard="1GB")
    ck = store.checkpoint(import_hf(store, src, "c", progress=False))
    info = ck.info("model.layers.1.mlp.up_proj.weight", "weight")
    flip_chunk_byte(store_path, info, (0, 0))
    rc, _, err = ucp("export", "hf", "c@0", tmp_path / "out", "--store", store_path)
    assert rc == 1 and "model.layers.1.mlp.up_proj.weight" in err and "chunk [0, 0]" in err and "crc32c" in err
    assert sorted(os.listdir(tmp_path)) == ["src", "store"]  # no folder, no temporary folder left behind


def test_tied_embeddings_round_trip(tmp_path, store):
    """save_pretrained leaves a tied lm_head out; so does the export, and from_pretrained ties it again."""
    model = tiny_llama(torch.float32, seed=9, tie_word_embeddings=True)
    src = tmp_path / "src"
    model.save_pretrained(src)
    ck = store.checkpoint(import_hf(store, src, "tied", progress=False))
    assert "lm_head.weight" not in ck.names()
    export_hf(ck, tmp_path / "out", progress=False)
    back = load(tmp_path / "out")
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    assert torch.equal(logits(back), logits(model))


def test_export_fp32_state_of_a_mixed_checkpoint(tmp_path, store, store_path):
    """--state picks the master weights of a training checkpoint; the weight state is ignored. Exporting
    the weight state reads nothing else: with every other state's arrays gone from the store, it still
    writes the same files."""
    model = tiny_llama(torch.float32, seed=4)
    sd = model.state_dict()
    with store.begin("mixed", 1) as w:
        for name, t in sd.items():
            w.write(name, "fp32", t)
            w.write(name, "weight", t.to(torch.bfloat16))
            w.write(name, "exp_avg", torch.zeros_like(t))
        w.write_object("hf.config", model.config.to_dict())
    ck = store.checkpoint("mixed@1")
    export_hf(ck, tmp_path / "fp32", state="fp32", progress=False)
    assert torch.equal(logits(load(tmp_path / "fp32")), logits(model))
    export_hf(ck, tmp_path / "default", progress=False)  # default: the weight state
    assert read_header(str(tmp_path / "default" / "model.safetensors")).entries["model.norm.weight"][0] == "bfloat16"
    got = load(tmp_path / "default").state_dict()
    assert all(torch.equal(got[n], sd[n].to(torch.bfloat16).to(got[n].dtype)) for n in sd)
    with pytest.raises(SourceFormatError, match="no state 'fp16'.*exp_avg, fp32, weight"):
        export_hf(ck, tmp_path / "x", state="fp16", progress=False)
    import shutil

    keep = {i.array for i in ck.tensors(state="weight")}
    gone = {i.array for i in ck.tensors() if i.state != "weight"} - keep
    assert gone
    for rel in gone:  # the fp32 master and the optimizer state: no export of the weight state may touch them
        shutil.rmtree(store_path / rel)
    export_hf(ck, tmp_path / "again", state="weight", progress=False)
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "again" / f).read_bytes() == (tmp_path / "default" / f).read_bytes()
    with pytest.raises(UcpError) as err:  # and the fp32 export does read its (now missing) arrays
        export_hf(ck, tmp_path / "y", state="fp32", progress=False)
    assert "state 'fp32'" in str(err.value) and "model." in str(err.value)
    assert not (tmp_path / "y").exists()


# ------------------------------------------------------------------------------------------- bad input
def _saved(tmp_path, shard=SHARD):
    model = tiny_llama(torch.float32, seed=5)
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size=shard)
    return src


def _rewrite_header(path, edit):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _first_tensor(path):
    h = read_header(str(path))
    return h.in_file_order()[0], h.in_file_order()[-1]


def _check_refused(ucp, store_path, src, *needles):
    rc, out, err = ucp("import", "hf", src, "--run", "bad", "--store", store_path)
    assert rc == 1
    line = err.strip()
    assert line.startswith("ucp: error: ") and "\n" not in line and "Traceback" not in err
    for needle in needles:
        assert needle in line, (needle, line)
    import ucp_store

    store = ucp_store.open_store(str(store_path))
    assert listed(store) == []  # nothing listed, not even a pending save
    return line


def test_truncated_shard_is_refused(tmp_path, store, store_path, ucp):
    src = _saved(tmp_path)
    shard = src / "model-00002-of-00003.safetensors"
    assert shard.exists(), os.listdir(src)
    _, last = _first_tensor(shard)
    shard.write_bytes(shard.read_bytes()[:-100])
    line = _check_refused(ucp, store_path, src, str(shard), repr(last), "truncated")
    assert "overrun" in line


def test_header_offsets_overrunning_the_file_are_refused(tmp_path, store, store_path, ucp):
    src = _saved(tmp_path)
    shard = src / "model-00001-of-00003.safetensors"
    first, _ = _first_tensor(shard)

    def edit(header):
        e = header[first]
        e["data_offsets"] = [e["data_offsets"][0] + 10**6, e["data_offsets"][1] + 10**6]

    _rewrite_header(shard, edit)
    _check_refused(ucp, store_path, src, str(shard), repr(first), "overrun", str(10**6))


def test_missing_shard_named_in_the_index_is_refused(tmp_path, store, store_path, ucp):
    src = _saved(tmp_path)
    (src / "model-00003-of-00003.safetensors").unlink()
    _check_refused(ucp, store_path, src, "model.safetensors.index.json", "model-00003-of-00003.safetensors",
                   "missing")


def test_index_naming_a_tensor_no_shard_holds_is_refused(tmp_path, store, store_path, ucp):
    src = _saved(tmp_path)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.ghost.weight"] = "model-00001-of-00003.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    _check_refused(ucp, store_path, src, "model.layers.9.ghost.weight", "no shard holds it")


def test_index_shard_outside_the_folder_is_refused(tmp_path, store, store_path, ucp):
    src = _saved(tmp_path)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../../etc/passwd"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    _check_refused(ucp, store_path, src, "../../etc/passwd", "outside")


@pytest.mark.parametrize("code,needle", [("F8_E4M3", "cannot be stored bit-exactly"), ("Q4_K", "unknown dtype")])
def test_dtype_the_store_cannot_hold_is_refused(tmp_path, store, store_path, ucp, code, needle):
    src = _saved(tmp_path)
    shard = src / "model-00003-of-00003.safetensors"
    first, _ = _first_tensor(shard)

    def edit(header):
        header[first]["dtype"] = code

    _rewrite_header(shard, edit)
    _check_refused(ucp, store_path, src, str(shard), repr(first), code, needle)


def test_tensor_name_escaping_the_store_is_refused(tmp_path, store, store_path, ucp):
    src = _saved(tmp_path)
    shard = src / "model-00001-of-00003.safetensors"
    first, _ = _first_tensor(shard)

    def edit(header):
        header["../../escape"] = header.pop(first)

    _rewrite_header(shard, edit)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["../../escape"] = index["weight_map"].pop(first)
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    _check_refused(ucp, store_path, src, str(shard), "'../../escape'", "escape the store")


def test_failure_while_writing_leaves_nothing_listed(tmp_path, store, monkeypatch):
    """A shard that shrinks after its header was checked aborts the import mid-way: nothing listed."""
    src = _saved(tmp_path, shard="1GB")
    source = HfSource(src)
    path = src / "model.safetensors"
    path.write_bytes(path.read_bytes()[:4096])
    from ucp_store.formats.base import import_source

    with pytest.raises(SourceFormatError, match="shrank"):
        import_source(store, source, "r", 0, progress=False, distributed=False)
    assert listed(store) == []


def test_not_a_model_folder(tmp_path, store):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(SourceFormatError, match=r"no model.safetensors.*pytorch_model.bin.*pickles"):
        HfSource(tmp_path)
    with pytest.raises(SourceFormatError, match="does not exist"):
        HfSource(tmp_path / "nope")


def test_export_refuses_a_dtype_hf_cannot_hold_and_writes_nothing(tmp_path, store):
    with store.begin("c", 1) as w:
        w.write("model.norm.weight", "weight", torch.ones(4))
        w.write("model.rot.weight", "weight", torch.ones(4, dtype=torch.complex128))
        w.write_object("hf.config", tiny_config().to_dict())
    with pytest.raises(DTypeError, match="'model.rot.weight'.*complex128"):
        export_hf(store.checkpoint("c@1"), tmp_path / "out", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["store"]


def test_export_refuses_an_existing_folder_and_a_missing_config(tmp_path, store, store_path, ucp):
    with store.begin("c", 1) as w:
        w.write("model.norm.weight", "weight", torch.ones(4))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    rc, _, err = ucp("export", "hf", "c@1", tmp_path / "full", "--store", store_path)
    assert rc == 1 and "exists and is not an empty folder" in err
    rc, _, err = ucp("export", "hf", "c@1", tmp_path / "new", "--store", store_path)
    assert rc == 1 and "no stored Hugging Face config" in err and "--config" in err
    assert not (tmp_path / "new").exists()
    rc, _, err = ucp("export", "hf", "c@1", tmp_path / "new", "--max-shard-size", "lots", "--store", store_path)
    assert rc == 1 and "'lots'" in err


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("40KB") == 40_000
    assert parse_size(123) == 123
    for bad in ("0GB", "-1MB", "GB", "x"):
        with pytest.raises(ConfigurationError):
            parse_size(bad)


# ------------------------------------------------------------------------------------------- name maps
def fuse_llama(model) -> tuple[dict, dict]:
    """(tensors, patterns) of a Llama state dict with each layer's q/k/v and gate/up fused, as a training
    framework would hold them: ``qkv_proj`` = [q; k; v] and ``gate_up_proj`` = [gate; up] along dim 0."""
    sd = model.state_dict()
    out, patterns = {}, {}
    for name, t in sd.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name or ".mlp.up_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            parts = [sd[name], sd[name.replace("q_proj", "k_proj")], sd[name.replace("q_proj", "v_proj")]]
            fused = name.replace("q_proj", "qkv_proj")
        elif ".mlp.gate_proj." in name:
            parts = [sd[name], sd[name.replace("gate_proj", "up_proj")]]
            fused = name.replace("gate_proj", "gate_up_proj")
        else:
            out[name] = t
            continue
        out[fused] = torch.cat(parts, 0)
        patterns[fused] = {"kind": "fused", "dim": 0, "sizes": [p.shape[0] for p in parts]}
    return out, patterns


@pytest.mark.parametrize("with_pattern", [True, False], ids=["fused-pattern", "sizes-from-config"])
def test_fused_store_exports_through_the_llama_map(tmp_path, store, store_path, ucp, with_pattern):
    model = tiny_llama(torch.float32, seed=6, num_attention_heads=8, num_key_value_heads=2, hidden_size=32,
                       intermediate_size=40)
    tensors, patterns = fuse_llama(model)
    assert tensors["model.layers.0.self_attn.qkv_proj.weight"].shape == (32 + 2 * 8, 32)  # GQA: 8 q, 2 kv heads
    store.save("fused", 1, tensors, patterns=patterns if with_pattern else None,
               objects={"hf.config": model.config.to_dict()})
    info = store.checkpoint("fused@1").info("model.layers.1.mlp.gate_up_proj.weight")
    assert (info.pattern or {}).get("kind") == ("fused" if with_pattern else None)
    config = tmp_path / "config.json"
    cfg = model.config.to_dict()
    if not with_pattern:
        cfg.pop("head_dim", None)  # the map's variable computes it
    config.write_text(json.dumps(cfg))
    rc, out, err = ucp("export", "hf", "fused@1", tmp_path / "hf", "--map", "llama", "--config", config,
                       "--store", store_path)
    assert rc == 0, err
    back = load(tmp_path / "hf")
    assert set(back.state_dict()) == set(model.state_dict())
    assert torch.equal(logits(back), logits(model))


def test_fused_pattern_splits_without_sizes_in_the_map(tmp_path, store):
    model = tiny_llama(torch.float32, seed=7)
    tensors, patterns = fuse_llama(model)
    store.save("fp", 1, tensors, patterns=patterns, objects={"hf.config": model.config.to_dict()})
    bare = {"rules": [
        {"match": "model.layers.{i}.self_attn.qkv_proj.weight",
         "split": {"into": [f"model.layers.{{i}}.self_attn.{x}_proj.weight" for x in "qkv"]}},
        {"match": "model.layers.{i}.mlp.gate_up_proj.weight",
         "split": {"into": ["model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"]}}]}
    export_hf(store.checkpoint("fp@1"), tmp_path / "hf", name_map=bare, progress=False)
    assert torch.equal(logits(load(tmp_path / "hf")), logits(model))
    # without a fused pattern the same map has nothing to split by
    store.save("np", 1, tensors, objects={"hf.config": model.config.to_dict()})
    with pytest.raises(ConfigurationError, match="no 'fused' pattern, so the rule must give 'sizes'"):
        export_hf(store.checkpoint("np@1"), tmp_path / "hf2", name_map=bare, progress=False)
    assert not (tmp_path / "hf2").exists()


def test_rename_and_drop_rules(tmp_path, store):
    model = tiny_llama(torch.float32, seed=8)
    sd = model.state_dict()
    renamed = {n.replace("model.layers.", "blocks.").replace("model.embed_tokens", "tok"): t for n, t in sd.items()}
    renamed["rotary.inv_freq"] = torch.arange(4.0)
    store.save("ren", 1, renamed, objects={"hf.config": model.config.to_dict()})
    nmap = {"unmatched": "error", "rules": [
        {"match": "blocks.{i}.{part}.{proj}.weight", "rename": "model.layers.{i}.{part}.{proj}.weight"},
        {"match": "blocks.{i}.{norm}.weight", "rename": "model.layers.{i}.{norm}.weight"},
        {"match": "tok.weight", "rename": "model.embed_tokens.weight"},
        {"match": "rotary.inv_freq", "drop": True},
        {"match": "model.{x}.weight", "rename": "model.{x}.weight"},  # a placeholder is one dotted component
        {"match": "{x}.weight", "rename": "{x}.weight"}]}
    export_hf(store.checkpoint("ren@1"), tmp_path / "hf", name_map=nmap, progress=False)
    assert torch.equal(logits(load(tmp_path / "hf")), logits(model))


class _Info:
    def __init__(self, name, shape, pattern=None):
        self.name, self.shape, self.pattern, self.state, self.dtype = name, tuple(shape), pattern, "weight", "float32"


QKV = "model.layers.0.self_attn.qkv_proj.weight"
CFG = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48}


@pytest.mark.parametrize("data,needle", [
    ({"rulez": []}, "unknown key 'rulez'; did you mean 'rules'?"),
    ({"rules": [{"match": "a", "rename": "b", "dorp": True}]}, "unknown key 'dorp'; did you mean 'drop'?"),
    ({"rules": [{"match": "a", "split": {"dim": 0, "sizes": [1, 2], "into": ["x", "y"], "size": 3}}]},
     "unknown key 'size'; did you mean 'sizes'?"),
    ({"rules": [{"match": "a", "rename": "b", "drop": True}]}, "exactly one of"),
    ({"rules": [{"match": "a.{i}", "rename": "b.{j}"}]}, "uses {j}, which 'match' does not define"),
    ({"rules": [{"match": "a", "split": {"sizes": [1], "into": ["x"]}}]}, "at least two"),
    ({"rules": [{"match": "a", "split": {"sizes": [1, 2, 3], "into": ["x", "y"]}}]}, "one size per 'into' name"),
    ({"rules": [{"match": "a", "split": {"sizes": ["__import__('os')", 1], "into": ["x", "y"]}}]},
     "may only use config names"),
    ({"unmatched": "ignore"}, "'unmatched' must be keep, drop or error"),
    ({"format": "other/2"}, "format 'other/2'"),
])
def test_map_validation(data, needle):
    with pytest.raises(ConfigurationError) as e:
        NameMap(data, origin="m.json")
    assert needle in str(e.value) and "m.json" in str(e.value)


def test_map_sizes_that_do_not_add_up_and_colliding_names():
    infos = [_Info(QKV, (64, 32))]
    llama = load_map("llama")
    with pytest.raises(ConfigurationError, match=r"sizes \[32, 16, 16\] add up to 64, but dim 0.*has 48"):
        llama.plan([_Info(QKV, (48, 32))], CFG)
    assert [p.name.rsplit(".", 2)[1] for p in llama.plan(infos, CFG)] == ["q_proj", "k_proj", "v_proj"]
    assert [(p.start, p.stop) for p in llama.plan(infos, CFG)] == [(0, 32), (32, 48), (48, 64)]
    with pytest.raises(ConfigurationError, match="needs 'num_key_value_heads'.*did you mean 'num_key_value_head'"):
        llama.plan(infos, {**{k: v for k, v in CFG.items() if k != "num_key_value_heads"}, "num_key_value_head": 2})
    clash = infos + [_Info("model.layers.0.self_attn.k_proj.weight", (16, 32))]
    with pytest.raises(ConfigurationError, match="output name 'model.layers.0.self_attn.k_proj.weight' is produced "
                                                 "twice"):
        llama.plan(clash, CFG)
    fused = _Info(QKV, (64, 32), {"kind": "fused", "dim": 0, "sizes": [40, 12, 12]})
    with pytest.raises(ConfigurationError, match=r"sizes \[32, 16, 16\] disagree with the fused pattern"):
        llama.plan([fused], CFG)
    with pytest.raises(ConfigurationError, match="no such file, and no shipped map.*did you mean the shipped map "
                                                 "'llama'"):
        load_map("lama")
