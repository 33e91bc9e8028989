"""``ucp import dcp`` / ``ucp export dcp`` in one process: key layouts, both serializations, non-tensor
values (JSON or opaque bytes), the export's options, and bad inputs (unsafe ``.metadata`` that would run
code, truncated and missing data files, foreign folders), each with a clear error and nothing listed.

Folders are written by DCP itself (``dcp.save(..., no_dist=True)``); the multi-process TP x FSDP2 round
trip lives in ``tests/test_dcp_roundtrip.py``.
"""

from __future__ import annotations

import datetime
import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import (
    FileSystemWriter,
    SerializationFormat,
)

import ucp_store
from ucp_store import cli
from ucp_store.errors import SourceFormatError, UcpError
from ucp_store.formats.dcp.adapter import DcpSource, export_dcp, import_dcp, opaque_entries


def _save(folder, sd, *, fmt=SerializationFormat.TORCH_SAVE):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=FileSystemWriter(str(folder), serialization_format=fmt), no_dist=True)


def _load(folder, sd):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(folder), no_dist=True)
    return sd


def _state(gen):
    w = torch.randn(6, 4, generator=gen)
    return {
        "model": {"layers.0.w": w, "layers.0.b": torch.randn(6, generator=gen).to(torch.bfloat16),
                  "emb": torch.randn(10, 4, generator=gen)},
        "optim": {"state": {"layers.0.w": {"exp_avg": torch.randn(6, 4, generator=gen),
                                           "step": torch.tensor(7.0)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["layers.0.w"]}]},
        "train_state": {"step": 7, "name": "run-a", "started": datetime.date(2026, 12, 3)},
        "rng": torch.arange(20, dtype=torch.uint8),
    }


def _template():
    return {
        "model": {"layers.0.w": torch.zeros(6, 4), "layers.0.b": torch.zeros(6, dtype=torch.bfloat16),
                  "emb": torch.zeros(10, 4)},
        "optim": {"state": {"layers.0.w": {"exp_avg": torch.zeros(6, 4), "step": torch.tensor(0.0)}},
                  "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}]},
        "train_state": {"step": 0, "name": "", "started": None},
        "rng": torch.zeros(20, dtype=torch.uint8),
    }


@pytest.fixture
def folder(tmp_path):
    f = tmp_path / "ckpt"
    _save(f, _state(torch.Generator().manual_seed(0)))
    return f


def _no_checkpoints(store_path):
    st = ucp_store.open_store(str(store_path))
    assert st.list_checkpoints(include_pending=True) == []
    arrays = store_path / "arrays"
    assert not arrays.exists() or not any(arrays.rglob("*.zarr"))


def test_nested_layout_maps_keys_and_values(tmp_path, folder):
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    ck = import_dcp(store, str(folder), "r", 1, progress=False)
    want = _state(torch.Generator().manual_seed(0))
    got = {(i.name, i.state) for i in ck.tensors()}
    assert got == {("layers.0.w", "weight"), ("layers.0.b", "weight"), ("emb", "weight"),
                   ("layers.0.w", "exp_avg"), ("layers.0.w", "step")}
    for n, t in want["model"].items():
        r = ck.read(n, "weight")
        assert r.dtype == t.dtype and torch.equal(r, t)
    assert torch.equal(ck.read("layers.0.w", "exp_avg"), want["optim"]["state"]["layers.0.w"]["exp_avg"])
    objs = ck.objects()
    assert objs["train_state.step"] == 7 and objs["train_state.name"] == "run-a"
    assert objs["optim.param_groups.0.betas"] == {"__tuple__": [0.9, 0.95]}
    assert torch.equal(objs["rng"], want["rng"])  # a tensor outside model/optim: an array object
    assert [o["key"] for o in opaque_entries(ck)] == ["train_state.started"]
    assert "datetime.date" in opaque_entries(ck)[0]["why"]
    assert ck.provenance["source_kind"] == "dcp"


def test_flat_layout(tmp_path):
    gen = torch.Generator().manual_seed(1)
    w, m = torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen)
    sd = {"block.attn.w": w, "optimizer": {"state.block.attn.w.exp_avg": m, "param_groups.block.attn.w.lr": 0.5},
          "lr_scheduler": {"last_epoch": 3}}
    _save(tmp_path / "flat", sd)
    src = DcpSource(str(tmp_path / "flat"))
    kinds = {k: (e.kind, e.name, e.state) for k, e in src.entries.items()}
    assert kinds["block.attn.w"] == ("tensor", "block.attn.w", "weight")
    assert kinds["optimizer.state.block.attn.w.exp_avg"] == ("tensor", "block.attn.w", "exp_avg")
    assert kinds["optimizer.param_groups.block.attn.w.lr"][0] == "value"
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    ck = import_dcp(store, str(tmp_path / "flat"), "r", 1, progress=False)
    assert torch.equal(ck.read("block.attn.w", "exp_avg"), m)
    export_dcp(ck, str(tmp_path / "out"), progress=False)
    tmpl = {"block.attn.w": torch.zeros(4, 3), "optimizer": {"state.block.attn.w.exp_avg": torch.zeros(4, 3),
                                                             "param_groups.block.attn.w.lr": 0.0},
            "lr_scheduler": {"last_epoch": 0}}
    got = _load(tmp_path / "out", tmpl)
    assert torch.equal(got["block.attn.w"], w) and torch.equal(got["optimizer"]["state.block.attn.w.exp_avg"], m)
    assert got["optimizer"]["param_groups.block.attn.w.lr"] == 0.5 and got["lr_scheduler"]["last_epoch"] == 3


