"""The registry: references, dedup, rm, gc and retention, aborts, objects, stats and diff (API level)."""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch
from sqlalchemy import func, select, update

import ucp_store
from ucp_store.catalog import models as m
from ucp_store.errors import CatalogError, ReferenceNotFound, ShapeMismatch, UcpError
from ucp_store.registry.checkpoint import diff

from ucp_test_helpers import array_folders, bits, tree_digest


def n_arrays(store) -> int:
    with store.catalog.session() as s:
        return s.scalar(select(func.count()).select_from(m.Array))


def all_rows(store, model) -> list:
    with store.catalog.session() as s:
        return list(s.scalars(select(model)))


def steps(store, run: str) -> list[int]:
    return [c["step"] for c in store.list_checkpoints(run)]


@pytest.fixture
def frozen():
    return torch.randn(300, 300, generator=torch.Generator().manual_seed(7))


# --- open / create ---------------------------------------------------------------------------------

def test_open_missing_store_errors(tmp_path):
    with pytest.raises(CatalogError, match="no store at"):
        ucp_store.open_store(str(tmp_path / "nothing"))
    assert not (tmp_path / "nothing").exists()


def test_reopen_sees_committed_versions(store, store_path):
    store.save("r", 3, {"w": torch.ones(2)})
    again = ucp_store.open_store(str(store_path))
    assert [c["step"] for c in again.list_checkpoints()] == [3]
    assert torch.equal(again.checkpoint("r@3").read("w"), torch.ones(2))


# --- references -----------------------------------------------------------------------------------

@pytest.fixture
def refs_store(store):
    ids = {}
    for step in (0, 10, 20, 30):
        ids[step] = store.save("run1", step, {"w": torch.full((3,), float(step))}).id
    ids["other"] = store.save("other-run", 5, {"w": torch.zeros(1)}).id
    store.tag("run1@10", "best")
    return store, ids


def test_reference_forms(refs_store):
    store, ids = refs_store
    assert store.resolve("run1@20") == ids[20]
    assert store.resolve("run1@latest") == ids[30]
    assert store.resolve("run1:best") == ids[10]
    assert store.resolve(ids[0]) == ids[0]
    assert store.resolve(ids["other"][:10]) == ids["other"]
    assert store.checkpoint("run1:best").read("w").tolist() == [10.0] * 3
    assert store.checkpoint("other-run@latest").step == 5


@pytest.mark.parametrize("ref, near", [
    ("run2@10", "run1"),            # unknown run: near run names
    ("run1@11", "10"),              # unknown step: the run's steps
    ("run1:bset", "run1:best"),     # unknown tag: near tags
    ("rnu1", "run1"),               # not a ref form at all: near runs / RUN@STEP
    ("run1@ten", "integer"),
])
def test_unknown_reference_lists_near_matches(refs_store, ref, near):
    store, _ = refs_store
    with pytest.raises(ReferenceNotFound) as exc:
        store.resolve(ref)
    assert ref in str(exc.value) and near in str(exc.value)


def test_ambiguous_id_prefix(store):
    ids = [store.save("r", step, {"w": torch.full((1,), float(step))}).id for step in range(17)]
    by_first = {}
    for cid in ids:
        by_first.setdefault(cid[0], []).append(cid)
    prefix = next(p for p, group in by_first.items() if len(group) > 1)  # 17 ids, 16 hex digits
    with pytest.raises(ReferenceNotFound, match="ambiguous"):
        store.resolve(prefix)
    with pytest.raises(ReferenceNotFound):
        store.resolve("")


def test_pending_checkpoint_is_not_resolvable(store):
    w = store.begin("r", 1)
    w.write("w", "weight", torch.ones(2))
    w.flush()
    with pytest.raises(ReferenceNotFound):
        store.resolve("r@1")
    with pytest.raises(ReferenceNotFound):
        store.resolve(w.id)
    assert store.list_checkpoints() == []
    assert [c["status"] for c in store.list_checkpoints(include_pending=True)] == ["pending"]
    w.commit()
    assert store.resolve("r@1") == w.id


def test_parent_links_and_duplicate_step(store):
    a = store.save("r", 1, {"w": torch.ones(1)})
    b = store.save("r", 2, {"w": torch.ones(1) * 2})
    assert b.parent == a.id
    c = store.save("r", 3, {"w": torch.ones(1)}, parent=None)
    assert c.parent is None
    with pytest.raises(UcpError, match="already has a committed checkpoint at step 2"):
        store.save("r", 2, {"w": torch.ones(1)})
    assert steps(store, "r") == [1, 2, 3]


