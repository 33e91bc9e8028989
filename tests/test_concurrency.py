"""Several processes saving into one SQLite store at once (while gc runs) lose nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from sqlalchemy import func, select

import ucp_store
from ucp_store.catalog import models as m

from ucp_test_helpers import REPO, array_folders, bits, python_env, wait_for

N_PROCS, N_SAVES = 4, 5

TENSORS_SRC = textwrap.dedent("""
    import torch

    def tensors(i, j):
        g = lambda seed: torch.Generator().manual_seed(seed)
        return {
            "shared.emb": torch.randn(128, 128, generator=g(1)),                   # identical everywhere
            "frozen": torch.randn(64, 64, generator=g(100 + i)).bfloat16(),        # per process, every save
            "layer.w": {"fp32": torch.randn(32, 32, generator=g(1000 * i + j)),    # distinct per save
                        "exp_avg": torch.randn(32, 32, generator=g(5000 * i + j))},
            "counter": torch.tensor(i * 100 + j),
        }

    def where(i, j):
        return (f"p{i}" if j < 3 else "common"), i * 10 + j
""")

CHILD = TENSORS_SRC + textwrap.dedent("""
    import os, sys, time
    import ucp_store

    root, i, ready, go, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    store = ucp_store.open_store(root)
    open(ready, "w").close()
    while not os.path.exists(go):   # start all savers together
        time.sleep(0.01)
    for j in range(n):
        run, step = where(i, j)
        store.save(run, step, tensors(i, j), objects={"who": [i, j]})
    print("saved", n)
""")


def test_parallel_savers_lose_nothing(store, store_path, tmp_path):
    ns: dict = {}
    exec(TENSORS_SRC, ns)
    tensors, where = ns["tensors"], ns["where"]

    script = tmp_path / "saver.py"
    script.write_text(CHILD)
    go = tmp_path / "go"
    readies = [tmp_path / f"ready{i}" for i in range(N_PROCS)]
    procs = [subprocess.Popen([sys.executable, str(script), str(store_path), str(i), str(readies[i]), str(go),
                               str(N_SAVES)], env=python_env(), cwd=str(REPO), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(N_PROCS)]
    try:
        wait_for(lambda: all(r.exists() for r in readies), what="all savers ready", procs=procs)
        go.touch()
        gc_runs = 0
        while any(p.poll() is None for p in procs):  # gc concurrently: it must not take live data
            report = store.gc()
            assert report.removed_checkpoints == [] and report.removed_pending == []
            gc_runs += 1
            time.sleep(0.3)
        results = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert out.strip() == f"saved {N_SAVES}"
    assert gc_runs >= 1

    store.gc()
    listed = store.list_checkpoints(include_pending=True)
    assert len(listed) == N_PROCS * N_SAVES and {c["status"] for c in listed} == {"committed"}
    assert {r["run"]: r["checkpoints"] for r in store.runs()} == {
        **{f"p{i}": 3 for i in range(N_PROCS)}, "common": 2 * N_PROCS}

    fresh = ucp_store.open_store(str(store_path))
    for i in range(N_PROCS):
        for j in range(N_SAVES):
            run, step = where(i, j)
            ck = fresh.checkpoint(f"{run}@{step}")
            expected = tensors(i, j)
            assert bits(ck.read("shared.emb")) == bits(expected["shared.emb"])
            assert bits(ck.read("frozen")) == bits(expected["frozen"])
            assert bits(ck.read("layer.w", "fp32")) == bits(expected["layer.w"]["fp32"])
            assert bits(ck.read("layer.w", "exp_avg")) == bits(expected["layer.w"]["exp_avg"])
            assert ck.read("counter").item() == i * 100 + j
            assert ck.objects() == {"who": [i, j]}
            assert ck.verify() == []

    with fresh.catalog.session() as s:
        def arrays_for(name, state="weight"):
            return set(s.scalars(select(m.Tensor.array_id).where(m.Tensor.name == name, m.Tensor.state == state)))

        # dedup: each process's frozen tensor is one array for its 5 versions; the shared one at most
        # one per process (two first saves may race), at least one
        for i in range(N_PROCS):
            cids = [fresh.resolve("{}@{}".format(*where(i, j))) for j in range(N_SAVES)]
            frozen_ids = set(s.scalars(select(m.Tensor.array_id).where(
                m.Tensor.name == "frozen", m.Tensor.checkpoint_id.in_(cids))))
            assert len(frozen_ids) == 1
        assert 1 <= len(arrays_for("shared.emb")) <= N_PROCS
        assert len(arrays_for("layer.w", "fp32")) == N_PROCS * N_SAVES
        # no orphans: every array row is referenced, every folder on disk has a row, and vice versa
        referenced = set(s.scalars(select(m.Tensor.array_id))) | set(
            s.scalars(select(m.StoredObject.array_id).where(m.StoredObject.array_id.is_not(None))))
        rows = {a.id: a.path for a in s.scalars(select(m.Array))}
        assert set(rows) == referenced
        assert set(rows.values()) == array_folders(store_path)
        assert s.scalar(select(func.count()).select_from(m.Tensor)) == N_PROCS * N_SAVES * 5
