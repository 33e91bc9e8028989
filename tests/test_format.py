"""The array format: bit-exact dtypes, slice reads, chunk geometry, checksums, zarr-python/TensorStore interop."""

from __future__ import annotations

import itertools
import json
import math

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import basic_indices

import ucp_store
from ucp_store import dtypes
from ucp_store.errors import ChecksumError, DTypeError, UcpError
from ucp_store.io import format as fmt
from ucp_store.io.chunking import MIN_CHUNK_BYTES, _pow2_unit, choose_chunking
from ucp_store.save.writer import CheckpointWriter

from ucp_test_helpers import array_folders, bits, flip_byte, flip_chunk_byte, random_bits, shard_file_and_range

# every dtype the format stores, with its zarr v3 name and numpy dtype
DTYPES = {
    torch.float32: ("float32", np.dtype(np.float32)),
    torch.float16: ("float16", np.dtype(np.float16)),
    torch.bfloat16: ("bfloat16", np.dtype(ml_dtypes.bfloat16)),
    torch.float64: ("float64", np.dtype(np.float64)),
    torch.int8: ("int8", np.dtype(np.int8)),
    torch.int16: ("int16", np.dtype(np.int16)),
    torch.int32: ("int32", np.dtype(np.int32)),
    torch.int64: ("int64", np.dtype(np.int64)),
    torch.uint8: ("uint8", np.dtype(np.uint8)),
    torch.uint16: ("uint16", np.dtype(np.uint16)),
    torch.uint32: ("uint32", np.dtype(np.uint32)),
    torch.uint64: ("uint64", np.dtype(np.uint64)),
    torch.bool: ("bool", np.dtype(np.bool_)),
    torch.complex64: ("complex64", np.dtype(np.complex64)),
    torch.complex128: ("complex128", np.dtype(np.complex128)),
}
SHAPES = [(), (7, 3, 5), (1,), (0, 4), (1031,), (512, 260)]  # the last spans several inner chunks

# NaN payloads (quiet, signalling, negative), signed zeros, infinities, the smallest subnormal
_SPECIAL_BITS = {
    torch.float16: (16, [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7E01, 0xFE55, 0x7C01, 0x0001, 0x8001]),
    torch.bfloat16: (16, [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFD5, 0x7F81, 0x0001, 0x8001]),
    torch.float32: (32, [0x0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00001, 0xFFC12345,
                         0x7F800001, 0x00000001, 0x80000001]),
    torch.float64: (64, [0x0, 1 << 63, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000,
                         0x7FF8000000000001, 0xFFF8123456789ABC, 0x7FF0000000000001, 0x1, (1 << 63) | 1]),
}


def special_floats(dtype: torch.dtype) -> torch.Tensor:
    width, patterns = _SPECIAL_BITS[dtype]
    arr = np.array(patterns, dtype=f"<u{width // 8}").view(f"<i{width // 8}")
    return torch.from_numpy(arr.copy()).view(dtype)


def _tname(dtype: torch.dtype, shape) -> str:
    return f"{str(dtype).removeprefix('torch.')}.s{'x'.join(map(str, shape)) or 'scalar'}"


@pytest.fixture(scope="module")
def dtype_ckpt(tmp_path_factory):
    """One checkpoint holding random-bit tensors of every dtype and shape, and the special float values."""
    root = tmp_path_factory.mktemp("dtypes") / "store"
    store = ucp_store.open_store(str(root), create=True)
    gen = torch.Generator().manual_seed(1234)
    tensors = {}
    for dtype in DTYPES:
        for shape in SHAPES:
            tensors[_tname(dtype, shape)] = random_bits(shape, dtype, gen)
    for dtype in _SPECIAL_BITS:
        tensors[f"special.{str(dtype).removeprefix('torch.')}"] = special_floats(dtype)
    # non-contiguous source tensors are stored in their logical (C) order
    tensors["noncontig.t"] = random_bits((6, 9), torch.float32, gen).t()
    tensors["noncontig.step"] = random_bits((20, 8), torch.bfloat16, gen)[::3, 1::2]
    ck = store.save("dtypes", 0, tensors)
    return store, root, ck, tensors


