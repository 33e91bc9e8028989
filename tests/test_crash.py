"""A save killed mid-way (SIGKILL of a real process) is never listed, and ``ucp gc`` reclaims it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import torch
from sqlalchemy import select

import ucp_store
from ucp_store.catalog import models as m

from ucp_test_helpers import REPO, array_folders, bits, python_env, tree_digest, wait_for

N_TENSORS = 40

CHILD = textwrap.dedent("""
    import os, sys, time
    import torch, ucp_store

    root, marker, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = ucp_store.open_store(root)
    frozen = torch.randn(300, 300, generator=torch.Generator().manual_seed(7))
    w = store.begin("crash", 1, message="never finishes")
    w.write("frozen", "weight", frozen)          # dedups against the committed version
    for i in range(n):
        w.write(f"t{i}", "weight", torch.full((64, 64), float(i)))
        if i == n // 2:
            w.flush()                            # rows for the first half; files only for the rest
    with open(marker + ".tmp", "w") as f:
        f.write(w.id)
    os.replace(marker + ".tmp", marker)
    time.sleep(600)                              # the parent kills us here
""")


def _pending_ids(store) -> list[str]:
    return [c["id"] for c in store.list_checkpoints(include_pending=True) if c["status"] == "pending"]


def test_killed_save_is_not_listed_and_gc_reclaims_it(store, store_path, ucp, tmp_path):
    frozen = torch.randn(300, 300, generator=torch.Generator().manual_seed(7))
    good = store.save("good", 1, {"frozen": frozen, "w": torch.arange(10.0)})
    good_dir = store_path / "arrays" / good.id
    good_digest = tree_digest(good_dir)
    catalog_before = json.loads(json.dumps(good.manifest(), default=str))

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    marker = tmp_path / "written"
    child = subprocess.Popen([sys.executable, str(script), str(store_path), str(marker), str(N_TENSORS)],
                             env=python_env(), cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        wait_for(marker.exists, what="the child's marker file", procs=[child])
        cid = marker.read_text()
        crash_dir = store_path / "arrays" / cid
        assert len(list(crash_dir.glob("*.zarr"))) == N_TENSORS  # the frozen tensor was not rewritten

        # while its writer lives, the save is pending: not listed, not resolvable, and gc leaves it alone
        assert _pending_ids(store) == [cid]
        report = store.gc()
        assert report.removed_pending == [] and crash_dir.is_dir()
        assert len(list(crash_dir.glob("*.zarr"))) == N_TENSORS
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL

    # after the kill: still never listed
    assert [c["id"] for c in store.list_checkpoints()] == [good.id]
    rc, out, _ = ucp("ls", "--all", "--json", "--store", store_path)
    assert rc == 0 and [r["id"] for r in json.loads(out)] == [good.id]
    rc, out, _ = ucp("ls", "crash", "--json", "--store", store_path)
    assert rc == 0 and json.loads(out) == []
    rc, _, err = ucp("show", "crash@1", "--store", store_path)
    assert rc == 1 and err.startswith("ucp: error: ")
    with store.catalog.session() as s:
        assert s.scalar(select(m.Array.id).where(m.Array.path.startswith(f"arrays/{cid}/"))) is not None

    # ucp gc reclaims everything the killed save wrote
    rc, out, _ = ucp("gc", "--json", "--store", store_path)
    assert rc == 0
    report = json.loads(out)
    assert report["removed_pending"] == [cid]
    assert report["removed_checkpoints"] == []
    assert report["removed_arrays"] >= N_TENSORS
    assert not crash_dir.exists()
    assert _pending_ids(store) == []
    with store.catalog.session() as s:
        assert s.get(m.Checkpoint, cid) is None
        assert s.scalar(select(m.Tensor.id).where(m.Tensor.checkpoint_id == cid)) is None
        assert s.scalar(select(m.Array.id).where(m.Array.path.startswith(f"arrays/{cid}/"))) is None
    assert {p.split("/")[1] for p in array_folders(store_path)} == {good.id}

    # the committed version in the same store survives byte for byte, catalog rows included
    assert tree_digest(good_dir) == good_digest
    again = ucp_store.open_store(str(store_path)).checkpoint("good@1")
    assert json.loads(json.dumps(again.manifest(), default=str)) == catalog_before
    assert bits(again.read("frozen")) == bits(frozen)
    assert again.verify() == []
    rc, _, _ = ucp("verify", "good@1", "--store", store_path)
    assert rc == 0
    # and a second gc has nothing left to do
    rc, out, _ = ucp("gc", "--json", "--store", store_path)
    assert json.loads(out)["removed_arrays"] == 0 and tree_digest(good_dir) == good_digest
