"""The index math of one writer per shard file (``ucp_store.save.straddle``, issue 27 item 0), property-tested.

``split_box`` must partition a box exactly into the shard files it covers whole and one part per shard file it
cuts; ``plan_exchange`` must give every cut file exactly one owner among the ranks holding it, the one with most
of its bytes; ``assemble`` must rebuild a file from its pieces. The multi-rank saves that use them are
tests/test_one_writer.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_store.save import straddle


@st.composite
def _boxes(draw):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 12)) for _ in range(nd))
    shard = tuple(draw(st.integers(1, s + 2)) for s in shape)
    offset = tuple(draw(st.integers(0, s - 1)) for s in shape)
    extent = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offset))
    return shape, shard, offset, extent


def _cells(offset, extent):
    grids = np.meshgrid(*[np.arange(o, o + e) for o, e in zip(offset, extent)], indexing="ij")
    return {tuple(int(g.flat[i]) for g in grids) for i in range(grids[0].size)}


@settings(max_examples=300, deadline=None)
@given(_boxes())
def test_split_box_partitions_the_box_into_whole_files_and_one_part_per_cut_file(case):
    shape, shard, offset, extent = case
    whole, parts = straddle.split_box(shape, shard, offset, extent)
    seen: list = []
    if whole is not None:
        w_off, w_ext = whole
        cells = _cells(w_off, w_ext)
        seen += list(cells)
        # the whole part is a union of whole shard files (each edge on a shard edge or the array's end)
        for o, e, s, n in zip(w_off, w_ext, shard, shape):
            assert o % s == 0 and ((o + e) % s == 0 or o + e == n)
    files = set()
    for index, (p_off, p_ext) in parts:
        cells = _cells(p_off, p_ext)
        seen += list(cells)
        f_off, f_ext = straddle.shard_box(shape, shard, index)
        # inside its one shard file, and not the whole of it
        assert all(fo <= po and po + pe <= fo + fe for po, pe, fo, fe in zip(p_off, p_ext, f_off, f_ext))
        assert not _covers(offset, extent, f_off, f_ext)  # a file the box covers whole is in the whole part
        assert index not in files  # one part per cut file
        files.add(index)
    assert len(seen) == len(set(seen)) == math.prod(extent)
    assert set(seen) == _cells(offset, extent)


def _covers(offset, extent, f_off, f_ext) -> bool:
    return all(o <= fo and fo + fe <= o + e for o, e, fo, fe in zip(offset, extent, f_off, f_ext))


def test_split_box_examples():
    # a ZeRO fragment's last partial row of a (7, 13) array in (4, 13) shard files: one cut file
    assert straddle.split_box((7, 13), (4, 13), (5, 0), (1, 6)) == (None, [((1, 0), ((5, 0), (1, 6)))])
    # rows 2..7 of (8, 4) in (4, 4) files: file 1 whole, file 0 cut
    assert straddle.split_box((8, 4), (4, 4), (2, 0), (6, 4)) == (((4, 0), (4, 4)), [((0, 0), ((2, 0), (2, 4)))])
    # the array's clipped last file counts as whole
    assert straddle.split_box((7,), (4,), (4,), (3,)) == (((4,), (3,)), [])


@st.composite
def _fragments(draw):
    """A flat array cut into contiguous fragments across ranks (ZeRO), stored in 1-d shard files."""
    n = draw(st.integers(1, 60))
    world = draw(st.integers(1, 5))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=world - 1, max_size=world - 1)))
    shard = draw(st.integers(1, 16))
    return n, [0, *cuts, n], shard


@settings(max_examples=200, deadline=None)
@given(_fragments())
def test_every_cut_file_gets_one_owner_and_is_rebuilt_from_its_pieces(case):
    n, bounds, shard = case
    data = np.arange(n, dtype=np.float32) * 1.5
    held, written = [], {}
    for r in range(len(bounds) - 1):
        lo, hi = bounds[r], bounds[r + 1]
        mine = []
        if hi > lo:
            whole, parts = straddle.split_box((n,), (shard,), (lo,), (hi - lo,))
            if whole is not None:
                for f in range(whole[0][0] // shard, -(-(whole[0][0] + whole[1][0]) // shard)):
                    written.setdefault(f, []).append(r)
            for index, (off, ext) in parts:
                mine.append(straddle.Piece("w", "fp32", index, off, data[off[0]:off[0] + ext[0]].copy()))
        held.append(mine)
    answers = straddle.plan_exchange([[straddle.describe(p) for p in mine] for mine in held])
    assert len({a["moves"] for a in answers}) == 1
    owned: dict[int, list] = {}
    for r, (mine, ans) in enumerate(zip(held, answers)):
        assert len(ans["send"]) == len(mine)
        for p, dst in zip(mine, ans["send"]):
            owned.setdefault(dst, []).append(p)
        for src, descs in ans["recv"].items():  # what arrives is exactly what the senders send to r
            assert descs == [straddle.describe(p) for p, d in zip(held[int(src)], answers[int(src)]["send"])
                             if d == r]
    for dst, pieces in owned.items():
        for p in pieces:
            holders = {r: sum(q.data.nbytes for q in held[r] if q.shard == p.shard) for r in range(len(held))}
            assert holders[dst] == max(holders.values())  # a rank holding most of the file's bytes
            written.setdefault(p.shard[0], []).append(dst)
        by_file: dict = {}
        for p in pieces:
            by_file.setdefault(p.shard, []).append(p)
        for group in by_file.values():
            (off, ext), rebuilt = straddle.assemble((n,), (shard,), group)
            assert np.array_equal(rebuilt, data[off[0]:off[0] + ext[0]])
    # every shard file of the array: written, and by one rank
    assert set(written) == set(range(-(-n // shard)))
    assert all(len(set(v)) == 1 for v in written.values()), written


def test_received_refuses_a_payload_that_does_not_add_up():
    p = straddle.Piece("w", "fp32", (0,), (1,), np.ones(3, dtype=np.float32))
    d = straddle.describe(p)
    back = straddle.received([d], memoryview(p.data.tobytes()), lambda n, s: np.dtype(np.float32))
    assert np.array_equal(back[0].data, p.data) and back[0].offset == (1,)
    with pytest.raises(ValueError, match="12 bytes arrived|16 bytes arrived"):
        straddle.received([d], memoryview(p.data.tobytes() + b"\0" * 4), lambda n, s: np.dtype(np.float32))
