"""Listings in model order and "the" state of a tensor (issue 37).

Positions follow the caller's state dict (or source file) with each tensor's states together, on every save
path: ``ucp_store.distributed`` (one process here; 4 gloo ranks in tests/test_dist.py), the DCP storage backend
(one process here; 2 ranks in tests/test_dcp_storage.py), and the imports (DCP, torch file). One rule picks the
state a listing or picture shows: fp32, weight, the largest, never a 0-d state when a larger one exists.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ucp_store
from ucp_store.records import TensorInfo, main_state, merge_orders, model_order

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _info(name: str, state: str, shape: tuple, nbytes: int, position: int = 0) -> TensorInfo:
    return TensorInfo(name, state, shape, "float32", None, shape, shape, "a", "id", nbytes=nbytes, position=position)


def _grouped(keys: list[tuple[str, str]]) -> bool:
    """Each name's states are one run of the list."""
    runs = [n for i, (n, _) in enumerate(keys) if i == 0 or keys[i - 1][0] != n]
    return len(runs) == len(set(runs))


def test_model_order_groups_each_tensors_states_in_first_appearance_order():
    keys = [("b", "weight"), ("a", "weight"), ("b", "exp_avg"), ("a", "exp_avg"), ("b", "step"), ("a", "step")]
    assert list(model_order(keys)) == [("b", "weight"), ("b", "exp_avg"), ("b", "step"),
                                       ("a", "weight"), ("a", "exp_avg"), ("a", "step")]
    assert list(model_order(keys).values()) == [1, 2, 3, 4, 5, 6]


def test_merge_orders_keeps_the_first_and_places_the_others_after_their_predecessors():
    same = [("a", "w"), ("b", "w"), ("c", "w")]
    assert merge_orders([same, list(same), list(same)]) == same
    # pipeline stages: disjoint keys follow one another
    assert merge_orders([[("a", "w"), ("b", "w")], [("c", "w"), ("d", "w")]]) == [("a", "w"), ("b", "w"),
                                                                                    ("c", "w"), ("d", "w")]
    # a key only rank 1 holds goes right after its predecessor in rank 1's order
    assert merge_orders([[("a", "w"), ("c", "w")], [("a", "w"), ("b", "w"), ("c", "w")]]) == [
        ("a", "w"), ("b", "w"), ("c", "w")]
    assert merge_orders([]) == []


def test_main_state_rule():
    step = _info("w", "step", (), 4, 1)
    big = _info("w", "exp_avg", (8, 4), 128, 2)
    sq = _info("w", "exp_avg_sq", (8, 4), 128, 3)
    weight = _info("w", "weight", (8, 4), 64, 4)
    fp32 = _info("w", "fp32", (8, 4), 128, 5)
    assert main_state([step, big, sq, weight, fp32]) is fp32
    assert main_state([step, big, sq, weight]) is weight
    assert main_state([step, big, sq]) is big  # the largest, the first by position on a tie
    assert main_state([step, _info("w", "tiny", (1,), 4, 9)]).state == "tiny"  # never the 0-d one
    assert main_state([step]) is step
    zero_d_weight = _info("w", "weight", (), 4, 1)
    assert main_state([zero_d_weight, big]) is big  # a 0-d weight loses to a state with dimensions
    with pytest.raises(ValueError):
        main_state([])


def _state_dict():
    """A training state dict whose order is not the names' sorted order (b before a)."""
    model = {"b.weight": torch.randn(6, 4), "a.weight": torch.randn(3, 4), "a.bias": torch.randn(3)}
    state = {k: {"step": torch.tensor(2.0), "exp_avg": torch.randn(*v.shape), "exp_avg_sq": torch.rand(*v.shape)}
             for k, v in model.items()}
    return {"model": model, "optim": {"state": state, "param_groups": [{"lr": 0.1, "params": list(model)}]}}


EXPECTED = [(n, s) for n in ("b.weight", "a.weight", "a.bias") for s in ("weight", "step", "exp_avg", "exp_avg_sq")]


def _listed(ck) -> list[tuple[str, str]]:
    return [(i.name, i.state) for i in ck.tensors()]


def test_distributed_save_one_process_lists_the_state_dict_order(tmp_path):
    import ucp_store.distributed as ucpd

    ucpd.save(_state_dict(), store=tmp_path / "s", run="r", step=1, progress=False)
    ck = ucp_store.open_store(str(tmp_path / "s")).checkpoint("r@1")
    assert _listed(ck) == EXPECTED
    assert ck.info("b.weight").state == "weight"  # the one rule, not the first row (its step)


def test_dcp_backend_and_dcp_import_list_the_state_dict_order(tmp_path):
    from ucp_store.formats.dcp.adapter import import_dcp
    from ucp_store.formats.dcp.storage import UcpStorageWriter

    st = ucp_store.open_store(str(tmp_path / "s"), create=True)
    sd = _state_dict()
    dcp.save(sd, storage_writer=UcpStorageWriter(st, run="backend", step=1), no_dist=True)
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    imported = import_dcp(st, str(tmp_path / "dcp"), "imported", 1, progress=False)
    backend = st.checkpoint("backend@1")
    assert _listed(backend) == EXPECTED
    assert _listed(imported) == EXPECTED
    assert _grouped(_listed(backend))


def test_torch_file_import_lists_the_file_order(tmp_path, ucp):
    from ucp_store.formats.torch_file import import_torch_file

    path = tmp_path / "m.pt"
    torch.save({"z.weight": torch.randn(3), "m.weight": torch.randn(2), "a.weight": torch.randn(4)}, path)
    st = ucp_store.open_store(str(tmp_path / "s"), create=True)
    ck = import_torch_file(st, str(path), "t", 1, progress=False)
    assert [n for n, _ in _listed(ck)] == ["z.weight", "m.weight", "a.weight"]


def test_show_stats_diff_and_read_list_in_model_order(tmp_path, ucp):
    import ucp_store.distributed as ucpd

    sd = _state_dict()
    ucpd.save(sd, store=tmp_path / "s", run="r", step=1, progress=False)
    sd["model"]["a.bias"] += 1
    ucpd.save(sd, store=tmp_path / "s", run="r", step=2, progress=False)
    store = tmp_path / "s"
    rc, out, err = ucp("--store", store, "show", "r@1", "--json")
    assert rc == 0, err
    assert [(t["name"], t["state"]) for t in json.loads(out)["tensors"]] == EXPECTED
    rc, out, err = ucp("--store", store, "diff", "r@1", "r@2", "--json")
    assert rc == 0, err
    assert [(t["name"], t["state"]) for t in json.loads(out)] == EXPECTED
    rc, out, err = ucp("--store", store, "stats", "r@1", "--json")
    assert rc == 0, err
    assert [(t["name"], t["state"]) for t in json.loads(out)] == EXPECTED
    rc, out, err = ucp("--store", store, "read", "r@1", "b.weight", "--json")  # the default state: weight
    assert rc == 0, err
    doc = json.loads(out)
    assert (doc["state"], doc["shape"]) == ("weight", [6, 4])