# --- bit-exact round trip ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_and_shape_round_trips_bit_exact(dtype_ckpt, dtype):
    store, _, _, tensors = dtype_ckpt
    ck = store.checkpoint("dtypes@0")  # a fresh handle: everything below comes from the catalog and disk
    for shape in SHAPES:
        name = _tname(dtype, shape)
        out = ck.read(name)
        src = tensors[name]
        assert out.dtype == dtype, name
        assert tuple(out.shape) == shape, name
        assert bits(out) == bits(src), f"{name}: bits differ"
        info = ck.info(name)
        assert info.dtype == DTYPES[dtype][0]
        assert info.nbytes == math.prod(shape) * src.element_size()


@pytest.mark.parametrize("dtype", list(_SPECIAL_BITS), ids=lambda d: str(d).removeprefix("torch."))
def test_nan_payloads_signed_zeros_and_infinities_survive(dtype_ckpt, dtype):
    store, _, ck, tensors = dtype_ckpt
    name = f"special.{str(dtype).removeprefix('torch.')}"
    out = store.checkpoint(ck.id).read(name)
    assert out.dtype == dtype
    assert bits(out) == bits(tensors[name])
    # the payloads really are NaNs with distinct bits, and -0.0 really is negative
    assert torch.isnan(out.float()).sum() >= 4
    assert torch.signbit(out.float()[1]) and not torch.signbit(out.float()[0])


def test_noncontiguous_sources_are_stored_in_logical_order(dtype_ckpt):
    store, _, ck, tensors = dtype_ckpt
    for name in ("noncontig.t", "noncontig.step"):
        out = ck.read(name)
        assert bits(out) == bits(tensors[name].contiguous())
        assert out.shape == tensors[name].shape


def test_clean_dtype_checkpoint_verifies(dtype_ckpt):
    store, _, ck, _ = dtype_ckpt
    assert ck.verify() == []


def test_multi_chunk_shape_really_spans_several_chunks(dtype_ckpt):
    _, _, ck, _ = dtype_ckpt
    info = ck.info(_tname(torch.float32, (512, 260)))
    layout = fmt.ArrayLayout.from_catalog(info.dtype, info.shape, info.chunk_shape, info.shard_shape, info.codecs)
    assert math.prod(layout.chunk_grid()) > 1


# --- unsupported dtypes -------------------------------------------------------------------------------

def _unsupported():
    out = [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]  # float8_e4m3fn and float8_e5m2 are stored (issue 39)
    if hasattr(torch, "float8_e8m0fnu"):
        out.append(torch.float8_e8m0fnu)
    return out


@pytest.mark.parametrize("dtype", _unsupported(), ids=str)
def test_unsupported_dtype_is_refused_naming_the_tensor(store, store_path, dtype):
    bad = torch.zeros(4, 3).to(dtype)
    with pytest.raises(DTypeError) as exc:
        store.save("r", 1, {"ok.weight": torch.ones(3), "layers.3.bad.weight": bad})
    msg = str(exc.value)
    assert "layers.3.bad.weight" in msg and str(dtype).removeprefix("torch.") in msg
    assert store.list_checkpoints(include_pending=True) == []
    assert array_folders(store_path) == set()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantized_tensor_is_refused_naming_the_tensor(store):
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(DTypeError, match=r"quant\.w"):
        store.save("r", 1, {"quant.w": q})
    assert store.list_checkpoints(include_pending=True) == []


@pytest.mark.parametrize("array", [np.array(["a", "b"]), np.array([object()], dtype=object),
                                   np.array([1, 2], dtype="m8[s]")],
                         ids=["str", "object", "timedelta"])
def test_unsupported_numpy_dtype_is_refused(store, array):
    with pytest.raises(DTypeError, match="np.thing"):
        store.save("r", 1, {"np.thing": array})


def test_dtype_table_is_a_bijection():
    for torch_dtype, (name, np_dtype) in DTYPES.items():
        assert dtypes.zarr_name(torch_dtype) == name
        assert dtypes.zarr_name(np_dtype) == name
        assert dtypes.zarr_name(name) == name
        assert dtypes.torch_dtype(name) == torch_dtype
        assert dtypes.numpy_dtype(name) == np_dtype
    assert dtypes.zarr_name(np.dtype(">f4")) == "float32"


