"""Tiered saves on real gloo ranks (issue 38): simulated nodes (``UCP_NODE``) with their own fast-tier folders,
a folder as the durable tier, SQLite and PostgreSQL catalogs.

Each test runs tests/tier_ranks.py (plain rank processes: one killed with SIGKILL leaves the others to report) and
then checks the catalog and the files: the safety levels are reached in order and never listed above what the
rows and files show, every complete copy the catalog lists exists with its crc32c, and the versions load back
bit for bit from the durable tier, or from one node's fast folder alone when they are replicated.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import ucp_store
from ucp_store.io.location import Location
from ucp_store.tiers import objects as tobj
from ucp_store.tiers import placement as tp

from ucp_test_helpers import PG_ENV, postgres_schema_url, run_python

sys.path.insert(0, os.path.dirname(__file__))
from tier_ranks import SHAPES, full_tensor  # noqa: E402


def _run(tmp_path: Path, timeout: float = 300, catalog: str | None = None, **spec) -> list[dict]:
    spec = {"store": str(tmp_path / "store"), "fast": str(tmp_path / "fast" / "{node}"), "out": str(tmp_path / "out"),
            **spec}
    env = {"UCP_CATALOG": catalog} if catalog else {}
    proc = run_python(["tests/tier_ranks.py", json.dumps(spec)], timeout=timeout, **env)
    outs = []
    for r in range(spec["world"]):
        path = tmp_path / "out" / f"rank{r}.json"
        outs.append(json.loads(path.read_text()) if path.exists() else None)
    if not spec.get("kill"):
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert all(o is not None and "error" not in o for o in outs), [o and o.get("trace") for o in outs]
    return outs


def _store(tmp_path: Path, catalog: str | None = None):
    return ucp_store.open_store(str(tmp_path / "store"), catalog=catalog)


def _expected(name: str, step: int) -> torch.Tensor:
    return full_tensor("b", step + 100) if name == "rep" else full_tensor(name, step)


def _loads_exact(store, ref: str, step: int, root: Path | None = None) -> None:
    """Every tensor of ``ref`` read back bit for bit, from the durable tier or (``root``) one fast folder."""
    if root is not None:
        store.location = Location(url=str(root), kind="file", root=str(root), catalog_url=store.location.catalog_url)
    ck = store.checkpoint(ref)
    assert sorted(ck.names()) == sorted([*SHAPES, "rep"])
    for name in ck.names():
        assert torch.equal(ck.read(name).view(torch.int32), _expected(name, step).view(torch.int32)), (ref, name, root)


def _copies_check_out(store, tmp_path: Path, ck: str) -> dict:
    """Every complete copy the catalog lists exists with its size and crc32c; returns the copies."""
    with store.catalog.session() as s:
        copies = tp.copies(s, ck)
    assert copies and all(copies.values()), "an object listed without a complete copy"
    for key, cs in copies.items():
        for c in cs:
            if c.tier == "fast":
                tobj.read_checked(tmp_path / "fast" / c.node, key, c.crc32c, c.nbytes)
            else:
                tobj.read_checked(tmp_path / "store", key, c.crc32c, c.nbytes)
    return copies


def _safety(store, ck: str) -> str | None:
    with store.catalog.session() as s:
        return tp.safety_of(s, ck)


def _durable_is_plain_zarr(store, tmp_path: Path, ck: str, step: int) -> None:
    """The drained copy is a complete Zarr v3 store: zarr-python opens each array from its zarr.json alone."""
    import numpy as np
    import zarr

    c = store.checkpoint(ck)
    for name in c.names():
        rel = c.info(name).array
        got = np.asarray(zarr.open_array(str(tmp_path / "store" / rel), mode="r")[...])
        want = _expected(name, step)
        assert got.tobytes() == want.contiguous().view(torch.uint8).numpy().tobytes(), (ck, name)


def _durable_roundtrip(tmp_path: Path, catalog: str | None) -> None:
    outs = _run(tmp_path, world=4, per_node=2, steps=[1, 2, 3], wait="durable", fast_keep=1, catalog=catalog)
    ids = [rec["id"] for rec in outs[0]["steps"]]
    for o in outs:  # every rank: replicated when save returned, durable once waited on
        assert [(r["id"], r["safety"], r["waited"]) for r in o["steps"]] == [(i, "replicated", "durable") for i in ids]
    store = _store(tmp_path, catalog)
    for step, ck in zip([1, 2, 3], ids):
        assert _safety(store, ck) == "durable"
        copies = _copies_check_out(store, tmp_path, ck)
        fast = {(c.node) for cs in copies.values() for c in cs if c.tier == "fast"}
        meta = {k for k in copies if k.endswith("/zarr.json")}  # made from the catalog's layout by the drain
        assert meta and all({(c.tier, c.node) for c in copies[k]} == {("durable", "")} for k in meta)
        if step == 3:  # the newest keeps its fast copies: every shard file on both nodes and on the durable tier
            assert all({(c.tier, c.node) for c in cs} == {("fast", "n0"), ("fast", "n1"), ("durable", "")}
                       for k, cs in copies.items() if k not in meta)
        else:  # fast_keep=1: evicted from the fast tier (rows, then folders), durable only
            assert fast == set()
            assert not any((tmp_path / "fast" / n / "arrays" / ck).exists() for n in ("n0", "n1"))
        _loads_exact(store, ck, step)
        _durable_is_plain_zarr(store, tmp_path, ck, step)
    for node in ("n0", "n1"):  # one node's fast folder alone holds all of the newest version
        _loads_exact(_store(tmp_path, catalog), ids[2], 3, tmp_path / "fast" / node)


def test_tiered_save_replicated_then_durable_then_evicted(tmp_path):
    _durable_roundtrip(tmp_path, None)


def test_tiered_save_on_postgresql(tmp_path):
    if not os.environ.get(PG_ENV):
        pytest.skip(f"{PG_ENV} is not set")
    with postgres_schema_url() as url:
        _durable_roundtrip(tmp_path, url)


def test_replicated_without_drain_survives_either_node(tmp_path):
    outs = _run(tmp_path, world=2, per_node=1, steps=[5], drain=False)
    ck = outs[0]["steps"][0]["id"]
    store = _store(tmp_path)
    assert _safety(store, ck) == "replicated"
    with store.catalog.session() as s:
        assert {p.tier for p in tp.rows_of(s, ck)} == {"fast"}  # nothing on the durable tier yet
    assert not (tmp_path / "store" / "arrays" / ck).exists()
    _copies_check_out(store, tmp_path, ck)
    for node in ("n0", "n1"):  # lose either node: the other's folder has everything
        _loads_exact(_store(tmp_path), ck, 5, tmp_path / "fast" / node)


def test_async_save_to_the_fast_tier(tmp_path):
    outs = _run(tmp_path, world=2, per_node=1, steps=[1, 2], wait="durable", fast_keep=1, **{"async": True})
    ids = [r["id"] for r in outs[0]["steps"]]
    assert [(r["safety"], r["waited"]) for r in outs[1]["steps"]] == [("replicated", "durable")] * 2
    store = _store(tmp_path)
    for step, ck in zip([1, 2], ids):  # the state at the call, not the one changed after it
        assert _safety(store, ck) == "durable"
        _copies_check_out(store, tmp_path, ck)
        _loads_exact(_store(tmp_path), ck, step)
    for node in ("n0", "n1"):
        _loads_exact(_store(tmp_path), ids[1], 2, tmp_path / "fast" / node)


def test_kill_during_replication_leaves_it_local(tmp_path):
    outs = _run(tmp_path, world=2, per_node=1, steps=[1], kill={"1": "tier.replicate"}, timeout_s=15)
    assert outs[1] is None  # killed
    assert "replicat" in outs[0]["error"]
    store = _store(tmp_path)
    (ck,) = [c["id"] for c in store.list_checkpoints("t")]
    assert _safety(store, ck) == "local"  # committed, never listed above what it reached
    copies = _copies_check_out(store, tmp_path, ck)
    assert all(c.tier == "fast" for cs in copies.values() for c in cs)  # nothing durable
    assert any(len(cs) == 1 for cs in copies.values())  # some object on one node only: 'replicated' would overstate


def test_kill_during_drain_leaves_it_replicated(tmp_path):
    outs = _run(tmp_path, world=2, per_node=1, steps=[1], wait="durable", kill={"1": "tier.drain"}, timeout_s=15)
    assert outs[1] is None
    assert outs[0]["steps"][0]["safety"] == "replicated" and "drain" in outs[0]["error"]
    store = _store(tmp_path)
    ck = outs[0]["steps"][0]["id"]
    assert _safety(store, ck) == "replicated"
    _copies_check_out(store, tmp_path, ck)
    for node in ("n0", "n1"):
        _loads_exact(_store(tmp_path), ck, 1, tmp_path / "fast" / node)


def test_kill_during_eviction_loses_nothing(tmp_path):
    outs = _run(tmp_path, world=2, per_node=1, steps=[1, 2], wait="durable", fast_keep=1, kill={"1": "tier.evict"},
                timeout_s=15)
    assert outs[1] is None
    first, second = (r["id"] for r in outs[0]["steps"])
    store = _store(tmp_path)
    assert _safety(store, first) == "durable" and _safety(store, second) == "durable"
    with store.catalog.session() as s:
        assert {p.state for p in tp.rows_of(s, first) if p.tier == "fast"} == {"evicted"}
    _copies_check_out(store, tmp_path, second)
    _loads_exact(_store(tmp_path), first, 1)
    _loads_exact(_store(tmp_path), second, 2)
    assert (tmp_path / "fast" / "n1" / "arrays" / first).exists()  # killed before its folder went
    proc = run_python(["-m", "ucp_store.cli", "gc", "--store", str(tmp_path / "store"), "--fast-tier",
                       str(tmp_path / "fast" / "{node}"), "--node", "n1"])
    assert proc.returncode == 0, proc.stderr
    assert "evicted" in proc.stdout and not (tmp_path / "fast" / "n1" / "arrays" / first).exists()  # rows: evicted
    _copies_check_out(store, tmp_path, second)
