"""The ``ucp`` command: every subcommand in-process (capsys), a few through real subprocesses."""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from sqlalchemy import update

import ucp_store
from ucp_store.catalog import models as m
from ucp_store.schema import schema_path, validate

from ucp_test_helpers import bits, flip_chunk_byte, python_env, run_python


@pytest.fixture
def populated(store, store_path):
    """run1 @ 0, 10, 20 (a frozen tensor shared by all; w changes), run2 @ 5."""
    gen = torch.Generator().manual_seed(11)
    frozen = torch.randn(64, 48, generator=gen)
    ws = {}
    for step in (0, 10, 20):
        ws[step] = torch.randn(8, 6, generator=gen)
        store.save("run1", step, {"frozen": frozen, "w": ws[step], "bias": torch.zeros(6).bfloat16()},
                   message=f"step {step}")
    store.save("run2", 5, {"emb": torch.arange(12, dtype=torch.int64).reshape(3, 4)}, objects={"cfg": {"a": 1}})
    return store, str(store_path), frozen, ws


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ucp: error: "), err
    return lines[0]


# --- init, ls, --store placement, UCP_STORE ------------------------------------------------------------

def test_init_then_ls(tmp_path, ucp):
    path = tmp_path / "new"
    rc, out, err = ucp("init", "--store", path, "--compression", "zstd")
    assert rc == 0 and "store ready" in out and "zstd" in out
    assert (path / "catalog.db").is_file()
    rc, out, _ = ucp("--store", path, "ls", "--json")
    assert rc == 0 and json.loads(out) == []
    store = ucp_store.open_store(str(path))
    assert store.settings["compression"] == "zstd"
    ck = store.save("z", 1, {"w": torch.randn(100, 30)})
    assert ck.verify() == [] and ck.info("w").codecs[0]["configuration"]["codecs"][1]["name"] == "zstd"


def test_store_option_before_or_after_and_env(populated, ucp, monkeypatch):
    _, path, _, _ = populated
    outs = []
    for argv in (["--store", path, "ls", "--json"], ["ls", "--store", path, "--json"],
                 ["ls", "--json", "--store", path]):
        rc, out, _ = ucp(*argv)
        assert rc == 0
        outs.append(json.loads(out))
    monkeypatch.setenv("UCP_STORE", path)
    rc, out, _ = ucp("ls", "--json")
    assert rc == 0
    outs.append(json.loads(out))
    assert all(o == outs[0] for o in outs)
    assert {r["run"]: r["checkpoints"] for r in outs[0]} == {"run1": 3, "run2": 1}


