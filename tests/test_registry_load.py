"""Registry under load (issues 16 and 30): savers in separate processes saving into one registry, on SQLite and
PostgreSQL, with a reader, an rm loop and a gc loop running throughout; afterwards every save committed or
raised a clear error, and every listed version verifies (the harness and its checks: tests/registry_load.py;
issue 30's full 8 x 25 run with its counts: ``tools/fault_table.py stress``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import registry_load
import torch

from ucp_store.errors import CommitRaceError

from ucp_test_helpers import REPO, array_folders, bits, postgres_schema_url, python_env


def test_save_survives_rm_of_the_version_it_deduplicated_against(store, store_path):
    """The in-flight half of "rm never deletes what a version needs": the array a pending save deduplicated
    against is swept by an rm before the save's rows are flushed; the save writes it again and commits."""
    t = torch.randn(8, 8)
    old = store.save("a", 1, {"x": t}).id
    w = store.begin("b", 1)
    w.write("x", "weight", t)  # deduplicated against a@1's array (nothing written)
    w.write("y", "weight", torch.ones(3))
    store.rm("a@1")  # nothing committed references that array any more: swept now
    assert not any(f.startswith(f"arrays/{old}/") for f in array_folders(store_path))
    ck = w.commit()
    assert bits(ck.read("x")) == bits(t) and ck.verify() == []
    assert store.gc().removed_arrays == 0
    assert bits(store.checkpoint("b@1").read("x")) == bits(t)


def test_save_whose_tensor_changed_after_write_aborts_when_its_dedup_target_is_gone(store, store_path):
    t = torch.randn(8, 8)
    store.save("a", 1, {"x": t.clone()})
    w = store.begin("b", 1)
    w.write("x", "weight", t)
    t.add_(1)  # the caller changed the tensor in place after write(): its old content is nowhere now
    store.rm("a@1")
    with pytest.raises(CommitRaceError, match="tensor 'x' state 'weight'.*changed"):
        w.commit()
    assert store.list_checkpoints(include_pending=True) == [] and array_folders(store_path) == set()


#: CI's size of the stress run (issue 30's 8 x 25 is ``tools/fault_table.py stress``): the same code path,
#: fewer savers and saves
CI_SAVERS, CI_SAVES = 4, 6


def _run(tmp_path, store_url, catalog, savers=CI_SAVERS, saves=CI_SAVES):
    out = tmp_path / "result.json"
    p = subprocess.run([sys.executable, str(REPO / "tests" / "registry_load.py"), store_url, catalog or "", str(out),
                        str(savers), str(saves)], env=python_env(), cwd=str(REPO), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    counts = registry_load.check(json.loads(out.read_text()), store_url, catalog)
    print("registry under load:", json.dumps(counts))
    assert counts["committed"] == savers * saves + 3
    assert counts["step_conflicts"] == 3 * (savers - 1)
    return counts


@pytest.mark.xdist_group("registry_load")
def test_registry_under_load_sqlite(tmp_path):
    _run(tmp_path, str(tmp_path / "store"), None)


@pytest.mark.postgres
@pytest.mark.xdist_group("registry_load")
def test_registry_under_load_postgres(tmp_path):
    with postgres_schema_url() as url:
        _run(tmp_path, str(tmp_path / "store"), url)
