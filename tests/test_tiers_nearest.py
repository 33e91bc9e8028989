"""A restore's choices (issue 38, restore side): which copy each needed object comes from (``tiers/nearest.py``)
and which objects a plan's boxes touch (``distributed/restore.array_keys``), checked against brute force."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_store.distributed.restore import array_keys
from ucp_store.io.format import ArrayLayout
from ucp_store.tiers import nearest

F, D = "fast", "durable"


def test_a_lost_nodes_object_comes_from_the_surviving_replica_and_each_node_fetches_it_once():
    copies = {"a": [[F, "n0", "aa", 10], [F, "n1", "aa", 10]],  # n1 lost: only n0 holds it
              "b": [[F, "n1", "bb", 7], [F, "n2", "bb", 7]]}
    wants = [("n0", []), ("n0", []), ("n2", ["a"]), ("n2", ["a"])]  # both ranks of n2 need "a"
    plan, lost = nearest.assign(wants, copies)
    assert lost == []
    assert [p.recv for p in plan] == [[], [], [["a", 0, "n0", 10, "aa"]], []]  # one receiver on n2
    assert plan[0].send == [["a", 2, 10]] and plan[1].send == [] and not any(p.durable for p in plan)


def test_senders_and_receivers_are_spread_by_bytes():
    copies = {k: [[F, "n0", k, 100], [F, "n9", k, 100]] for k in "abcd"}
    plan, _ = nearest.assign([("n0", []), ("n0", []), ("n1", list("abcd")), ("n1", list("abcd"))], copies)
    assert sorted(len(p.send) for p in plan[:2]) == [2, 2]
    assert sorted(len(p.recv) for p in plan[2:]) == [2, 2]


def test_bad_copies_are_skipped_then_the_durable_tier_then_nothing():
    copies = {"a": [[F, "n0", "aa", 3], [F, "n1", "aa", 3], [D, "", "aa", 3]]}
    wants = [("n0", []), ("n1", []), ("n2", ["a"])]
    plan, _ = nearest.assign(wants, copies, bad=[("a", "n0")])
    assert plan[1].send == [["a", 2, 3]]
    plan, _ = nearest.assign(wants, copies, bad=[("a", "n0"), ("a", "n1")])
    assert plan[2].durable == [["a", 3, "aa"]] and not plan[0].send and not plan[1].send
    plan, lost = nearest.assign(wants, copies, bad=[("a", "n0"), ("a", "n1"), ("a", "")])
    assert len(lost) == 1 and lost[0].startswith("a: no good copy") and not plan[2].durable


def test_a_node_never_takes_its_own_copy_from_itself_and_an_unplaced_object_comes_from_where_the_store_keeps_it():
    copies = {"a": [[F, "n0", "aa", 3]]}
    plan, lost = nearest.assign([("n0", ["a", "x"])], copies)
    assert lost and lost[0].startswith("a:")  # n0's own copy was found bad (it asked), no other
    assert plan[0].durable == [["x", None, None]]


def test_unreachable_names_objects_without_a_surviving_or_durable_copy():
    copies = {"a": [[F, "n0"], [F, "n1"]], "b": [[F, "n1"], [D, ""]], "c": [[F, "n2"]]}
    assert nearest.unreachable(copies, ["n1"]) == ["c"]
    assert nearest.unreachable(copies, ["n2"]) == ["a"]
    assert nearest.unreachable(copies, []) == ["a", "c"]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_array_keys_are_the_shard_files_of_the_chunks_a_box_touches(data):
    nd = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.integers(1, 12)) for _ in range(nd))
    chunk = tuple(data.draw(st.integers(1, s)) for s in shape)
    shard = tuple(c * data.draw(st.integers(1, 3)) for c in chunk)
    layout = ArrayLayout("float32", shape, chunk, shard)
    box = []
    for s in shape:
        lo = data.draw(st.integers(0, s))
        box.append((lo, data.draw(st.integers(lo, s))))
    want: set[str] = set()
    if all(hi > lo for lo, hi in box):
        for ci in itertools.product(*[range(lo // c, (hi - 1) // c + 1) for (lo, hi), c in zip(box, chunk)]):
            want.add(f"A/{layout.shard_key(ci)}")
    assert array_keys("A", layout, [box]) == want


def test_a_scalar_array_is_one_object():
    assert array_keys("A", ArrayLayout("float32", (), (), ()), [()]) == {"A/c"}


def test_a_store_in_host_memory_reads_through_the_local_path(tmp_path):
    """A fast tier under /dev/shm (tmpfs) refuses preadv2's RWF_NOWAIT (EOPNOTSUPP): the local read path then
    reads blocking instead of failing the load."""
    import os
    import shutil
    import uuid

    import pytest
    import torch

    from ucp_store.distributed import load, save

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    root = f"/dev/shm/ucp-test-{uuid.uuid4().hex[:8]}"
    try:
        sd = {"model": {"w": torch.randn(300, 70)}, "n": 3}
        save(sd, store=root, run="a", step=1, progress=False)
        out = {"model": {"w": torch.zeros(300, 70)}, "n": 0}
        load(out, store=root, ref="a@1", progress=False)
        assert torch.equal(out["model"]["w"], sd["model"]["w"]) and out["n"] == 3
    finally:
        shutil.rmtree(root, ignore_errors=True)