# --- other readers: zarr-python and TensorStore ---------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: str(d).removeprefix("torch."))
def test_zarr_python_and_tensorstore_read_what_the_store_wrote(dtype_ckpt, dtype):
    store, root, ck, tensors = dtype_ckpt
    name_zarr, np_dtype = DTYPES[dtype]
    for shape in SHAPES:
        name = _tname(dtype, shape)
        path = root / ck.info(name).array
        expected = bits(tensors[name])
        meta = json.loads((path / "zarr.json").read_text())
        assert meta["data_type"] == name_zarr  # bf16 as "bfloat16", never disguised as uint16

        z = zarr.open_array(str(path), mode="r")
        assert z.dtype == np_dtype, name
        assert z.shape == shape
        data = z[...]
        assert np.asarray(data).dtype == np_dtype
        assert np.ascontiguousarray(data).tobytes() == expected, f"zarr-python: {name}"

        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}, open=True).result()
        assert t.dtype.name == name_zarr, name
        assert tuple(t.shape) == shape
        assert np.ascontiguousarray(t.read().result()).tobytes() == expected, f"TensorStore: {name}"


def test_zarr_python_reads_sharded_multi_chunk_bf16(store, store_path, small_chunks):
    small_chunks(lambda shape: ((8, 16), (32, 48)))
    x = torch.randn(70, 48).bfloat16()
    ck = store.save("bf", 0, {"w": x})
    info = ck.info("w")
    assert info.chunk_shape == (8, 16) and info.shard_shape == (32, 48)
    z = zarr.open_array(str(store_path / info.array), mode="r")
    assert str(z.dtype) == "bfloat16"
    assert z[...].tobytes() == bits(x)
    assert z[9:30, 5:40].tobytes() == bits(x[9:30, 5:40].contiguous())


# --- slice reads ------------------------------------------------------------------------------------

def _positive_steps(index) -> bool:
    idx = index if isinstance(index, tuple) else (index,)
    return all(not isinstance(i, slice) or i.step is None or i.step > 0 for i in idx)


@st.composite
def shapes_and_chunks(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=ndim, max_size=ndim)))
    chunk = tuple(draw(st.integers(1, max(s, 1))) for s in shape)
    per_shard = tuple(draw(st.integers(1, 3)) for _ in shape)
    return shape, chunk, tuple(c * p for c, p in zip(chunk, per_shard))


_CHUNKS: dict = {}


@pytest.fixture(scope="module")
def slice_store(tmp_path_factory):
    """A store whose writer takes chunk/shard shapes from ``_CHUNKS`` (set per hypothesis example)."""
    root = tmp_path_factory.mktemp("slices") / "store"
    store = ucp_store.open_store(str(root), create=True)

    def _layout(self, shape, dtype, pattern, boundaries=None, shard_shape=None):
        shape = tuple(int(s) for s in shape)
        chunk, shard = _CHUNKS.get(shape, (None, None))
        if chunk is None or 0 in shape:
            return fmt.plan_layout(shape, dtype)
        return fmt.ArrayLayout(dtype, shape, chunk, shard)

    mp = pytest.MonkeyPatch()
    mp.setattr(CheckpointWriter, "_layout", _layout)
    yield store, itertools.count()
    mp.undo()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(geometry=shapes_and_chunks(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int16, torch.bool]),
       data=st.data())
def test_slice_reads_equal_numpy_slicing(slice_store, geometry, dtype, data):
    store, steps = slice_store
    shape, chunk, shard = geometry
    _CHUNKS[shape] = (chunk, shard)
    gen = torch.Generator().manual_seed(len(shape) * 1000 + sum(shape))
    x = random_bits(shape, dtype, gen)
    ck = store.save("slices", next(steps), {"x": x})
    handle = ck.tensor("x")
    ref = dtypes.to_numpy(x)
    for _ in range(8):
        index = data.draw(basic_indices(shape, max_dims=len(shape), allow_ellipsis=True), label="index")
        if not _positive_steps(index):
            with pytest.raises(UcpError, match="negative slice steps"):
                handle.read_numpy(index)
            continue
        expected = ref[index]
        got = handle.read_numpy(index)
        assert got.shape == np.shape(expected), index
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(expected).tobytes(), index
        t = handle[index]
        assert t.dtype == dtype and tuple(t.shape) == np.shape(expected)
        assert bits(t) == np.ascontiguousarray(expected).tobytes()
        if t.numel():  # standard strides, so that e.g. t.view(torch.uint8) works on what a read returns
            assert t.stride() == torch.empty(t.shape).stride(), (index, t.stride())


