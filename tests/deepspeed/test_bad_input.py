"""Bad DeepSpeed input: clear errors naming the file and the expectation; with the store, nothing listed.

The broken folders are copies of a real DeepSpeed checkpoint (conftest.py) with one thing changed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ucp_store import open_store
from ucp_store import safe_pickle as sp
from ucp_store.deepspeed.source import DeepSpeedReader, import_deepspeed
from ucp_store.deepspeed.universal import export_universal, import_universal, safe_dir
from ucp_store.errors import InvalidNameError, SourceFormatError, UnsafePickleError


class Payload:
    """Unpickling this runs ``os.system('touch <marker>')``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _copy(ds, name, tmp_path) -> Path:
    dst = tmp_path / name
    shutil.copytree(ds.tag_dir(name), dst)
    return dst


def _nothing_listed(store_path: Path, run: str) -> None:
    """Nothing committed, nothing pending, no arrays left behind for ``run``."""
    store = open_store(str(store_path), create=True)
    assert [c for c in store.list_checkpoints(include_pending=True) if c["run"] == run] == []
    arrays = store_path / "arrays"
    assert not arrays.exists() or not any(p.is_file() for p in arrays.rglob("*"))


def _import_fails(tag: Path, tmp_path: Path, exc_type, *needles: str):
    store_path = tmp_path / "store"
    store = open_store(str(store_path), create=True)
    with pytest.raises(exc_type) as info:
        import_deepspeed(store, str(tag), "bad", progress=False)
    msg = str(info.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    _nothing_listed(store_path, "bad")
    return msg


def test_unsafe_pickle_refused_marker_not_created(tmp_path):
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pt"
    torch.save({"optimizer_state_dict": Payload(str(marker))}, evil)
    with pytest.raises(UnsafePickleError) as info:
        sp.load(evil)
    assert str(evil) in str(info.value) and "system" in str(info.value)
    assert not marker.exists()


@pytest.mark.slow
def test_unsafe_optimizer_file_in_checkpoint(ds, tmp_path):
    tag = _copy(ds, "z2_fp32", tmp_path)
    marker = tmp_path / "marker"
    victim = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Payload(str(marker)), "ds_version": "0.19.8"}, victim)
    _import_fails(tag, tmp_path, UnsafePickleError, victim.name, "system")
    assert not marker.exists()


@pytest.mark.slow
def test_missing_dp_rank_file(ds, tmp_path):
    tag = _copy(ds, "z2_fp32", tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    # DP=2 is recorded in the model states: the missing rank-1 file is named
    _import_fails(tag, tmp_path, SourceFormatError, "dp_world_size=2")
    tag3 = _copy(ds, "z3_bf16", tmp_path / "z3")
    (tag3 / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(SourceFormatError):
        DeepSpeedReader(tag3)


@pytest.mark.slow
def test_missing_model_parallel_file(ds, tmp_path):
    tag = _copy(ds, "tp2_bf16", tmp_path)
    (tag / "mp_rank_01_model_states.pt").unlink()
    _import_fails(tag, tmp_path, SourceFormatError, "mp_rank_01_model_states.pt", "missing")


@pytest.mark.slow
def test_truncated_file(ds, tmp_path):
    tag = _copy(ds, "z1_bf16", tmp_path)
    victim = tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    msg = _import_fails(tag, tmp_path, SourceFormatError, victim.name, "truncated")
    assert "expected" in msg or "torch.save" in msg


@pytest.mark.slow
def test_mixed_ds_versions(ds, tmp_path):
    tag = _copy(ds, "z2_fp32", tmp_path)
    ms = tag / "mp_rank_00_model_states.pt"
    sd = sp.load(ms, mmap=False)
    sd["ds_version"] = "0.14.0"
    torch.save(sd, ms)  # plain types only: still a valid, safe file
    _import_fails(tag, tmp_path, SourceFormatError, "0.14.0", "0.19.8", "mixed")


@pytest.mark.slow
def test_fragments_that_do_not_cover_a_parameter(ds, tmp_path, monkeypatch):
    """A DP file whose fragment mapping leaves part of a parameter uncovered (a file of another save):
    the error names the parameter and what is missing; the store lists nothing."""
    reader = DeepSpeedReader(ds.tag_dir("z2_fp32"))
    real = reader._optim

    def tampered(key):
        sd = real(key)
        if key == (0, 1):
            for group in sd["optimizer_state_dict"]["param_slice_mappings"]:
                for name in list(group)[-1:]:
                    del group[name]
        return sd

    monkeypatch.setattr(reader, "_optim", tampered)
    with pytest.raises(SourceFormatError) as info:
        list(reader.records())
    assert "cover" in str(info.value) and "elements" in str(info.value)


def test_unknown_layout(tmp_path):
    (tmp_path / "junk").mkdir()
    torch.save({"weights": torch.zeros(3)}, tmp_path / "junk" / "model.pt")
    with pytest.raises(SourceFormatError) as info:
        DeepSpeedReader(tmp_path / "junk")
    assert "unknown layout" in str(info.value) and "zero_pp_rank" in str(info.value)
    with pytest.raises(SourceFormatError):
        DeepSpeedReader(tmp_path / "nope")
    # a folder that looks like ZeRO by name but holds something else
    (tmp_path / "fake").mkdir()
    torch.save({"hello": 1}, tmp_path / "fake" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"hello": 1}, tmp_path / "fake" / "mp_rank_00_model_states.pt")
    with pytest.raises(SourceFormatError) as info:
        DeepSpeedReader(tmp_path / "fake")
    assert "optimizer_state_dict" in str(info.value)
    with pytest.raises(SourceFormatError):
        import_universal(open_store(str(tmp_path / "s"), create=True), str(tmp_path / "junk"), "u")


def test_export_names_cannot_escape(tmp_path):
    root = tmp_path / "out"
    root.mkdir()
    base = root / "tag" / "zero"
    base.mkdir(parents=True)
    real = os.path.realpath(root)
    for bad in ("../x", "/abs", "a/../../x", "..", "a\\b"):
        with pytest.raises(InvalidNameError):
            safe_dir(real, str(base), bad)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, base / "link")
    with pytest.raises(InvalidNameError):
        safe_dir(real, str(base), "link/w")
    assert safe_dir(real, str(base), "layers.0.w").startswith(real)


