"""Foreign inputs and exports (issue 30 items 6, 8 and part of 11): every bad input is one ``ucp: error:`` line
naming it, DCP chunks must tile their tensor, universal export refuses what float32 cannot hold, a failed
export leaves no temporary file, and a shard file copied from another array is caught by ``verify``.

Inputs are built by the real producers (``torch.save``, safetensors, ``torch.distributed.checkpoint.save``,
``json``); a DCP ``.metadata`` is rewritten with DCP's own classes, as a corrupt or crafted one would be.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch

import ucp_store
from ucp_store import cli
from ucp_store.errors import DTypeError, SourceFormatError
from ucp_store.formats.dcp.adapter import import_dcp, tiling_problem

DEEP = "[" * 100_000 + "]" * 100_000


def ucp(*argv) -> tuple[int, str]:
    """Run one ``ucp`` command line in-process; (exit status, stderr). An exception escaping ``main`` fails."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli.main([str(a) for a in argv])
        except SystemExit as e:  # argparse usage errors
            rc = int(e.code or 0)
    return rc, err.getvalue()


def refused(rc: int, err: str, *needles: str) -> None:
    assert rc != 0, err
    assert err.startswith("ucp: error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


def only_run_r(store: Path) -> bool:
    """Nothing was imported: the store holds only the fixture's run."""
    return [r["run"] for r in ucp_store.open_store(str(store)).runs()] == ["r"]


def no_temporaries(folder: Path) -> None:
    left = [p.name for p in folder.iterdir() if ".tmp" in p.name or ".partial" in p.name]
    assert not left, left


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "store"
    s = ucp_store.open_store(str(path), create=True)
    s.save("r", 1, {"w": torch.arange(24.0).reshape(4, 6), "v": torch.ones(3)})
    return path


# ------------------------------------------------------------------------------------------ DCP tiling
def test_tiling_problem_is_exact():
    full = [((0, 0), (2, 6)), ((2, 0), (2, 6))]
    assert tiling_problem((4, 6), full) is None
    assert tiling_problem((4, 6), [full[0], full[0]]) == ("overlap", 0, 1, 0)        # sums to 24 elements
    assert tiling_problem((4, 6), [((0, 0), (3, 6)), ((1, 0), (1, 6))])[0] == "overlap"
    assert tiling_problem((4, 6), [full[0]]) == ("gap", -1, -1, 12)
    assert tiling_problem((4, 6), [full[0], ((3, 0), (2, 6))]) == ("outside", 1, -1, 0)
    assert tiling_problem((4, 6), [((0, 0), (4, 3)), ((0, 3), (4, 3))]) is None        # a column split
    assert tiling_problem((0, 6), []) is None and tiling_problem((), [((), ())]) is None
    assert tiling_problem((), []) == ("gap", -1, -1, 1)
    # a 40 x 40 grid in shuffled order, and the same grid with one cell moved onto its neighbour
    grid = [((r * 3, c * 2), (3, 2)) for r in range(40) for c in range(40)]
    grid = grid[::7] + [b for i, b in enumerate(grid) if i % 7]
    assert tiling_problem((120, 80), grid) is None
    moved = list(grid)
    moved[5] = ((moved[5][0][0], moved[5][0][1] + 1), moved[5][1]) if moved[5][0][1] + 3 <= 80 else moved[5]
    assert tiling_problem((120, 80), moved)[0] == "overlap"


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        return fn()


def dcp_folder(path: Path, chunks: list[tuple[list[int], list[int]]], size=(4, 6)) -> torch.Tensor:
    """A DCP folder whose tensor ``model.w`` of ``size`` lists ``chunks``: each chunk's bytes are a real tensor
    dcp.save wrote (under a helper key ``model.part<i>``), its metadata rewritten with DCP's own classes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    w = torch.arange(float(torch.Size(size).numel())).reshape(size)
    parts = {f"part{i}": w[tuple(slice(o, o + s) for o, s in zip(off, sz))].clone()
             for i, (off, sz) in enumerate(chunks)}
    _quiet(lambda: dcp.save({"model": {"w": w, **parts}}, checkpoint_id=str(path)))
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own file, written by DCP a moment ago
    tmd = md.state_dict_metadata["model.w"]
    tmd.size = torch.Size(size)
    tmd.chunks = [ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz)) for off, sz in chunks]
    for i, (off, _) in enumerate(chunks):
        idx = next(k for k in md.storage_data if k.fqn == f"model.part{i}")
        md.storage_data[MetadataIndex("model.w", torch.Size(off))] = md.storage_data[idx]
    for key in [k for k in md.storage_data if k.fqn == "model.w" and k.offset != torch.Size([0] * len(size))
                and all(tuple(k.offset) != tuple(off) for off, _ in chunks)]:
        del md.storage_data[key]
    if all(tuple(off) != (0,) * len(size) for off, _ in chunks):
        del md.storage_data[MetadataIndex("model.w", torch.Size([0] * len(size)))]
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return w


def test_dcp_chunks_that_tile_import_exactly(tmp_path, store):
    w = dcp_folder(tmp_path / "d", [([0, 0], [2, 6]), ([2, 0], [2, 6])])
    ck = import_dcp(ucp_store.open_store(str(store)), str(tmp_path / "d"), "d", 1, progress=False)
    assert torch.equal(ck.read("w", "weight"), w)


@pytest.mark.parametrize("chunks, needle", [
    ([([0, 0], [2, 6]), ([0, 0], [2, 6])], "chunk [0, 0]+[2, 6] (in __0_0.distcp) is listed twice"),
    # volumes add up to the tensor's 24 elements: the old sum-of-sizes check imported row 3 uninitialised
    ([([0, 0], [2, 6]), ([1, 0], [2, 6])], "chunk [0, 0]+[2, 6] (in __0_0.distcp) and chunk [1, 0]+[2, 6]"),
    ([([0, 0], [2, 6])], "12 element(s) lie in no saved chunk"),
], ids=["duplicate", "overlap-hiding-a-gap", "gap"])
def test_dcp_chunks_that_do_not_tile_are_refused_naming_them(tmp_path, store, chunks, needle):
    dcp_folder(tmp_path / "d", chunks)
    rc, err = ucp("import", "dcp", tmp_path / "d", "--run", "d", "--step", "1", "--store", store, "--no-progress")
    refused(rc, err, f"{tmp_path}/d/.metadata", "'model.w'", needle, "must tile the tensor exactly")
    assert only_run_r(store)


def test_dcp_declared_size_beyond_the_files_is_refused_before_allocating(tmp_path, store):
    # one chunk that claims the whole 2^40-element tensor: it tiles, but its file entry holds 96 bytes
    dcp_folder(tmp_path / "d", [([0, 0], [4, 6])])
    with open(tmp_path / "d" / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.state_dict_metadata["model.w"].size = torch.Size([2**20, 2**20])
    md.state_dict_metadata["model.w"].chunks[0].sizes = torch.Size([2**20, 2**20])
    with open(tmp_path / "d" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    rc, err = ucp("import", "dcp", tmp_path / "d", "--run", "d", "--step", "1", "--store", store, "--no-progress")
    refused(rc, err, "__0_0.distcp", "'model.w'", f"declares {4 * 2**40} bytes", "bytes (per .metadata)")
    # the same size with the real chunk: a gap of 2^40 - 24 elements, refused from the metadata alone
    md.state_dict_metadata["model.w"].chunks[0].sizes = torch.Size([4, 6])
    with open(tmp_path / "d" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(SourceFormatError, match=f"{2**40 - 24} element"):
        import_dcp(ucp_store.open_store(str(store)), str(tmp_path / "d"), "d", 1, progress=False)


# ------------------------------------------------------------------------- one error line, never a traceback
def test_corrupt_catalog_is_one_error_line(tmp_path, store):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "catalog.db").write_bytes(os.urandom(64 * 1024))
    refused(*ucp("ls", "--store", tmp_path / "bad"), f"{tmp_path}/bad/catalog.db", "file is not a database")


def test_catalog_page_corrupt_after_open_is_one_error_line(tmp_path):
    path = tmp_path / "s"
    s = ucp_store.open_store(str(path), create=True)
    for step in range(40):
        s.save("r", step, {f"w{j}": torch.ones(2) for j in range(20)})
    s.catalog.engine.dispose()
    raw = bytearray((path / "catalog.db").read_bytes())
    pages = len(raw) // 4096
    for page in range(pages - 6, pages - 1):  # the tensor rows of the last versions, not the schema
        # all but the page's header: a partly corrupted page can keep the damage in its free gap (no reader
        # notices), which made this test pass or fail by where the random row ids put the cells
        raw[page * 4096 + 12:(page + 1) * 4096] = os.urandom(4096 - 12)
    (path / "catalog.db").write_bytes(bytes(raw))
    outcomes = [ucp(*cmd, "--store", path) for cmd in (["show", "r@39"], ["show", "r@38"], ["ls"])]
    assert any(rc for rc, _ in outcomes)
    for rc, err in outcomes:
        if rc:
            refused(rc, err, "catalog")


def _hf(folder: Path, *, config: str | None = None, index: str | None = None) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    name = "a.safetensors" if index is not None else "model.safetensors"
    save_file({"w": torch.ones(2)}, str(folder / name))
    if config is not None:
        (folder / "config.json").write_text(config)
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(index)
    return folder


def _raw_safetensors(folder: Path, header: bytes, data: bytes = b"") -> Path:
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    return folder


@pytest.mark.parametrize("build, needle", [
    (lambda d: _hf(d, config=DEEP), "config.json: JSON nested more than 100 levels"),
    (lambda d: _hf(d, config=json.dumps({"a": json.loads("[" * 150 + "]" * 150)})), "config.json: JSON nested"),
    (lambda d: _hf(d, index=DEEP), "model.safetensors.index.json: JSON nested"),
    (lambda d: _hf(d, config='{"vocab_size": ' + "9" * 5000 + "}"), "config.json is not valid JSON (it holds an "
                                                                     "integer with more digits"),
    (lambda d: _raw_safetensors(d, ('{"w": ' + DEEP + "}").encode()), "model.safetensors: header: JSON nested"),
    (lambda d: _raw_safetensors(d, json.dumps({"w": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}})
                                .encode()), "tensor 'w': shape [0, 9223372036854775808] is too large"),
    (lambda d: _raw_safetensors(d, json.dumps({"__metadata__": {"a": [[1]]}, "w": {
        "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode(), bytes(4)), "__metadata__ must be"),
], ids=["deep-config", "config-150-levels", "deep-index", "5000-digit-int", "deep-header", "shape-0-2^63",
        "metadata-not-strings"])
def test_hf_import_of_hostile_json_is_one_error_line(tmp_path, store, build, needle):
    folder = build(tmp_path / "hf")
    rc, err = ucp("import", "hf", folder, "--run", "h", "--store", store, "--no-progress")
    refused(rc, err, str(folder), needle)
    assert only_run_r(store)


def test_export_options_are_checked(tmp_path, store):
    (tmp_path / "deep.json").write_text(DEEP)
    refused(*ucp("export", "hf", "r@1", tmp_path / "o1", "--config", tmp_path / "deep.json", "--store", store,
                 "--no-progress"), f"config {tmp_path}/deep.json: JSON nested")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    refused(*ucp("export", "hf", "r@1", tmp_path / "o2", "--map", tmp_path / "deep.json", "--config",
                 tmp_path / "config.json", "--store", store, "--no-progress"),
            f"name map {tmp_path}/deep.json: JSON nested")
    for size in ("infGB", "nanGB", "-1GB"):
        refused(*ucp("export", "hf", "r@1", tmp_path / "o3", f"--max-shard-size={size}", "--store", store,
                     "--no-progress"), f"max_shard_size {size!r}")
    refused(*ucp("export", "torch", "r@1", "", "--store", store, "--no-progress"), "cannot write torch file ''",
            "empty")
    for kind in ("dcp", "hf", "deepspeed-universal"):
        refused(*ucp("export", kind, "r@1", "", "--store", store, "--no-progress"), "to '': expected a path")
    refused(*ucp("export", "dcp", "r@1", tmp_path / "o4", "--threads", "0", "--store", store, "--no-progress"),
            "--threads", "got 0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "deep.json", "store"]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1"])
def test_init_chunk_mib_must_be_positive_and_finite(tmp_path, value):
    refused(*ucp("init", "--store", tmp_path / "s", f"--chunk-mib={value}"), "--chunk-mib", "positive, finite")
    assert not (tmp_path / "s").exists()


def test_plan_caps_the_world_size(store):
    refused(*ucp("plan", "r@1", "--mesh", "100000,100000", "--store", store), "--mesh 100000,100000",
            "10000000000 ranks", "at most 1048576")
    refused(*ucp("plan", "r@1", "--tp", "100000", "--dp", "100000", "--store", store), "tp=100000", "at most 1048576")
    refused(*ucp("plan", "r@1", "--mesh", "1024,1024", "--store", store), "pass --rank R")
    rc, err = ucp("plan", "r@1", "--mesh", "1024,1024", "--rank", "1048575", "--store", store)
    assert rc == 0, err


def test_conjugate_view_in_a_torch_file_is_stored_by_value(tmp_path, store):
    c = torch.randn(5, 3, dtype=torch.complex64)
    torch.save({"c": c.conj(), "n": torch.randn(4, dtype=torch.complex64).conj().imag}, tmp_path / "conj.pt")
    rc, err = ucp("import", "torch", tmp_path / "conj.pt", "--run", "c", "--step", "1", "--store", store,
                  "--no-progress")
    assert rc == 0, err
    ck = ucp_store.open_store(str(store)).checkpoint("c@1")
    got = ck.read("c", "weight")
    assert not got.is_conj() and torch.equal(got, c.conj().resolve_conj())
    assert torch.equal(ck.read("n", "weight"), torch.load(tmp_path / "conj.pt")["n"].resolve_neg())


def test_the_top_level_net_names_the_input_and_keeps_programming_errors(tmp_path, store, monkeypatch):
    """An unforeseen parse failure is still one line naming the command and input (and where it was raised,
    for a report); a TypeError (a bug, not bad input) is not swallowed."""
    from ucp_store.formats import torch_file

    def deep(*a, **k):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(torch_file, "export_torch_file", deep)
    refused(*ucp("export", "torch", "r@1", tmp_path / "x.pt", "--store", store),
            f"ucp export torch r@1 {tmp_path}/x.pt", "RecursionError", "please report")

    def bug(*a, **k):
        raise TypeError("a bug")

    monkeypatch.setattr(torch_file, "export_torch_file", bug)
    with pytest.raises(TypeError):
        ucp("export", "torch", "r@1", tmp_path / "x.pt", "--store", store)


# ------------------------------------------------------------------------------------- exports: no temporaries
@pytest.fixture
def odd_store(tmp_path):
    path = tmp_path / "odd"
    ucp_store.open_store(str(path), create=True).save("r", 1, {
        "a": torch.ones(4), "c": torch.randn(3, dtype=torch.complex64),
        "u": torch.tensor([1, 2**40 + 1]).to(torch.uint64), "b": torch.tensor([True, False])})
    return path


@pytest.mark.parametrize("name, dtype", [("c", "complex64"), ("u", "uint64"), ("b", "bool")])
def test_universal_export_refuses_what_float32_cannot_hold(tmp_path, odd_store, name, dtype):
    from ucp_store.deepspeed.universal import export_universal

    s = ucp_store.open_store(str(odd_store))
    s.save("one", 1, {name: s.checkpoint("r@1").read(name, "weight"), "a": torch.ones(2)})
    with pytest.raises(DTypeError, match=f"tensor '{name}' state 'weight' of one@1 is {dtype}"):
        export_universal(s.checkpoint("one@1"), str(tmp_path / "uni"), progress=False)
    assert not (tmp_path / "uni").exists()  # no partial folder, no latest_universal, not even the folder
    rc, err = ucp("export", "deepspeed-universal", "one@1", tmp_path / "uni", "--store", odd_store)
    refused(rc, err, f"'{name}'", dtype)


def _corrupt(store: Path, ck, name: str) -> None:
    """Flip bytes in the middle of the (one) shard file of tensor ``name``: a ChecksumError mid-export."""
    info = next(i for i in ck.tensors() if i.name == name)
    shards = [p for p in (store / info.array).rglob("*") if p.is_file() and p.name != "zarr.json"]
    raw = bytearray(shards[0].read_bytes())
    raw[len(raw) // 4] ^= 0xFF
    shards[0].write_bytes(bytes(raw))


@pytest.mark.parametrize("kind", ["torch", "hf", "dcp", "deepspeed-universal"])
def test_a_failed_export_leaves_no_temporary(tmp_path, kind):
    path = tmp_path / "s"
    s = ucp_store.open_store(str(path), create=True)
    ck = s.save("r", 1, {"a": torch.ones(64, 64), "z": torch.arange(4096.0).reshape(64, 64)},
                objects={"hf.config": {"model_type": "x"}})
    ck = s.checkpoint(getattr(ck, "id", ck))
    _corrupt(path, ck, "z")
    out = tmp_path / "out"
    out.mkdir()
    rc, err = ucp("export", kind, "r@1", out / "dest", "--store", path, "--no-progress")
    refused(rc, err, "'z'")
    no_temporaries(out)
    assert not (out / "dest").exists()


def test_torch_export_onto_a_folder_and_read_out_onto_a_folder_leave_nothing(tmp_path, store):
    (tmp_path / "dir").mkdir()
    refused(*ucp("export", "torch", "r@1", tmp_path / "dir", "--store", store, "--no-progress"), "a folder")
    rc, err = ucp("read", "r@1", "w", "--out", tmp_path / "dir", "--store", store)
    assert rc != 0 and "Traceback" not in err
    no_temporaries(tmp_path)
    assert os.listdir(tmp_path / "dir") == []


# ------------------------------------------------------------------------------------- a shard file copied
def test_a_shard_copied_from_another_array_is_caught_by_verify(tmp_path):
    """The chunk checksums are standard Zarr v3 crc32c, over a chunk's bytes only, and the shard index of an
    uncompressed layout is the same for every array of that layout, so a read of a shard file copied from
    another array of the same layout cannot tell (ARCHITECTURE.md, format invariants): the content hash,
    which ``verify`` recomputes, binds an array's bytes to its catalog row."""
    path = tmp_path / "s"
    s = ucp_store.open_store(str(path), create=True)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    s.save("r", 1, {"a": a, "b": b})
    ck = s.checkpoint("r@1")
    files = {}
    for info in ck.tensors():
        files[info.name] = sorted(p for p in (path / info.array).rglob("*") if p.is_file() and p.name != "zarr.json")
    assert len(files["a"]) == len(files["b"]) == 1
    shutil.copyfile(files["a"][0], files["b"][0])
    assert torch.equal(s.checkpoint("r@1").read("b", "weight"), a)  # the limit this test documents
    problems = s.checkpoint("r@1").verify()
    assert {p["tensor"] for p in problems} == {"b"} and all("content hash" in p["error"] for p in problems)
    rc, _ = ucp("verify", "r@1", "--store", path)
    assert rc != 0