# --- dedup, rm, gc ------------------------------------------------------------------------------------

def test_dedup_frozen_tensor_writes_one_array(store, store_path, frozen):
    a = store.save("r", 1, {"frozen": frozen, "w": torch.randn(10)})
    before = n_arrays(store)
    b = store.save("r", 2, {"frozen": frozen.clone(), "w": torch.randn(10)})
    assert n_arrays(store) == before + 1  # only the changed tensor
    assert a.info("frozen").array_id == b.info("frozen").array_id
    assert len(array_folders(store_path)) == n_arrays(store) == 3
    # same content under two names in one version: one array too
    c = store.save("r", 3, {"x": torch.arange(5), "y": torch.arange(5), "frozen": frozen})
    assert c.info("x").array_id == c.info("y").array_id
    assert n_arrays(store) == 4
    # same bytes, other dtype or shape: never deduplicated
    ints = torch.arange(5, dtype=torch.int32)
    d = store.save("r", 4, {"i32": ints, "f32": ints.view(torch.float32), "shaped": frozen.reshape(900, 100)})
    assert d.info("i32").array_id != d.info("f32").array_id
    assert d.info("shaped").array_id != a.info("frozen").array_id
    assert n_arrays(store) == 7


def test_rm_keeps_arrays_a_later_version_needs(store, store_path, frozen):
    a = store.save("r", 1, {"frozen": frozen, "w": torch.randn(10)})
    store.save("r", 2, {"frozen": frozen, "w": torch.randn(10)})
    frozen_dir = store_path / a.info("frozen").array
    only_a = store_path / a.info("w").array
    digest = tree_digest(frozen_dir)
    store.rm("r@1")
    assert steps(store, "r") == [2]
    assert not only_a.exists()  # nothing else needed it
    assert frozen_dir.exists() and tree_digest(frozen_dir) == digest
    store.gc()
    assert tree_digest(frozen_dir) == digest
    ck = store.checkpoint("r@2")
    assert bits(ck.read("frozen")) == bits(frozen)
    assert ck.verify() == []
    assert ck.parent is None  # the removed parent is unlinked
    store.rm("r@2")
    assert not frozen_dir.exists()
    assert n_arrays(store) == 0 and array_folders(store_path) == set()
    assert list((store_path / "arrays").iterdir()) == []


def test_rm_of_tagged_version_needs_force(store):
    store.save("r", 1, {"w": torch.ones(1)})
    store.tag("r@1", "keep")
    with pytest.raises(UcpError, match="tagged keep"):
        store.rm("r@1")
    store.rm("r:keep", force=True)
    assert steps(store, "r") == []


def test_tag_race_lost_to_another_writer_answers_as_if_the_row_was_there(store, monkeypatch):
    """Two writers tag one name at once (PostgreSQL: both see no row, the second insert violates the
    unique key). The loser must answer as the winner's row dictates, never with a raw IntegrityError."""
    from sqlalchemy.orm import Session

    from ucp_store.errors import TagInUseError

    a = store.save("r", 1, {"w": torch.ones(1)})
    store.save("r", 2, {"w": torch.zeros(1)})
    store.tag("r@1", "best")  # the winner's row
    real = Session.scalar
    blind = {"n": 1}

    def scalar(self, stmt, *args, **kw):
        if blind["n"] and "tags" in str(stmt):
            blind["n"] -= 1
            return None  # the loser's read ran before the winner committed
        return real(self, stmt, *args, **kw)

    monkeypatch.setattr(Session, "scalar", scalar)
    with pytest.raises(TagInUseError, match="already names checkpoint"):
        store.tag("r@2", "best")
    assert blind["n"] == 0
    blind["n"] = 1
    assert store.tag("r@1", "best") == a.id  # same checkpoint: done, no error
    assert store.checkpoint("r:best").id == a.id


def test_gc_never_removes_data_a_committed_version_needs(store, store_path, frozen):
    cks = [store.save("r", s, {"frozen": frozen, "w": torch.full((4,), float(s))}) for s in range(5)]
    digests = {p: tree_digest(store_path / p) for p in array_folders(store_path)}
    report = store.gc()
    assert report.removed_arrays == 0 and report.removed_checkpoints == [] and report.removed_pending == []
    assert {p: tree_digest(store_path / p) for p in array_folders(store_path)} == digests
    # a stray folder nothing knows about is reclaimed; the data stays
    stray = store_path / "arrays" / "deadbeefdeadbeef" / "0123.zarr"
    stray.mkdir(parents=True)
    (stray / "zarr.json").write_text("{}")
    store.gc()
    assert not stray.parent.exists()
    for ck in cks:
        assert store.checkpoint(ck.id).verify() == []