def test_integer_index_gives_a_0d_tensor(store):
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    h = store.save("r", 0, {"x": x}).tensor("x")
    assert h[2, 3].shape == () and h[2, 3].item() == x[2, 3].item()
    assert h[-1, -1].item() == 23.0
    assert h.read_numpy((1, 2)).shape == ()


def test_bad_indexes_are_refused(store):
    h = store.save("r", 0, {"x": torch.zeros(4, 6)}).tensor("x")
    for bad in [(4,), (0, -7), (0, 0, 0), ([0, 1],), (None,), (1.5,)]:
        with pytest.raises(UcpError):
            h.read_numpy(bad)


# --- which chunks a read touches --------------------------------------------------------------------

SHAPE2, CHUNK2, SHARD2 = (40, 30), (8, 10), (16, 30)  # chunk grid 5 x 3; shards of 2 x 3 chunks


@pytest.fixture(scope="module")
def corrupt_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("corrupt") / "store"
    store = ucp_store.open_store(str(root), create=True)
    mp = pytest.MonkeyPatch()
    mp.setattr(CheckpointWriter, "_layout",
               lambda self, shape, dtype, pattern, **kw: fmt.ArrayLayout(dtype, tuple(shape), CHUNK2, SHARD2))
    x = torch.randn(SHAPE2, generator=torch.Generator().manual_seed(5))
    ck = store.save("c", 0, {"x": x})
    mp.undo()
    return store, root, ck, x


def _selected_coords(shape, index):
    """Per dim, the coordinates of the selected elements (numpy applied to coordinate grids)."""
    grids = np.indices(shape)
    return [g[index].reshape(-1) for g in grids]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(index=basic_indices(SHAPE2, max_dims=2).filter(_positive_steps),
       bad=st.tuples(st.integers(0, 4), st.integers(0, 2)))
