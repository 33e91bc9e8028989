"""Pattern classes answer ``layer`` and ``split_dims``; chunking and ``ucp plan`` read them instead of raw dicts."""

from __future__ import annotations

import pytest

from ucp_store.io.chunking import choose_chunking, split_dims_for_pattern
from ucp_store.patterns import Expert, Fused, Partitioned, Placement, Replicated, Vocab, parse_pattern


@pytest.mark.parametrize("record, dims, edges", [
    ({"kind": "replicated"}, (), {}),
    ({"kind": "averaged", "max_deviation": 0.5}, (), {}),
    ({"kind": "partitioned", "dim": 1}, (1,), {1: frozenset()}),
    ({"kind": "vocab", "dim": 0, "original_size": 50}, (0,), {0: frozenset()}),
    ({"kind": "fused", "dim": 0, "sizes": [8, 4, 4]}, (0,), {0: frozenset({8, 12})}),
    ({"kind": "expert", "dim": 0, "num_experts": 4, "inner": {"kind": "partitioned", "dim": 0}}, (0, 1),
     {0: frozenset(), 1: frozenset()}),
    ({"kind": "expert", "dim": 1, "num_experts": 4, "inner": {"kind": "fused", "dim": 1, "sizes": [2, 6]}}, (1, 2),
     {1: frozenset(), 2: frozenset({2})}),
    ({"kind": "expert", "dim": 2, "num_experts": 4, "inner": {"kind": "partitioned", "dim": 0}}, (0, 2),
     {0: frozenset(), 2: frozenset()}),
    ({"kind": "expert", "dim": 0, "num_experts": 4}, (0,), {0: frozenset()}),
])
def test_split_dims_and_edges(record, dims, edges):
    p = parse_pattern(record)
    assert p.split_dims == dims
    assert p.split_edges() == edges
    # chunking's view is the same, as mutable sets
    assert split_dims_for_pattern(record, 3) == {d: set(e) for d, e in edges.items()}
    assert split_dims_for_pattern(p, 3) == {d: set(e) for d, e in edges.items()}


def test_split_dims_without_pattern():
    assert split_dims_for_pattern(None, 2) == {0: set()}
    assert split_dims_for_pattern({}, 2) == {0: set()}
    assert split_dims_for_pattern({"kind": "partitioned", "dim": 1}, 0) == {}


def test_layer_from_placement():
    assert Replicated().layer is None
    assert Partitioned(dim=0, placement=Placement(layer=7)).layer == 7
    assert Fused(dim=0, sizes=(2, 2), placement=Placement(stages=("first", "last"))).layer is None
    assert parse_pattern({"kind": "vocab", "original_size": 10, "placement": {"layer": 3}}).layer == 3
    assert parse_pattern({"kind": "expert", "num_experts": 2, "placement": {"layer": 0}}).layer == 0
    assert Vocab(original_size=5).layer is None
    assert Expert(num_experts=2, inner=Partitioned(dim=0, placement=None)).layer is None


def test_chunking_same_for_dict_and_class():
    rec = {"kind": "fused", "dim": 0, "sizes": [1536, 512, 512]}
    a = choose_chunking((2560, 1024), 2, pattern=rec)
    b = choose_chunking((2560, 1024), 2, pattern=parse_pattern(rec))
    assert a == b
    # the fused edges land on chunk boundaries
    assert 1536 % a.chunk_shape[0] == 0 and 2048 % a.chunk_shape[0] == 0


def test_infer_layers_reads_pattern_layer():
    from types import SimpleNamespace

    from ucp_store.cli.plan import infer_layers as _infer_layers

    infos = [SimpleNamespace(pattern={"kind": "partitioned", "dim": 0, "placement": {"layer": 5}}),
             SimpleNamespace(pattern={"kind": "replicated", "placement": {"stages": ["first", "last"]}}),
             SimpleNamespace(pattern=None)]
    assert _infer_layers(infos) == 6
    assert _infer_layers([SimpleNamespace(pattern=None)]) == 0