def test_safe_pickle_needs_no_deepspeed(tmp_path):
    """The DeepSpeed stand-ins load a real optimizer file with deepspeed unimportable."""
    from ucp_store.safe_pickle import FragmentAddress, LossScalerStandIn, ZeroStageEnum

    path = tmp_path / "opt.pt"
    # the classes pickled under their DeepSpeed paths, exactly as DeepSpeed files name them
    code = f"""
import sys, types, enum, dataclasses, torch, collections
for mod in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", "deepspeed.runtime.fp16.loss_scaler",
            "deepspeed.runtime.zero", "deepspeed.runtime.zero.config", "deepspeed.utils",
            "deepspeed.utils.tensor_fragment"):
    sys.modules[mod] = types.ModuleType(mod)
class LossScaler:
    def __init__(self): self.cur_scale = 1.0; self.dynamic = False
LossScaler.__module__ = "deepspeed.runtime.fp16.loss_scaler"
sys.modules["deepspeed.runtime.fp16.loss_scaler"].LossScaler = LossScaler
class ZeroStageEnum(int, enum.Enum):
    disabled = 0; optimizer_states = 1; gradients = 2; weights = 3
ZeroStageEnum.__module__ = "deepspeed.runtime.zero.config"
sys.modules["deepspeed.runtime.zero.config"].ZeroStageEnum = ZeroStageEnum
@dataclasses.dataclass
class fragment_address:
    numel: int
    start: int
fragment_address.__module__ = "deepspeed.utils.tensor_fragment"
sys.modules["deepspeed.utils.tensor_fragment"].fragment_address = fragment_address
torch.save({{"optimizer_state_dict": {{"loss_scaler": LossScaler(), "zero_stage": ZeroStageEnum.gradients,
            "param_slice_mappings": [collections.OrderedDict(w=fragment_address(5, 3))],
            "single_partition_of_fp32_groups": [torch.ones(8)]}}}}, {str(path)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    check = f"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ImportError("deepspeed is blocked in this test")
sys.meta_path.insert(0, Block())
from ucp_store import safe_pickle as sp
sd = sp.load({str(path)!r})["optimizer_state_dict"]
assert type(sd["loss_scaler"]).__name__ == "LossScalerStandIn" and sd["loss_scaler"].cur_scale == 1.0
assert int(sd["zero_stage"]) == 2
fa = sd["param_slice_mappings"][0]["w"]
assert (fa.numel, fa.start) == (5, 3), fa
assert not any(m == "deepspeed" or m.startswith("deepspeed.") for m in sys.modules), "deepspeed got imported"
print("OK")
"""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
    assert FragmentAddress and LossScalerStandIn and ZeroStageEnum


