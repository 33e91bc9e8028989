"""Issue 27 item 5, faults at scale, on 8 real gloo ranks (tools/scale_ranks.py: forked from one interpreter).

- One rank is SIGKILLed in the middle of a ``ucp_store.distributed.save`` (at the kill point
  ``dist.mid_write``, after it wrote two boxes): every surviving rank raises a ``UcpError`` that says a rank
  died or did not answer, within the collective timeout (``dist_timeout``, 20 s here) of the death; nothing
  is listed (no new version, and no pending row once the coordinator aborted). The job restarted (a new
  launch, as a scheduler would) saves again, and that version loads back bit-exact.
- The coordinator itself killed mid-save: the survivors raise as well; its pending row is never listed, and
  ``ucp gc`` drops it (its owner is dead); the restarted job saves and loads exact.
- gc runs in a loop while the restarted job's saves commit (``ucp gc``, the CLI, a process per run; or
  ``Store.gc()`` again and again in one other process): every run succeeds and removes no committed version,
  at least one overlaps a save, and every committed version still verifies (``Checkpoint.verify``).

On SQLite and, with ``UCP_TEST_POSTGRES_URL``, PostgreSQL. A survivor that hung would stop its launch at
``launch_timeout`` (the launch fails), and a half-written version listed fails the catalog checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

from ucp_test_helpers import REPO, postgres_schema_url

WORLD = 8
DIST_TIMEOUT = 20  # seconds a ucp_store collective may wait (UCP_DIST_TIMEOUT in every rank)
TENSORS = 10
RUN = "scale"


def _launch(out, spec: dict) -> list[list[dict]]:
    spec = {"out": str(out), "world": WORLD, "timeout": 120, "dist_timeout": DIST_TIMEOUT, "launch_timeout": 240,
            **spec}
    env = {**os.environ, "UCP_PROGRESS": "0", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    env.pop("UCP_CATALOG", None)
    env.pop("UCP_KILL_AT", None)
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "scale_ranks.py"), json.dumps(spec)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]  # a hung survivor, or a victim that was not killed
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def _store(base: dict):
    """The store opened from this (test) process, its catalog connection closed after."""
    from ucp_store.store import open_store

    st = open_store(base["store"], catalog=base.get("catalog"))
    try:
        yield st
    finally:
        st.catalog.close()


def _kill_mid_save(tmp_path, base: dict, victim: int) -> tuple[str, list[dict]]:
    """Step 1 committed, then ``victim`` killed in the save of step 2: checks every survivor's error and
    its timing; returns step 1's id and the catalog rows (pending included) left behind."""
    phases = [{"op": "save", "tensors": TENSORS, "step": 1},
              {"op": "save_kill_rank", "tensors": TENSORS, "step": 2, "rank": victim, "at": "dist.mid_write:2"}]
    results = _launch(tmp_path / "kill", {**base, "phases": phases})
    first = results[0][0]["id"] if victim != 0 else results[1][0]["id"]
    killed = results[victim][-1]
    assert killed.get("killed") and len(results[victim]) == 2, results[victim]
    for rank, got in enumerate(results):
        assert got[0]["error"] is None and got[0]["id"] == first, (rank, got[0])
        if rank == victim:
            continue
        ph = got[-1]
        assert ph["op"] == "save_kill_rank" and "id" not in ph, (rank, ph)
        assert ph["error"] and ph["error"].startswith("UcpError:"), (rank, ph["error"])
        assert f"save of {RUN}@2" in ph["error"] and "a rank died" in ph["error"], (rank, ph["error"])
        # within the collective timeout of the death (reaped at most one poll after it), never a hang
        assert ph["t_end"] - killed["reaped_at"] < DIST_TIMEOUT, (rank, ph["t_end"] - killed["reaped_at"])
    with _store(base) as st:
        rows = st.list_checkpoints(include_pending=True)
        assert [(c["step"], c["id"]) for c in st.list_checkpoints()] == [(1, first)], rows
    return first, rows