def test_ls_run_and_all(populated, ucp):
    store, path, _, _ = populated
    rc, out, _ = ucp("ls", "run1", "--store", path, "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["step"] for r in rows] == [0, 10, 20]
    assert rows[1]["parent"] == rows[0]["id"] and rows[2]["message"] == "step 20"
    rc, out, _ = ucp("ls", "--all", "--store", path, "--json")
    assert [(r["run"], r["step"]) for r in json.loads(out)] == [("run1", 0), ("run1", 10), ("run1", 20), ("run2", 5)]
    rc, out, _ = ucp("ls", "run1", "--store", path)  # the table
    assert rc == 0 and all(r["id"] in out for r in rows)
    rc, _, err = ucp("ls", "runn1", "--store", path)
    assert rc == 1 and "did you mean: run1" in one_error_line(err)


# --- show, read, stats, diff, log --------------------------------------------------------------------------

def test_show_json_validates_against_the_manifest_schema(populated, ucp):
    import jsonschema
    from referencing import Registry, Resource

    store, path, frozen, _ = populated
    rc, out, _ = ucp("show", "run2@5", "--store", path, "--json")
    assert rc == 0
    doc = json.loads(out)
    validate("manifest", doc)
    # and with a plain jsonschema validator over the schema files themselves
    docs = [json.loads(p.read_text()) for p in schema_path("manifest").parent.glob("*.schema.json")]
    registry = Registry().with_resources([(d["$id"], Resource.from_contents(d)) for d in docs])
    jsonschema.Draft202012Validator(json.loads(schema_path("manifest").read_text()), registry=registry).validate(doc)
    assert doc["run"] == "run2" and doc["step"] == 5 and doc["status"] == "committed"
    assert doc["objects"] == {"cfg": {"kind": "json", "value": {"a": 1}}}
    (t,) = doc["tensors"]
    assert (t["name"], t["state"], t["shape"], t["dtype"]) == ("emb", "weight", [3, 4], "int64")
    assert Path(t["array"]).is_dir()
    rc, out, _ = ucp("show", "run1@10", "--store", path, "--json")
    assert [t["name"] for t in json.loads(out)["tensors"]] == ["frozen", "w", "bias"]
    rc, out, _ = ucp("show", "run1@10", "--store", path)
    assert rc == 0 and "frozen" in out and "64x48" in out


def test_read_slice_to_npy(populated, ucp, tmp_path):
    _, path, frozen, ws = populated
    out_file = tmp_path / "f.npy"
    rc, out, _ = ucp("read", "run1@10", "w", "--slice", "3:5,:", "--out", out_file, "--store", path)
    assert rc == 0 and "wrote" in out
    got = np.load(out_file, allow_pickle=False)
    assert got.dtype == np.float32 and np.array_equal(got, ws[10].numpy()[3:5, :])
    rc, _, _ = ucp("read", "run1@latest", "frozen", "--slice", "...,::7", "--out", out_file, "--store", path)
    assert rc == 0 and np.array_equal(np.load(out_file), frozen.numpy()[..., ::7])
    rc, out, _ = ucp("read", "run2@5", "emb", "--slice", "1", "--json", "--store", path)
    assert rc == 0 and json.loads(out)["values"] == [4, 5, 6, 7]
    rc, out, _ = ucp("read", "run1@0", "w", "--slice", "0,0:2", "--json", "--store", path)
    assert json.loads(out)["values"] == pytest.approx(ws[0][0, :2].double().tolist())
    rc, out, _ = ucp("read", "run1@0", "bias", "--store", path)  # bf16 printed
    assert rc == 0 and "0." in out
    assert not list(tmp_path.glob("*.tmp.npy"))


def test_read_prints_signaling_nans_as_nan_without_warnings(store, store_path, ucp):
    snan32 = torch.tensor([0x7F800001, 0x3F800000], dtype=torch.int32).view(torch.float32)
    snan16 = torch.tensor([0x7F81, 0x3F80], dtype=torch.int16).view(torch.bfloat16)
    store.save("s", 1, {"f": snan32, "b": snan16})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("f", "b"):
            rc, out, _ = ucp("read", "s@1", name, "--json", "--store", store_path)
            values = json.loads(out)["values"]
            assert rc == 0 and values[0] == "NaN" and values[1] == 1.0, name  # strict JSON: NaN as a string
            rc, out, _ = ucp("read", "s@1", name, "--store", store_path)
            assert rc == 0 and "nan" in out and "1." in out, name


def test_stats_with_planted_nan_and_inf(store, store_path, ucp):
    x = torch.randn(100, 7, generator=torch.Generator().manual_seed(2))
    x[1, 1] = x[50, 3] = x[99, 6] = float("nan")
    x[2, 2] = float("inf")
    x[3, 3] = float("-inf")
    store.save("s", 1, {"x": x, "y": torch.arange(10)})
    rc, out, _ = ucp("stats", "s@1", "x", "--json", "--store", store_path)
    assert rc == 0
    (s,) = json.loads(out)
    a = x.double().numpy()
    fin = a[np.isfinite(a)]
    assert (s["nan"], s["inf"], s["numel"], s["shape"], s["dtype"]) == (3, 2, 700, [100, 7], "float32")
    assert s["min"] == fin.min() and s["max"] == fin.max()
    assert s["mean"] == pytest.approx(fin.mean(), rel=1e-9)
    assert s["std"] == pytest.approx(fin.std(), rel=1e-9)
    assert s["norm"] == pytest.approx(np.linalg.norm(fin), rel=1e-9)
    rc, out, _ = ucp("stats", "s@1", "--json", "--store", store_path)
    stats = {r["name"]: r for r in json.loads(out)}
    assert stats["y"]["mean"] == 4.5 and stats["y"]["nan"] == 0
    rc, out, _ = ucp("stats", "s@1", "--store", store_path)
    assert rc == 0 and "nan" in out


def test_diff(populated, ucp):
    store, path, _, ws = populated
    store.save("run1", 30, {"frozen": store.checkpoint("run1@20").read("frozen"), "w": ws[20] * 1.5,
                            "extra": torch.ones(2)})
    rc, out, _ = ucp("diff", "run1@20", "run1@30", "--json", "--store", path)
    assert rc == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert {k: r["status"] for k, r in rows.items()} == {"frozen": "same", "w": "changed", "bias": "removed",
                                                         "extra": "added"}
    assert rows["w"]["relative_change"] == pytest.approx(0.5, rel=1e-6)
    assert rows["frozen"]["relative_change"] == 0.0
    rc, out, _ = ucp("diff", "run1@20", "run1@30", "--store", path)
    assert rc == 0 and "1 same, 1 changed, 1 added, 1 removed" in out


def test_log_follows_parents(populated, ucp):
    _, path, _, _ = populated
    rc, out, _ = ucp("log", "run1@20", "--json", "--store", path)
    assert rc == 0 and [c["step"] for c in json.loads(out)] == [20, 10, 0]
    rc, out, _ = ucp("log", "run1@20", "--store", path)
    assert rc == 0 and "run1" in out


# --- tag, rm, gc ------------------------------------------------------------------------------------

def test_tag_move_delete_and_rm(populated, ucp):
    store, path, _, _ = populated
    rc, out, _ = ucp("tag", "run1@10", "best", "--store", path)
    assert rc == 0 and store.resolve("run1:best") == store.resolve("run1@10")
    rc, _, err = ucp("tag", "run1@20", "best", "--store", path)
    assert rc == 1 and "--force" in one_error_line(err)
    assert ucp("tag", "run1@20", "best", "--force", "--store", path)[0] == 0
    assert store.resolve("run1:best") == store.resolve("run1@20")
    rc, _, err = ucp("rm", "run1:best", "--store", path)
    assert rc == 1 and "tagged best" in one_error_line(err)
    assert ucp("tag", "run1:best", "--delete", "--store", path)[0] == 0
    rc, out, _ = ucp("rm", "run1@20", "run1@0", "--store", path)
    assert rc == 0 and out.count("removed") == 2
    assert [c["step"] for c in store.list_checkpoints("run1")] == [10]
    assert bits(store.checkpoint("run1@10").read("frozen")) == bits(populated[2])
    rc, _, err = ucp("tag", "run1@10", "bad/tag", "--store", path)
    assert rc == 1 and "invalid" in one_error_line(err)


def test_gc_retention_from_cli(store, store_path, ucp):
    for s in range(0, 60, 10):
        store.save("r", s, {"w": torch.full((3,), float(s))})
    store.tag("r@10", "keep")
    rc, out, _ = ucp("gc", "--run", "r", "--keep-last", "2", "--dry-run", "--json", "--store", store_path)
    report = json.loads(out)
    assert rc == 0 and report["dry_run"] and len(report["removed_checkpoints"]) == 3
    assert len(store.list_checkpoints("r")) == 6
    rc, out, _ = ucp("gc", "--run", "r", "--keep-last", "2", "--store", store_path)
    assert rc == 0 and "removed 3 version(s)" in out
    assert [c["step"] for c in store.list_checkpoints("r")] == [10, 40, 50]
    rc, _, _ = ucp("retention", "r", "--keep-every", "20", "--no-keep-tagged", "--store", store_path)
    assert rc == 0
    assert ucp("gc", "--store", store_path)[0] == 0
    assert [c["step"] for c in store.list_checkpoints("r")] == [40, 50]


# --- verify ------------------------------------------------------------------------------------------

def test_verify_clean_and_corrupt(store, store_path, ucp, small_chunks):
    small_chunks(lambda shape: ((4,) + shape[1:], (8,) + shape[1:]))
    x = torch.randn(32, 5)
    ck = store.save("v", 1, {"x": x, "y": torch.ones(3)})
    rc, out, err = ucp("verify", "v@1", "--store", store_path)
    assert rc == 0 and out.startswith("ok: v@1") and err == ""
    info = ck.info("x")
    flip_chunk_byte(store_path, info, (5, 0))
    rc, out, err = ucp("verify", "v@1", "--store", store_path)
    assert rc == 1
    array_url = str(store_path / info.array)
    assert "FAIL x [weight]" in err and array_url in err and "chunk [5, 0]" in err and "c/2/0" in err
    rc, out, _ = ucp("verify", "v@1", "--json", "--store", store_path)
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False and [p["chunk"] for p in doc["problems"]] == [[5, 0]]
    rc, _, err = ucp("read", "v@1", "x", "--slice", "20:24", "--store", store_path)
    line = one_error_line(err)
    assert rc == 1 and "chunk [5, 0]" in line and array_url in line and "crc32c" in line
    assert ucp("read", "v@1", "x", "--slice", "0:20", "--json", "--store", store_path)[0] == 0


def test_verify_catches_tampered_catalog_hash(populated, ucp):
    store, path, _, _ = populated
    cid = store.resolve("run2@5")
    assert ucp("verify", "run2@5", "--store", path)[0] == 0
    with store.catalog.write_session() as s:
        s.execute(update(m.Tensor).where(m.Tensor.checkpoint_id == cid).values(content_hash="xxh3-128:" + "f" * 32))
    rc, _, err = ucp("verify", "run2@5", "--store", path)
    assert rc == 1 and "emb" in err and "content hash" in err


# --- import / export torch -------------------------------------------------------------------------------

def test_import_export_torch_round_trip(tmp_path, ucp):
    path = tmp_path / "store"
    sd = {"layer.w": torch.randn(5, 3), "layer.b": torch.randn(3).bfloat16(), "steps": torch.tensor(7),
          "mask": torch.tensor([True, False]), "half": torch.randn(4, dtype=torch.float16)}
    src = tmp_path / "in.pt"
    torch.save(sd, src)
    rc, out, _ = ucp("import", "torch", src, "--run", "imp", "--step", "3", "--store", path)  # creates the store
    assert rc == 0 and "imported" in out and "imp@3" in out
    store = ucp_store.open_store(str(path))
    ck = store.checkpoint("imp@3")
    assert ck.provenance["source_kind"] == "torch_file"
    assert ck.provenance["source_hashes"]["in.pt"].startswith("sha256:")
    dst = tmp_path / "out.pt"
    rc, out, _ = ucp("export", "torch", "imp@3", dst, "--store", path)
    assert rc == 0 and "wrote 5 tensors" in out
    back = torch.load(dst, weights_only=True)
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and bits(back[k]) == bits(v), k
    rc, _, err = ucp("import", "torch", src, "--run", "imp", "--store", path)
    assert rc == 1 and "--step" in one_error_line(err)
    rc, _, err = ucp("export", "torch", "imp@3", tmp_path / "no" / "such" / "dir.pt", "--store", path)
    assert rc == 1 and "does not exist" in one_error_line(err)


def test_import_nested_state_dict_keeps_non_tensors_as_json(tmp_path, store, ucp, store_path):
    src = tmp_path / "nested.pt"
    torch.save({"model": {"a": torch.ones(2), "blocks": [{"w": torch.zeros(1)}]}, "epoch": 4, "lr": 0.5}, src)
    assert ucp("import", "torch", src, "--run", "n", "--step", "1", "--store", store_path)[0] == 0
    ck = store.checkpoint("n@1")
    assert ck.names() == ["model.a", "model.blocks.0.w"]
    assert ck.objects() == {"epoch": 4, "lr": 0.5}


# --- query ------------------------------------------------------------------------------------------

def test_query_select_and_write_refused(populated, ucp, tmp_path):
    store, path, _, _ = populated
    rc, out, _ = ucp("query", "SELECT name FROM runs ORDER BY name", "--json", "--store", path)
    assert rc == 0 and json.loads(out) == [{"name": "run1"}, {"name": "run2"}]
    rc, out, _ = ucp("query", "SELECT r.name, count(c.id) AS n FROM runs r JOIN checkpoints c ON c.run_id = r.id "
                              "GROUP BY r.name ORDER BY r.name", "--store", path)
    assert rc == 0 and "run1" in out and "3" in out
    for sql in ("DELETE FROM runs", "UPDATE checkpoints SET step = 99", "DROP TABLE tags",
                "PRAGMA query_only = OFF", f"ATTACH DATABASE '{tmp_path / 'evil.db'}' AS e"):
        rc, _, err = ucp("query", sql, "--store", path)
        assert rc == 1, sql
        one_error_line(err)
    assert not (tmp_path / "evil.db").exists()  # ATTACH would create the file
    assert len(store.runs()) == 2 and len(store.list_checkpoints()) == 4
    # the refusal did not leave the pooled connection read-only: writes still work
    store.tag("run1@0", "after-query")
    assert store.resolve("run1:after-query")
    rc, out, _ = ucp("query", "SELECT count(*) AS n FROM tags", "--json", "--store", path)
    assert json.loads(out) == [{"n": 1}]


# --- errors ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["show", "nope@1"],
    ["read", "run1@latest", "nope"],
    ["read", "run1@latest", "w", "--slice", "100"],
    ["read", "run1@latest", "w", "--slice", "a:b"],
    ["read", "run1@latest", "w", "--out", "/nonexistent-dir/x/f.npy"],
    ["stats", "run1@0", "nope"],
    ["diff", "run1@0", "run9@0"],
    ["verify", "0000"],
    ["rm", "run1@999"],
    ["tag", "run1@0"],
    ["log", "run1:nothing"],
    ["retention", "nope", "--keep-last", "1"],
    ["import", "torch", "/nonexistent-file.pt", "--run", "x", "--step", "1"],
    ["export", "torch", "run1@0", "/nonexistent-dir/x/out.pt"],
    ["query", "SELEC 1"],
])
def test_errors_exit_1_with_one_line(populated, ucp, argv):
    _, path, _, _ = populated
    rc, out, err = ucp(*argv, "--store", path)
    assert rc == 1
    one_error_line(err)


