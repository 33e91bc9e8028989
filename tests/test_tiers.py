"""Tiers of one store (issue 38): node identity, the fast tier's folder, placement rows and safety levels.

The catalog operations run on SQLite and, with UCP_TEST_POSTGRES_URL, PostgreSQL (a fresh schema each)."""

from __future__ import annotations

import pytest
import torch

from ucp_store import config
from ucp_store.catalog import models as m
from ucp_store.errors import ChecksumError, ConfigurationError, ValidationError
from ucp_store.tiers import node as tnode
from ucp_store.tiers import objects as tobj
from ucp_store.tiers import placement as tp
from ucp_store.tiers.placement import Copy, ObjectInfo

from ucp_test_helpers import store_on

CATALOGS = ["sqlite", "postgres"]


def test_node_name_argument_then_env_then_host(monkeypatch):
    import socket

    monkeypatch.delenv("UCP_NODE", raising=False)
    assert tnode.node_name() == socket.gethostname()
    monkeypatch.setenv("UCP_NODE", "n7")
    assert tnode.node_name() == "n7"
    assert tnode.node_name("n2") == "n2"
    with config.override(node="n3"):
        assert tnode.node_name() == "n3"
    for bad in ("", "a/b", "..", " x", "a\0b"):
        with pytest.raises(ConfigurationError, match="node"):
            tnode.node_name(bad)
    monkeypatch.setenv("UCP_NODE", "../up")
    with pytest.raises(ConfigurationError, match="UCP_NODE"):
        tnode.node_name()


def test_fast_tier_root_template(monkeypatch, tmp_path):
    monkeypatch.delenv("UCP_FAST_TIER", raising=False)
    monkeypatch.setenv("UCP_NODE", "n1")
    assert tnode.fast_tier_root() is None
    assert tnode.fast_tier_root(f"{tmp_path}/ucp/{{node}}/shm") == tmp_path / "ucp" / "n1" / "shm"
    assert tnode.fast_tier_root(str(tmp_path / "ft"), node="n2") == tmp_path / "ft" / "n2"
    monkeypatch.setenv("UCP_FAST_TIER", f"{tmp_path}/{{node}}")
    assert tnode.fast_tier_root() == tmp_path / "n1"
    with pytest.raises(ConfigurationError, match="fast_tier"):
        tnode.fast_tier_root("s3://bucket/x")
    with pytest.raises(ConfigurationError, match="only field"):
        tnode.fast_tier_root(f"{tmp_path}/{{rank}}/{{node}}")


def test_objects_roundtrip_and_checks(tmp_path):
    info = tobj.write_object(tmp_path / "a", "arrays/ck/x.zarr/c/0", b"hello")
    assert info == ObjectInfo("arrays/ck/x.zarr/c/0", 5, tobj.crc_hex(b"hello"))
    assert tobj.read_checked(tmp_path / "a", info.key, info.crc32c, 5) == b"hello"
    assert list(tobj.walk_objects(tmp_path / "a")) == [info.key]
    (tmp_path / "a" / info.key).write_bytes(b"hellp")
    with pytest.raises(ChecksumError, match="crc32c"):
        tobj.read_checked(tmp_path / "a", info.key, info.crc32c, 5)
    with pytest.raises(Exception, match="escape"):
        tobj.write_object(tmp_path / "a", "../out", b"x")


def _objs(n: int) -> list[ObjectInfo]:
    return [ObjectInfo(f"arrays/ck/a{i}.zarr/c/0", 10 + i, f"{i:08x}") for i in range(n)]


@pytest.mark.parametrize("catalog", CATALOGS)
def test_safety_levels_follow_complete_rows(tmp_path, catalog):
    with store_on(catalog, tmp_path / "s") as store:
        ck = store.begin("r", 1).id
        objs = _objs(3)
        with store.catalog.write_session() as s:
            tp.record(s, ck, "fast", "n0", objs, "writing", refresh=True)
            assert tp.safety_of(s, ck) == "local"
            tp.record(s, ck, "fast", "n0", objs, "complete", refresh=True)
            tp.record(s, ck, "fast", "n1", objs[:2], "complete", refresh=True)
        with store.catalog.session() as s:
            assert tp.safety_of(s, ck) == "local"  # a2 has one node only
            assert tp.missing(s, ck) == []
        with store.catalog.write_session() as s:
            tp.record(s, ck, "durable", "", objs[2:], "complete", refresh=True)
            assert tp.safety_of(s, ck) == "replicated"  # a0, a1 on two nodes; a2 durable
            tp.record(s, ck, "durable", "", objs[:2], "writing", refresh=True)
            assert tp.safety_of(s, ck) == "replicated"
            tp.set_state(s, ck, "durable", "", "complete")
            assert tp.safety_of(s, ck) == "durable"
        with store.catalog.session() as s:
            got = tp.copies(s, ck)
        assert got[objs[0].key] == [Copy("fast", "n0", objs[0].crc32c, 10), Copy("fast", "n1", objs[0].crc32c, 10),
                                    Copy("durable", "", objs[0].crc32c, 10)]
        assert got[objs[2].key] == [Copy("fast", "n0", objs[2].crc32c, 12), Copy("durable", "", objs[2].crc32c, 12)]