def test_read_touches_only_intersecting_chunks(corrupt_ckpt, index, bad):
    store, root, ck, x = corrupt_ckpt
    handle = store.checkpoint(ck.id).tensor("x")
    layout = handle.layout
    info = handle.info
    coords = _selected_coords(SHAPE2, index)
    needed = {tuple(int(c[k]) // cs for c, cs in zip(coords, CHUNK2)) for k in range(coords[0].size)}
    if coords[0].size:
        box = tuple((int(c.min()), int(c.max()) + 1) for c in coords)
        in_box = set(itertools.product(*[range(lo // cs, (hi - 1) // cs + 1) for (lo, hi), cs in zip(box, CHUNK2)]))
        assert set(layout.chunks_touching(box)) == in_box
        assert needed <= in_box
    else:
        in_box = set()
    path, pos = flip_chunk_byte(root, info, bad)
    try:
        if bad in needed:
            with pytest.raises(ChecksumError) as exc:
                handle.read_numpy(index)
            msg = str(exc.value)
            assert f"chunk {list(bad)}" in msg and handle.array_url in msg
        elif bad not in in_box:
            got = handle.read_numpy(index)
            assert np.array_equal(got, x.numpy()[index])
        # a chunk inside the bounding box that no selected element needs: either outcome is correct
    finally:
        flip_byte(path, pos)
    assert np.array_equal(handle.read_numpy(index), x.numpy()[index])


def test_corrupt_chunk_named_in_read_and_verify(corrupt_ckpt):
    store, root, ck, x = corrupt_ckpt
    handle = store.checkpoint(ck.id).tensor("x")
    path, pos = flip_chunk_byte(root, handle.info, (3, 1))
    try:
        assert np.array_equal(handle.read_numpy((slice(0, 24),)), x.numpy()[:24])  # rows 0..23: chunks 0-2
        with pytest.raises(ChecksumError, match=r"chunk \[3, 1\] \(shard file c/1/0\)"):
            handle.read_numpy((slice(20, 30), slice(12, 13)))
        problems = store.checkpoint(ck.id).verify()
        assert [p["chunk"] for p in problems] == [[3, 1]]
        assert problems[0]["array"] == handle.array_url and problems[0]["shard"] == "c/1/0"
    finally:
        flip_byte(path, pos)
    assert store.checkpoint(ck.id).verify() == []


def test_corrupt_shard_index_is_caught(corrupt_ckpt):
    store, root, ck, x = corrupt_ckpt
    handle = store.checkpoint(ck.id).tensor("x")
    path, _, _ = shard_file_and_range(root, handle.info, (0, 0))
    pos = path.stat().st_size - 10  # inside the shard index (before its crc32c)
    flip_byte(path, pos)
    try:
        with pytest.raises(ChecksumError):
            handle.read_numpy((slice(0, 4),))
        assert np.array_equal(handle.read_numpy((slice(16, 40),)), x.numpy()[16:])  # other shards are fine
        assert store.checkpoint(ck.id).verify() != []
    finally:
        flip_byte(path, pos)
    assert store.checkpoint(ck.id).verify() == []


def test_deleted_shard_file_is_caught_by_verify(corrupt_ckpt, tmp_path):
    store, root, ck, x = corrupt_ckpt
    handle = store.checkpoint(ck.id).tensor("x")
    path, _, _ = shard_file_and_range(root, handle.info, (2, 0))
    saved = path.read_bytes()
    path.unlink()
    try:
        problems = store.checkpoint(ck.id).verify()
        assert problems and all("missing chunk" in p["error"] for p in problems)
        assert [2, 0] in [p["chunk"] for p in problems]
    finally:
        path.write_bytes(saved)


def test_deleted_shard_file_is_caught_by_read(corrupt_ckpt):
    store, root, ck, x = corrupt_ckpt
    handle = store.checkpoint(ck.id).tensor("x")
    path, _, _ = shard_file_and_range(root, handle.info, (2, 0))
    saved = path.read_bytes()
    path.unlink()
    try:
        with pytest.raises(ChecksumError, match=r"chunk \[2, 0\]"):
            handle.read_numpy((slice(16, 40),))
    finally:
        path.write_bytes(saved)


# --- chunk policy -----------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(1, 5000), min_size=1, max_size=4), itemsize=st.sampled_from([1, 2, 4, 8]),
       target=st.sampled_from([1 << 20, 4 << 20, 8 << 20]))
def test_chunking_invariants(shape, itemsize, target):
    c = choose_chunking(shape, itemsize, target_bytes=target)
    assert len(c.chunk_shape) == len(c.shard_shape) == len(shape)
    assert all(1 <= ch <= s for ch, s in zip(c.chunk_shape, shape))
    assert all(sh % ch == 0 for sh, ch in zip(c.shard_shape, c.chunk_shape))  # whole inner chunks per shard
    assert math.prod(c.chunk_shape) * itemsize <= target
    # rows (the default split dim) stay aligned with every power-of-two split the size allows
    unit = _pow2_unit(shape[0], math.prod(shape[1:]) * itemsize, MIN_CHUNK_BYTES)
    assert unit % c.chunk_shape[0] == 0


def test_small_split_arrays_chunk_down_to_the_floor():
    """A small partitioned array is cut along its split dim down to ``MIN_CHUNK_BYTES`` (16 KiB): a ZeRO-3
    rank of dp=4 over a 64 KiB [128, 128] fp32 parameter then reads exactly one 16 KiB chunk (was: the
    whole 64 KiB one); an array at or below the floor stays one chunk."""
    assert MIN_CHUNK_BYTES == 16 << 10
    assert choose_chunking((128, 128), 4, pattern={"kind": "partitioned", "dim": 0}).chunk_shape == (32, 128)
    assert choose_chunking((4096,), 4).chunk_shape == (4096,)  # a 16 KiB bias: one chunk
    assert choose_chunking((8192,), 4).chunk_shape == (4096,)
    assert choose_chunking((64, 64), 2).chunk_shape == (64, 64)  # 8 KiB


def test_chunking_of_0d_and_empty():
    assert choose_chunking((), 4).chunk_shape == ()
    assert choose_chunking((0, 4), 4).chunk_shape == (1, 4)


def test_content_hash_depends_on_dtype_shape_and_bits():
    a = np.zeros((2, 3), np.float32)
    h = fmt.content_hash(a)
    assert h.startswith(fmt.HASH_PREFIX)
    assert fmt.content_hash(a.reshape(3, 2)) != h
    assert fmt.content_hash(a.view(np.int32)) != h
    b = a.copy()
    b[0, 0] = -0.0
    assert fmt.content_hash(b) != h  # -0.0 == 0.0 numerically, but not bitwise
    assert fmt.content_hash(a.copy()) == h