def test_missing_store_is_an_error(tmp_path, ucp):
    rc, _, err = ucp("ls", "--store", tmp_path / "missing")
    assert rc == 1 and "no store at" in one_error_line(err)
    assert not (tmp_path / "missing").exists()


# --- real subprocesses ---------------------------------------------------------------------------------

def _ucp_script() -> str:
    exe = Path(sys.executable).parent / "ucp"
    return str(exe) if exe.exists() else shutil.which("ucp")


def test_console_script_end_to_end(populated, tmp_path):
    """The installed ``ucp`` script, store from $UCP_STORE, a slice read into a .npy file."""
    import subprocess

    store, path, _, ws = populated
    exe = _ucp_script()
    assert exe, "the ucp console script is not installed"
    out_file = tmp_path / "w.npy"
    p = subprocess.run([exe, "read", "run1@20", "w", "--slice", "3:5,:", "--out", str(out_file)],
                       capture_output=True, text=True, env=python_env(UCP_STORE=path), timeout=180)
    assert p.returncode == 0, p.stderr
    assert "wrote" in p.stdout
    assert np.array_equal(np.load(out_file), ws[20].numpy()[3:5, :])


def test_python_m_ucp_store_cli_error_is_one_line(populated):
    """``python -m ucp_store.cli``: an unknown reference exits 1 with one ``ucp: error:`` line, no traceback."""
    _, path, _, _ = populated
    p = run_python(["-m", "ucp_store.cli", "show", "runn1@20", "--store", path])
    assert p.returncode == 1 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ucp: error: ") and "did you mean: run1" in lines[0], p.stderr
