"""Issue 40, part B: objects keep their types, hostile safetensors and FIFOs as inputs, exports onto a full
disk, a store on a full disk or a read-only mount, look-alike names, a universal-export path clash, and a
DCP-backend save left pending by a spawned coordinator that exits normally.

The disk cases use real filesystems: a small tmpfs mounted for the test (root is needed; without it they
skip, saying so), filled by a real file, or remounted read-only."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ucp_store
from ucp_store.errors import (
    CatalogError,
    ConflictError,
    InvalidNameError,
    ValidationError,
)

from ucp_test_helpers import free_port, python_env, store_on

CATALOGS = ["sqlite", "postgres"]


def ucp(*argv, timeout: float = 120) -> subprocess.CompletedProcess:
    """``ucp ARGV`` in a real process (an input that blocks fails the test by its timeout, never hangs it)."""
    return subprocess.run([sys.executable, "-m", "ucp_store.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env=python_env())


def cli(*argv) -> subprocess.CompletedProcess:
    """``ucp ARGV`` in this process (``cli.main``), as a CompletedProcess: for inputs that cannot block."""
    import contextlib
    import io

    from ucp_store import cli as ucp_cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = ucp_cli.main([str(a) for a in argv])
        except SystemExit as e:
            rc = int(e.code or 0)
    return subprocess.CompletedProcess(list(argv), rc, out.getvalue(), err.getvalue())


def one_error_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and p.stderr.startswith("ucp: error: "), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    return p.stderr


# --------------------------------------------------------------------------------------------- item 8: objects
@pytest.mark.parametrize("catalog", CATALOGS)
def test_objects_keep_tuples_non_string_keys_and_numpy_scalars(tmp_path, catalog):
    value = {"betas": (0.9, 0.999), "nested": [(1, (2, "x")), {"k": ()}],
             "keys": {1: "int", False: "bool", 1.5: "float", "1": "str", None: "none", (1, "a"): "tuple"},
             "tag_like": {"__ucp_tuple__": [1, 2]}, "np": np.float64(0.1), "i": np.int32(-7), "f": -0.0}
    with store_on(catalog, tmp_path / "s") as store:
        store.save("r", 1, {"w": torch.zeros(2)}, objects={"cfg": value})
        got = store.checkpoint("r@1").objects()["cfg"]
    assert type(got["betas"]) is tuple and got["betas"] == (0.9, 0.999)
    assert type(got["nested"][0][1]) is tuple and got["nested"][1] == {"k": ()} and type(got["nested"][1]["k"]) is tuple
    assert list(got["keys"]) == list(value["keys"]) and got["keys"] == value["keys"]
    assert [type(k) for k in got["keys"]] == [int, bool, float, str, type(None), tuple]
    assert got["tag_like"] == {"__ucp_tuple__": [1, 2]}  # a user dict that looks like a tag stays a dict
    assert type(got["np"]) is np.float64 and got["np"] == np.float64(0.1)
    assert type(got["i"]) is np.int32 and got["i"] == -7
    assert math.copysign(1.0, got["f"]) == -1.0


@pytest.mark.parametrize("bad, path, what", [
    ({"layers": [0, 1, 2, {1, 2}]}, "objects['cfg']['layers'][3]", "builtins.set"),
    ({"b": b"raw"}, "objects['cfg']['b']", "builtins.bytes"),
    ({"k": {frozenset(): 1}}, "objects['cfg']['k'] key", "frozenset"),
    ({"e": torch.float32}, "objects['cfg']['e']", "torch.dtype"),
])
def test_objects_json_cannot_hold_exactly_are_refused_naming_the_path(tmp_path, bad, path, what):
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    with pytest.raises(ValidationError) as e:
        store.save("r", 1, {"w": torch.zeros(2)}, objects={"cfg": bad})
    assert path in str(e.value) and what in str(e.value)
    assert store.list_checkpoints(include_pending=True) == []


def test_lone_surrogate_in_an_object_or_a_name_is_a_ucp_error(tmp_path):
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    with pytest.raises(ValidationError, match=r"objects\['cfg'\]\['s'\] holds a string with a lone surrogate U\+D800"):
        store.save("r", 1, {"w": torch.zeros(2)}, objects={"cfg": {"s": "a\ud800b"}})
    with pytest.raises(ValidationError, match="lone surrogate U\\+DFFF"):
        store.save("r", 1, {"w": torch.zeros(2)}, objects={"cfg": {"a\udfff": 1}})
    with pytest.raises(InvalidNameError, match="lone surrogate U\\+D800"):
        store.save("r", 1, {"w\ud800": torch.zeros(2)})
    with pytest.raises(InvalidNameError, match="lone surrogate"):
        store.save("r", 1, {"w": torch.zeros(2)}, objects={"o\ud800": 1})
    assert store.list_checkpoints(include_pending=True) == []


# -------------------------------------------------------------------------------------------- look-alike names
@pytest.mark.parametrize("name, char", [("ln\u200df.weight", "U+200D"), ("ln\u200bf.weight", "U+200B"),
                                        ("ln\u00a0f.weight", "U+00A0"), ("ln\ufefff.weight", "U+FEFF"),
                                        ("ln\u00adf.weight", "U+00AD"), ("lnf\ufe0f.weight", "U+FE0F"),
                                        ("ln\u3164f.weight", "U+3164")])
def test_invisible_characters_in_names_are_refused(tmp_path, name, char):
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    with pytest.raises(InvalidNameError, match=f"invisible character {char.replace('+', '[+]')}"):
        store.save("r", 1, {"lnf.weight": torch.zeros(2), name: torch.ones(2)})
    with pytest.raises(InvalidNameError, match=f"object name .*{char.replace('+', '[+]')}"):
        store.save("r", 1, {"w": torch.zeros(2)}, objects={name: 1})
    store.save("r", 1, {"lnf.weight": torch.zeros(2), "with space": torch.ones(1)})  # a plain space is fine


# ----------------------------------------------------------------------------------- item 9: safetensors tiling
def _safetensors(path: Path, entries: dict, data: bytes) -> None:
    raw = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("entries, size, needle", [
    ({"a": [0, 16], "b": [8, 24]}, 24, "tensor 'b' (data_offsets [8, 24]) overlaps bytes of tensor 'a'"),
    ({"a": [0, 16], "b": [0, 16]}, 16, "overlaps the same bytes as tensor 'a'"),
    ({"a": [0, 16], "b": [24, 40]}, 40, "a gap of 8 bytes [16, 24) after tensor 'a', before tensor 'b'"),
    ({"a": [8, 24]}, 24, "a gap of 8 bytes [0, 8) at the start of the data section"),
    ({"a": [0, 16]}, 20, "4 bytes after the last tensor ('a', ending at 16)"),
])
def test_safetensors_whose_offsets_overlap_alias_or_leave_gaps_are_refused(tmp_path, entries, size, needle):
    d = tmp_path / "hf"
    d.mkdir()
    _safetensors(d / "model.safetensors", {k: {"dtype": "F32", "shape": [(v[1] - v[0]) // 4], "data_offsets": v}
                                           for k, v in entries.items()}, bytes(range(size)))
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    p = cli("import", "hf", d, "--run", "r", "--step", "1", "--store", tmp_path / "s")
    err = one_error_line(p)
    assert needle in err and str(d / "model.safetensors") in err, err
    assert store.list_checkpoints(include_pending=True) == []


def test_a_valid_safetensors_with_empty_tensors_imports(tmp_path):
    from ucp_store.formats.hf.adapter import read_header

    d = tmp_path / "ok.safetensors"
    _safetensors(d, {"e": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
                     "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "z": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]}}, bytes(8))
    assert set(read_header(str(d)).entries) == {"e", "a", "z"}


def test_an_hf_config_that_is_a_json_list_is_refused(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    save_file({"model.embed_tokens.weight": torch.ones(4, 2)}, str(d / "model.safetensors"))
    (d / "config.json").write_text("[1, 2]")
    err = one_error_line(cli("import", "hf", d, "--run", "r", "--step", "1", "--store", tmp_path / "s"))
    assert f"{d / 'config.json'} is a JSON list, expected an object" in err
    store = ucp_store.open_store(str(tmp_path / "t"), create=True)
    store.save("r", 1, {"model.embed_tokens.weight": torch.ones(4, 2)})
    (tmp_path / "cfg.json").write_text('["not", "a", "config"]')
    err = one_error_line(cli("export", "hf", "r@1", tmp_path / "out", "--config", tmp_path / "cfg.json",
                             "--store", tmp_path / "t"))
    assert "is a JSON list, expected an object" in err and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ item 10: FIFOs
def _hf_with(tmp_path: Path, fifo: str) -> Path:
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    if fifo != "model.safetensors":
        save_file({"model.embed_tokens.weight": torch.ones(4, 2)}, str(d / "model.safetensors"))
    os.mkfifo(d / fifo)
    return d


@pytest.mark.parametrize("fifo", ["model.safetensors", "config.json", "generation_config.json",
                                  "model.safetensors.index.json"])
def test_a_fifo_in_an_hf_folder_is_refused_without_blocking(tmp_path, fifo):
    d = _hf_with(tmp_path, fifo)
    err = one_error_line(ucp("import", "hf", d, "--run", "r", "--step", "1", "--store", tmp_path / "s", timeout=60))
    assert f"{d / fifo} is not a regular file (a FIFO)" in err, err


def test_fifo_inputs_of_every_kind_say_so(tmp_path):
    store = tmp_path / "s"
    ucp_store.open_store(str(store), create=True).save("r", 1, {"model.embed_tokens.weight": torch.ones(4, 2)})
    os.mkfifo(tmp_path / "x.pt")
    (tmp_path / "dcp").mkdir()
    os.mkfifo(tmp_path / "dcp" / ".metadata")
    os.mkfifo(tmp_path / "cfg.json")
    uni = tmp_path / "uni" / "global_step1"
    (uni / "zero").mkdir(parents=True)
    os.mkfifo(uni / "zero" / "optimizer_state.pt")
    tag = tmp_path / "ds" / "global_step1"
    tag.mkdir(parents=True)
    os.mkfifo(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    os.mkfifo(tag / "mp_rank_00_model_states.pt")
    cases = {
        ("import", "torch", tmp_path / "x.pt"): f"{tmp_path / 'x.pt'} is not a regular file (a FIFO)",
        ("import", "dcp", tmp_path / "dcp"): f"{tmp_path / 'dcp' / '.metadata'} is not a regular file (a FIFO)",
        ("import", "deepspeed-universal", uni): f"{uni / 'zero' / 'optimizer_state.pt'} is not a regular file (a FIFO)",
        ("import", "deepspeed", tag): f"{tag / 'zero_pp_rank_0_mp_rank_00_optim_states.pt'} is not a regular file "
                                      "(a FIFO)",
    }
    for argv, needle in cases.items():
        err = one_error_line(ucp(*argv, "--run", "i", "--step", "1", "--store", store, timeout=60))
        assert needle in err, (argv, err)
        assert "does not exist" not in err and "found .metadata" not in err
    err = one_error_line(ucp("export", "hf", "r@1", tmp_path / "out", "--config", tmp_path / "cfg.json", "--store",
                             store, timeout=60))
    assert f"{tmp_path / 'cfg.json'} is not a regular file (a FIFO)" in err
    assert [c["run"] for c in ucp_store.open_store(str(store)).list_checkpoints(include_pending=True)] == ["r"]


# ------------------------------------------------------------------------------- disks: tmpfs, full, read-only
_MOUNT_OK: list[bool] = []


def _can_mount(tmp_path: Path) -> bool:
    if not _MOUNT_OK:
        probe = tmp_path / "probe"
        probe.mkdir()
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(probe)], check=True)
        _MOUNT_OK.append(ok)
    return _MOUNT_OK[0]


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(name, size)``: a fresh tmpfs of ``size`` at ``tmp_path/name``, unmounted afterwards."""
    if not _can_mount(tmp_path):
        pytest.skip("mounting a tmpfs is not permitted here (needs root): the full-disk and read-only cases need one")
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], check=True)
        mounted.append(d)
        return d

    yield mount
    for d in reversed(mounted):
        subprocess.run(["umount", "-l", str(d)], check=False)