@pytest.fixture
def ten_versions(store, frozen):
    """run r, steps 0, 10, ..., 90, all sharing the frozen tensor written by step 0; step 40 tagged."""
    for s in range(0, 100, 10):
        store.save("r", s, {"frozen": frozen, "w": torch.full((8,), float(s))})
    store.save("keepme", 1, {"w": torch.ones(2)})
    store.tag("r@40", "milestone")
    return store


@pytest.mark.parametrize("kwargs, kept", [
    ({"keep_last": 3}, [40, 70, 80, 90]),
    ({"keep_last": 3, "keep_tagged": False}, [70, 80, 90]),
    ({"keep_every": 30}, [0, 30, 40, 60, 90]),
    ({"keep_every": 40, "keep_tagged": False}, [0, 40, 80, 90]),  # the newest always stays
    ({"keep_last": 1, "keep_every": 50}, [0, 40, 50, 90]),
    ({"keep_last": 1, "keep_tagged": False}, [90]),
])
def test_retention_via_gc_removes_exactly_the_expected_versions(ten_versions, store_path, frozen, kwargs, kept):
    store = ten_versions
    removed = store.gc(run="r", **kwargs).removed_checkpoints
    assert steps(store, "r") == kept
    assert len(removed) == 10 - len(kept)
    assert steps(store, "keepme") == [1]  # other runs untouched
    for s in kept:  # every survivor reads back, including the frozen array step 0 wrote
        ck = store.checkpoint(f"r@{s}")
        assert bits(ck.read("frozen")) == bits(frozen)
        assert ck.read("w").tolist() == [float(s)] * 8
        assert ck.verify() == []
    with store.catalog.session() as s:
        referenced = set(s.scalars(select(m.Tensor.array_id)))
    assert {a.id for a in all_rows(store, m.Array)} == referenced
    assert len(array_folders(store_path)) == len(referenced)


def test_stored_retention_policy_applies_on_gc(ten_versions):
    store = ten_versions
    policy = store.set_retention("r", keep_last=2)
    assert policy == {"keep_last": 2, "keep_every": None, "keep_tagged": True}
    assert store.gc(dry_run=True).removed_checkpoints  # dry run: reported, nothing removed
    assert len(steps(store, "r")) == 10
    store.gc()
    assert steps(store, "r") == [40, 80, 90]
    store.set_retention("r")  # no policy: gc keeps everything
    store.gc()
    assert steps(store, "r") == [40, 80, 90]
    with pytest.raises(ReferenceNotFound):
        store.set_retention("nope", keep_last=1)


# --- aborts and mismatches -------------------------------------------------------------------------------

def test_shape_mismatch_aborts_and_nothing_is_listed(store, store_path):
    with pytest.raises(ShapeMismatch, match=r"shape \(3,\) does not match the declared \(4,\)"):
        with store.begin("r", 1) as w:
            w.write("a", "weight", torch.ones(5))
            w.write("b", "weight", torch.ones(3), expect_shape=(4,))
    with pytest.raises(ShapeMismatch, match="dtype float32 does not match the declared bfloat16"):
        with store.begin("r", 1) as w:
            w.write("b", "weight", torch.ones(3), expect_dtype=torch.bfloat16)
    assert store.list_checkpoints(include_pending=True) == []
    assert store.runs() == []  # the run row begin() created went with the aborted save
    assert n_arrays(store) == 0 and array_folders(store_path) == set()
    with store.begin("r", 1) as w:  # the declared shape and dtype, matching: fine
        w.write("b", "weight", torch.ones(3), expect_shape=(3,), expect_dtype="float32")
    assert steps(store, "r") == [1]


def test_exception_inside_begin_aborts(store, store_path):
    store.save("r", 0, {"w": torch.ones(2)})
    with pytest.raises(RuntimeError, match="boom"):
        with store.begin("r", 1) as w:
            for i in range(5):
                w.write(f"t{i}", "weight", torch.full((100,), float(i)))
            w.flush()
            w.write("late", "weight", torch.ones(7))
            raise RuntimeError("boom")
    assert steps(store, "r") == [0]
    assert [c["status"] for c in store.list_checkpoints(include_pending=True)] == ["committed"]
    assert not (store_path / "arrays" / w.id).exists()
    assert n_arrays(store) == 1 and len(array_folders(store_path)) == 1
    with pytest.raises(UcpError, match="closed"):
        w.write("again", "weight", torch.ones(1))