def _restart_with_gc(tmp_path, base: dict, first: str, mode: str) -> None:
    """The restarted job saves steps 2 to 6 (rank 0's commits) while gc runs in a loop (``mode``: ``"cli"``,
    ``ucp gc`` a process per run; ``"api"``, ``Store.gc()`` again and again in one process); step 6 loads
    exact, step 2 verifies on the ranks; every committed version verifies, none is lost."""
    steps = (2, 3, 4, 5, 6)
    phases = [{"op": "save", "tensors": TENSORS, "step": s} for s in steps] + [
        {"op": "load", "tensors": TENSORS, "step": 6}, {"op": "verify", "tensors": TENSORS, "step": 2}]
    gc = {"interval": 0.05, "mode": mode, "start": "now"}  # the store exists: gc from the restart on
    results = _launch(tmp_path / "restart", {**base, "phases": phases, "gc": gc})
    for rank, got in enumerate(results):
        for ph in got:
            assert ph["error"] is None and ph.get("exact", True), (rank, ph)
    ids = {1: first, **{s: results[0][i]["id"] for i, s in enumerate(steps)}}
    with open(tmp_path / "restart" / "gc.json") as f:
        gc_runs = json.load(f)
    assert gc_runs and all(g["rc"] == 0 for g in gc_runs), [g for g in gc_runs if g["rc"]][:2]
    assert not any(g.get("removed_checkpoints") for g in gc_runs), gc_runs  # no retention policy: none goes
    saves = [(ph["t_start"], ph["t_end"]) for ph in results[0][:len(steps)]]
    overlapping = [g for g in gc_runs if any(g["t_start"] < end and g["t_end"] > start for start, end in saves)]
    assert overlapping, (saves, [(g["t_start"], g["t_end"]) for g in gc_runs])
    with _store(base) as st:
        listed = {c["step"]: c["id"] for c in st.list_checkpoints(include_pending=True)}
        assert listed == ids, (listed, ids)
        for step, cid in ids.items():
            assert st.checkpoint(cid).verify() == [], step


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def base(request, tmp_path):
    spec = {"store": str(tmp_path / "store")}
    if request.param == "sqlite":
        yield spec
        return
    with postgres_schema_url() as url:
        yield {**spec, "catalog": url}


def test_rank_killed_mid_save_lists_nothing_then_restart_saves_with_gc_running(tmp_path, base):
    first, rows = _kill_mid_save(tmp_path, base, victim=WORLD - 3)
    assert [(c["step"], c["status"]) for c in rows] == [(1, "committed")], rows  # the coordinator aborted
    _restart_with_gc(tmp_path, base, first, "cli")


def test_coordinator_killed_mid_save_leaves_only_an_unlisted_pending_row_that_gc_drops(tmp_path, base):
    first, rows = _kill_mid_save(tmp_path, base, victim=0)
    pending = [c["id"] for c in rows if c["status"] == "pending"]
    assert [(c["step"], c["status"]) for c in rows] == [(1, "committed"), (2, "pending")], rows
    with _store(base) as st:
        report = st.gc()
        assert report.removed_pending == pending and not report.removed_checkpoints, report
        assert [c["id"] for c in st.list_checkpoints(include_pending=True)] == [first]
    _restart_with_gc(tmp_path, base, first, "api")


def test_rank_killed_before_the_control_group_exists_gives_a_ucp_error_within_the_timeout(tmp_path):
    """The victim dies at once (a timer of 0 s) in the job's first save, while every rank is still creating the
    bounded-timeout gloo group (``control_group``: ``dist.new_group``, a rendezvous through the default
    group's store). Every survivor still raises a ``UcpError`` within ``dist_timeout``.

    Before the fix, dead before it published its address, the survivors raised torch's ``DistStoreError:
    wait timeout after 10000ms, keys: /default_pg/0//1//cpu//0/2``; dead during the connect, ``RuntimeError:
    Gloo connectFullMesh failed ... Connect timeout`` after 50 s (the default group's store timeout, not
    ``dist_timeout``). Neither named the save or the dead rank."""
    phases = [{"op": "save_kill_rank", "tensors": TENSORS, "step": 1, "rank": 2, "after": 0}]
    results = _launch(tmp_path / "kill", {"store": str(tmp_path / "store"), "world": 4, "timeout": 60,
                                          "dist_timeout": 10, "phases": phases})
    reaped = results[2][-1]["reaped_at"]
    for rank in (0, 1, 3):
        ph = results[rank][-1]
        assert ph["error"] and ph["error"].startswith("UcpError:"), (rank, ph["error"])
        assert ph["t_end"] - reaped < 10 + 5, (rank, ph["t_end"] - reaped)  # dist_timeout, and slack for a busy host