@pytest.mark.parametrize("catalog", CATALOGS)
def test_level_falls_when_copies_go(tmp_path, catalog):
    with store_on(catalog, tmp_path / "s") as store:
        ck = store.begin("r", 1).id
        other = store.begin("r", 2).id
        objs = _objs(2)
        with store.catalog.write_session() as s:
            for n in ("n0", "n1"):
                tp.record(s, ck, "fast", n, objs, "complete", refresh=True)
            tp.record(s, other, "fast", "n1", objs, "complete", refresh=True)
            assert tp.safety_of(s, ck) == "replicated"
        with store.catalog.write_session() as s:
            assert tp.forget_node(s, "n1") == sorted([ck, other])
            assert tp.safety_of(s, ck) == "local"
            assert tp.missing(s, other) == [o.key for o in objs]  # lost: no copy anywhere
            assert tp.fast_versions(s) == {ck: {"n0"}}
        with store.catalog.session() as s:
            states = {(p.node, p.state) for p in tp.rows_of(s, ck)}
        assert states == {("n0", "complete"), ("n1", "evicted")}


@pytest.mark.parametrize("catalog", CATALOGS)
def test_a_version_without_rows_keeps_null(tmp_path, catalog):
    with store_on(catalog, tmp_path / "s") as store:
        ck = store.begin("r", 1).id
        with store.catalog.write_session() as s:
            assert tp.refresh_safety(s, ck) is None
            assert tp.safety_of(s, ck) is None
        assert tp.reached(None, "durable") and tp.reached("replicated", "local")
        assert not tp.reached("local", "replicated")


def test_record_refuses_bad_tier_node_state(tmp_path):
    with store_on("sqlite", tmp_path / "s") as store:
        ck = store.begin("r", 1).id
        with store.catalog.write_session() as s:
            with pytest.raises(ValidationError, match="durable tier has node"):
                tp.record(s, ck, "durable", "n0", _objs(1), "complete")
            with pytest.raises(ValidationError, match="tier"):
                tp.record(s, ck, "ssd", "n0", _objs(1), "complete")
            with pytest.raises(ValidationError, match="state"):
                tp.record(s, ck, "fast", "n0", _objs(1), "done")
    assert m.SAFETY_LEVELS == ("local", "replicated", "durable")


@pytest.mark.parametrize("catalog", CATALOGS)
def test_eviction_never_takes_a_last_copy(tmp_path, catalog):
    from ucp_store.errors import ConflictError
    from ucp_store.tiers import retention as tret

    with store_on(catalog, tmp_path / "s") as store:
        ids = []
        for step in (1, 2, 3):
            w = store.begin("r", step)
            ids.append(w.id)
            w.commit()
        objs = _objs(2)
        with store.catalog.write_session() as s:
            for ck in ids:
                tp.record(s, ck, "fast", "n0", objs, "complete", refresh=True)
            tp.record(s, ids[0], "fast", "n1", objs, "complete", refresh=True)  # step 1: replicated, not durable
            tp.record(s, ids[1], "durable", "", objs, "complete", refresh=True)  # step 2: durable
        with store.catalog.write_session() as s:
            with pytest.raises(ConflictError, match="last copy"):
                tret.evict(s, ids[2], "n0")  # step 3's only copy
            assert tret.evict(s, ids[0], "n1") == 2  # n0 still holds step 1
            assert tp.safety_of(s, ids[0]) == "local"
            assert tret.evict_fast(s, run="r", keep=1) == [ids[1]]  # only the durable one of the older two
            assert tp.safety_of(s, ids[1]) == "durable"
        with store.catalog.session() as s:
            assert tp.fast_versions(s) == {ids[0]: {"n0"}, ids[2]: {"n0"}}