def fill(folder: Path) -> None:
    """Write a real file until the filesystem says ENOSPC."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
                f.flush()
        except OSError:
            pass


EXPORTS = [("export", "torch", "{dest}/x.pt"), ("export", "deepspeed-universal", "{dest}/u"),
           ("export", "dcp", "{dest}/d"), ("export", "hf", "{dest}/h"), ("read", "w", "--out", "{dest}/w.npy")]


def _export_argv(kind: tuple, dest: Path) -> list[str]:
    argv = [a.format(dest=dest) for a in kind]
    return [argv[0], "r@1", *argv[1:]] if argv[0] == "read" else [argv[0], argv[1], "r@1", argv[2]]


@pytest.mark.parametrize("margin", [-4096, 48], ids=["checked-first", "runs-out-while-writing"])
def test_exports_onto_a_full_disk_say_no_space_and_leave_nothing(tmp_path, tmpfs, margin):
    """Issue 40.13: the needed bytes are more than the disk holds (refused before writing), or a hair less
    (the file's framing runs out of room while writing): either way one line, no partial output."""
    dest = tmpfs("full", "200k")
    free = os.statvfs(dest).f_bavail * os.statvfs(dest).f_frsize
    n = (free - margin) // 4
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    store.save("r", 1, {"w": torch.randn(n, generator=torch.Generator().manual_seed(0))},
               objects={"hf.config": {"model_type": "llama"}})
    for kind in EXPORTS:
        argv = _export_argv(kind, dest)
        p = cli(*argv, "--store", tmp_path / "s")
        err = one_error_line(p)
        target = argv[3] if argv[0] == "export" else argv[-1]
        assert f"no space left on {target}" in err and "needs about" in err, (argv, err)
        assert os.listdir(dest) == [], (argv, os.listdir(dest))


def _two_versions(root: Path) -> None:
    s = ucp_store.open_store(str(root), create=True)
    g = torch.Generator().manual_seed(1)
    s.save("r", 1, {"w": torch.randn(256, 256, generator=g), "shared": torch.ones(64)}, objects={"cfg": (1, 2)})
    s.save("r", 2, {"w": torch.randn(256, 256, generator=g), "shared": torch.ones(64)})
    s.catalog.close()


def test_a_full_disk_store_can_be_read_and_freed_with_rm_and_gc(tmpfs):
    """Issue 40.14: on a full disk ls, show, verify, read, query and gc --dry-run work; rm and gc delete the
    removed versions' own files first, so they make room; the kept version verifies afterwards."""
    root = tmpfs("disk", "4m") / "s"
    _two_versions(root)
    fill(root.parent)
    assert os.statvfs(root).f_bavail == 0
    for argv in (["ls"], ["show", "r@1"], ["verify", "r@1"], ["log", "r@2"], ["read", "r@1", "shared"],
                 ["query", "select count(*) from checkpoints"], ["gc", "--dry-run"], ["stats", "r@2"]):
        p = cli(*argv, "--store", root)
        assert p.returncode == 0, (argv, p.stderr)
    p = cli("rm", "r@1", "--store", root)
    assert p.returncode == 0 and "removed r@1" in p.stdout, p.stderr
    p = cli("gc", "--store", root)
    assert p.returncode == 0, p.stderr
    s = ucp_store.open_store(str(root), read_only=True)
    assert [c["step"] for c in s.list_checkpoints(include_pending=True)] == [2]
    assert s.checkpoint("r@2").verify() == []
    assert torch.equal(s.checkpoint("r@2").read("shared"), torch.ones(64))


def test_gc_on_a_full_disk_frees_retention_victims_first(tmpfs):
    root = tmpfs("disk", "4m") / "s"
    _two_versions(root)
    fill(root.parent)
    p = cli("gc", "--keep-last", "1", "--store", root)
    assert p.returncode == 0 and "removed 1 version(s)" in p.stdout, (p.stdout, p.stderr)
    s = ucp_store.open_store(str(root), read_only=True)
    assert [c["step"] for c in s.list_checkpoints()] == [2] and s.checkpoint("r@2").verify() == []


def test_nothing_to_free_on_a_full_disk_is_one_clear_line(tmpfs):
    root = tmpfs("disk", "4m") / "s"
    _two_versions(root)
    fill(root.parent)
    err = one_error_line(cli("gc", "--store", root))
    assert f"no space left on {root}" in err and "free space on that filesystem" in err


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and not p.name.endswith(("-wal", "-shm"))}


