"""Registry under load (issue 16): 8 processes x 25 saves into one registry, on SQLite and PostgreSQL, with
readers and a gc/rm racer running throughout (the harness and its checks: tests/registry_load.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import registry_load

from ucp_test_helpers import REPO, postgres_schema_url, python_env


def _run(tmp_path, store_url, catalog):
    out = tmp_path / "result.json"
    p = subprocess.run([sys.executable, str(REPO / "tests" / "registry_load.py"), store_url, catalog or "", str(out)],
                       env=python_env(), cwd=str(REPO), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    counts = registry_load.check(json.loads(out.read_text()), store_url, catalog)
    print("registry under load:", json.dumps(counts))
    assert counts["committed"] == registry_load.SAVERS * registry_load.SAVES + 3
    assert counts["step_conflicts"] == 3 * (registry_load.SAVERS - 1)
    return counts


@pytest.mark.slow
@pytest.mark.xdist_group("registry_load")
def test_registry_under_load_sqlite(tmp_path):
    _run(tmp_path, str(tmp_path / "store"), None)


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.xdist_group("registry_load")
def test_registry_under_load_postgres(tmp_path):
    with postgres_schema_url() as url:
        _run(tmp_path, str(tmp_path / "store"), url)
