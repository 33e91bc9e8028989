"""A real DCP client through the backend (issue 29 item 4): torchtune 0.6.1's distributed recipe saves
through ``UcpStorageWriter`` and resumes through ``UcpStorageReader`` (``tools/run_dcp_client.py``,
docs/dcp-backend.md "A real client").

torchtune and its imports are not project dependencies: the tool installs them into a side folder
(default ``~/.cache/ucp_store/dcp-client/lib``). These tests run only when asked, with that folder named
in ``$UCP_DCP_CLIENT_LIB``: each starts torchrun several times (5-60 s a run with the load of the
2 cores, the file 1-5 minutes), and CI never sets it (a folder left on the machine by an earlier
run does not turn them on).

    UCP_DCP_CLIENT_LIB=~/.cache/ucp_store/dcp-client/lib .venv/bin/python -m pytest -q tests/test_dcp_client.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "run_dcp_client.py"
LIB = Path(os.path.expanduser(os.environ.get("UCP_DCP_CLIENT_LIB", "")))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("UCP_DCP_CLIENT_LIB"),
                       reason="opt-in: set UCP_DCP_CLIENT_LIB to the folder of torchtune 0.6.1 and its imports "
                              "(side packages, not project dependencies; `.venv/bin/python "
                              "tools/run_dcp_client.py` installs them into ~/.cache/ucp_store/dcp-client/lib)"),
    pytest.mark.skipif(not (LIB / "torchtune").is_dir() or not (LIB / "recipes").is_dir(),
                       reason=f"UCP_DCP_CLIENT_LIB={LIB} holds no torchtune 0.6.1 (torchtune/, recipes/)"),
]


def _run(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(TOOL), "--lib", str(LIB), "--steps", "2", "--timeout", "400",
                           "--keep", str(tmp_path / "work"), "--json", str(out), *flags],
                          capture_output=True, text=True, timeout=1500)
    return proc, (json.loads(out.read_text()) if out.exists() else {})


def test_torchtune_resumes_through_the_backend_on_the_same_and_other_meshes(tmp_path):
    """Save at FSDP=2 after epoch 0, resume at FSDP=2 (losses bit for bit), on 1 rank and on TP=2 (within
    1e-4). torchtune saves the optimizer's own state dict (states keyed by parameter number), which the
    backend's key classification once refused."""
    proc, result = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    checks = {c["what"]: c for c in result["checks"]}
    assert len(checks) == 5 and all(c["ok"] for c in checks.values()), checks
    runs = {r["name"]: r for r in result["runs"]}
    assert sorted(runs["resume"]["losses"]) == ["3", "4"]
    assert runs["resume"]["losses"] == {k: v for k, v in runs["reference"]["losses"].items() if k in ("3", "4")}
