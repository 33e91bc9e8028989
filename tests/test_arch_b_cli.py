"""The ``ucp`` command as a package: old import paths, a closed pipe exits quietly with 0, and the
catalog-only commands import no heavy module (real subprocesses on a real store)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ucp_test_helpers import REPO, python_env, run_python

HEAVY = ("torch", "tensorstore", "zarr", "ml_dtypes", "numcodecs", "matplotlib")


@pytest.fixture
def filled(store, store_path):
    """Two versions of run ``r`` (tagged, with a parent) and one of ``s``: a real store on disk."""
    store.save("r", 1, {"w": torch.randn(16, 8), "b": torch.zeros(8).bfloat16()}, message="first")
    store.save("r", 2, {"w": torch.randn(16, 8), "b": torch.ones(8).bfloat16()}, message="second")
    store.save("s", 7, {"e": torch.arange(6, dtype=torch.int64)})
    store.tag("r@2", "best")
    return str(store_path)


def test_cli_import_paths():
    from ucp_store import cli
    from ucp_store.cli import build_parser, main
    from ucp_store.cli import plan as plan_cli
    from ucp_store.cli.plot import draw_plan

    assert callable(main) and build_parser().prog == "ucp"
    assert cli.EXIT_OK == 0 and cli.EXIT_FAIL == 1
    assert callable(plan_cli.run_plan) and callable(draw_plan) and callable(plan_cli.topology_from_args)
    assert cli._fmt_bytes(1536) == "1.5 KiB"
    p = run_python(["-m", "ucp_store.cli", "--help"])
    assert p.returncode == 0 and "read plan of a version" in p.stdout and p.stderr == ""


def _imported_heavy(importtime_stderr: str) -> set[str]:
    """Top-level names of the heavy packages a ``python -X importtime`` run imported."""
    out = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name.split(".")[0] in HEAVY:
                out.add(name.split(".")[0])
    return out


CATALOG_ONLY = [
    ["ls"], ["ls", "r"], ["ls", "--all", "--json"], ["show", "r@2"], ["show", "r:best", "--json"], ["log", "r@2"],
    ["tag", "r@1", "old"], ["query", "SELECT name, state, nbytes FROM tensors"], ["db", "revision"],
    ["retention", "r", "--keep-last", "5"], ["gc", "--dry-run"], ["rm", "s@7"],
]


def test_catalog_only_commands_import_no_heavy_module(filled):
    """Each command runs in a fresh interpreter through ``python -m ucp_store.cli``, with ``-X importtime``
    listing every module it imports; none of them may be torch, TensorStore, zarr, ml_dtypes, numcodecs or
    matplotlib."""
    for argv in CATALOG_ONLY:
        p = run_python(["-X", "importtime", "-m", "ucp_store.cli", "--store", filled, *argv])
        assert p.returncode == 0, (argv, p.stderr[-2000:])
        assert "ucp: error" not in p.stderr, argv
        heavy = _imported_heavy(p.stderr)
        assert heavy == set(), f"ucp {' '.join(argv)} imported {sorted(heavy)}"
    # and the check can fail: a tensor command does import them
    p = run_python(["-X", "importtime", "-m", "ucp_store.cli", "--store", filled, "read", "r@2", "w"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert {"torch", "tensorstore"} <= _imported_heavy(p.stderr)


def test_ucp_console_script_ls_imports_no_torch(filled):
    """The installed ``ucp`` script (what a user runs), printing ``sys.modules`` at exit."""
    ucp = os.path.join(os.path.dirname(sys.executable), "ucp")
    code = ("import runpy, sys, atexit\n"
            "atexit.register(lambda: print('HEAVY=' + ','.join(sorted(m for m in " + repr(HEAVY)
            + " if m in sys.modules)), file=sys.stderr))\n"
            f"sys.argv = [{ucp!r}, '--store', {filled!r}, 'ls']\n"
            f"runpy.run_path({ucp!r}, run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), cwd=str(REPO),
                       timeout=180)
    assert p.returncode == 0, p.stderr
    assert "r " in p.stdout and "s " in p.stdout
    assert p.stderr.strip().splitlines()[-1] == "HEAVY="


@pytest.mark.parametrize("argv", [["ls"], ["ls", "--json"], ["show", "r@2"], ["log", "r@2", "--json"]])
def test_closed_pipe_exits_quietly(filled, argv):
    """stdout is a pipe whose reader is already gone: every write fails with EPIPE. The command exits 0
    and prints nothing on stderr (no ``ucp: error``, no traceback)."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "ucp_store.cli", "--store", filled, *argv], stdout=w,
                           stderr=subprocess.PIPE, text=True, env=python_env(), cwd=str(REPO), timeout=180)
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (0, "")


def test_ls_piped_into_head(filled):
    """``ucp ... | head -1`` through a real shell pipeline, with output far larger than the pipe buffer."""
    big = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 50000) SELECT x FROM c"
    for args in (["ls"], ["query", big], ["query", big, "--json"]):
        quoted = " ".join("'" + a + "'" for a in args)
        script = (f"'{sys.executable}' -m ucp_store.cli --store '{filled}' {quoted} | head -1; "
                  "echo rc=${PIPESTATUS[0]}")
        p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=python_env(), cwd=str(REPO),
                           timeout=180)
        lines = p.stdout.strip().splitlines()
        assert len(lines) == 2 and lines[-1] == "rc=0", (args, p.stdout[-500:], p.stderr[-2000:])
        assert p.stderr == "", (args, p.stderr)
