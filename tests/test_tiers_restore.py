"""Restore from the nearest copies into another mesh (issue 38, the restore side), on real gloo ranks.

Three simulated nodes (``UCP_NODE``) of one rank each save two versions with ``tier="fast", replicas=1``: the
first drained to the durable tier (a folder), the second ``replicated`` only. Then (tests/restore_ranks.py):

1. node n1 is lost (its fast folder removed); 2 nodes x 2 ranks on a 2-D ``dp x tp`` mesh load the replicated
   version: bit for bit, nothing from the durable tier, the lost node's objects from a peer;
2. a copy on n2 is corrupted: the load reports it in one line, takes the other copy, and is exact;
3. n0 is lost too: ``Checkpointer(tier="fast").load_latest`` (through ``newest_restorable``) passes over the
   replicated version (one line says so) and 2 ranks on n2 load the newest durable one, exact.

The catalog is PostgreSQL when ``UCP_TEST_POSTGRES_URL`` is set, else SQLite.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import ucp_store
from ucp_store.tiers import objects as tobj
from ucp_store.tiers import placement as tp

from ucp_test_helpers import PG_ENV, postgres_schema_url, run_python


def _run(tmp_path: Path, catalog: str | None, name: str, may_fail: bool = False, **spec) -> list[dict]:
    out = tmp_path / "out" / name
    spec = {"store": str(tmp_path / "store"), "fast": str(tmp_path / "fast" / "{node}"), "out": str(out),
            "world": len(spec["nodes"]), **spec}
    env = {"UCP_CATALOG": catalog} if catalog else {}
    proc = run_python(["tests/restore_ranks.py", json.dumps(spec)], timeout=400, **env)
    outs = [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
            for r in range(spec["world"])]
    if may_fail:
        return outs
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert all(o is not None and "error" not in o for o in outs), [o and o.get("trace") for o in outs]
    return outs


@pytest.fixture
def catalog():
    if os.environ.get(PG_ENV):
        with postgres_schema_url() as url:
            yield url
    else:
        yield None


def _copies(tmp_path: Path, catalog: str | None, ref: str) -> tuple[str, dict]:
    st = ucp_store.open_store(str(tmp_path / "store"), catalog=catalog)
    try:
        ck = st.checkpoint(ref)
        with st.catalog.session() as s:
            got = tp.copies(s, ck.id)
        return ck.id, {k: [(c.tier, c.node, c.crc32c, c.nbytes) for c in cs] for k, cs in got.items()}
    finally:
        st.catalog.close()


def test_restore_after_node_loss_corruption_and_two_lost_nodes(tmp_path: Path, catalog):
    saved = _run(tmp_path, catalog, "save", nodes=["n0", "n1", "n2"], mesh=[3], action="save", steps=[1, 2],
                 drain_steps=[1])
    assert saved[0]["saved"][0]["waited"] == "durable"
    assert saved[0]["saved"][1]["safety"] == "replicated"
    ck2, copies = _copies(tmp_path, catalog, "r@2")
    assert not any(c[0] == "durable" for cs in copies.values() for c in cs)  # step 2 lives on the fast tiers only

    # 1. n1 lost: the replicated version into a 2 x 2 mesh on n0 and n2, nothing from the durable tier
    shutil.rmtree(tmp_path / "fast" / "n1")
    outs = _run(tmp_path, catalog, "load1", nodes=["n0", "n0", "n2", "n2"], mesh=[2, 2], action="load", ref="r@2")
    for o in outs:
        assert o["id"] == ck2 and o["differ"] == [] and o["step"] == 2 and o["bad"] == []
        assert o["verified"][0], o["verified"]  # ucpd.verify reads the tiered version from the nearest copies too
    job = outs[0]["job"]
    assert job["durable"] == 0 and job["peer"] > 0 and job["local"] > 0, job
    assert sum(o["tier_bytes"]["peer"] for o in outs) == job["peer"]

    # 2. a copy on n2 (n2's own object, also on n0) corrupted: reported, the other copy taken, exact
    key = next(k for k, cs in sorted(copies.items()) if {c[1] for c in cs} == {"n0", "n2"} and "/c/" in k)
    bad = tmp_path / "fast" / "n2" / key
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    bad.write_bytes(bytes(raw))
    outs = _run(tmp_path, catalog, "load2", nodes=["n0", "n0", "n2", "n2"], mesh=[2, 2], action="load", ref="r@2")
    assert all(o["differ"] == [] for o in outs)
    lines = [line for o in outs for line in o["bad"]]
    assert lines and all(key in line and "'n2'" in line and "crc32c" in line for line in lines), lines
    assert outs[0]["job"]["durable"] == 0
    crc, n = next((c[2], c[3]) for c in copies[key] if c[1] == "n2")
    tobj.read_checked(tmp_path / "fast" / "n2", key, crc, n)  # the node's copy is whole again

    # 3. n0 lost too: the replicated version is not restorable; the newest durable one is, and one line says so
    shutil.rmtree(tmp_path / "fast" / "n0")
    outs = _run(tmp_path, catalog, "load3", nodes=["n2", "n2"], mesh=[2], action="load", ref="latest")
    for o in outs:
        assert o["ref"] == "r@1" and o["differ"] == [] and o["step"] == 1
    note = outs[0]["note"]
    assert note and "\n" not in note and "r@2" in note and "r@1 (durable)" in note, note


def _listed(tmp_path: Path, catalog: str | None) -> list[tuple[str, str, str | None, dict]]:
    """(ref, id, stored safety, copies) of every committed version of run r; the stored safety is what the
    rows show, and every complete copy the rows list is in place with its size and crc32c."""
    st = ucp_store.open_store(str(tmp_path / "store"), catalog=catalog)
    out = []
    try:
        for v in st.list_checkpoints("r"):
            with st.catalog.session() as s:
                level, shown, copies = tp.safety_of(s, v["id"]), tp.compute_safety(s, v["id"]), tp.copies(s, v["id"])
            assert level == shown, (v["step"], level, shown)
            for key, cs in copies.items():
                assert cs, f"r@{v['step']}: {key} has no complete copy"
                for c in cs:
                    root = tmp_path / "store" if c.tier == "durable" else tmp_path / "fast" / c.node
                    tobj.read_checked(root, key, c.crc32c, c.nbytes)
            out.append((f"r@{v['step']}", v["id"], level, copies))
    finally:
        st.catalog.close()
    return out


def _loads_exact(tmp_path: Path, catalog: str | None, name: str, scenarios: list[dict]) -> None:
    """Every scenario's refs loaded exact and verified, all in one launch of 2 ranks (rank r on ``nodes[r]``)."""
    for o in _run(tmp_path, catalog, name, nodes=scenarios[0]["nodes"], mesh=[2], action="load", scenarios=scenarios):
        for sc in scenarios:
            for ref, got in zip(sc["refs"], o["scenarios"][sc["name"]]["loads"]):
                assert got["differ"] == [] and got["verified"][0], (sc["name"], ref, got)


