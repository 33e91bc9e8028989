"""Named kill points (issue 16, "Kill points"): a real process SIGKILLed at each, then the store is checked.

The matrix runs tests/killpoint_driver.py (one process per catalog x backend; it forks a process per
kill) and asserts that every case was killed where it was meant to be and that the store survived: see
the driver's docstring for the checks. Every point is tried on all four combinations of catalog (SQLite,
PostgreSQL) and storage (folder, S3 through moto's server), one test per combination so that they spread
over the test workers; ``UCP_FAULTS_QUICK=1`` keeps only the points whose behaviour depends on PostgreSQL
and S3 there (transactions, object listing and deletion). ``tools/fault_table.py`` prints the table.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ucp_store
from ucp_store import _killpoints

from ucp_test_helpers import PG_ENV, REPO, moto_s3, python_env, run_python

sys.path.insert(0, os.path.dirname(__file__))
from killpoint_driver import CASES  # noqa: E402

ALL = [point for point, _, _ in CASES]
FULL = os.environ.get("UCP_FAULTS_QUICK") != "1"
# every point on all four; UCP_FAULTS_QUICK=1: on PostgreSQL and S3 only the points whose outcome depends on
# them (open transactions for the catalog, listing and deletion for the bucket)
MATRIX = {("sqlite", "folder"): ALL,
          ("postgresql", "folder"): ALL if FULL else ["flush.mid_rows", "commit.in_txn", "gc.after_rows"],
          ("sqlite", "s3"): ALL if FULL else ["write.array_written:2", "flush.before_rows", "sweep.mid:2"],
          ("postgresql", "s3"): ALL if FULL else ["commit.in_txn"]}


def test_every_point_is_named_and_documented():
    assert len(_killpoints.POINTS) >= 12
    tried = {p.split(":")[0] for p in ALL}
    assert tried == set(_killpoints.POINTS)  # the matrix tries every point
    arch = (REPO / "ARCHITECTURE.md").read_text()
    for point in _killpoints.POINTS:
        assert f"`{point}`" in arch and f"``{point}``" in _killpoints.__doc__
        assert any(f'killpoint("{point}")' in p.read_text() for p in (REPO / "ucp_store").rglob("*.py"))


def test_bad_kill_point_names_are_refused():
    with pytest.raises(ValueError, match="unknown kill point 'nope'"):
        _killpoints.rearm("nope")
    with pytest.raises(ValueError, match="must be an integer"):
        _killpoints.rearm("sweep.mid:x")
    with pytest.raises(ValueError, match=">= 1"):
        _killpoints.rearm("sweep.mid:0")
    _killpoints.rearm("")
    _killpoints.killpoint("sweep.mid")  # disarmed: a no-op


def test_nth_hit_kills_a_real_process():
    code = textwrap.dedent("""
        from ucp_store._killpoints import killpoint
        for i in range(5):
            killpoint("sweep.mid")
            killpoint("rm.after_row")
            print(i, flush=True)
    """)
    proc = run_python(["-c", code], UCP_KILL_AT="sweep.mid:3")
    assert proc.returncode == -signal.SIGKILL and proc.stdout.split() == ["0", "1"]
    proc = run_python(["-c", code])
    assert proc.returncode == 0 and proc.stdout.split() == ["0", "1", "2", "3", "4"]


def test_ucp_rm_killed_through_the_cli_then_gc_finishes_it(store, store_path, ucp):
    """The environment variable reaches the real ``ucp`` command line."""
    shared = torch.arange(6.0)
    store.save("r", 1, {"shared": shared, "a": torch.ones(3)})
    keep = store.save("r", 2, {"shared": shared, "b": torch.zeros(2)})
    a_dir = store_path / "arrays" / store.resolve("r@1")
    proc = subprocess.run([sys.executable, "-m", "ucp_store.cli", "rm", "r@1", "--store", str(store_path)],
                          env=python_env(UCP_KILL_AT="rm.after_row"), cwd=str(REPO), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [c["step"] for c in store.list_checkpoints()] == [2]  # the rm's row transaction had committed
    assert len(list(a_dir.glob("*.zarr"))) == 2                 # ... and no file was swept yet
    rc, out, _ = ucp("gc", "--json", "--store", store_path)
    assert rc == 0 and json.loads(out)["removed_arrays"] == 1   # "a" goes; "shared" stays for r@2
    assert [p.name for p in a_dir.glob("*.zarr")] and ucp_store.open_store(str(store_path)).checkpoint(
        keep.id).verify() == []


@pytest.fixture(scope="module")
def moto_endpoint():
    with moto_s3() as endpoint:
        yield endpoint


@pytest.mark.slow
@pytest.mark.parametrize("catalog,backend", list(MATRIX))
def test_kill_matrix(catalog, backend, tmp_path, request):
    """Every point of MATRIX for one catalog x storage in one driver launch (torch, TensorStore and DCP are
    imported once; each kill is a forked process)."""
    url = os.environ.get(PG_ENV)
    if catalog == "postgresql" and not url:
        pytest.skip(f"PostgreSQL catalog: set {PG_ENV} (tests/test_backends.py skips the same way)")
    points = MATRIX[(catalog, backend)]
    combos = [[url if catalog == "postgresql" else "sqlite",
               request.getfixturevalue("moto_endpoint") if backend == "s3" else "folder", points]]
    proc = run_python(["tests/killpoint_driver.py", "--work", str(tmp_path), "--combos", json.dumps(combos)],
                      timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    want = [(catalog, backend, p) for p in ALL if p in points]
    assert [(r["catalog"], r["backend"], r["point"]) for r in results] == want
    bad = [(r["catalog"], r["backend"], r["point"], r["failures"]) for r in results
           if not (r["killed"] and r["survived"])]
    assert not bad, bad


def test_overwriting_export_swaps_folders_in_one_step(tmp_path, monkeypatch):
    """``export_universal(overwrite=True)`` puts the new folder in place with one exchange: the old content is
    gone, the new is there, and no ``.old`` or partial sibling is left (no moment without a folder)."""
    from ucp_store.deepspeed.universal import replace_dir

    final, new = tmp_path / "t", tmp_path / ".t.partial-1"
    final.mkdir()
    (final / "old.pt").write_text("old")
    new.mkdir()
    (new / "new.pt").write_text("new")
    if sys.platform == "linux":  # renameat2(RENAME_EXCHANGE): the two-rename fallback must not run
        import ucp_store.deepspeed.universal as du

        monkeypatch.setattr(du.os, "replace", lambda *a: pytest.fail("fell back to two renames"))
    replace_dir(str(new), str(final))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]
    assert sorted(p.name for p in final.iterdir()) == ["new.pt"]
