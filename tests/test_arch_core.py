"""Issue 9, part A: the core modules' contracts after the split.

- the registry, catalog, retention and checkpoint metadata paths import no torch, TensorStore, zarr,
  ml_dtypes, numcodecs or matplotlib (checked in a fresh interpreter through ``sys.modules``);
- errors carry their kind (conflicts, closed writer, LookupError for unknown references);
- array paths are built and parsed in one place; the bounded window completes in order and stays bounded;
- names users import from the old paths still import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import ucp_store
from ucp_store import errors as E
from ucp_store.io.location import array_checkpoint, array_path
from ucp_store.io.window import FutureWindow, prefetch

HEAVY = ("torch", "tensorstore", "zarr", "ml_dtypes", "numcodecs", "matplotlib")


@pytest.fixture
def filled(store_path):
    store = ucp_store.open_store(str(store_path), create=True)
    store.save("r", 1, {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, objects={"cfg": {"lr": 0.1}})
    store.save("r", 2, {"w": torch.ones(3, 4)})
    store.tag("r@1", "best")
    return store_path


def test_catalog_only_paths_import_no_heavy_module(filled):
    code = f"""
import json, sys
import ucp_store
store = ucp_store.open_store({str(filled)!r})
out = {{}}
out["runs"] = store.runs()
out["list"] = [c["id"] for c in store.list_checkpoints("r")]
ck = store.checkpoint("r:best")
man = ck.manifest()
out["tensors"] = [t["name"] for t in man["tensors"]]
out["objects"] = ck.objects()
out["query"] = store.query("select count(*) from tensors")[1]
out["victims"] = store.retention_victims("r", keep_last=1, keep_tagged=False)
out["gc"] = store.gc(dry_run=True, keep_last=1).to_json()
store.tag("r@2", "latest-good")
store.untag("r", "latest-good")
out["heavy"] = [m for m in {HEAVY!r} if m in sys.modules]
print(json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["heavy"] == []
    assert out["tensors"] == ["w"]
    assert out["objects"] == {"cfg": {"lr": 0.1}}
    assert out["query"] == [[2]]
    assert len(out["victims"]) == 1 and out["gc"]["dry_run"] is True
    assert out["gc"]["removed_checkpoints"] == []  # r@1 is tagged: kept


def test_import_ucp_store_loads_names_lazily():
    code = ("import sys, ucp_store; before = sorted(m for m in sys.modules if m.startswith('ucp_store.'));"
            "ucp_store.Topology; ucp_store.Checkpoint; ucp_store.load_shard; print(before)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"
    assert ucp_store.Topology is __import__("ucp_store.topology", fromlist=["Topology"]).Topology
    assert ucp_store.load_shard is __import__("ucp_store.io.read", fromlist=["load_shard"]).load_shard


def test_zarr_learns_bfloat16_after_a_lazy_import(filled):
    code = ("import ucp_store, sys; assert 'zarr' not in sys.modules; import zarr, numpy as np, ml_dtypes;"
            "from zarr.core.dtype import get_data_type_from_native_dtype as f;"
            "print(f(np.dtype(ml_dtypes.bfloat16)).to_json(zarr_format=3))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "bfloat16" in res.stdout


def test_public_import_paths():
    from ucp_store.catalog import read_only_query as q2
    from ucp_store.registry.retention import GcReport
    from ucp_store.save.writer import layer_of as _layer_of
    from ucp_store.store import open_store, read_only_query

    assert read_only_query is q2 and callable(open_store)
    assert GcReport().to_json()["dry_run"] is False
    assert _layer_of({"kind": "replicated", "placement": {"layer": 3}}) == 3
    assert _layer_of(None) is None


def test_errors_by_kind(store_path):
    store = ucp_store.open_store(str(store_path), create=True)
    store.save("r", 1, {"w": torch.zeros(2)})
    with pytest.raises(E.StepCommittedError, match="already has a committed checkpoint at step 1"):
        store.begin("r", 1)
    store.save("r", 2, {"w": torch.ones(2)})
    store.tag("r@1", "t")
    with pytest.raises(E.TagInUseError, match="already names"):
        store.tag("r@2", "t")
    with pytest.raises(E.TaggedCheckpointError, match="is tagged t"):
        store.rm("r@1")
    with pytest.raises(LookupError):
        store.resolve("r@7")
    with pytest.raises(E.ReferenceNotFound):
        store.checkpoint("nope@1")
    w = store.begin("r", 3)
    w.write("a", "weight", torch.zeros(2))
    with pytest.raises(E.DuplicateEntryError, match="already written"):
        w.write("a", "weight", torch.zeros(2))
    w.commit()
    with pytest.raises(E.WriterClosedError, match="closed"):
        w.write("b", "weight", torch.zeros(2))
    joined = store.join(store.begin("r", 4).id)
    with pytest.raises(E.WriterClosedError, match="only the process that began"):
        joined.commit()
    with pytest.raises(E.QueryError, match="query failed"):
        store.query("delete from tensors")
    with pytest.raises(E.ConfigurationError, match="compression 'lz9' is unknown"):
        ucp_store.open_store(str(store_path / "other"), create=True, compression="lz9")
    for cls in (E.StepCommittedError, E.TagInUseError, E.CommitRaceError, E.WriterClosedError, E.QueryError):
        assert issubclass(cls, E.UcpError)


def test_commit_race_is_a_conflict(store_path):
    a = ucp_store.open_store(str(store_path), create=True)
    w1 = a.begin("r", 5)
    w1.write("x", "weight", torch.zeros(3))
    w2 = a.begin("r", 5)  # nothing committed at step 5 yet: both may begin
    w2.write("x", "weight", torch.ones(3))
    w1.commit()
    with pytest.raises(E.CommitRaceError, match="committed meanwhile"):
        w2.commit()
    assert [c["step"] for c in a.list_checkpoints("r")] == [5]


def test_array_paths_round_trip_and_refuse_foreign_paths():
    rel = array_path("ck1", "a2")
    assert rel == "arrays/ck1/a2.zarr" and array_checkpoint(rel) == "ck1"
    with pytest.raises(E.InvalidNameError, match="not of the form"):
        array_checkpoint("other/ck1/a2.zarr")


class _Future:
    def __init__(self, value, log, fail=False):
        self.value, self.log, self.fail = value, log, fail

    def result(self):
        self.log.append(self.value)
        if self.fail:
            raise ValueError(f"boom {self.value}")
        return self.value


def test_future_window_is_bounded_and_in_order():
    log: list = []
    done: list = []
    win: FutureWindow = FutureWindow(100, lambda f, item: done.append((f.result(), item)))
    for i in range(5):
        win.submit(_Future(i, log), 40, f"item{i}")
        assert win.bytes <= 100
    assert done == [(0, "item0"), (1, "item1"), (2, "item2")]
    win.drain()
    assert [v for v, _ in done] == [0, 1, 2, 3, 4] and win.bytes == 0 and len(win) == 0
    win.submit(_Future(9, log, fail=True), 10, "bad")
    win.submit(_Future(10, log), 10, "ok")
    win.cancel()  # errors dropped, every future waited for
    assert log[-2:] == [9, 10] and win.bytes == 0


def test_prefetch_bounds_read_ahead_and_reraises():
    produced: list[int] = []
    consumed: list[int] = []

    def gen():
        for i in range(20):
            produced.append(i)
            yield np.zeros(10, np.uint8)  # 10 bytes each

    it = prefetch(gen(), nbytes=lambda a: a.nbytes, max_bytes=30, max_items=64)
    for k, _ in enumerate(it):
        time.sleep(0.01)
        consumed.append(k)
        assert len(produced) - len(consumed) <= 4  # 3 buffered + 1 waiting for room
    assert consumed == list(range(20))

    def failing():
        yield 1
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        list(prefetch(failing(), nbytes=lambda _: 1))
    # closing early stops the worker thread
    g = prefetch(iter(range(10_000)), nbytes=lambda _: 1, max_items=2)
    next(g)
    g.close()
    time.sleep(0.2)
    assert not any(t.name == "ucp-prefetch" and t.is_alive() for t in threading.enumerate())