def test_duplicate_tensor_state_in_one_save(store):
    with pytest.raises(UcpError, match="already written"):
        with store.begin("r", 1) as w:
            w.write("a", "fp32", torch.ones(1))
            w.write("a", "fp32", torch.ones(1))
    assert store.list_checkpoints(include_pending=True) == []


def test_non_tensor_value_refused(store):
    with pytest.raises(UcpError, match="expected a torch.Tensor"):
        store.save("r", 1, {"a": [1, 2, 3]})
    assert store.list_checkpoints(include_pending=True) == []


# --- states, objects ---------------------------------------------------------------------------------

def test_states_and_objects_round_trip(store):
    fp32, m1, bf = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4).bfloat16()
    ck = store.save("r", 1, {"layer.w": {"fp32": fp32, "exp_avg": m1, "weight": bf}},
                    objects={"cfg": {"lr": 1e-3, "betas": [0.9, 0.95], "name": "adam"}, "rng": torch.arange(6)})
    ck = store.checkpoint(ck.id)
    assert ck.states("layer.w") == ["fp32", "exp_avg", "weight"]
    assert bits(ck.read("layer.w")) == bits(fp32)  # default state: fp32
    assert bits(ck.read("layer.w", "weight")) == bits(bf)
    assert bits(ck["layer.w", "exp_avg"].read()) == bits(m1)
    assert set(ck.state_dict("exp_avg")) == {"layer.w"}
    objs = ck.objects()
    assert objs["cfg"] == {"lr": 1e-3, "betas": [0.9, 0.95], "name": "adam"}
    assert torch.equal(objs["rng"], torch.arange(6))
    with pytest.raises(ReferenceNotFound, match="no state 'exp_avg_sq'"):
        ck.read("layer.w", "exp_avg_sq")
    with pytest.raises(ReferenceNotFound, match="did you mean: layer.w"):
        ck.read("layer.ww")


def test_objects_are_never_pickled(store):
    with pytest.raises(UcpError, match=r"objects\['bad'\] is a builtins.set, which is not stored exactly .*never a "
                                       "pickle"):
        store.save("r", 1, {"w": torch.ones(1)}, objects={"bad": {1, 2}})
    assert store.list_checkpoints(include_pending=True) == []


# --- stats and diff ---------------------------------------------------------------------------------