def test_safetensors_serialization_equals_torch_save(tmp_path):
    gen = torch.Generator().manual_seed(2)
    sd = _state(gen)
    _save(tmp_path / "t", sd)
    _save(tmp_path / "st", sd, fmt=SerializationFormat.SAFETENSORS)
    with open(tmp_path / "st" / "__0_0.distcp", "rb") as f:
        assert b"DCP_SHARDING_INFO" in f.read()  # really the safetensors serialization
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    a = import_dcp(store, str(tmp_path / "t"), "r", 1, progress=False)
    b = import_dcp(store, str(tmp_path / "st"), "r", 2, progress=False)
    ha = {(i.name, i.state): (i.dtype, i.shape, i.content_hash) for i in a.tensors()}
    hb = {(i.name, i.state): (i.dtype, i.shape, i.content_hash) for i in b.tensors()}
    assert ha == hb and len(ha) == 5
    oa, ob = a.objects(), b.objects()
    assert set(oa) == set(ob)
    for k in oa:
        if isinstance(oa[k], torch.Tensor):
            assert torch.equal(oa[k], ob[k]), k
        else:
            assert oa[k] == ob[k], k


def test_export_round_trip_and_opaque_bytes_identical(tmp_path, folder):
    store_path = tmp_path / "s"
    assert cli.main(["import", "dcp", str(folder), "--run", "r", "--step", "3", "--store", str(store_path),
                     "--no-progress"]) == 0
    out = tmp_path / "out"
    assert cli.main(["export", "dcp", "r@3", str(out), "--store", str(store_path), "--no-progress"]) == 0
    a, b = _load(folder, _template()), _load(out, _template())
    want = _state(torch.Generator().manual_seed(0))
    for k in want["model"]:
        assert torch.equal(a["model"][k], b["model"][k]) and torch.equal(b["model"][k], want["model"][k])
    assert torch.equal(b["optim"]["state"]["layers.0.w"]["exp_avg"], want["optim"]["state"]["layers.0.w"]["exp_avg"])
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"] == want["optim"]["param_groups"]
    assert a["train_state"] == b["train_state"] == want["train_state"]
    assert torch.equal(b["rng"], want["rng"])
    # the opaque blob is the very bytes the job wrote
    from ucp_store.safe_pickle import load_dcp_metadata

    def blob(f, key):
        md = load_dcp_metadata(f / ".metadata")
        info = next(v for k, v in md.storage_data.items() if k.fqn == key)
        with open(f / info.relative_path, "rb") as fh:
            fh.seek(info.offset)
            return fh.read(info.length)

    assert blob(folder, "train_state.started") == blob(out, "train_state.started")
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_show_lists_opaque_entries(tmp_path, folder, capsys):
    store_path = str(tmp_path / "s")
    assert cli.main(["import", "dcp", str(folder), "--run", "r", "--step", "1", "--store", store_path,
                     "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["show", "r@1", "--store", store_path]) == 0
    out = capsys.readouterr().out
    assert "opaque DCP entry train_state.started" in out and "datetime.date" in out


def test_export_states_and_refusals(tmp_path, folder):
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    ck = import_dcp(store, str(folder), "r", 1, progress=False)
    export_dcp(ck, str(tmp_path / "w"), states=["weight"], progress=False)
    from ucp_store.safe_pickle import load_dcp_metadata

    keys = set(load_dcp_metadata(tmp_path / "w" / ".metadata").state_dict_metadata)
    assert {k for k in keys if k.startswith("model.")} == {"model.layers.0.w", "model.layers.0.b", "model.emb"}
    assert not any(k.startswith("optim.") for k in keys) and "train_state.step" in keys
    with pytest.raises(UcpError, match="already exists"):
        export_dcp(ck, str(tmp_path / "w"), progress=False)
    with pytest.raises(UcpError, match="no state.*exp_avg_sq"):
        export_dcp(ck, str(tmp_path / "w2"), states=["exp_avg_sq"], progress=False)
    with pytest.raises(UcpError, match="did you mean 'exp_avg'"):
        export_dcp(ck, str(tmp_path / "w2"), states=["exp_avgg"], progress=False)
    assert not (tmp_path / "w2").exists()


def test_export_of_a_non_dcp_checkpoint_uses_get_state_dict_layout(tmp_path):
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    w, m = torch.randn(3, 2), torch.randn(3, 2)
    with store.begin("r", 1) as wr:
        wr.write("lin.weight", "fp32", w)
        wr.write("lin.weight", "exp_avg", m)
    export_dcp(store.checkpoint("r@1"), str(tmp_path / "out"), progress=False)
    got = _load(tmp_path / "out", {"model": {"lin.weight": torch.zeros(3, 2)},
                                   "optim": {"state": {"lin.weight": {"exp_avg": torch.zeros(3, 2)}}}})
    assert torch.equal(got["model"]["lin.weight"], w) and torch.equal(got["optim"]["state"]["lin.weight"]["exp_avg"], m)


# ------------------------------------------------------------------------------------------ bad inputs
class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this would create the marker file
        return (open, (self.marker, "w"))


def _write_evil_metadata(folder, marker, protocol):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    md = Metadata(state_dict_metadata={"x": BytesStorageMetadata()}, planner_data={"x": ("x",)},
                  storage_data={"evil": _Evil(str(marker))})
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f, protocol=protocol)


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_unsafe_metadata_is_refused_and_runs_nothing(tmp_path, folder, capsys, protocol):
    marker = tmp_path / "pwned"
    _write_evil_metadata(folder, marker, protocol)
    store_path = tmp_path / "s"
    rc = cli.main(["import", "dcp", str(folder), "--run", "r", "--step", "1", "--store", str(store_path),
                   "--no-progress"])
    err = capsys.readouterr().err
    assert rc != 0 and err.startswith("ucp: error:") and ".open" in err and ".metadata" in err
    assert not marker.exists()
    _no_checkpoints(store_path)


def test_truncated_distcp(tmp_path, folder, capsys):
    data = folder / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    store_path = tmp_path / "s"
    rc = cli.main(["import", "dcp", str(folder), "--run", "r", "--step", "1", "--store", str(store_path),
                   "--no-progress"])
    err = capsys.readouterr().err
    assert rc != 0 and "__0_0.distcp" in err and "truncated" in err and f"{size // 2} bytes" in err
    _no_checkpoints(store_path)


def test_corrupt_chunk_is_a_clear_error(tmp_path, folder):
    data = folder / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    from ucp_store.safe_pickle import load_dcp_metadata

    md = load_dcp_metadata(folder / ".metadata")
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.emb")
    raw[info.offset:info.offset + 30] = b"\0" * 30  # the chunk's zip header is gone
    data.write_bytes(bytes(raw))
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    with pytest.raises(SourceFormatError, match="model.emb"):
        import_dcp(store, str(folder), "r", 1, progress=False)
    _no_checkpoints(tmp_path / "s")


def test_missing_data_file(tmp_path, tmp_path_factory):
    folder = tmp_path / "two"
    sd = _state(torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=FileSystemWriter(str(folder), thread_count=2), no_dist=True)
    files = sorted(p.name for p in folder.glob("*.distcp"))
    assert len(files) == 2
    (folder / files[1]).unlink()
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    with pytest.raises(SourceFormatError, match=f"{files[1]}.*missing"):
        import_dcp(store, str(folder), "r", 1, progress=False)
    _no_checkpoints(tmp_path / "s")


def test_foreign_folders(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"\0" * 16)
    (hf / "config.json").write_text("{}")
    rc = cli.main(["import", "dcp", str(hf), "--run", "r", "--step", "1", "--store", str(tmp_path / "s"),
                   "--no-progress"])
    err = capsys.readouterr().err
    assert rc != 0 and "no .metadata" in err and "ucp import hf" in err
    with pytest.raises(SourceFormatError, match="does not exist"):
        DcpSource(str(tmp_path / "nowhere"))
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / ".metadata").write_bytes(b"not a pickle at all")
    with pytest.raises(SourceFormatError, match="not a readable pickle|cannot be unpickled"):
        DcpSource(str(junk))
    (junk / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(SourceFormatError, match="expected DCP's Metadata"):
        DcpSource(str(junk))
    _no_checkpoints(tmp_path / "s")


def test_step_is_required(tmp_path, folder, capsys):
    rc = cli.main(["import", "dcp", str(folder), "--run", "r", "--store", str(tmp_path / "s"), "--no-progress"])
    assert rc != 0 and "--step" in capsys.readouterr().err


@pytest.mark.parametrize("tensor", [torch.randn(5, 3), torch.randn(3, 5).t(), torch.randn(4).to(torch.bfloat16),
                                    torch.tensor(7.0), torch.zeros(0, 3), torch.arange(6, dtype=torch.int64)])
def test_chunks_are_read_in_place(tensor):
    """The zero-copy reader of a torch.save chunk rebuilds the tensor exactly (strides, dtype, 0-dim)."""
    from ucp_store.formats.dcp.adapter import _torch_chunk_in_place

    buf = io.BytesIO()
    torch.save(tensor, buf)
    got = _torch_chunk_in_place(memoryview(buf.getvalue()))
    assert got.dtype == tensor.dtype and got.shape == tensor.shape and got.stride() == tensor.stride()
    assert torch.equal(got, tensor)


def test_chunk_reader_refuses_unsafe_globals():
    from ucp_store.formats.dcp.adapter import _torch_chunk_in_place

    buf = io.BytesIO()
    torch.save({"t": torch.ones(2), "d": datetime.date(2026, 1, 1)}, buf)
    with pytest.raises(Exception, match="date"):
        _torch_chunk_in_place(memoryview(buf.getvalue()))


def test_flat_layout_keeps_nested_tensors_out_of_the_parameters(tmp_path):
    w = torch.randn(2, 2)
    _save(tmp_path / "f", {"lin.w": w, "optimizer": {"state.lin.w.exp_avg": torch.ones(2, 2),
                                                     "param_groups.lin.w.lr": 0.1},
                           "train_state": {"step": torch.tensor(12)}})
    src = DcpSource(str(tmp_path / "f"))
    assert src.entries["lin.w"].kind == "tensor" and src.entries["train_state.step"].kind == "array"


def test_key_that_would_escape_the_store_is_refused(tmp_path):
    _save(tmp_path / "evil", {"model": {"../../outside": torch.ones(3)}})
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    with pytest.raises(UcpError, match="escape"):
        import_dcp(store, str(tmp_path / "evil"), "r", 1, progress=False)
    _no_checkpoints(tmp_path / "s")
    assert not (tmp_path / "outside").exists()


def test_metadata_naming_a_file_outside_the_folder_is_refused(tmp_path, folder):
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written by DCP in this test
    for info in md.storage_data.values():
        info.relative_path = "../outside.distcp"
    (tmp_path / "outside.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    with pytest.raises(SourceFormatError, match="outside the folder"):
        import_dcp(store, str(folder), "r", 1, progress=False)
    _no_checkpoints(tmp_path / "s")


def test_zstd_stream_transform(tmp_path):
    """Chunks and blobs written through DCP's ZStandard extension are decoded with DCP's own registry;
    the opaque blob is kept as the bytes the job serialised, and the export loads without the extension."""
    from torch.distributed.checkpoint._extension import ZStandard

    sd = _state(torch.Generator().manual_seed(4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=FileSystemWriter(str(tmp_path / "z"), _extensions=[ZStandard()]), no_dist=True)
    from ucp_store.safe_pickle import load_dcp_metadata

    md = load_dcp_metadata(tmp_path / "z" / ".metadata")
    assert all(i.transform_descriptors for i in md.storage_data.values())  # really compressed
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    ck = import_dcp(store, str(tmp_path / "z"), "r", 1, progress=False)
    for n, t in sd["model"].items():
        assert torch.equal(ck.read(n, "weight"), t)
    assert [o["key"] for o in opaque_entries(ck)] == ["train_state.started"]
    export_dcp(ck, str(tmp_path / "out"), progress=False)
    got = _load(tmp_path / "out", _template())
    assert got["train_state"] == sd["train_state"] and torch.equal(got["model"]["emb"], sd["model"]["emb"])


@pytest.mark.parametrize("piece", [4, 13, 30 * 1024])
@pytest.mark.parametrize("shape", [(7, 5), (3, 4, 6), (2, 9), (0, 3), (), (17,)])
def test_chunk_assembly_copies_in_pieces_exactly(monkeypatch, piece, shape):
    """A saved chunk goes into its box of the assembled tensor in pieces (whole rows, or row by row when a
    row alone exceeds the piece), each small enough for torch to copy on the calling thread: every element
    lands where one ``copy_`` would put it, also from a transposed (non-contiguous) chunk."""
    from ucp_store.formats.dcp import adapter as dcp_mod

    monkeypatch.setattr(dcp_mod, "_PIECE", piece)
    gen = torch.Generator().manual_seed(len(shape) * 31 + piece)
    sources = [torch.randn(shape, generator=gen)]
    if len(shape) == 2:
        sources.append(torch.randn(shape[::-1], generator=gen).t())  # strides of a transposed chunk
    for src in sources:
        big = torch.full(tuple(n + 3 for n in shape), -1.0)
        box = tuple(slice(1, 1 + n) for n in shape)
        want = big.clone()
        want[box] = src
        dcp_mod._place(big[box], src)
        assert torch.equal(big, want)
