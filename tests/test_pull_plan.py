"""plan/pull (pure): chunk cuts of a box and routes between arrays, property-tested (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_store.errors import PlanError
from ucp_store.geometry import Box
from ucp_store.plan.pull import chunk_count, chunk_cuts, route, shard_slot


@st.composite
def layouts_and_boxes(draw):
    ndim = draw(st.integers(1, 3))
    shape, chunk, shard, ranges = [], [], [], []
    for _ in range(ndim):
        n = draw(st.integers(1, 23))
        c = draw(st.integers(1, 8))
        per = draw(st.integers(1, 3))
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        shape.append(n)
        chunk.append(c)
        shard.append(c * per)
        ranges.append((a, b))
    return tuple(shape), tuple(chunk), tuple(shard), Box(tuple(ranges))


@settings(max_examples=300, deadline=None)
@given(layouts_and_boxes())
def test_cuts_tile_the_box_and_land_where_the_chunk_holds_them(case):
    shape, chunk, shard, box = case
    data = np.arange(int(np.prod(shape))).reshape(shape)
    out = np.full(box.shape, -1)
    cuts = list(chunk_cuts(shape, chunk, shard, box))
    assert len(cuts) == chunk_count(shape, chunk, box)
    seen = set()
    for c in cuts:
        assert c.index not in seen
        seen.add(c.index)
        # the chunk as stored: its full shape, edge chunks padded
        stored = np.full(chunk, -2)
        cb = Box.of_chunk(c.index, chunk, shape)
        stored[tuple(slice(0, b - a) for a, b in cb.ranges)] = data[cb.slices()]
        assert (out[c.dst.slices()] == -1).all()  # no overlap
        out[c.dst.slices()] = stored[c.src.slices()]
        # the shard file and slot locate the chunk: slot is the row-major position within the shard
        per = [s // k for s, k in zip(shard, chunk)]
        sh, slot = shard_slot(c.index, chunk, shard)
        assert sh == c.shard and slot == c.slot
        local = np.unravel_index(slot, per)
        assert tuple(s * p + int(i) for s, p, i in zip(sh, per, local)) == c.index
    if not box.empty:
        assert (out == data[box.slices()]).all()  # no gap, right values
    else:
        assert cuts == []


def test_bad_layout_is_a_plan_error():
    with pytest.raises(PlanError, match="does not divide"):
        list(chunk_cuts((8,), (3,), (4,), Box(((0, 8),))))


@st.composite
def forests(draw):
    """Arrays with bases forming chains (a forest): id -> (encoding, base)."""
    n = draw(st.integers(1, 12))
    arrays: dict[str, tuple[str, str | None]] = {}
    for i in range(n):
        base = draw(st.one_of(st.none(), st.integers(0, i - 1))) if i else None
        arrays[f"a{i}"] = ("xor", f"a{base}") if base is not None else ("plain", None)
    have = draw(st.sampled_from(sorted(arrays)))
    want = draw(st.sampled_from(sorted(arrays)))
    return arrays, have, want


@settings(max_examples=300, deadline=None)
@given(forests(), st.data())
def test_route_xors_back_to_the_wanted_values(case, data):
    """Values: each plain array random bits, each xor array its own random delta; a route's deltas XORed into
    what ``have`` reconstructs give what ``want`` reconstructs, and a full route is taken only where the two
    chains share no array."""
    arrays, have, want = case
    own = {a: data.draw(st.integers(0, 2**16 - 1)) for a in arrays}

    def value(a):
        enc, base = arrays[a]
        return own[a] ^ value(base) if enc == "xor" else own[a]

    def chain(a):
        out = [a]
        while arrays[out[-1]][0] == "xor":
            out.append(arrays[out[-1]][1])
        return out

    r = route(have, want, arrays)
    if have == want:
        assert r.kind == "same"
    elif set(chain(have)) & set(chain(want)):
        assert r.kind == "delta"
        v = value(have)
        for d in r.deltas:
            assert arrays[d][0] == "xor"
            v ^= own[d]
        assert v == value(want)
        # never a delta both chains pass through below their meeting point
        assert len(set(r.deltas)) == len(r.deltas)
    else:
        assert r.kind == "full" and r.deltas == ()
    assert route(None, want, arrays).kind == "full"


def test_route_refuses_a_loop():
    with pytest.raises(PlanError, match="loops"):
        route("x", "a", {"a": ("xor", "b"), "b": ("xor", "a")})


def test_cut_cache_gives_what_a_fresh_cut_gives_and_stays_bounded():
    """registry/pull keeps chunk cuts by geometry and box (a puller moves the same boxes every version): a hit
    is the fresh cut, the least recently used entries go past the limit, a box with more cuts than the limit
    is cut and not kept."""
    from ucp_store.registry import pull as rp

    cache = rp._CutCache(limit=12)
    geo = ((64, 40), (8, 10), (32, 20))
    a, b = Box(((0, 32), (0, 40))), Box(((32, 64), (0, 20)))  # 16 cuts (over the limit), 8 cuts
    for box in (a, b, b):
        assert cache.get(*geo, box) == tuple(chunk_cuts(*geo, box))
    assert cache.size == 8  # a was too large to keep, b kept once
    c = Box(((0, 16), (0, 20)))  # 4 more: 12, at the limit
    assert cache.get(*geo, c) == tuple(chunk_cuts(*geo, c))
    assert cache.size == 12
    d = Box(((0, 8), (0, 10)))  # 1 more: b (least recently used) goes
    assert cache.get(*geo, d) == tuple(chunk_cuts(*geo, d))
    assert cache.size == 5 and cache.get(*geo, b) == tuple(chunk_cuts(*geo, b))