READS = [["ls"], ["show", "r@1"], ["verify", "r@1"], ["log", "r@2"], ["read", "r@1", "shared"], ["stats", "r@2"],
         ["diff", "r@1", "r@2"], ["query", "select count(*) from tensors"], ["gc", "--dry-run"],
         ["plan", "r@1", "--tp", "2"]]


def test_a_read_only_store_can_be_listed_read_and_exported(tmp_path, tmpfs):
    """Issue 40.15: every command that only reads works on a read-only mount; writes fail in one line."""
    root = tmpfs("ro", "4m") / "s"
    _two_versions(root)
    subprocess.run(["mount", "-o", "remount,ro", str(root.parent)], check=True)
    for argv in READS + [["export", "torch", "r@1", tmp_path / "x.pt"]]:
        p = cli(*argv, "--store", root)
        assert p.returncode == 0, (argv, p.stderr)
    assert torch.equal(torch.load(tmp_path / "x.pt")["shared"], torch.ones(64))
    for argv in (["rm", "r@1"], ["gc"], ["tag", "r@1", "t"], ["import", "torch", tmp_path / "x.pt", "--run", "i",
                                                              "--step", "1"]):
        err = one_error_line(cli(*argv, "--store", root))
        assert "read-only filesystem" in err, (argv, err)
    s = ucp_store.open_store(str(root), read_only=True)
    assert s.checkpoint("r@1").objects() == {"cfg": (1, 2)}
    with pytest.raises(CatalogError, match="opened read-only"):
        s.rm("r@1")


