"""Issue 31: a save over the same tensors reuses their description (the call then does no per-tensor work but
read contents), and a tensor swapped for new storage (``p.data = x``) is described afresh, never saved from the
old storage. Two real gloo ranks (tests/plan_reuse_ranks.py); every version loads back bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ucp_test_helpers import REPO


def test_description_is_reused_over_the_same_storage_and_redone_after_a_swap(tmp_path):
    env = {**os.environ, "UCP_PROGRESS": "0", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    env.pop("UCP_CATALOG", None)
    spec = {"store": str(tmp_path / "store"), "out": str(tmp_path / "out")}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "plan_reuse_ranks.py"), json.dumps(spec)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank, res in enumerate(json.loads(proc.stdout.strip().splitlines()[-1])):
        recs = {r["change"] or "first": r for r in res["records"]}
        assert all(r["exact"] for r in res["records"]), (rank, res["records"])
        assert recs["first"]["described"] == 1, (rank, recs)
        # in-place changes and new wrapper objects over the same storage: described once, reused since
        assert recs["wrappers"]["described"] == 0 and res["records"][1]["described"] == 0, (rank, recs)
        assert res["records"][-1]["described"] == 0, (rank, res["records"])
        assert recs["swap"]["described"] == 1, (rank, recs)  # new storage: described afresh
