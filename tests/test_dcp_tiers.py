"""Tiered saves through the DCP backend (issue 38) on real gloo ranks: ``dcp.save`` with
``UcpStorageWriter(tier="fast")`` on simulated nodes (``UCP_NODE``) with their own fast-tier folders, then
``writer.replicate()`` and the drain to the durable folder (tests/dcp_tier_ranks.py).

Checked: the catalog's safety after each phase is exactly the level reached (``local`` when ``dcp.save``
returns, ``replicated`` after ``replicate()``, ``durable`` after the drain), every complete copy the catalog
lists exists with its crc32c, older versions are evicted from the fast tier (``fast_keep=1``), and every
version loads back bit for bit through ``UcpStorageReader``, through ``ucp_store.distributed.load``, from the
durable tier and (the newest) from either node's fast folder alone.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ucp_store
from ucp_store.io.location import Location
from ucp_store.tiers import objects as tobj
from ucp_store.tiers import placement as tp

from ucp_test_helpers import run_python

sys.path.insert(0, os.path.dirname(__file__))
from tier_ranks import SHAPES, full_tensor  # noqa: E402


def run_ranks(tmp_path: Path, **spec) -> list[Any]:
    spec = {"store": str(tmp_path / "store"), "fast": str(tmp_path / "fast" / "{node}"), "out": str(tmp_path / "out"),
            **spec}
    (tmp_path / "out").mkdir()
    proc = run_python(["tests/dcp_tier_ranks.py", json.dumps(spec)], timeout=300)
    paths = [tmp_path / "out" / f"rank{r}.json" for r in range(spec["world"])]
    outs: list[Any] = [json.loads(p.read_text()) if p.exists() else None for p in paths]
    if spec.get("kill"):
        return outs  # a killed rank wrote nothing (None)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert all("error" not in o for o in outs), [o.get("trace") for o in outs]
    return outs


def loads_exact(tmp_path: Path, ref: str, step: int, root: Path | None = None) -> None:
    store = ucp_store.open_store(str(tmp_path / "store"))
    if root is not None:  # one node's fast folder alone
        store.location = Location(url=str(root), kind="file", root=str(root), catalog_url=store.location.catalog_url)
    ck = store.checkpoint(ref)
    assert sorted(ck.names()) == sorted([*SHAPES, "rep"])
    for name in ck.names():
        want = full_tensor("b", step + 100) if name == "rep" else full_tensor(name, step)
        assert torch.equal(ck.read(name).view(torch.int32), want.view(torch.int32)), (ref, name, root)


@pytest.mark.parametrize("per_node", [1, 2])
def test_dcp_tiered_save_replicated_then_durable(tmp_path, per_node):
    outs = run_ranks(tmp_path, world=2 * per_node, per_node=per_node, steps=[1, 2], fast_keep=1)
    ids = [rec["id"] for rec in outs[0]["steps"]]
    assert len(set(ids)) == 2
    for rec in outs[0]["steps"]:  # the catalog never lists a version above the level it reached
        assert (rec["after_save"], rec["after_replicate"], rec["after_wait"]) == ("local", "replicated", "durable")
    for o in outs:
        for rec, ck in zip(o["steps"], ids):
            assert (rec["id"], rec["safety"], rec["waited"]) == (ck, "replicated", "durable")
            assert rec["dcp_load_bad"] == [] and rec["ucpd_load_bad"] == []  # every rank's shards, bit for bit
    store = ucp_store.open_store(str(tmp_path / "store"))
    for step, ck in zip([1, 2], ids):
        with store.catalog.session() as s:
            assert tp.safety_of(s, ck) == "durable"
            copies = tp.copies(s, ck)
        assert copies and all(copies.values())
        for key, cs in copies.items():  # every complete copy listed exists with its crc32c
            for c in cs:
                root = tmp_path / "fast" / c.node if c.tier == "fast" else tmp_path / "store"
                tobj.read_checked(root, key, c.crc32c, c.nbytes)
        where = {frozenset((c.tier, c.node) for c in cs) for cs in copies.values()}
        if step == 2:  # the newest: every object on both nodes' fast tiers and on the durable tier
            assert where == {frozenset({("fast", "n0"), ("fast", "n1"), ("durable", "")})}
        else:  # fast_keep=1: evicted from the fast tier, rows and folders
            assert where == {frozenset({("durable", "")})}
            assert not any((tmp_path / "fast" / n / "arrays" / ck).exists() for n in ("n0", "n1"))
        loads_exact(tmp_path, ck, step)
    for node in ("n0", "n1"):  # lose either node: the other's folder holds all of the newest version
        loads_exact(tmp_path, ids[1], 2, tmp_path / "fast" / node)


def test_dcp_tier_options_checked(tmp_path):
    from ucp_store.errors import ConfigurationError, UcpError
    from ucp_store.formats.dcp.storage import UcpStorageWriter

    with pytest.raises(ConfigurationError, match="tier='slow'"):
        UcpStorageWriter(str(tmp_path / "s"), run="r", step=1, tier="slow")
    with pytest.raises(ConfigurationError, match="replicas=2"):
        UcpStorageWriter(str(tmp_path / "s"), run="r", step=1, tier="fast", replicas=2)
    with pytest.raises(UcpError, match="no tiered save to replicate"):
        UcpStorageWriter(str(tmp_path / "s"), run="r", step=1, tier="fast", fast_tier=str(tmp_path)).replicate()


def test_dcp_tiered_save_one_process_replicas_0(tmp_path):
    """No process group: the version is committed ``local`` on this node's fast tier, then drained."""
    import torch.distributed.checkpoint as dcp

    from ucp_store.formats.dcp.storage import UcpStorageReader, UcpStorageWriter

    sd = {"w": full_tensor("w1", 7), "b": full_tensor("b", 7)}
    writer = UcpStorageWriter(str(tmp_path / "store"), run="one", step=7, tier="fast", replicas=0, node="solo",
                              fast_tier=str(tmp_path / "fast" / "{node}"))
    dcp.save(sd, storage_writer=writer)
    store = ucp_store.open_store(str(tmp_path / "store"))
    (ck,) = [c["id"] for c in store.list_checkpoints("one")]
    with store.catalog.session() as s:
        assert tp.safety_of(s, ck) == "local"
        assert {(c.tier, c.node) for cs in tp.copies(s, ck).values() for c in cs} == {("fast", "solo")}
    assert not (tmp_path / "store" / "arrays" / ck).exists()  # nothing on the durable tier yet
    res = writer.replicate()
    assert str(res) == ck and res.wait("durable", timeout=120) == "durable"
    with store.catalog.session() as s:
        assert tp.safety_of(s, ck) == "durable"
    back = {"w": torch.zeros(SHAPES["w1"]), "b": torch.zeros(SHAPES["b"])}
    dcp.load(back, storage_reader=UcpStorageReader(str(tmp_path / "store"), ck))
    assert torch.equal(back["w"], sd["w"]) and torch.equal(back["b"], sd["b"])


def test_dcp_kill_during_replication_leaves_it_local(tmp_path):
    outs = run_ranks(tmp_path, world=2, per_node=1, steps=[1], kill={"1": "tier.replicate"}, timeout_s=15)
    assert outs[1] is None  # killed while writing the replica it received
    rec = outs[0]["steps"][0]
    assert rec["after_save"] == "local" and "replicat" in outs[0]["error"]
    store = ucp_store.open_store(str(tmp_path / "store"))
    (ck,) = [c["id"] for c in store.list_checkpoints("t")]
    with store.catalog.session() as s:
        assert tp.safety_of(s, ck) == "local"  # committed, never listed above what it reached
        copies = tp.copies(s, ck)
    assert all(c.tier == "fast" for cs in copies.values() for c in cs)  # nothing durable
    for key, cs in copies.items():
        for c in cs:
            tobj.read_checked(tmp_path / "fast" / c.node, key, c.crc32c, c.nbytes)
    assert any(len(cs) == 1 for cs in copies.values())  # some object on one node only: 'replicated' would overstate