@pytest.mark.parametrize("catalog", CATALOGS)
def test_safety_by_reference_ls_show_and_wait(tmp_path, catalog, capsys):
    import threading

    from ucp_store import cli

    with store_on(catalog, tmp_path / "s") as store:
        plain = store.save("r", 1, {"w": torch.ones(3)}).id
        w = store.begin("r", 2)
        ck = w.id
        w.commit()
        with store.catalog.write_session() as s:
            tp.record(s, ck, "fast", "n0", _objs(1), "complete", refresh=True)
        assert store.safety("r@1") == "durable" and store.safety(plain) == "durable"  # written durable directly
        assert store.safety("r@2") == "local"
        with pytest.raises(TimeoutError, match="'local'"):
            store.safety("r@2", wait="replicated", timeout=0.3, poll=0.05)

        def later():
            with store.catalog.write_session() as s:
                tp.record(s, ck, "fast", "n1", _objs(1), "complete", refresh=True)

        t = threading.Timer(0.3, later)
        t.start()
        assert store.safety("r@2", wait="replicated", timeout=30, poll=0.05) == "replicated"
        t.join()
        assert {r["step"]: r["safety"] for r in store.list_checkpoints("r")} == {1: "durable", 2: "replicated"}
        args = ["--store", str(tmp_path / "s")] + (["--catalog", store.location.catalog_url] if catalog != "sqlite"
                                                   else [])
        capsys.readouterr()
        assert cli.main(["ls", "r", *args]) == 0
        out = capsys.readouterr().out
        assert "safety" in out and "replicated" in out and "durable" in out
        assert cli.main(["show", "r@2", *args]) == 0
        assert "safety: replicated" in capsys.readouterr().out


def test_gc_of_a_fast_tier_removes_evicted_reports_untied(tmp_path, capsys):
    from ucp_store import cli

    with store_on("sqlite", tmp_path / "s") as store:
        w = store.begin("r", 1)
        ck = w.id
        w.commit()
        fast = tmp_path / "fast" / "n0"
        kept = tobj.write_object(fast, f"arrays/{ck}/a.zarr/c/0", b"kept")
        gone = tobj.write_object(fast, f"arrays/{ck}/a.zarr/c/1", b"evicted")
        stray = tobj.write_object(fast, "arrays/0123456789abcdef/x.zarr/zarr.json", b"{}")
        with store.catalog.write_session() as s:
            tp.record(s, ck, "fast", "n0", [kept, gone], "complete", refresh=True)
            tp.set_state(s, ck, "fast", "n0", "evicted", [gone.key])
        capsys.readouterr()
        argv = ["gc", "--store", str(tmp_path / "s"), "--fast-tier", str(tmp_path / "fast" / "{node}"),
                "--node", "n0"]
        assert cli.main([*argv, "--dry-run"]) == 0
        assert (fast / gone.key).exists()
        assert cli.main(argv) == 0
        out, err = capsys.readouterr()
        assert "removed 1 evicted" in out and "kept 1" in out
        assert not (fast / gone.key).exists() and (fast / kept.key).exists()
        assert (fast / stray.key).exists() and stray.key in err  # untied: reported, never deleted


def test_one_process_tiered_save_drains_and_says_so(tmp_path, monkeypatch):
    import ucp_store
    import ucp_store.distributed as ucpd

    monkeypatch.delenv("UCP_FAST_TIER", raising=False)
    sd = {"model": {"w": torch.arange(5000.0).reshape(50, 100), "b": torch.ones(7)}, "step": 3}
    store = str(tmp_path / "store")
    with pytest.raises(ConfigurationError, match="tier='nvme'"):
        ucpd.save(sd, store=store, run="r", step=1, tier="nvme")
    with pytest.raises(ConfigurationError, match="fast_tier="):
        ucpd.save(sd, store=store, run="r", step=1, tier="fast", replicas=0)
    with pytest.raises(ConfigurationError, match="second node"):
        ucpd.save(sd, store=store, run="r", step=1, tier="fast", node="n0", fast_tier=str(tmp_path / "f"))
    res = ucpd.save(sd, store=store, run="r", step=1, tier="fast", replicas=0, node="n0",
                    fast_tier=str(tmp_path / "f" / "{node}"), progress=False)
    assert res.wait("durable", timeout=120) == "durable" and res.safety == "durable"
    st = ucp_store.open_store(store)
    assert st.safety("r@1") == "durable"
    assert torch.equal(st.checkpoint("r@1").read("model.w" if "model.w" in st.checkpoint("r@1").names() else "w"),
                       sd["model"]["w"])
    with st.catalog.session() as s:
        copies = tp.copies(s, str(res))
    assert copies and all({(c.tier, c.node) for c in cs} == {("fast", "n0"), ("durable", "")} for cs in copies.values())
    for key, cs in copies.items():  # the fast folder and the durable one hold the same bytes under the same keys
        assert tobj.read_checked(tmp_path / "f" / "n0", key, cs[0].crc32c) == tobj.read_object(tmp_path / "store", key)