@pytest.mark.slow
def test_real_files_load_without_deepspeed(ds):
    """Every file of every real checkpoint loads through safe_pickle with deepspeed blocked."""
    paths = [str(p) for name in ds.configs for p in sorted(ds.tag_dir(name).glob("*.pt"))]
    paths += [str(p) for name in ds.configs for p in sorted(ds.ds_universal(name).rglob("*.pt"))]
    check = f"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ImportError("deepspeed is blocked in this test")
sys.meta_path.insert(0, Block())
from ucp_store import safe_pickle as sp
from ucp_store.deepspeed.source import DeepSpeedReader
for p in {paths!r}:
    sp.load(p)
for d in {[str(ds.tag_dir(n)) for n in ds.configs]!r}:
    list(DeepSpeedReader(d).records())
assert not any(m == "deepspeed" or m.startswith("deepspeed.") for m in sys.modules)
print("OK", len({paths!r}))
"""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.slow
def test_failed_export_target_untouched_and_import_aborts_cleanly(ds, tmp_path):
    """An import that fails half-way (a corrupt file late in the folder) lists nothing and leaves the
    store usable; a good import afterwards works."""
    tag = _copy(ds, "z3_fp32", tmp_path)
    victim = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    _import_fails(tag, tmp_path, SourceFormatError, victim.name)
    store = open_store(str(tmp_path / "store"))
    cid = import_deepspeed(store, str(ds.tag_dir("z3_fp32")), "bad", progress=False)
    assert store.checkpoint(cid).step == ds.steps
    export_universal(store.checkpoint(cid), str(tmp_path / "exp"), progress=False)


@pytest.mark.slow
def test_export_is_atomic_and_refuses_to_clobber(ds, tmp_path):
    ck = ds.store.checkpoint(f"z2_fp32@{ds.steps}")
    root = tmp_path / "out"
    path = Path(export_universal(ck, str(root), tag="t", progress=False))
    (path / "zero" / "stale.pt").write_bytes(b"old")
    with pytest.raises(Exception, match="exists"):
        export_universal(ck, str(root), tag="t", progress=False)
    path = Path(export_universal(ck, str(root), tag="t", progress=False, overwrite=True))
    assert not (path / "zero" / "stale.pt").exists()
    assert (root / "latest_universal").read_text() == "t"
    assert sorted(p.name for p in root.iterdir()) == ["latest_universal", "t"]  # no partial folders left


def test_export_of_a_non_deepspeed_checkpoint(tmp_path):
    """A checkpoint saved by another adapter (no DeepSpeed objects) still exports a loadable folder."""
    store = open_store(str(tmp_path / "s"), create=True)
    w = torch.randn(6, 4)
    with store.begin("plain", 7) as wr:
        for st in ("fp32", "exp_avg", "exp_avg_sq"):
            wr.write("lin.weight", st, w + len(st), pattern={"kind": "partitioned", "dim": 0})
            wr.write("lin.bias", st, torch.ones(6) * len(st))
        wr.write("lin.weight", "step", torch.tensor(7.0))
        wr.write("lin.bias", "step", torch.tensor(7.0))
        wr.write("buf", "weight", torch.arange(3.0))
    out = Path(export_universal(store.checkpoint("plain@7"), str(tmp_path / "o"), progress=False))
    fp32 = torch.load(out / "zero" / "lin.weight" / "fp32.pt", weights_only=True)
    assert fp32["cat_dim"] == 0 and torch.equal(fp32["param"], w + 4)
    assert torch.load(out / "zero" / "lin.weight" / "step.pt", weights_only=True) == 7.0
    assert torch.equal(torch.load(out / "zero" / "buf" / "fp32.pt", weights_only=True)["param"], torch.arange(3.0))
    ms = torch.load(out / "mp_rank_00_model_states.pt", weights_only=True)
    assert ms["global_steps"] == 7 and list(ms["param_shapes"][0]) == ["lin.weight", "lin.bias"]
    opt = torch.load(out / "zero" / "optimizer_state.pt", weights_only=True)
    assert "ds_version" in opt and "param_groups" in opt
