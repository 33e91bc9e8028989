"""Pattern algebra: parsing, errors, flat-range decomposition, ZeRO partitions, and the forward/inverse
maps checked against an independent numpy reference on random patterns and topologies (hypothesis)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ucp_store.errors import PatternError, TopologyError
from ucp_store.patterns import (
    Box,
    FlatRange,
    Fragment,
    average_replicas,
    canonical_names,
    check_pattern,
    flat_range_to_boxes,
    fragment_layout,
    fragment_writer_copies,
    holds,
    is_writer,
    local_layout,
    parse_pattern,
    placement_stages,
    split_contiguous,
    stage_local_name,
    tp_layout,
    validate_pattern_record,
    writer_copies,
    zero_group_layout,
)
from ucp_store.patterns.parse import parse_record
from ucp_store.topology import AXES, Topology

TPS = (1, 2, 3, 4, 8)
LAYERS = 4
SENTINEL = -1


# ---------------------------------------------------------------------- independent reference
def _cuts(widths):
    return np.cumsum(widths)[:-1].tolist()


def ref_local(pj, x, tp, r, ep=1, er=0, vmult=1):
    """The TP/EP-local tensor, written with numpy split/concat only (no ucp_store code)."""
    kind = "replicated" if pj is None else pj["kind"]
    if kind in ("replicated", "averaged"):
        return x.copy()
    if kind == "partitioned":
        d = pj["dim"]
        w = pj.get("widths", {}).get(str(tp)) or [x.shape[d] // tp] * tp
        return np.split(x, _cuts(w), axis=d)[r]
    if kind == "vocab":
        d, n = pj.get("dim", 0), x.shape[pj.get("dim", 0)]
        m = vmult * tp
        pad = list(x.shape)
        pad[d] = -(-n // m) * m - n
        return np.split(np.concatenate([x, np.zeros(pad, x.dtype)], axis=d), tp, axis=d)[r]
    if kind == "fused":
        d, sizes = pj["dim"], pj["sizes"]
        ws = pj.get("widths", {}).get(str(tp)) or [[s // tp] * tp for s in sizes]
        subs = np.split(x, _cuts(sizes), axis=d)
        return np.concatenate([np.split(s, _cuts(w), axis=d)[r] for s, w in zip(subs, ws)], axis=d)
    if kind == "expert":
        e = pj.get("dim", 0)
        mine = np.split(x, ep, axis=e)[er]
        parts = [ref_local(pj.get("inner"), np.take(mine, i, axis=e), tp, r, vmult=vmult)
                 for i in range(mine.shape[e])]
        return np.stack(parts, axis=e)
    raise AssertionError(kind)


def ref_zero_partition(tensors, world, zrank, stage, alignment=2, param_alignment=1):
    """DeepSpeed's flat partition of a group, transcribed (stage_1_and_2 / partition_parameters)."""
    if stage == 3:
        parts = []
        for t in tensors:
            f = t.ravel()
            p = -(-f.size // world)
            f = np.concatenate([f, np.zeros(p * world - f.size, f.dtype)])
            parts.append(f[zrank * p:(zrank + 1) * p])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)
    flat, n = [], 0
    for i, t in enumerate(tensors):
        flat.append(t.ravel())
        n += t.size
        if i < len(tensors) - 1:
            pad = (-n) % param_alignment
            flat.append(np.zeros(pad, t.dtype))
            n += pad
    unit = alignment * world
    flat.append(np.zeros(-(-n // unit) * unit - n, np.int64))
    return np.split(np.concatenate(flat), world)[zrank]


def ref_zero_rank(t, rank, expert):
    c = t.coords(rank)
    group = [q for q in range(t.world_size) if t.coords(q)["tp"] == c["tp"] and t.coords(q)["pp"] == c["pp"]
             and (not expert or t.coords(q)["ep"] == c["ep"])]
    return group.index(rank), len(group)


# ---------------------------------------------------------------------- strategies
def composition(draw, n, parts):
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0] + cuts + [n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def widths_for(draw, n, tps):
    out = {}
    for tp in tps:
        if n % tp or draw(st.integers(0, 3)) == 0:
            out[str(tp)] = composition(draw, n, tp)
    return out


@st.composite
def placements(draw):
    which = draw(st.integers(0, 4))
    if which == 0:
        return None
    if which == 1:
        return {"stages": draw(st.sampled_from([["first"], ["last"], ["first", "last"]]))}
    return {"layer": draw(st.integers(0, LAYERS - 1))}


@st.composite
def pattern_and_shape(draw, tps, eps=(1,), kinds=None, inner=False):
    kinds = kinds or ["replicated", "averaged", "partitioned", "vocab", "fused", "expert"]
    kind = draw(st.sampled_from(kinds))
    if kind in ("replicated", "averaged"):
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        pj = {"kind": kind} if kind == "replicated" else {"kind": kind, "max_deviation": 0.5}
    elif kind == "partitioned":
        shape = list(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
        d = draw(st.integers(0, len(shape) - 1))
        shape[d] = draw(st.integers(0, 17))
        pj = {"kind": kind, "dim": d}
        w = widths_for(draw, shape[d], tps)
        if w:
            pj["widths"] = w
    elif kind == "vocab":
        shape = list(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
        d = draw(st.integers(0, len(shape) - 1))
        shape[d] = draw(st.integers(1, 21))
        pj = {"kind": kind, "dim": d, "original_size": shape[d]}
    elif kind == "fused":
        shape = list(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
        d = draw(st.integers(0, len(shape) - 1))
        sizes = draw(st.lists(st.integers(0, 9), min_size=1, max_size=4))
        shape[d] = sum(sizes)
        pj = {"kind": kind, "dim": d, "sizes": sizes}
        per_tp = {}
        for tp in tps:
            if any(s % tp for s in sizes) or draw(st.integers(0, 3)) == 0:
                per_tp[str(tp)] = [composition(draw, s, tp) for s in sizes]
        if per_tp:
            pj["widths"] = per_tp
    else:
        inner_pj, inner_shape = draw(pattern_and_shape(tps, kinds=["replicated", "partitioned", "fused", "vocab"],
                                                       inner=True))
        e = draw(st.integers(0, len(inner_shape)))
        n_exp = math.lcm(*eps) * draw(st.integers(1, 2))
        shape = tuple(inner_shape[:e]) + (n_exp,) + tuple(inner_shape[e:])
        pj = {"kind": "expert", "dim": e, "num_experts": n_exp, "inner": inner_pj}
    if not inner:
        pl = draw(placements())
        if pl is not None:
            pj["placement"] = pl
    return pj, tuple(shape)


@st.composite
def topologies(draw, max_world=48):
    tp = draw(st.sampled_from(TPS))
    dp = draw(st.sampled_from([1, 2, 3, 4]))
    ep = draw(st.sampled_from([d for d in (1, 2, 4) if dp % d == 0]))
    t = Topology(tp=tp, pp=draw(st.integers(1, 3)), dp=dp, sp=draw(st.sampled_from([1, 1, 2])), ep=ep,
                 zero_stage=draw(st.integers(0, 3)), layers=LAYERS, vocab_multiple=draw(st.sampled_from([1, 2, 4])),
                 order=tuple(draw(st.permutations(AXES))), zero_alignment=draw(st.sampled_from([1, 2, 4])),
                 zero_param_alignment=draw(st.sampled_from([1, 1, 8])))
    assume(t.world_size <= max_world)
    return t


# ---------------------------------------------------------------------- forward + inverse, one pattern
def build_local(pattern, x, t, rank):
    """A rank's TP-local tensor from the forward map: copies, then zero padding; nothing left unset."""
    lay = local_layout(pattern, x.shape, t, rank)
    out = np.full(lay.shape, SENTINEL, x.dtype)
    hits = np.zeros(lay.shape, np.int64)
    for c in lay.copies:
        assert c.logical.shape == c.local.shape
        out[c.local.slices()] = x[c.logical.slices()]
        hits[c.local.slices()] += 1
    for b in lay.padding:
        out[b.slices()] = 0
        hits[b.slices()] += 1
    assert (hits == 1).all(), "local copies and padding must tile the local tensor exactly"
    return out


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_forward_inverse_roundtrip_against_reference(data):
    src = data.draw(topologies(), label="source")
    tgt = data.draw(topologies(), label="target")
    eps = (src.ep, tgt.ep)
    pj, shape = data.draw(pattern_and_shape((src.tp, tgt.tp), eps), label="pattern")
    validate_pattern_record(pj)
    rng = np.random.default_rng(0)
    x = rng.integers(1, 1 << 40, size=shape, dtype=np.int64)

    # every source rank's shard from the forward map; it must equal the independent reference
    shards = {}
    for rank in range(src.world_size):
        c = src.coords(rank)
        shards[rank] = build_local(pj, x, src, rank)
        ref = ref_local(pj, x, src.tp, c["tp"], src.ep, c["ep"], src.vocab_multiple)
        assert shards[rank].shape == ref.shape and np.array_equal(shards[rank], ref)

    # reassemble through the inverse with the writer rule: every element exactly once
    out = np.full(shape, SENTINEL, np.int64)
    hits = np.zeros(shape, np.int64)
    for rank in range(src.world_size):
        for c in writer_copies(pj, shape, src, rank):
            out[c.logical.slices()] = shards[rank][c.local.slices()]
            hits[c.logical.slices()] += 1
    assert (hits == 1).all()
    assert np.array_equal(out, x)

    # the target layout of the reassembled tensor, against the reference
    for rank in range(tgt.world_size):
        c = tgt.coords(rank)
        got = build_local(pj, out, tgt, rank)
        assert np.array_equal(got, ref_local(pj, x, tgt.tp, c["tp"], tgt.ep, c["ep"], tgt.vocab_multiple))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_zero_fragments_roundtrip_against_reference(data):
    t = data.draw(topologies())
    assume(t.zero_stage > 0)
    params = data.draw(st.lists(pattern_and_shape((t.tp,), (t.ep,)), min_size=1, max_size=4), label="params")
    rng = np.random.default_rng(1)
    xs = [rng.integers(1, 1 << 40, size=shape, dtype=np.int64) for _, shape in params]
    out = [np.full(x.shape, SENTINEL, np.int64) for x in xs]
    hits = [np.zeros(x.shape, np.int64) for x in xs]
    for rank in range(t.world_size):
        stage = t.coords(rank)["pp"]
        for expert in (False, True):
            members = [i for i, (pj, _) in enumerate(params)
                       if (pj["kind"] == "expert") == expert and stage in placement_stages(pj, t)]
            if not members:
                continue
            locals_ = [build_local(params[i][0], xs[i], t, rank) for i in members]
            zrank, zworld = ref_zero_rank(t, rank, expert)
            assert (zrank, zworld) == (t.zero_rank(rank, expert), t.zero_world(expert))
            layout = zero_group_layout([a.size for a in locals_], zworld, t.zero_stage,
                                       alignment=t.zero_alignment, param_alignment=t.zero_param_alignment)
            buf = np.full(layout.partition_numel, SENTINEL, np.int64)
            cover = np.zeros(layout.partition_numel, np.int64)
            for index, frag in layout.fragments(zrank):
                i = members[index]
                pj, shape = params[i]
                fl = fragment_layout(pj, shape, t, rank, frag)
                base = frag.buffer_start
                for fc in fl.copies:
                    assert fc.flat.numel == fc.logical.numel
                    buf[base + fc.flat.start:base + fc.flat.stop] = xs[i][fc.logical.slices()].ravel()
                    cover[base + fc.flat.start:base + fc.flat.stop] += 1
                for pad in fl.padding:
                    buf[base + pad.start:base + pad.stop] = 0
                    cover[base + pad.start:base + pad.stop] += 1
                # inverse: the writer puts each fragment back
                for fc in fragment_writer_copies(pj, shape, t, rank, frag):
                    piece = buf[base + fc.flat.start:base + fc.flat.stop]
                    out[i][fc.logical.slices()] = piece.reshape(fc.logical.shape)
                    hits[i][fc.logical.slices()] += 1
            for gap in layout.gaps(zrank):
                buf[gap.start:gap.stop] = 0
                cover[gap.start:gap.stop] += 1
            assert (cover == 1).all(), "fragments, their padding and the group gaps tile the buffer"
            ref = ref_zero_partition(locals_, zworld, zrank, t.zero_stage, t.zero_alignment, t.zero_param_alignment)
            assert np.array_equal(buf, ref)
    for x, o, h in zip(xs, out, hits):
        assert (h == 1).all()
        assert np.array_equal(o, x)


def test_writer_rule_examples():
    t = Topology(tp=2, dp=2, pp=2, sp=2, layers=2, zero_stage=1)
    rep = {"kind": "replicated", "placement": {"stages": ["first", "last"]}}
    part = {"kind": "partitioned", "dim": 0, "placement": {"layer": 1}}
    writers = [r for r in range(t.world_size) if is_writer(rep, t, r)]
    assert writers == [t.rank({"tp": 0, "sp": 0, "dp": 0, "pp": 0})]
    # ZeRO fragments are disjoint over sp x dp: one writer per (sp, dp) cell
    assert len([r for r in range(t.world_size) if is_writer(rep, t, r, flat=True)]) == 4
    writers = [r for r in range(t.world_size) if holds(part, t, r) and is_writer(part, t, r)]
    assert sorted(t.coords(r)["tp"] for r in writers) == [0, 1] and all(t.coords(r)["pp"] == 1 for r in writers)


# ---------------------------------------------------------------------- flat ranges
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=4), st.data())
def test_flat_range_to_boxes(shape, data):
    n = math.prod(shape)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    boxes = flat_range_to_boxes(shape, a, b)
    idx = np.arange(n).reshape(shape)
    got = [idx[box.slices()].ravel() for box in boxes]
    for g in got:  # each box is contiguous in the flattening
        assert g.size > 0 and np.array_equal(g, np.arange(g[0], g[0] + g.size))
    flat = np.concatenate(got) if got else np.zeros(0, np.int64)
    assert np.array_equal(flat, np.arange(a, b))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_flat_range_to_boxes_example_and_errors():
    assert flat_range_to_boxes((100, 10), 5, 1000) == [Box(((0, 1), (5, 10))), Box(((1, 100), (0, 10)))]
    assert flat_range_to_boxes((), 0, 1) == [Box(())]
    with pytest.raises(PatternError, match="outside"):
        flat_range_to_boxes((2, 2), 0, 5)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_split_contiguous(shape, data):
    ranges = []
    for n in shape:
        a = data.draw(st.integers(0, n - 1))
        ranges.append((a, data.draw(st.integers(a + 1, n))))
    box = Box(tuple(ranges))
    idx = np.arange(math.prod(shape)).reshape(shape)
    pieces = split_contiguous(box, shape)
    seen = np.concatenate([idx[p.slices()].ravel() for p in pieces])
    assert np.array_equal(np.sort(seen), np.sort(idx[box.slices()].ravel()))
    for p in pieces:
        g = idx[p.slices()].ravel()
        assert np.array_equal(g, np.arange(g[0], g[0] + g.size))


# ---------------------------------------------------------------------- ZeRO partitions
def test_zero12_layout_matches_deepspeed_example():
    # three params of 10, 7, 5 elements over 4 ranks, nccl alignment 2: padded to 24, 6 per rank
    lay = zero_group_layout([10, 7, 5], world=4, zero_stage=2)
    assert (lay.offsets, lay.partition_numel, lay.total_numel) == ((0, 10, 17), 6, 24)
    assert lay.fragment(0, 1) == Fragment(6, 10, 0, 4)  # param 0 straddles ranks 0 and 1
    assert lay.fragment(1, 1) == Fragment(0, 2, 4, 2)
    assert lay.fragment(0, 2) is None
    assert lay.fragment(2, 2) == Fragment(0, 1, 5, 1)
    assert lay.fragment(2, 3) == Fragment(1, 5, 0, 4)  # rank 3 holds [18, 24): param 2 [1, 5) + 2 tail padding
    assert lay.gaps(3) == (FlatRange(4, 6),)
    lay3 = zero_group_layout([10, 7], world=4, zero_stage=3)
    assert lay3.fragment(0, 3) == Fragment(9, 10, 0, 3)  # ceil(10/4)=3: last rank clipped to 1 + 2 padding
    assert lay3.fragment(1, 3) == Fragment(6, 7, 3, 2)
    assert lay3.partition_numel == 5
    # parameter_alignment: every param but the last starts on a multiple of 8
    lay_a = zero_group_layout([3, 5, 2], world=2, zero_stage=1, param_alignment=8)
    assert lay_a.offsets == (0, 8, 16) and lay_a.total_numel == 20


# ---------------------------------------------------------------------- parsing and errors
def test_parse_roundtrip_every_kind():
    records = [
        None,
        {"kind": "replicated"},
        {"kind": "averaged", "max_deviation": 0.25},
        {"kind": "partitioned", "dim": 1, "widths": {"3": [2, 1, 1]}},
        {"kind": "vocab", "dim": 0, "original_size": 50, "placement": {"stages": ["first", "last"]}},
        {"kind": "fused", "dim": 0, "sizes": [8, 2, 2], "widths": {"3": [[3, 3, 2], [1, 1, 0], [1, 1, 0]]},
         "placement": {"layer": 3, "local_name": "layers.{local}.attn.qkv"}},
        {"kind": "expert", "dim": 0, "num_experts": 4, "inner": {"kind": "partitioned", "dim": 1}},
        {"kind": "replicated", "placement": {"stages": ["first", "last"],
                                             "local_name": {"first": "embed.w", "last": "head.w"}}},
    ]
    for rec in records:
        p = parse_pattern(rec)
        validate_pattern_record(rec)
        if rec is not None:
            assert p.to_json() == rec
            validate_pattern_record(p.to_json())
            assert parse_pattern(p.to_json()) == p


@pytest.mark.parametrize("rec,msg", [
    ({"kind": "sharded", "dim": 0}, "unknown pattern kind 'sharded'"),
    ({"kind": "partitioned"}, "needs 'dim'"),
    ({"kind": "partitioned", "dim": 0, "widht": {}}, "unknown field"),
    ({"kind": "partitioned", "dim": 0, "widths": {"3": [1, 2]}}, "3 per-rank widths"),
    ({"kind": "fused", "dim": 0, "sizes": [4, 4], "widths": {"2": [[2, 2]]}}, "lists 1 sub-parameters"),
    ({"kind": "vocab", "dim": 0}, "original_size"),
    ({"kind": "expert", "num_experts": 4, "inner": {"kind": "expert", "num_experts": 2}}, "cannot nest"),
    ({"kind": "replicated", "placement": {"layer": 1, "stages": ["first"]}}, "exactly one"),
    ({"kind": "replicated", "placement": {"stages": ["middle"]}}, "first"),
])
def test_parse_errors_name_the_tensor(rec, msg):
    with pytest.raises(PatternError, match=msg) as err:
        parse_pattern(rec, name="layers.0.x")
    assert "'layers.0.x'" in str(err.value)
    with pytest.raises(PatternError):
        validate_pattern_record(rec, name="layers.0.x")


def test_split_errors_say_what_would_divide():
    with pytest.raises(TopologyError) as err:
        tp_layout({"kind": "partitioned", "dim": 0}, (1024, 8), 3, 0, name="layers.0.attn.qkv")
    assert str(err.value).startswith(
        "tensor 'layers.0.attn.qkv' dim 0 of size 1024 cannot be split 3 ways: give widths for tp=3 "
        "or use tp in {1, 2, 4, 8")
    with pytest.raises(TopologyError, match="sub-parameter 1 of size 6 .* cannot be split 4 ways.*tp in \\{1, 2\\}"):
        tp_layout({"kind": "fused", "dim": 0, "sizes": [8, 6, 6]}, (20, 2), 4, 0, name="qkv")
    with pytest.raises(TopologyError, match="6 experts cannot be split over ep=4"):
        tp_layout({"kind": "expert", "num_experts": 6}, (6, 2), 1, 0, ep=4, name="moe")
    with pytest.raises(PatternError, match="add up to 19 but dim 0 has size 20"):
        check_pattern({"kind": "fused", "dim": 0, "sizes": [8, 6, 5]}, (20, 2), name="qkv")
    with pytest.raises(PatternError, match="splits dim 2 but the tensor has shape"):
        check_pattern({"kind": "partitioned", "dim": 2}, (4, 4), name="w")
    with pytest.raises(PatternError, match="original_size is 50"):
        check_pattern({"kind": "vocab", "original_size": 50}, (56, 4), name="emb")
    with pytest.raises(PatternError, match="widths for tp=2 are \\[1, 2\\] \\(sum 3\\)"):
        check_pattern({"kind": "partitioned", "dim": 0, "widths": {"2": [1, 2]}}, (4, 4), name="w")


def test_uneven_widths_and_zero_row_rank():
    pj = {"kind": "partitioned", "dim": 0, "widths": {"3": [3, 0, 1]}}
    layouts = [tp_layout(pj, (4, 2), 3, r) for r in range(3)]
    assert [lay.shape for lay in layouts] == [(3, 2), (0, 2), (1, 2)]
    assert layouts[1].copies == ()
    assert layouts[2].copies[0].logical == Box(((3, 4), (0, 2)))


def test_vocab_padding_rows():
    pj = {"kind": "vocab", "original_size": 10}
    # tp=4, vocab_multiple=2: padded to 16, 4 rows per rank; rank 2 holds rows 8, 9 + 2 padding rows
    lay = tp_layout(pj, (10, 3), 4, 2, vocab_multiple=2)
    assert lay.shape == (4, 3)
    assert lay.copies[0].logical == Box(((8, 10), (0, 3)))
    assert lay.padding == (Box(((2, 4), (0, 3))),)
    lay3 = tp_layout(pj, (10, 3), 4, 3, vocab_multiple=2)
    assert lay3.copies == () and lay3.padding == (Box(((0, 4), (0, 3))),)


def test_swiglu_and_gqa_layouts():
    swiglu = {"kind": "fused", "dim": 0, "sizes": [8, 8]}
    lay = tp_layout(swiglu, (16, 4), 2, 1)  # rank 1 holds [gate_1; up_1]
    assert [c.logical.ranges[0] for c in lay.copies] == [(4, 8), (12, 16)]
    assert [c.local.ranges[0] for c in lay.copies] == [(0, 4), (4, 8)]
    gqa = {"kind": "fused", "dim": 0, "sizes": [12, 4, 4], "widths": {"3": [[4, 4, 4], [2, 1, 1], [2, 1, 1]]}}
    lay = tp_layout(gqa, (20, 4), 3, 2)
    assert lay.shape == (6, 4)
    assert [c.logical.ranges[0] for c in lay.copies] == [(8, 12), (15, 16), (19, 20)]


def test_placement_and_local_names():
    t = Topology(pp=2, layers=4)
    fused = {"kind": "fused", "dim": 0, "sizes": [2, 2],
             "placement": {"layer": 3, "local_name": "layers.{local}.mlp.w"}}
    assert placement_stages(fused, t) == (1,)
    assert stage_local_name("layers.3.mlp.w", fused, t) == "layers.1.mlp.w"
    tied = {"kind": "vocab", "original_size": 5,
            "placement": {"stages": ["first", "last"], "local_name": {"first": "embed.w", "last": "head.w"}}}
    assert placement_stages(tied, t) == (0, 1)
    assert placement_stages(tied, Topology()) == (0,)
    assert stage_local_name("embedding.weight", tied, t, 0) == "embed.w"
    assert stage_local_name("embedding.weight", tied, t, 1) == "head.w"
    assert placement_stages(None, t) == (0, 1)
    names = canonical_names([("layers.3.mlp.w", fused), ("embedding.weight", tied), ("norm", None)], t, 1)
    assert names == {"layers.1.mlp.w": "layers.3.mlp.w", "head.w": "embedding.weight", "norm": "norm"}
    with pytest.raises(TopologyError, match="layer 7 but the topology has layers=4"):
        placement_stages({"kind": "replicated", "placement": {"layer": 7}}, t, name="layers.7.w")
    # the topology-level rule applies when the placement has no template
    tr = Topology(pp=2, layers=4, layer_names={"canonical": "layers.{layer}.", "local": "layers.{local}."})
    rep2 = {"kind": "replicated", "placement": {"layer": 2}}
    assert stage_local_name("layers.2.attn.o", rep2, tr) == "layers.0.attn.o"


def test_average_replicas_numpy_and_torch():
    reps = [np.array([1.0, 2.0], np.float32), np.array([3.0, 2.5], np.float32)]
    mean, dev = average_replicas(reps)
    assert mean.dtype == np.float32 and np.array_equal(mean, np.array([2.0, 2.25], np.float32))
    assert dev == pytest.approx(1.0)
    treps = [torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([3.0, 2.0], dtype=torch.bfloat16)]
    tmean, tdev = average_replicas(treps)
    assert tmean.dtype == torch.bfloat16 and tmean.tolist() == [2.0, 2.0] and tdev == pytest.approx(1.0)
    mean, dev = average_replicas([np.ones(3)])
    assert dev == 0.0
    with pytest.raises(PatternError, match="different shapes"):
        average_replicas([np.ones(2), np.ones(3)])


def test_schemas_are_valid_draft_2020_12():
    import jsonschema

    from ucp_store.topology import load_schema

    for filename in ("pattern.schema.json", "topology.schema.json"):
        schema = load_schema(filename)
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        jsonschema.Draft202012Validator.check_schema(schema)
    # the schema and the parser agree on what an expert's inner pattern may hold
    with pytest.raises(PatternError, match="pattern.schema.json"):
        validate_pattern_record({"kind": "expert", "num_experts": 2,
                                 "inner": {"kind": "replicated", "placement": {"layer": 0}}})
    with pytest.raises(PatternError, match="cannot have a placement"):
        parse_pattern({"kind": "expert", "num_experts": 2, "inner": {"kind": "replicated", "placement": {"layer": 0}}})


@pytest.mark.parametrize("base", [
    {"kind": "fused", "dim": 0, "sizes": [8, 4, 4], "widths": {"3": [[3, 3, 2], [2, 1, 1], [2, 1, 1]]}},
    {"kind": "expert", "num_experts": 4, "inner": {"kind": "partitioned", "dim": 1}},
    {"kind": "vocab", "original_size": 1000},
])
@pytest.mark.parametrize("placement", [{"layer": 7}, {"stages": ["last", "first"], "local_name": "x.{local}"}])
def test_placement_parsed_apart_equals_whole_record(base, placement):
    """parse_pattern memoises the placement apart from the rest; the result must be the same object
    value as parsing the whole record at once (caches cold and warm)."""
    from ucp_store import patterns as pat

    record = {**base, "placement": placement}
    pat.clear_caches()
    whole = parse_record(record, "t", inner=False)
    pat.clear_caches()
    assert pat.parse_pattern(record, name="t") == whole
    assert pat.parse_pattern(dict(record), name="t") == whole  # warm
    assert pat.parse_pattern({**base, "placement": {"layer": 8}}, name="t").placement.layer == 8
    from dataclasses import replace

    bare = pat.without_placement(pat.parse_pattern(record, name="t"))
    assert bare == replace(whole, placement=None) and bare.placement is None
    assert bare is pat.without_placement(pat.parse_pattern({**base, "placement": {"layer": 9}}, name="t"))
    assert pat.without_placement(whole) == bare  # a pattern built elsewhere takes the slow path, same value
    with pytest.raises(PatternError, match="'t'.*placement"):
        pat.parse_pattern({**base, "placement": {"layer": 1, "stages": ["first"]}}, name="t")


@settings(max_examples=300, deadline=None)
@given(numels=st.lists(st.integers(0, 40), min_size=1, max_size=12), world=st.integers(1, 9),
       stage=st.sampled_from([1, 2, 3]), alignment=st.sampled_from([1, 2, 4]),
       param_alignment=st.sampled_from([1, 2, 8]))
def test_zero_fragments_equal_fragment_per_parameter(numels, world, stage, alignment, param_alignment):
    """``fragments`` (bisected for ZeRO-1/2) lists exactly the parameters ``fragment`` gives a slot, and every
    flat element of the group lands on one rank once."""
    layout = zero_group_layout(numels, world, stage, alignment=alignment, param_alignment=param_alignment)
    cover = [0] * sum(numels)
    starts = [sum(numels[:i]) for i in range(len(numels))]
    for z in range(world):
        want = [(i, f) for i in range(len(numels)) if (f := layout.fragment(i, z)) is not None and f.slot > 0]
        got = layout.fragments(z)
        assert got == want
        for i, f in got:
            for k in range(f.start, f.stop):
                cover[starts[i] + k] += 1
    assert cover == [1] * sum(numels)
