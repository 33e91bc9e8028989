"""Issue 9, part A: the adapter interface after the split (sources, groups, read-ahead, sinks, placement).

DeepSpeed end to end (real checkpoints under torchrun) is tests/deepspeed/; these tests pin the shared
pieces every source now goes through.
"""

from __future__ import annotations

import pytest
import torch

import ucp_store
from ucp_store.deepspeed.files import pipeline_placement
from ucp_store.deepspeed.merge import with_placement
from ucp_store.deepspeed.universal import UniversalSink
from ucp_store.formats.base import Sink, Source, TensorRecord, import_source, merge_objects, write_records
from ucp_store.formats.torch_file import TorchFileSink, TorchFileSource
from ucp_store.patterns import Partitioned, parse_pattern


class ListSource:
    """A source over an in-memory list of groups (the smallest thing that satisfies ``Source``)."""

    kind = "test"

    def __init__(self, groups, *, prefetch=False, fail_after=None):
        self.groups = groups
        self.prefetch = prefetch
        self.fail_after = fail_after
        self.total = len(groups)
        self.seen = 0

    def describe(self):
        return "list"

    def provenance(self):
        return {"source_kind": self.kind, "source_path": "/dev/null"}

    def records(self):
        for g in self.groups:
            if self.fail_after is not None and self.seen >= self.fail_after:
                raise RuntimeError("source broke mid-way")
            self.seen += 1
            yield g

    def objects(self):
        return {"seen": self.seen}


def _groups(n=6):
    out = []
    for i in range(n):
        w = torch.full((4, 8), float(i))
        out.append((TensorRecord(f"l{i}.w", "fp32", w, pattern=Partitioned(dim=0).to_json()),
                    TensorRecord(f"l{i}.w", "exp_avg", w * 2)))
    return out


@pytest.mark.parametrize("prefetch", [False, True])
def test_import_source_writes_groups_with_and_without_read_ahead(store_path, prefetch):
    store = ucp_store.open_store(str(store_path), create=True)
    src = ListSource(_groups(), prefetch=prefetch)
    assert isinstance(src, Source)
    ck = store.checkpoint(import_source(store, src, "r", 1, progress=False))
    assert [(i.name, i.state) for i in ck.tensors()] == [(f"l{i}.w", s) for i in range(6) for s in ("fp32", "exp_avg")]
    for i in range(6):
        assert torch.equal(ck.read(f"l{i}.w", "exp_avg"), torch.full((4, 8), 2.0 * i))
    assert ck.info("l3.w", "fp32").pattern == {"kind": "partitioned", "dim": 0}
    assert ck.objects() == {"seen": 6}
    assert ck.provenance["source_kind"] == "test"


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_failing_source_lists_nothing(store_path, prefetch):
    store = ucp_store.open_store(str(store_path), create=True)
    with pytest.raises(RuntimeError, match="source broke"):
        import_source(store, ListSource(_groups(), prefetch=prefetch, fail_after=3), "r", 1, progress=False)
    assert store.list_checkpoints(include_pending=True) == []
    assert store.runs() == []


class CountingWriter:
    def __init__(self):
        self.log = []

    def write(self, name, state, tensor, *, pattern=None, position=None):
        self.log.append((name, state))

    def flush(self):
        self.log.append("flush")


def test_write_records_never_flushes_inside_a_group():
    w = CountingWriter()
    # each group is 2 x 128 bytes; a 100-byte budget flushes after every group, never between its states
    n = write_records(w, _groups(3), inflight_bytes=100)
    assert n == 3 * 2 * 128
    assert w.log == [("l0.w", "fp32"), ("l0.w", "exp_avg"), "flush", ("l1.w", "fp32"), ("l1.w", "exp_avg"), "flush",
                     ("l2.w", "fp32"), ("l2.w", "exp_avg"), "flush"]


def test_merge_objects_merges_shares_in_rank_order_and_never_picks_a_rank():
    # a partitioned source's dict shares merge in rank order; an entry that differs is no share (per rank)
    merged = merge_objects([{"meta": {"a": 1, "b": 2}, "cfg": 1}, {"meta": {"c": 3, "a": 1}, "cfg": 1, "x": 5}],
                           partitioned=True)
    assert merged == {"meta": {"a": 1, "b": 2, "c": 3}, "cfg": 1, "x": 5}
    assert list(merged["meta"]) == ["a", "b", "c"]
    clash = merge_objects([{"meta": {"a": 1}}, {"meta": {"a": 9}}], partitioned=True)
    assert "meta" not in clash and clash["ucp/per_rank"]["keys"][0]["text"] == "meta"


def test_pipeline_placement_one_home():
    # tied on the first and last stage of 4
    assert pipeline_placement("0.embed.weight", {0, 3}, 4, layered=True) == {"stages": ["first", "last"]}
    assert pipeline_placement("x", {1, 2}, 4, layered=True) is None  # several middle stages: no label
    assert pipeline_placement("7.mlp.weight", {2}, 4, layered=True) == {"layer": 7}
    assert pipeline_placement("7.mlp.weight", {2}, 4, layered=False) is None
    assert pipeline_placement("final_norm.weight", {3}, 4, layered=True) is None
    # the record is a valid pattern placement once attached
    rec = with_placement(None, pipeline_placement("5.attn.weight", {1}, 2, layered=True))
    assert rec == {"kind": "replicated", "placement": {"layer": 5}}
    assert parse_pattern(rec).layer == 5


def test_sinks_share_one_shape(store_path, tmp_path):
    store = ucp_store.open_store(str(store_path), create=True)
    ck = store.save("r", 1, {"a": torch.arange(6.0), "b": torch.ones(2, 3)})
    sink = TorchFileSink()
    assert isinstance(sink, Sink) and isinstance(UniversalSink(), Sink)
    out = sink.write(ck, str(tmp_path / "w.pt"))
    assert out == {"kind": "torch_file", "path": str(tmp_path / "w.pt"), "tensors": 2}
    back = torch.load(tmp_path / "w.pt", weights_only=True)
    assert torch.equal(back["a"], torch.arange(6.0)) and torch.equal(back["b"], torch.ones(2, 3))
    # and a torch file comes back in through its Source
    src = TorchFileSource(str(tmp_path / "w.pt"))
    ck2 = store.checkpoint(import_source(store, src, "r2", 1, progress=False, distributed=False))
    assert torch.equal(ck2.read("a", "weight"), torch.arange(6.0))