def _without(tmp_path: Path, name: str, lost: set[str]) -> str:
    """A copy of the fast tiers without the ``lost`` nodes' folders (a node loss), as a ``{node}`` template."""
    root = tmp_path / "scenarios" / name
    root.mkdir(parents=True)
    for n in ("n0", "n1", "n2"):
        if n not in lost and (tmp_path / "fast" / n).exists():
            shutil.copytree(tmp_path / "fast" / n, root / n)
    return str(root / "{node}")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["tier.replicate", "tier.drain", "tier.evict"])
def test_a_kill_loses_nothing_listed(tmp_path: Path, catalog, point):
    """A rank SIGKILLed while its node replicates, drains or evicts step 2 (steps 1-3 saved, each waiting for
    durable, the fast tier keeping 1): every version stays listed at a level its copies show; every version
    listed replicated or durable loads exact after the loss of any single node (its folder hidden), and every
    version listed durable from the durable tier alone."""
    outs = _run(tmp_path, catalog, "save", may_fail=True, nodes=["n0", "n1", "n2"], mesh=[3], action="save",
                steps=[1, 2, 3], drain=True, fast_keep=1, timeout_s=20, kill={"rank": 1, "step": 2, "point": point})
    assert outs[1] is None  # the killed rank wrote nothing
    listed = _listed(tmp_path, catalog)
    assert [r for r, _, _, _ in listed][:1] == ["r@1"] and listed[0][2] == "durable"
    safe = [r for r, _, level, _ in listed if level in ("replicated", "durable")]
    durable = [r for r, _, level, _ in listed if level == "durable"]
    nodes = ("n0", "n1", "n2")
    scenarios = [{"name": f"without-{lost}", "nodes": [n for n in nodes if n != lost],
                  "fast": _without(tmp_path, f"without-{lost}", {lost}), "refs": safe} for lost in nodes]
    scenarios.append({"name": "durable-only", "nodes": ["m0", "m1"], "fast": _without(tmp_path, "durable", set(nodes)),
                      "refs": durable})
    _loads_exact(tmp_path, catalog, "loads", scenarios)