def test_stats_match_numpy_with_planted_nan_and_inf(store):
    x = torch.randn(257, 33, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 5 + 1
    x[3, 4] = float("nan")
    x[100, 0] = float("nan")
    x[7, 7] = float("inf")
    x[8, 8] = float("-inf")
    ck = store.save("r", 1, {"x": x, "b": x.bfloat16(), "allnan": torch.full((3,), float("nan"))})
    a = x.numpy()
    fin = a[np.isfinite(a)]
    (s,) = ck.stats("x")
    assert (s.nan, s.inf, s.numel) == (2, 2, a.size)
    assert s.min == fin.min() and s.max == fin.max()
    assert s.mean == pytest.approx(fin.mean(), rel=1e-12)
    assert s.std == pytest.approx(fin.std(), rel=1e-9)
    assert s.norm == pytest.approx(np.linalg.norm(fin), rel=1e-12)
    (sb,) = ck.stats("b")
    fb = x.bfloat16().double().numpy()
    fb = fb[np.isfinite(fb)]
    assert (sb.nan, sb.inf) == (2, 2) and sb.max == fb.max() and sb.mean == pytest.approx(fb.mean(), rel=1e-12)
    (sn,) = ck.stats("allnan")
    assert sn.nan == 3 and sn.mean is None and sn.min is None
    assert len(ck.stats()) == 3


def test_stats_and_diff_take_signaling_nans_and_infs_without_warnings(store):
    """A signaling NaN (quiet bit clear) is a NaN like any other: counted by stats, a NaN change in diff, and
    no numpy warning from the float64 cast (fp32 and bf16 casts raise FE_INVALID on one; with warnings as
    errors, stats and diff failed)."""
    f32 = torch.tensor([0x7F800001, 0x3F800000, 0x7F800000], dtype=torch.int32).view(torch.float32)  # sNaN, 1, inf
    bf16 = torch.tensor([0x7F81, 0x3F80, -0x0080], dtype=torch.int16).view(torch.bfloat16)  # sNaN, 1, -inf
    ck = store.save("r", 1, {"f": f32, "b": bf16})
    ck2 = store.save("r", 2, {"f": f32 * 1, "b": bf16.flip(0)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = {s.name: s for s in ck.stats()}
        changed = {r["name"]: r for r in diff(ck, ck2)}
    assert changed["b"]["status"] == "changed" and math.isnan(changed["b"]["relative_change"])
    inf = float("inf")
    a = store.save("r", 3, {"x": torch.tensor([1.0, inf]), "y": torch.tensor([1.0, 2.0])})
    b = store.save("r", 4, {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([1.0, inf])})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rel = {r["name"]: r["relative_change"] for r in diff(a, b)}
    assert math.isnan(rel["x"]) and rel["y"] == inf  # an Inf in a: undefined; only in b: infinite
    for name in ("f", "b"):
        s = stats[name]
        assert (s.nan, s.inf, s.numel) == (1, 1, 3), name
        assert s.min == s.max == s.mean == 1.0 and s.norm == 1.0, name


def test_diff_same_changed_added_removed(store, frozen):
    w = torch.randn(50, 20, dtype=torch.float64)
    d = torch.randn(50, 20, dtype=torch.float64) * 0.01
    a = store.save("r", 1, {"frozen": frozen, "w": w, "gone": torch.ones(3), "reshaped": torch.ones(4)})
    b = store.save("r", 2, {"frozen": frozen, "w": w + d, "new": torch.ones(3), "reshaped": torch.ones(2, 2)})
    rows = {r["name"]: r for r in diff(a, b)}
    assert rows["frozen"]["status"] == "same" and rows["frozen"]["relative_change"] == 0.0
    assert rows["w"]["status"] == "changed"
    assert rows["w"]["relative_change"] == pytest.approx(float(d.norm() / w.norm()), rel=1e-9)
    assert rows["gone"]["status"] == "removed" and rows["new"]["status"] == "added"
    assert rows["reshaped"]["status"] == "changed" and rows["reshaped"]["relative_change"] is None


# --- verify: catalog tampering -----------------------------------------------------------------------

@pytest.mark.parametrize("table", [m.Tensor, m.Array])
def test_verify_catches_a_tampered_content_hash(store, table):
    ck = store.save("r", 1, {"w": torch.randn(64), "v": torch.randn(8)})
    assert ck.verify() == []
    aid = ck.info("w").array_id
    col = table.array_id if table is m.Tensor else table.id
    with store.catalog.write_session() as s:
        s.execute(update(table).where(col == aid).values(content_hash="xxh3-128:" + "0" * 32))
    problems = store.checkpoint(ck.id).verify()
    assert problems and all(p["tensor"] == "w" for p in problems)
    assert any(re.search(r"content hash .* != catalog", p["error"]) for p in problems)


def test_dedup_looks_up_only_the_hashes_a_save_writes(tmp_path):
    """A save that writes a few arrays asks the catalog for their content hashes alone (an indexed IN query),
    never for every committed array's hash, and still reuses an identical committed array; a writer with
    many lookups reads them all once instead of querying per write."""
    from sqlalchemy import event

    from ucp_store.save import dedup as writer_mod

    store = ucp_store.open_store(str(tmp_path / "store"), create=True)
    store.save("a", 1, {f"t{i}": torch.full((4,), float(i)) for i in range(20)})
    hash_queries: list[str] = []
    event.listen(store.catalog.engine, "before_cursor_execute",
                 lambda conn, cur, stmt, *a: hash_queries.append(stmt) if "content_hash" in stmt
                 and stmt.lstrip().upper().startswith("SELECT") else None)
    w = store.begin("b", 1)
    w.write("same", "weight", torch.full((4,), 3.0))  # a@1's t3
    w.write("new", "weight", torch.full((4,), 99.0))
    w.commit()
    with store.catalog.session() as s:
        ids = {(run, n): a for run, n, a in s.execute(
            select(m.Run.name, m.Tensor.name, m.Tensor.array_id).select_from(m.Tensor)
            .join(m.Checkpoint, m.Tensor.checkpoint_id == m.Checkpoint.id).join(m.Run, m.Checkpoint.run_id == m.Run.id)
            .where(m.Tensor.name.in_(["t3", "same", "new"])))}
    assert ids[("b", "same")] == ids[("a", "t3")] and ids[("b", "new")] != ids[("a", "t3")]
    assert len(hash_queries) == 2 and all(" IN (" in q for q in hash_queries), hash_queries
    hash_queries.clear()
    many = writer_mod.TARGETED_LOOKUPS + 5
    store.save("c", 1, {f"u{i}": torch.full((4,), 100.0 + i) for i in range(many)})
    assert len(hash_queries) == writer_mod.TARGETED_LOOKUPS + 1  # then one read of every committed hash
    assert " IN (" not in hash_queries[-1]