def test_commands_that_only_read_write_nothing(tmp_path):
    """No migration, no journal-mode switch, no settings: the catalog's bytes are the same afterwards."""
    root = tmp_path / "s"
    s = ucp_store.open_store(str(root), create=True, sqlite_journal="delete")
    s.save("r", 1, {"w": torch.ones(3), "shared": torch.ones(64)})
    s.save("r", 2, {"w": torch.zeros(3), "shared": torch.ones(64)})
    s.catalog.close()
    before = _tree(root)
    for argv in READS + [["export", "dcp", "r@1", tmp_path / "d"]]:
        p = cli(*argv, "--store", root)
        assert p.returncode == 0, (argv, p.stderr)
    assert _tree(root) == before


def test_an_immutable_catalog_file_is_read(tmp_path):
    """``chattr +i`` catalog.db (root cannot write it either): reads work, a write says why it cannot."""
    root = tmp_path / "s"
    _two_versions(root)
    db = root / "catalog.db"
    if subprocess.run(["chattr", "+i", str(db)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported on this filesystem")
    try:
        for argv in READS:
            p = cli(*argv, "--store", root)
            assert p.returncode == 0, (argv, p.stderr)
        p = cli("tag", "r@1", "t", "--store", root)
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    finally:
        subprocess.run(["chattr", "-i", str(db)], check=True)


# ------------------------------------------------------------------------------- universal export path clash
@pytest.mark.parametrize("names, needle", [
    (("x", "x/fp32.pt"), "tensor 'x/fp32.pt' needs zero/x/fp32.pt as a folder, but tensor 'x' writes the file"),
    (("a/b", "a/b/exp_avg.pt"), "tensor 'a/b/exp_avg.pt' needs zero/a/b/exp_avg.pt as a folder"),
    (("optimizer_state.pt",), "needs zero/optimizer_state.pt as a folder, but the export writes the file"),
])
def test_universal_export_refuses_a_name_clash_up_front(tmp_path, names, needle):
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    with store.begin("r", 1) as w:
        for n in names:
            w.write(n, "fp32", torch.ones(2))
            w.write(n, "exp_avg", torch.zeros(2))
    err = one_error_line(cli("export", "deepspeed-universal", "r@1", tmp_path / "out", "--store", tmp_path / "s"))
    assert needle in err, err
    assert not (tmp_path / "out").exists()
    from ucp_store.deepspeed import export_universal

    with pytest.raises(ConflictError):
        export_universal(store.checkpoint("r@1"), str(tmp_path / "out2"), progress=False)


# ----------------------------------------------------------------------- a DCP-backend save pending after exit
def _failing_rank(rank: int, port: int, store: str) -> None:
    import datetime

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ucp_store.formats.dcp.storage import UcpStorageWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))

    class Failing(DefaultSavePlanner):
        def resolve_data(self, write_item):
            if rank == 1:
                raise RuntimeError("rank 1 cannot stage its shard")
            return super().resolve_data(write_item)

    try:
        dcp.save({"w": torch.ones(4), "b": torch.zeros(2)}, storage_writer=UcpStorageWriter(store, run="f", step=1),
                 planner=Failing())
    except BaseException:  # noqa: BLE001 - the save fails on purpose; the process then exits normally
        pass
    import gc

    gc.collect()  # the failed save's writer is garbage now, as it soon is in any program
    dist.destroy_process_group()


