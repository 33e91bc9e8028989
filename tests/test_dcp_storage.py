"""ucp_store as a storage backend of torch.distributed.checkpoint (issue 29).

One spawn of 2 gloo ranks (tests/dcp_storage_worker.py) runs the multi-rank scenarios CI can afford: the
representative subset of PyTorch's own DCP tests (tools/run_dcp_upstream_tests.py runs those themselves;
CI has no network to fetch them): save, load on the same mesh, load resharded, async_save with the thread
executor, non-tensor BYTE_IO values, bad inputs, and a torchtitan-style FSDP2 / TP loop resumed through
the backend. The single-process tests cover the reader over versions the backend did not write and the
coordinator's plan checks.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ucp_store import open_store
from ucp_store.errors import ConfigurationError, InvalidNameError, ReferenceNotFound, ShapeMismatch
from ucp_store.formats.dcp.storage import UcpStorageReader, UcpStorageWriter, _plan_keys

from ucp_test_helpers import REPO, run_python

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SCENARIOS = ["save", "load_same", "load_tp", "async_thread", "async_process", "bad"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    base = tmp_path_factory.mktemp("dcp_storage")
    spec = {"world": 2, "out": str(base / "out"), "store": str(base / "store"), "dcp": str(base / "dcp"),
            "scenarios": SCENARIOS, "timeout": 200}
    proc = run_python([str(REPO / "tests" / "dcp_storage_worker.py"), json.dumps(spec)], timeout=240)
    results = []
    for r in range(2):
        path = base / "out" / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    assert proc.returncode == 0 and all(results), proc.stderr[-3000:]
    return base, results


def _ok(results, scenario):
    for r in results:
        assert "error" not in r[scenario], r[scenario]["error"]
    return [r[scenario] for r in results]


def test_save_lists_one_version_with_every_key(ranks):
    base, results = ranks
    _ok(results, "save")
    ck = open_store(str(base / "store")).checkpoint("r@2")
    states = {(i.name, i.state) for i in ck.tensors()}
    assert ("tok_embeddings.weight", "weight") in states and ("tok_embeddings.weight", "exp_avg") in states
    assert ("tok_embeddings.weight", "step") in states  # a 0-d optimizer tensor, written whole
    objs = ck.objects()
    index = objs["_dcp"]["keys"]
    assert index["model.tok_embeddings.weight"] == {"kind": "tensor", "name": "tok_embeddings.weight",
                                                    "state": "weight", "path": ["model", "tok_embeddings.weight"]}
    assert index["optim.state.tok_embeddings.weight.exp_avg"]["state"] == "exp_avg"
    # non-tensor values are DCP's bytes, never unpickled; each rank's own key is kept
    assert index["extras.note.tags"]["kind"] == "opaque" and index["extras.per_rank_1.rank"]["kind"] == "opaque"
    assert index["extras.counter"]["kind"] == "array" and index["extras.rng"]["kind"] == "array"
    raw = objs["extras.note.tags"].numpy().tobytes()
    assert torch.load(io.BytesIO(raw), weights_only=True) == ["a", "b"]


def test_load_same_mesh_equals_dcp_and_resumes_the_run(ranks):
    _, results = ranks
    for r in _ok(results, "load_same"):
        assert r["diffs"] == []
        assert r["note"] == {"step": 2, "tags": ["a", "b"]} and r["counter"] == 7
        # the resumed run's losses are the uninterrupted run's, exactly
        assert r["loss_ucp"] == r["uninterrupted"] == r["loss_dcp"]


def test_load_resharded_onto_tp_equals_dcp_bit_for_bit(ranks):
    _, results = ranks
    for r in _ok(results, "load_tp"):
        assert r["diffs"] == []
        assert r["loss_ucp"] == r["loss_dcp"]


def test_async_save_thread_holds_the_state_at_the_call(ranks):
    _, results = ranks
    for r in _ok(results, "async_thread"):
        assert r["wrong"] == []


def test_bad_inputs_name_the_problem_and_list_nothing(ranks):
    _, results = ranks
    for r in _ok(results, "bad"):
        assert r["missing_ref"].startswith("ReferenceNotFound") and "r@999" in r["missing_ref"]
        assert "InvalidNameError" in r["escaping_run"] and "'../evil'" in r["escaping_run"]
        assert "'../evil'" in r["escaping_id"]
        assert "Size mismatch" in r["shape"] and "model.tok_embeddings.weight" in r["shape"]
        assert "model.nope.weight" in r["missing_key"]
        assert "rank 1 cannot stage its shard" in r["rank_fails"]
        assert r["listed"] == ["aproc@1", "async@1", "r@2"] and r["pending_left"] == 0


def test_async_save_process_executor_holds_the_state_at_the_call(ranks):
    _, results = ranks
    for r in _ok(results, "async_process"):
        assert r["wrong"] == [] and r["objects"] == ["extras.note.rank0"]


@pytest.mark.parametrize("mode", ["hang", "exit"])
def test_a_dead_rank_fails_every_other_rank_within_the_writer_timeout(tmp_path, mode):
    """3 gloo ranks whose process group waits 10 minutes; the writer's timeout is 3 s. The last rank stops in
    write_data: the other two (the coordinator and a plain rank) get an error from dcp.save while it is still
    stuck (a hang would run into the harness's limit), and nothing is listed."""
    spec = {"world": 3, "out": str(tmp_path / "out"), "store": str(tmp_path / "store"), "scenarios": ["dead_rank"],
            "timeout": 120, "pg_timeout": 600, "writer_timeout": 3, "dead_mode": mode}
    proc = run_python([str(REPO / "tests" / "dcp_storage_worker.py"), json.dumps(spec)], timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(2):
        res = json.loads((tmp_path / "out" / f"rank{r}.json").read_text())["dead_rank"]
        assert res["error"] is not None, res
        assert not res["stuck_released_first"], res  # the error came while the stuck rank was still stuck
        assert res["listed"] == [], res


# ------------------------------------------------------------------------------------------ one process
def _store(tmp_path):
    return open_store(str(tmp_path / "s"), create=True)


def test_reader_serves_versions_saved_elsewhere_under_dcp_keys(tmp_path):
    """A version with DeepSpeed's states (fp32, exp_avg) loads with DCP under nested and flat keys."""
    st = _store(tmp_path)
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    m = torch.randn(6, 4)
    with st.begin("ds", 5) as wr:
        wr.write("layers.0.w", "fp32", w)
        wr.write("layers.0.w", "exp_avg", m)
    nested = {"model": {"layers.0.w": torch.zeros(6, 4)},
              "optim": {"state": {"layers.0.w": {"exp_avg": torch.zeros(6, 4)}}}}
    dcp.load(nested, storage_reader=UcpStorageReader(st, "ds@5"), no_dist=True)
    assert torch.equal(nested["model"]["layers.0.w"], w)
    assert torch.equal(nested["optim"]["state"]["layers.0.w"]["exp_avg"], m)
    flat = {"layers.0.w": torch.zeros(3, 4), "optimizer": {"state": {"layers.0.w": {"exp_avg": torch.zeros(6, 4)}}}}
    flat["layers.0.w"] = torch.zeros(6, 4, dtype=torch.bfloat16)  # a cast on load, as DCP's reader casts
    dcp.load(flat, storage_reader=UcpStorageReader(st, "ds@latest"), no_dist=True)
    assert torch.equal(flat["layers.0.w"], w.to(torch.bfloat16))
    assert torch.equal(flat["optimizer"]["state"]["layers.0.w"]["exp_avg"], m)


def test_round_trip_one_process_and_import_dcp_agree(tmp_path):
    """A single-process save through the backend, and the same state saved by DCP and imported with
    ``ucp import dcp``, give the same tensor-states and load back the same."""
    from ucp_store.formats.dcp.adapter import import_dcp

    st = _store(tmp_path)
    sd = {"model": {"a.weight": torch.randn(5, 3), "b.bias": torch.randn(7)},
          "optim": {"state": {"a.weight": {"exp_avg": torch.randn(5, 3), "step": torch.tensor(3.0)}},
                    "param_groups": [{"lr": 0.1, "params": ["a.weight"]}]}}
    dcp.save(sd, storage_writer=UcpStorageWriter(st, run="one", step=1), no_dist=True)
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    imported = import_dcp(st, str(tmp_path / "dcp"), "imp", 1, progress=False)
    mine = st.checkpoint("one@1")
    assert {(i.name, i.state) for i in mine.tensors()} == {(i.name, i.state) for i in imported.tensors()}
    for i in mine.tensors():
        assert torch.equal(mine.read(i.name, i.state), imported.read(i.name, i.state))
    for ref in ("one@1", "imp@1"):
        back = {"model": {"a.weight": torch.zeros(5, 3), "b.bias": torch.zeros(7)},
                "optim": {"state": {"a.weight": {"exp_avg": torch.zeros(5, 3), "step": torch.tensor(0.0)}},
                          "param_groups": [{"lr": 0.0, "params": ["a.weight"]}]}}
        dcp.load(back, storage_reader=UcpStorageReader(st, ref), no_dist=True)
        assert torch.equal(back["model"]["a.weight"], sd["model"]["a.weight"])
        assert float(back["optim"]["state"]["a.weight"]["step"]) == 3.0
        assert back["optim"]["param_groups"][0]["lr"] == 0.1


def test_writer_bad_inputs(tmp_path):
    st = _store(tmp_path)
    with pytest.raises(InvalidNameError, match="'a/../b'"):
        UcpStorageWriter(st, run="a/../b", step=1)
    with pytest.raises(ReferenceNotFound, match="'nope@1'"):
        UcpStorageReader(st, "nope@1")
    with pytest.raises(Exception, match="no store at"):
        UcpStorageReader(str(tmp_path / "missing"), "r@1")
    sd = {"x": torch.zeros(2)}
    with pytest.raises(BaseException, match="needs run= and step="):
        dcp.save(sd, storage_writer=UcpStorageWriter(st), no_dist=True)
    dcp.save(sd, storage_writer=UcpStorageWriter(st, run="r", step=1), no_dist=True)
    with pytest.raises(BaseException, match="already has a committed checkpoint at step 1"):
        dcp.save(sd, storage_writer=UcpStorageWriter(st, run="r", step=1), no_dist=True)
    with pytest.raises(ConfigurationError, match="use_collectives"):
        UcpStorageWriter(st, run="r", step=2).set_up_storage_writer(True, rank=0, use_collectives=False)
    assert [c["step"] for c in st.list_checkpoints()] == [1]


def _item(key, offsets, sizes, size, dtype=torch.float32):
    return WriteItem(index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                 properties=TensorProperties(dtype=dtype), size=torch.Size(size)))


def test_global_plan_keeps_replicas_once_and_checks_tiling():
    paths = {"model.w": ("model", "w"), "model.b": ("model", "b")}  # DefaultSavePlanner's planner_data
    plans = [SavePlan([_item("model.w", [0, 0], [2, 4], [4, 4]), _item("model.b", [0], [4], [4])], planner_data=paths),
             SavePlan([_item("model.w", [2, 0], [2, 4], [4, 4]), _item("model.b", [0], [4], [4])], planner_data=paths)]
    keys, keep, _ = _plan_keys(plans)
    assert keys["model.w"].name == "w" and keys["model.w"].state == "weight"
    assert keys["model.w"].points() == {0: [2]}
    assert keep == {(0, 0): True, (0, 1): True, (1, 0): True, (1, 1): False}  # the replica once
    with pytest.raises(ShapeMismatch, match=r"'model.w'.*overlap"):
        _plan_keys([SavePlan([_item("model.w", [0, 0], [3, 4], [4, 4])]),
                    SavePlan([_item("model.w", [2, 0], [2, 4], [4, 4])])])
    with pytest.raises(ShapeMismatch, match=r"'model.w'.*4 elements lie in no rank's box"):
        _plan_keys([SavePlan([_item("model.w", [0, 0], [3, 4], [4, 4])]), SavePlan([])])
    with pytest.raises(ShapeMismatch, match=r"'model.w': rank 1 saves it as torch.float16\[4, 4\]"):
        _plan_keys([SavePlan([_item("model.w", [0, 0], [2, 4], [4, 4])]),
                    SavePlan([_item("model.w", [2, 0], [2, 4], [4, 4], torch.float16)])])


def test_index_keyed_optimizer_state_keeps_the_model_prefix():
    """An optimizer's own ``state_dict()`` keys its states by parameter number (torchtune saves
    ``{"model": ..., "optimizer": optimizer.state_dict()}``): those numbers name no parameter, yet the sharded
    ``model.*`` tensors are still model state (they were refused as "no model or optimizer state")."""
    paths = {"model.w": ("model", "w"), "optimizer.state.0.exp_avg": ("optimizer", "state", 0, "exp_avg")}
    plans = [SavePlan([_item("model.w", [0, 0], [2, 4], [4, 4]), _item("optimizer.state.0.exp_avg", [0, 0], [2, 4],
                                                                      [4, 4])], planner_data=paths),
             SavePlan([_item("model.w", [2, 0], [2, 4], [4, 4]), _item("optimizer.state.0.exp_avg", [2, 0], [2, 4],
                                                                      [4, 4])], planner_data=paths)]
    keys, _, _ = _plan_keys(plans)
    assert (keys["model.w"].name, keys["model.w"].state) == ("w", "weight")
    opt = keys["optimizer.state.0.exp_avg"]
    assert (opt.name, opt.state, opt.points()) == ("0", "exp_avg", {0: [2]})


@pytest.mark.parametrize("split", [0, 1])
def test_chunks_follow_row_and_column_splits(tmp_path, split):
    """An FSDP Shard(0) save loaded by TP Shard(1), and the reverse: a half of either dim is whole chunks
    (read amplification 1), and the chunks are not cut below the store's target for it."""
    import math

    shape = [1024, 2048]
    half = [n // 2 if d == split else n for d, n in enumerate(shape)]
    second = [n // 2 if d == split else 0 for d, n in enumerate(shape)]
    plans = [SavePlan([_item("model.w", [0, 0], half, shape)]), SavePlan([_item("model.w", second, half, shape)])]
    st = _store(tmp_path)
    keys, _, _ = _plan_keys(plans, st.settings["chunk_target_bytes"])
    w = st.begin("r", 1)
    try:
        w.open_regions([keys["model.w"].region()])
        chunk = w.shards.sharded[(keys["model.w"].name, keys["model.w"].state)][2].chunk_shape
    finally:
        w.abort()
    assert all((n // 2) % c == 0 for n, c in zip(shape, chunk)), chunk
    assert math.prod(chunk) * 4 == st.settings["chunk_target_bytes"], chunk


def test_a_folder_store_is_opened_once_per_process_and_afresh_when_remade(tmp_path):
    """Writers and readers built from a folder share one open Store (a loop makes one per dcp.save); a store
    removed and created again at the same folder is opened afresh, so nothing reaches the old catalog."""
    import shutil

    path = str(tmp_path / "s")
    open_store(path, create=True)
    sd = {"x": torch.arange(4.0)}
    w1, w2 = UcpStorageWriter(path, run="r", step=1), UcpStorageWriter(path, run="r", step=2)
    dcp.save(sd, storage_writer=w1, no_dist=True)
    dcp.save(sd, storage_writer=w2, no_dist=True)
    assert w1.store is w2.store
    assert UcpStorageReader(path, "r@2").store is w1.store
    shutil.rmtree(path)
    open_store(path, create=True)
    w3 = UcpStorageWriter(path, run="r", step=1)
    dcp.save(sd, storage_writer=w3, no_dist=True)  # step 1 again: a new catalog, not the removed one
    assert w3.store is not w1.store
    assert [c["step"] for c in open_store(path).list_checkpoints("r")] == [1]
