"""Hostile input: names that would escape the store, pickles that run code, paths outside the root."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ucp_store
from ucp_store import names
from ucp_store.errors import InvalidNameError, SourceFormatError, UnsafePickleError
from ucp_store.formats.torch_file import import_torch_file, load_weights_only
from ucp_store.io.location import Location

from ucp_test_helpers import array_folders, python_env

ESCAPING = ["../x", "/abs", "a/../../b", "a\\b", "..\\..\\x", "a/./b", "a//b", "./a", "C:/win", "~/home",
            "a/..", "", "nul\x00byte", "new\nline"]
BAD_RUNS = ["../x", "/abs", "a/../../b", "a\\b", "..", ".hidden", "a/b", "a..b", "", "x" * 201, "tab\there"]


def _snapshot(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _nothing_written(store, store_path: Path, tmp_path: Path, before: set[str]) -> None:
    assert store.list_checkpoints(include_pending=True) == []
    assert store.runs() == []
    assert array_folders(store_path) == set()
    sqlite_side_files = {"store/catalog.db-wal", "store/catalog.db-shm"}
    assert _snapshot(tmp_path) - before <= sqlite_side_files  # no file or folder anywhere else
    assert not (tmp_path.parent / "x").exists() and not Path("/abs").exists()


@pytest.mark.parametrize("name", ESCAPING, ids=repr)
def test_escaping_tensor_names_refused_and_nothing_written(store, store_path, tmp_path, name):
    before = _snapshot(tmp_path)
    with pytest.raises(InvalidNameError):
        store.save("r", 1, {"fine": torch.ones(3), name: torch.ones(2)})
    _nothing_written(store, store_path, tmp_path, before)
    with pytest.raises(InvalidNameError):
        store.save("r", 1, {"fine": torch.ones(3)}, objects={name: {"a": 1}})
    _nothing_written(store, store_path, tmp_path, before)


@pytest.mark.parametrize("run", BAD_RUNS, ids=repr)
def test_escaping_run_names_refused_and_nothing_written(store, store_path, tmp_path, run):
    before = _snapshot(tmp_path)
    with pytest.raises(InvalidNameError):
        store.save(run, 1, {"w": torch.ones(2)})
    _nothing_written(store, store_path, tmp_path, before)


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "x" * 65, "sp ace"], ids=repr)
def test_bad_state_and_tag_names(store, bad):
    with pytest.raises(InvalidNameError):
        store.save("r", 1, {"w": {bad: torch.ones(1)}})
    assert store.list_checkpoints(include_pending=True) == []
    store.save("r", 2, {"w": torch.ones(1)})
    if bad != "x" * 65:  # 65 characters is a fine tag (tags allow 200)
        with pytest.raises(InvalidNameError):
            store.tag("r@2", bad)


def test_good_names_are_accepted():
    for n in ["layers.0.attn.qkv.weight", "model/encoder/w", "a-b_c.D9", "é"]:
        assert names.tensor_name(n) == n
    for r in ["llama-7b", "run.1", "R_2"]:
        assert names.run_name(r) == r


def test_location_never_leaves_the_root(tmp_path):
    loc = Location.parse(str(tmp_path / "root"))
    for rel in ["../x", "/etc", "a/../../b", "a\\b", "..", "a/\x00"]:
        with pytest.raises(InvalidNameError):
            loc.kvstore(rel)
        with pytest.raises(InvalidNameError):
            loc.delete_tree(rel)
    for rel in ["", "."]:
        with pytest.raises(InvalidNameError):
            loc.delete_tree(rel)
    assert loc.kvstore("arrays/x.zarr")["path"] == str(tmp_path / "root" / "arrays" / "x.zarr") + "/"


# --- pickles ----------------------------------------------------------------------------------------

MARKER_NAME = "pwned"


class Exploit:
    """Unpickling this runs ``os.system`` (it would create the marker file)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class CustomState:
    """A class only this test module knows: torch.load(weights_only=True) must refuse it."""

    def __init__(self):
        self.w = torch.ones(2)


@pytest.fixture
def evil_files(tmp_path):
    marker = tmp_path / MARKER_NAME
    files = {}
    files["zip_reduce"] = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(3), "payload": Exploit(marker)}, files["zip_reduce"])
    files["legacy_reduce"] = tmp_path / "evil_legacy.pt"
    torch.save({"w": torch.ones(3), "payload": Exploit(marker)}, files["legacy_reduce"],
               _use_new_zipfile_serialization=False)
    files["raw_pickle"] = tmp_path / "evil.pkl"
    with open(files["raw_pickle"], "wb") as f:
        pickle.dump({"payload": Exploit(marker)}, f, protocol=2)
    files["custom_class"] = tmp_path / "custom.pt"
    torch.save({"w": torch.ones(3), "state": CustomState()}, files["custom_class"])
    assert not marker.exists()
    return marker, files


@pytest.mark.parametrize("kind", ["zip_reduce", "legacy_reduce", "raw_pickle", "custom_class"])
def test_unsafe_torch_files_refused_without_running_code(store, store_path, evil_files, kind):
    marker, files = evil_files
    with pytest.raises(UnsafePickleError) as exc:
        import_torch_file(store, str(files[kind]), "imp", 1, progress=False)
    assert str(files[kind]) in str(exc.value)
    if kind == "custom_class":
        assert "CustomState" in str(exc.value)
    assert not marker.exists()
    assert store.list_checkpoints(include_pending=True) == [] and store.runs() == []
    assert array_folders(store_path) == set()


def test_unsafe_torch_file_via_cli_in_process(store_path, evil_files, ucp):
    marker, files = evil_files
    assert ucp("init", "--store", store_path)[0] == 0
    for path in files.values():
        rc, out, err = ucp("import", "torch", path, "--run", "imp", "--step", "1", "--store", store_path)
        assert rc == 1
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ucp: error: torch file ") and "refusing" in lines[0]
    assert not marker.exists()
    rc, out, _ = ucp("ls", "--all", "--json", "--store", store_path)
    assert rc == 0 and out.strip() == "[]"


def test_unsafe_torch_file_via_cli_subprocess(store_path, evil_files):
    marker, files = evil_files
    p = subprocess.run([sys.executable, "-m", "ucp_store.cli", "import", "torch", str(files["zip_reduce"]),
                        "--run", "imp", "--step", "1", "--store", str(store_path)],
                       capture_output=True, text=True, env=python_env(), timeout=180)
    assert p.returncode == 1
    assert p.stderr.startswith("ucp: error: ") and len(p.stderr.strip().splitlines()) == 1
    assert not marker.exists()
    store = ucp_store.open_store(str(store_path))  # import created the store, but listed nothing
    assert store.list_checkpoints(include_pending=True) == [] and store.runs() == []


def test_truncated_or_foreign_files_are_source_format_errors(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(1000)}, good)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:300])
    text = tmp_path / "text.pt"
    text.write_text("not a checkpoint")
    for path in (cut, text, tmp_path / "missing.pt"):
        with pytest.raises((SourceFormatError, UnsafePickleError)):
            load_weights_only(str(path))
    assert torch.equal(load_weights_only(str(good))["w"], torch.ones(1000))


def test_store_format_holds_no_pickle(store, store_path):
    store.save("r", 1, {"w": torch.randn(50, 50), "b": torch.randn(3).bfloat16()}, objects={"cfg": {"x": [1, 2]}})
    for p in store_path.rglob("*"):
        if p.is_file() and p.name != "catalog.db" and not p.name.startswith("catalog.db-"):
            head = p.read_bytes()[:2]
            assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), p