def test_a_failed_dcp_save_is_aborted_when_a_spawned_coordinator_exits(tmp_path):
    """Issue 40: ranks started with multiprocessing spawn leave through os._exit, which skips atexit; the
    coordinator's pending version must still be aborted when it exits normally."""
    store = str(tmp_path / "s")
    ucp_store.open_store(store, create=True).catalog.close()
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_failing_rank, args=(r, port, store)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0, p.exitcode
    s = ucp_store.open_store(store)
    assert s.list_checkpoints(include_pending=True) == []
    assert not any((Path(store) / "arrays").iterdir())


# ------------------------------------------------------------------- attacker pass: outputs that replace things
def test_outputs_never_replace_a_fifo_a_device_or_a_link(tmp_path):
    """``read --out /dev/stdout`` (a link) or ``/dev/null`` (a device) used to be replaced by a regular file
    (the temporary file renamed over it, as root even in /dev); every such destination is refused unchanged."""
    import stat as st_

    store = tmp_path / "s"
    ucp_store.open_store(str(store), create=True).save("r", 1, {"w": torch.ones(3)})
    os.mkfifo(tmp_path / "fifo")
    os.mknod(tmp_path / "null", st_.S_IFCHR | 0o666, os.makedev(1, 3))
    (tmp_path / "file").write_bytes(b"keep")
    os.symlink(tmp_path / "file", tmp_path / "link")
    os.symlink("/proc/self/fd/1", tmp_path / "stdout")
    for name, kind in (("fifo", "a FIFO"), ("null", "a character device"), ("link", "a symbolic link"),
                       ("stdout", "a symbolic link")):
        dest = tmp_path / name
        before = os.lstat(dest)
        for argv in (["read", "r@1", "w", "--out", dest], ["export", "torch", "r@1", dest]):
            err = one_error_line(cli(*argv, "--store", store))
            assert f"{dest} exists and is not a regular file ({kind})" in err, err
            after = os.lstat(dest)
            assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino), (argv, name)
    assert (tmp_path / "file").read_bytes() == b"keep"
    assert sorted(os.listdir(tmp_path)) == ["fifo", "file", "link", "null", "s", "stdout"]
    os.mkfifo(tmp_path / "w.npy.tmp.npy")  # read --out's temporary file: np.save would wait on it forever
    err = one_error_line(ucp("read", "r@1", "w", "--out", tmp_path / "w.npy", "--store", store, timeout=60))
    assert "w.npy.tmp.npy exists and is not a regular file (a FIFO)" in err and not (tmp_path / "w.npy").exists()


