"""Issue 27 on 4 real gloo ranks (ucp_store.demo.scale_ranks: forked from one interpreter, one launch per
catalog running several phases): one catalog client per job, and a collective budget independent of the
tensor count.

- SQLite: no rank but the coordinator opens ``catalog.db`` (an audit hook on ``open`` and
  ``sqlite3.connect`` in every rank) in a save, a load and a verify; each is bit-exact.
- PostgreSQL: a 4-rank save and a 4-rank load each open exactly one catalog connection, counted by the
  server (``pg_stat_activity`` under an ``application_name`` set per phase) and by the clients.
- The collectives of a save and of a load are the same at 10 and at 1,000 tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ucp_test_helpers import REPO, postgres_schema_url


def _launch(tmp_path, spec: dict) -> list[list[dict]]:
    spec = {"out": str(tmp_path / "out"), "timeout": 120, **spec}
    env = {**os.environ, "UCP_PROGRESS": "0", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    env.pop("UCP_CATALOG", None)
    proc = subprocess.run([sys.executable, "-m", "ucp_store.demo.scale_ranks", json.dumps(spec)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for rank, phases in enumerate(results):
        for ph in phases:
            assert ph["error"] is None, (rank, ph)
            assert ph.get("exact", True), (rank, ph)
    return results


def test_sqlite_only_the_coordinator_opens_the_catalog_and_collectives_are_constant(tmp_path):
    phases = [{"op": "save", "tensors": 10, "step": 1}, {"op": "save", "tensors": 1000, "step": 2},
              {"op": "load", "tensors": 10, "step": 1}, {"op": "load", "tensors": 1000, "step": 2},
              {"op": "verify", "tensors": 10, "step": 1}]
    results = _launch(tmp_path, {"world": 4, "store": str(tmp_path / "store"), "phases": phases})
    for rank, got in enumerate(results):
        for ph in got:
            if rank == 0:
                assert ph["connects"] >= 1 and ph["catalog_opens"], ph
            else:  # never a connection, never a file of the catalog opened
                assert ph["connects"] == 0 and ph["catalog_opens"] == [], (rank, ph)
        save10, save1000, load10, load1000, _ = got
        assert save10["collectives"] == save1000["collectives"], (rank, save10, save1000)
        assert load10["collectives"] == load1000["collectives"], (rank, load10, load1000)
        assert sum(save10["collectives"].values()) <= 12 and sum(load10["collectives"].values()) <= 4


@pytest.mark.postgres
def test_postgres_one_catalog_connection_per_save_and_load(tmp_path):
    with postgres_schema_url() as url:
        tag = os.urandom(4).hex()
        phases = [{"op": "save", "tensors": 10, "step": 1, "app": f"ucp27s{tag}"},
                  {"op": "load", "tensors": 10, "step": 1, "app": f"ucp27l{tag}"}]
        results = _launch(tmp_path, {"world": 4, "store": str(tmp_path / "store"), "catalog": url, "phases": phases})
    for i in range(2):
        assert results[0][i]["server_connections"] == 1, results[0][i]
        assert sum(r[i]["connects"] for r in results) == 1, [r[i]["connects"] for r in results]
