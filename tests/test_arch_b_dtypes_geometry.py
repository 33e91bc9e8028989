"""One dtype table for the planner and ``dtypes``; the geometry module's box helpers; planner phases."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch

from ucp_store import dtype_table, dtypes
from ucp_store.errors import DTypeError, PlanError
from ucp_store.geometry import Box, FlatRange, uncovered
from ucp_store.patterns import zero_group_layout
from ucp_store.plan.planner import itemsize, plan
from ucp_store.topology import Topology


def test_one_table_for_planner_and_dtypes():
    assert dtypes.SUPPORTED == dtype_table.SUPPORTED
    for name in dtype_table.SUPPORTED:
        assert itemsize(name) == dtypes.itemsize(name) == dtypes.numpy_dtype(name).itemsize
        assert itemsize(str(dtypes.torch_dtype(name))) == dtypes.torch_dtype(name).itemsize
    assert itemsize("bf16") == 2 and itemsize("torch.float32") == 4 and itemsize(np.dtype("float64")) == 8


@pytest.mark.parametrize("dtype", ["float8_e4m3fnuz", "float8_e5m2fnuz", "torch.float8_e4m3fnuz"])
def test_planner_refuses_what_the_store_cannot_write(dtype, tmp_path):
    # the store really refuses it ...
    from ucp_store.store import open_store

    store = open_store(str(tmp_path / "s"), create=True)
    with pytest.raises(DTypeError, match="float8"):
        with store.begin("r", 1) as w:
            w.write("w", "weight", torch.zeros(4).to(getattr(torch, dtype.removeprefix("torch."))))
    # ... so the planner refuses it too, naming the tensor and the reason
    rec = {"name": "w", "state": "weight", "shape": [4], "dtype": dtype, "pattern": None}
    with pytest.raises(PlanError, match=r"tensor 'w' state 'weight': dtype float8_\w+ cannot be stored"):
        plan([rec], Topology(), 0)
    with pytest.raises(PlanError, match="cannot be stored"):
        itemsize(dtype)


def test_unknown_dtype_names_a_near_match():
    with pytest.raises(DTypeError, match=r"unknown dtype 'float23'.*did you mean 'float32'"):
        dtype_table.itemsize("float23")
    with pytest.raises(PlanError, match="unknown dtype 'bfloat61'.*did you mean 'bfloat16'"):
        plan([{"name": "w", "state": "weight", "shape": [4], "dtype": "bfloat61", "pattern": None}], Topology(), 0)


def test_dtype_table_is_torch_free():
    code = ("import sys; import ucp_store.dtype_table, ucp_store.plan.planner, ucp_store.geometry, ucp_store.patterns;"
            "bad = [m for m in ('torch', 'numpy', 'tensorstore', 'zarr', 'ml_dtypes') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("spans, length, expect", [
    ([], 5, [(0, 5)]),
    ([(0, 5)], 5, []),
    ([(3, 4), (0, 1)], 6, [(1, 3), (4, 6)]),
    ([(0, 3), (2, 4), (6, 7)], 7, [(4, 6)]),
    ([(1, 2)], 2, [(0, 1)]),
])
def test_uncovered(spans, length, expect):
    assert uncovered(spans, length) == tuple(FlatRange(a, b) for a, b in expect)


def test_gaps_use_uncovered_and_match_fragments():
    layout = zero_group_layout([5, 3, 7], 3, 1, alignment=2, param_alignment=4)
    for z in range(3):
        slots = [(f.buffer_start, f.buffer_start + f.slot) for _, f in layout.fragments(z)]
        covered = set()
        for a, b in slots:
            covered.update(range(a, b))
        for g in layout.gaps(z):
            assert not covered & set(range(g.start, g.stop))
            covered.update(range(g.start, g.stop))
        assert covered == set(range(layout.partition_numel))


def test_box_chunk_helpers_agree_with_brute_force():
    shape, chunk = (10, 7), (3, 4)
    box = Box(((2, 8), (3, 5)))
    got = set(box.chunk_indices(chunk))
    grid = [range(-(-s // c)) for s, c in zip(shape, chunk)]
    want = {idx for idx in itertools.product(*grid) if Box.of_chunk(idx, chunk, shape).intersect(box) is not None}
    assert got == want
    assert Box.of_chunk((3, 1), chunk, shape) == Box(((9, 10), (4, 7)))
    assert list(Box(((2, 2), (0, 7))).chunk_indices(chunk)) == []


def test_buffer_padding_keeps_a_missing_state_slot_zero():
    # two parameters; only the first has exp_avg_sq: the second's slot is padding in that buffer
    recs = [{"name": n, "state": s, "shape": [8], "dtype": "float32", "pattern": None}
            for n, s in (("a", "exp_avg"), ("a", "exp_avg_sq"), ("b", "exp_avg"))]
    p = plan(recs, Topology(dp=1, zero_stage=1), 0)
    by_key = {b.key: b for b in p.buffers}
    assert by_key["default/exp_avg"].padding == ()
    assert by_key["default/exp_avg_sq"].padding == (FlatRange(8, 16),)