def test_outputs_inside_the_store_are_refused(tmp_path):
    """``read --out STORE/catalog.db`` replaced the catalog; an export into ``arrays/`` left files gc then
    reports as foreign. Every output inside a folder store is refused, and the store is byte-identical."""
    store = tmp_path / "s"
    s = ucp_store.open_store(str(store), create=True)
    s.save("r", 1, {"w": torch.ones(3)}, objects={"hf.config": {"model_type": "llama"}})
    s.catalog.close()  # the writer's last connection checkpoints its WAL now, not when GC closes it mid-test
    before = _tree(store)
    for argv in (["read", "r@1", "w", "--out", store / "catalog.db"], ["export", "torch", "r@1", store / "catalog.db"],
                 ["export", "dcp", "r@1", store / "arrays" / "d"], ["export", "hf", "r@1", store / "h"],
                 ["export", "deepspeed-universal", "r@1", store / "u"],
                 ["export", "torch", "r@1", store / ".." / "s" / "x.pt"]):
        err = one_error_line(cli(*argv, "--store", store))
        assert f"is inside the store {store}" in err, (argv, err)
    assert _tree(store) == before


def test_a_fifo_as_the_catalog_is_refused_without_blocking(tmp_path):
    """A FIFO named catalog.db made ``ucp ls`` (a read-only open) wait forever."""
    (tmp_path / "s").mkdir()
    os.mkfifo(tmp_path / "s" / "catalog.db")
    for argv in (["ls"], ["tag", "r@1", "t"], ["verify", "r@1"]):
        err = one_error_line(ucp(*argv, "--store", tmp_path / "s", timeout=60))
        assert f"{tmp_path / 's' / 'catalog.db'} is not a regular file (a FIFO)" in err, err


def test_a_row_that_only_looks_tagged_reads_as_plain_json():
    """A value stored before the typed encoding (or by hand) whose dict happens to be one tag key with a
    payload that is not the encoding's is read as the plain JSON it is, never an exception."""
    from ucp_store import typed_json

    for raw in ({"__ucp_np__": ["<f8", [], "zz"]}, {"__ucp_np__": ["no-dtype", [], "00"]}, {"__ucp_map__": [1]},
                {"__ucp_tuple__": "text"}):
        assert typed_json.decode(raw) == raw
    assert typed_json.decode({"__ucp_tuple__": [1, {"__ucp_map__": [[2, 3]]}]}) == (1, {2: 3})
