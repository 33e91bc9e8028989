"""The local read path (ucp_store/io/localread.py) against TensorStore: identical bytes, identical errors.

Arrays are written by TensorStore itself (``format.create_array``), then read by both paths: every dtype
the store keeps (bf16, fp16, fp32, ints, bool, 0-d), random shapes, chunkings, shard groupings and boxes.
Every corruption TensorStore catches is made on disk (flipped byte in a chunk, in its crc, in the index,
a truncated shard, a missing shard, an index entry past the end of the file, a missing chunk) and both
paths must raise the same ChecksumError naming the array and the chunk.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucp_store
from ucp_store import config, dtypes
from ucp_store.dtypes import numpy_view
from ucp_store.errors import ChecksumError
from ucp_store.io import format as fmt
from ucp_store.io.localread import LocalArray, LocalReadError, is_local_chain, open_reader
from ucp_store.io.location import Location

from ucp_test_helpers import flip_byte, random_bits

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64,
          torch.uint8, torch.bool]
_counter = itertools.count()


@pytest.fixture(scope="module")
def where(tmp_path_factory):
    root = tmp_path_factory.mktemp("localread")
    loc = Location.parse(str(root))
    loc.ensure_root()
    return loc, fmt.make_context()


@pytest.fixture(params=["pread", "mapped"])
def single_path(request, monkeypatch):
    """Single-chunk reads by ``pread`` into scratch, or through the held mapping of the shard file (the
    path of chunks of at least ``MAP_MIN_CHUNK_BYTES``), whatever the chunk size."""
    import ucp_store.io.localread as lr

    monkeypatch.setattr(lr, "MAP_MIN_CHUNK_BYTES", 0 if request.param == "mapped" else 1 << 62)
    return request.param


def _write(where, tensor: torch.Tensor, chunk, per_shard) -> tuple[str, fmt.ArrayLayout]:
    loc, ctx = where
    shape = tuple(tensor.shape)
    shard = tuple(c * p for c, p in zip(chunk, per_shard))
    layout = fmt.ArrayLayout(dtypes.zarr_name(tensor.dtype), shape, tuple(chunk), shard)
    rel = f"arrays/t/{next(_counter)}.zarr"
    fmt.create_array(loc, rel, layout, ctx).write(dtypes.to_numpy(tensor)).result()
    return rel, layout


def _both(where, rel, layout):
    loc, ctx = where
    local = open_reader(loc, rel, layout, ctx)
    assert isinstance(local, LocalArray)
    return local, fmt.open_array(loc, rel, layout, ctx)


@st.composite
def arrays_and_boxes(draw):
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 24), min_size=ndim, max_size=ndim)))
    chunk = tuple(draw(st.integers(1, n)) for n in shape)
    per_shard = tuple(draw(st.integers(1, 3)) for _ in shape)
    box = []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        box.append((lo, draw(st.integers(lo + 1, n))))
    return dtype, shape, chunk, per_shard, tuple(box), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=arrays_and_boxes(), scratch=st.booleans(), mapped=st.booleans())
def test_identical_bytes_to_tensorstore(where, case, scratch, mapped):
    """``scratch``: every chunk read through scratch placed at its file offset's page position and copied
    (the path for destinations at a slow copy distance), else in place wherever the destination allows.
    ``mapped``: single-chunk reads go through the held mapping of the shard file (``_read_single_mapped``,
    the path of large chunks) whatever the chunk size."""
    import ucp_store.io.localread as lr

    saved, saved_map = lr._BAD_DISTANCE, lr.MAP_MIN_CHUNK_BYTES
    lr._BAD_DISTANCE = lr.PAGE + 1 if scratch else saved
    lr.MAP_MIN_CHUNK_BYTES = 0 if mapped else 1 << 62
    try:
        _identical(where, case)
    finally:
        lr._BAD_DISTANCE, lr.MAP_MIN_CHUNK_BYTES = saved, saved_map


def _identical(where, case):
    dtype, shape, chunk, per_shard, box, seed = case
    x = random_bits(shape, dtype, torch.Generator().manual_seed(seed))
    rel, layout = _write(where, x, chunk, per_shard)
    local, ts_handle = _both(where, rel, layout)
    index = fmt.box_index(box)
    got = local[index].read().result()
    want = ts_handle[index].read().result()
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    # the whole array too, and into a strided destination (every other element of a larger buffer)
    full = tuple((0, n) for n in shape)
    assert local.read(full).tobytes() == ts_handle[fmt.box_index(full)].read().result().tobytes()
    if shape:
        big = np.zeros(tuple(2 * (hi - lo) for lo, hi in box), local.dtype)
        dest = big[tuple(slice(None, None, 2) for _ in box)]
        local.read_into(box, dest)
        assert dest.tobytes() == want.tobytes()
        assert not big[tuple(slice(1, None, 2) for _ in box)].any()  # nothing written outside the view


def test_large_read_uses_threads_and_matches(where, monkeypatch):
    import ucp_store.io.localread as lr

    monkeypatch.setattr(lr, "PARALLEL_BYTES", 1 << 16)
    monkeypatch.setattr(lr, "RUN_BYTES", 1 << 15)
    advised = []
    real_fadvise = lr.os.posix_fadvise
    monkeypatch.setattr(lr.os, "posix_fadvise", lambda fd, off, n, how: (advised.append((off, n, how)),
                                                                         real_fadvise(fd, off, n, how))[1])
    x = random_bits((512, 256), torch.float32, torch.Generator().manual_seed(1))
    rel, layout = _write(where, x, (16, 128), (8, 1))
    local, ts_handle = _both(where, rel, layout)
    for box in [((0, 512), (0, 256)), ((3, 500), (7, 250)), ((100, 101), (0, 256))]:
        assert local.read(box).tobytes() == ts_handle[fmt.box_index(box)].read().result().tobytes()
    # the split reads asked the kernel to read ahead each shard file's span at once (one call per file),
    # and each segment's reads were announced as sequential
    chunk = 16 * 128 * 4 + 4
    willneed = [a for a in advised if a[2] == lr.os.POSIX_FADV_WILLNEED]
    assert willneed and all(n >= chunk and n % chunk == 0 for _, n, _how in willneed)
    seq = [a for a in advised if a[2] == lr.os.POSIX_FADV_SEQUENTIAL]
    assert seq and all(n >= chunk and n % chunk == 0 for _, n, _how in seq)


def test_large_read_segments_match(where, monkeypatch):
    """A large read split into contiguous segments per file, each through its own open file, returns
    TensorStore's bytes, and a corrupt chunk is caught."""
    import ucp_store.io.localread as lr

    monkeypatch.setattr(lr, "PARALLEL_BYTES", 1 << 16)
    monkeypatch.setattr(lr, "RUN_BYTES", 1 << 14)
    monkeypatch.setattr(lr, "SEGMENT_MIN_BYTES", 1 << 15)
    opened = []
    real_open = lr.os.open
    monkeypatch.setattr(lr.os, "open", lambda path, flags, *a: (opened.append(path), real_open(path, flags, *a))[1])
    x = random_bits((1024, 64), torch.float32, torch.Generator().manual_seed(2))
    rel, layout = _write(where, x, (16, 64), (16, 1))  # 4 shard files of 256 rows, 16 chunks of 4 KiB each
    local, ts_handle = _both(where, rel, layout)
    for box in [((0, 1024), (0, 64)), ((5, 1000), (3, 60))]:
        opened.clear()
        assert local.read(box).tobytes() == ts_handle[fmt.box_index(box)].read().result().tobytes()
        per_file = max(opened.count(p) for p in set(opened))
        assert per_file > 1  # a file opened again per segment
    shard = os.path.join(where[0].root, rel, "c", "1", "0")
    with open(shard, "r+b") as f:
        f.seek(5 * (16 * 64 * 4 + 4) + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(LocalReadError, match="crc32c checksum mismatch"):
        local.read(((0, 1024), (0, 64)))


def test_segments_cut_each_file_in_order():
    import ucp_store.io.localread as lr

    runs = [(fd, "k", [(off, None)], 1 << 20) for fd in (3, 4) for off in range(0, 16 << 20, 1 << 20)]
    runs += [(5, "k", [(0, None)], 1 << 20)]
    tasks = lr._segments(runs, 33 << 20)
    assert [r for _own, seg in tasks for r in seg] == runs  # every run once, in order
    for own, seg in tasks:
        assert len({r[0] for r in seg}) == 1  # one file per segment
        assert own == (sum(1 for _o, s in tasks if s[0][0] == seg[0][0]) > 1)
    assert sum(1 for _o, s in tasks if s[0][0] == 3) > 1  # a 16 MiB file is split
    assert [s for _o, s in tasks if s[0][0] == 5] == [[runs[-1]]]


# --- routing ----------------------------------------------------------------------------------------

def test_open_reader_picks_local_only_for_the_plain_chain(where):
    loc, ctx = where
    x = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    rel, layout = _write(where, x, (4, 8), (1, 1))
    assert isinstance(open_reader(loc, rel, layout, ctx), LocalArray)
    assert is_local_chain(layout.codecs(), layout)
    zstd = fmt.ArrayLayout(layout.dtype, layout.shape, layout.chunk_shape, layout.shard_shape, "zstd")
    assert not is_local_chain(zstd.codecs(), zstd)
    zrel = f"arrays/t/{next(_counter)}.zarr"
    fmt.create_array(loc, zrel, zstd, ctx).write(x.numpy()).result()
    h = open_reader(loc, zrel, zstd, ctx)
    assert not isinstance(h, LocalArray)
    assert np.array_equal(h.read().result(), x.numpy())
    # any other chain (index at the start, another inner codec) stays with TensorStore
    other = layout.codecs()
    other[0] = {**other[0], "configuration": {**other[0]["configuration"], "index_location": "start"}}
    assert not is_local_chain(other, layout)
    assert not isinstance(open_reader(loc, rel, layout, ctx, codecs=other), LocalArray)
    s3 = Location.parse("s3://bucket/prefix?catalog=sqlite:///x.db&endpoint=http://127.0.0.1:9")
    assert not isinstance(open_reader(s3, rel, layout, ctx), LocalArray)


def test_numpy_view_shares_memory_for_bf16_and_strided():
    t = torch.zeros(4, 6, dtype=torch.bfloat16)
    v = numpy_view(t[:, ::2])
    v[...] = np.ones(v.shape, v.dtype)
    assert t[:, ::2].float().eq(1).all() and t[:, 1::2].float().eq(0).all()



@pytest.mark.parametrize("name", dtypes.SUPPORTED)
def test_numpy_view_and_from_numpy_as_share_memory_and_bits(name):
    """The one carrier table (dtypes): a tensor seen by numpy and back is the same memory and the same bits
    for every storable dtype, including those torch cannot hand to numpy as they are (bf16, uint16/32/64)."""
    t = random_bits((3, 5), dtypes.torch_dtype(name), torch.Generator().manual_seed(5))
    v = numpy_view(t)
    assert v.dtype == dtypes.numpy_dtype(name) and v.ctypes.data == t.data_ptr()
    back = dtypes.from_numpy_as(v, t.dtype)
    assert back.dtype == t.dtype and back.data_ptr() == t.data_ptr()
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))

# --- corruption: both paths, the same ChecksumError ---------------------------------------------------

SHAPE, CHUNK, PER_SHARD = (40, 30), (8, 10), (2, 3)  # chunk grid 5 x 3; shard files c/0/0, c/1/0, c/2/0


def _shard_path(loc, rel, sidx) -> Path:
    return Path(loc.root) / rel / "c" / Path(*map(str, sidx))


def _index(path: Path, n: int) -> tuple[bytes, int]:
    raw = path.read_bytes()
    return raw, len(raw) - 16 * n - 4


def _set_entry(path: Path, n: int, local: int, off: int, nb: int) -> None:
    """Rewrite one index entry and re-seal the index crc32c: only the entry itself is then wrong."""
    raw, start = _index(path, n)
    body = bytearray(raw[start:start + 16 * n])
    struct.pack_into("<QQ", body, 16 * local, off, nb)
    path.write_bytes(raw[:start] + bytes(body) + google_crc32c.value(bytes(body)).to_bytes(4, "little"))


def _entry(path: Path, n: int, local: int) -> tuple[int, int]:
    raw, start = _index(path, n)
    return struct.unpack_from("<QQ", raw, start + 16 * local)


N = PER_SHARD[0] * PER_SHARD[1]


def _corrupt(case: str, path: Path):
    """Apply one corruption to shard ``path`` (chunk (1, 1) of the shard is local entry 4)."""
    local = 1 * PER_SHARD[1] + 1
    off, nb = _entry(path, N, local)
    if case == "chunk byte":
        flip_byte(path, off + 5)
    elif case == "chunk crc":
        flip_byte(path, off + nb - 2)
    elif case == "index byte":
        flip_byte(path, path.stat().st_size - 4 - 16 * N + 16 * local + 3)
    elif case == "index crc":
        flip_byte(path, path.stat().st_size - 1)
    elif case == "truncated":
        raw = path.read_bytes()
        path.write_bytes(raw[:len(raw) - 7])
    elif case == "truncated below index":
        path.write_bytes(path.read_bytes()[:50])
    elif case == "missing shard":
        path.unlink()
    elif case == "entry past end of file":
        _set_entry(path, N, local, path.stat().st_size + 100, nb)
    elif case == "entry overlaps the index":
        _set_entry(path, N, local, path.stat().st_size - 4 - 16 * N - nb + 8, nb)
    elif case == "missing chunk":
        _set_entry(path, N, local, 2**64 - 1, 2**64 - 1)
    else:
        raise AssertionError(case)


CASES = ["chunk byte", "chunk crc", "index byte", "index crc", "truncated", "truncated below index", "missing shard",
         "entry past end of file", "entry overlaps the index", "missing chunk"]


@pytest.mark.parametrize("case", CASES)
def test_corruption_same_error_on_both_paths(where, single_path, case):
    loc, _ = where
    x = random_bits(SHAPE, torch.float32, torch.Generator().manual_seed(3))
    rel, layout = _write(where, x, CHUNK, PER_SHARD)
    local, ts_handle = _both(where, rel, layout)
    path = _shard_path(loc, rel, (1, 0))  # chunks (2..3, 0..2); the corrupted one is chunk [3, 1]
    saved = path.read_bytes()
    _corrupt(case, path)
    url = loc.display(rel)
    try:
        messages = {}
        for name, handle in (("local", local), ("tensorstore", ts_handle)):
            for box in [((0, 40), (0, 30)), ((25, 26), (12, 13)), ((16, 32), (0, 30))]:
                with pytest.raises(ChecksumError) as exc:
                    fmt.read_box(handle, layout, box, what="tensor 'x' state 'fp32'", array_url=url)
                messages.setdefault(box, {})[name] = str(exc.value)
            # a shard that was not touched still reads, on both paths
            assert (fmt.read_box(handle, layout, ((0, 16), (0, 30)), what="x", array_url=url).tobytes()
                    == x.numpy()[:16].tobytes())
        for box, by_path in messages.items():
            assert by_path["local"] == by_path["tensorstore"], (case, box)
            assert url in by_path["local"] and "chunk [" in by_path["local"]
        bad_local = fmt.verify_array(local, layout, url).bad_chunks
        bad_ts = fmt.verify_array(ts_handle, layout, url).bad_chunks
        assert [c for c, _ in bad_local] == [c for c, _ in bad_ts] and bad_local
        if case in ("chunk byte", "chunk crc", "entry past end of file", "entry overlaps the index",
                    "missing chunk"):
            assert [c for c, _ in bad_local] == [(3, 1)]
            assert "chunk [3, 1] (shard file c/1/0)" in messages[((25, 26), (12, 13))]["local"]
        if case in ("missing shard", "missing chunk"):  # verify words these as missing, never as zeros
            assert all("missing" in e or "NOT_FOUND" in e for _, e in bad_local)
    finally:
        path.write_bytes(saved)
    assert local.read(((0, 40), (0, 30))).tobytes() == x.numpy().tobytes()


def test_scalar_corruption_and_missing(where):
    loc, _ = where
    rel, layout = _write(where, torch.tensor(2.5), (), ())
    local, ts_handle = _both(where, rel, layout)
    path = Path(loc.root) / rel / "c"
    saved = path.read_bytes()
    url = loc.display(rel)
    try:
        for mutate in (lambda: flip_byte(path, 1), lambda: flip_byte(path, len(saved) - 1), path.unlink,
                       lambda: path.write_bytes(saved[:3])):
            path.write_bytes(saved)
            mutate()
            msgs = []
            for handle in (local, ts_handle):
                with pytest.raises(ChecksumError) as exc:
                    fmt.read_box(handle, layout, (), what="s", array_url=url)
                msgs.append(str(exc.value))
            assert msgs[0] == msgs[1]
    finally:
        path.write_bytes(saved)
    assert local.read(()).item() == 2.5


# --- through the store: every read entry point on the local path agrees with TensorStore ---------------

def test_store_reads_agree_with_tensorstore(tmp_path, monkeypatch):
    from ucp_store.topology import Topology

    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    g = torch.Generator().manual_seed(7)
    state = {"a.weight": random_bits((64, 48), torch.float32, g), "b.weight": random_bits((33, 17), torch.bfloat16, g),
             "c.bias": random_bits((48,), torch.float16, g), "d.flag": random_bits((5,), torch.bool, g),
             "e.step": torch.tensor(3, dtype=torch.int64)}
    store.save("r", 1, state, state="weight")
    ck = store.checkpoint("r@1")
    assert all(isinstance(ck.tensor(n, "weight").ts(), LocalArray) for n in state)

    def reads():
        c = store.checkpoint("r@1")
        sd = c.state_dict("weight")
        row = c.tensor("a.weight", "weight")[5, 3:40]
        shard = c.load_shard(Topology(tp=2), 1, states=["weight"])
        stats = [s.to_json() for s in c.stats()]
        return sd, row, shard, stats, c.verify()

    local = reads()
    with config.override(local_read=False):
        assert not isinstance(store.checkpoint("r@1").tensor("a.weight", "weight").ts(), LocalArray)
        tsr = reads()

    def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (a.dtype == b.dtype and a.shape == b.shape
                and dtypes.to_numpy(a).tobytes() == dtypes.to_numpy(b).tobytes())

    for n, t in state.items():
        assert same_bits(local[0][n], t) and same_bits(tsr[0][n], t)
    assert same_bits(local[1], tsr[1]) and same_bits(local[1], state["a.weight"][5, 3:40])
    assert local[2].tensors.keys() == tsr[2].tensors.keys() and local[2].tensors
    for k, t in local[2].tensors.items():
        assert same_bits(t, tsr[2].tensors[k])
    assert json.dumps(local[3], sort_keys=True) == json.dumps(tsr[3], sort_keys=True)  # NaN-safe equality
    assert local[4] == tsr[4] == []


def test_load_shard_casts_and_reads_in_place(tmp_path):
    from ucp_store.topology import Topology

    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    store.save("r", 1, {"w": w}, state="fp32")
    ck = store.checkpoint("r@1")
    same = ck.load_shard(Topology(tp=2), 0, states=["fp32"])
    cast = ck.load_shard(Topology(tp=2), 0, states=["fp32"], dtype=torch.bfloat16)
    (k, a), = same.tensors.items()
    assert torch.equal(a, w)  # no pattern: replicated, the whole tensor on every rank
    assert torch.equal(cast.tensors[k], a.bfloat16())


def test_corrupt_store_array_named_through_load_shard(tmp_path):
    from ucp_store.topology import Topology

    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(2))
    store.save("r", 1, {"w": w}, state="fp32")
    ck = store.checkpoint("r@1")
    info = ck.info("w", "fp32")
    path = next((Path(store.location.root) / info.array / "c").rglob("*"))
    while path.is_dir():
        path = next(path.iterdir())
    flip_byte(path, 100)
    with pytest.raises(ChecksumError, match=r"tensor 'w' state 'fp32' of checkpoint .* chunk \[0, 0\]"):
        ck.load_shard(Topology(tp=2), 0, states=["fp32"])
    with pytest.raises(ChecksumError, match=r"chunk \[0, 0\]"):
        store.checkpoint("r@1").state_dict("fp32")
    problems = store.checkpoint("r@1").verify()
    assert [p["chunk"] for p in problems] == [[0, 0]] and "crc32c mismatch" in problems[0]["error"]


def test_state_dict_streams_whole_reads(tmp_path, monkeypatch):
    """state_dict's large reads run several at once, each shard file one stream (a file over STREAM_BYTES
    in several, each through its own open file): the stored bytes, and a corrupt chunk is named with its
    tensor."""
    import ucp_store.io.localread as lr
    import ucp_store.io.read as uio

    monkeypatch.setattr(uio, "PARALLEL_BYTES", 1 << 15)
    monkeypatch.setattr(lr, "PARALLEL_BYTES", 1 << 15)
    monkeypatch.setattr(lr, "STREAM_BYTES", 1 << 18)
    monkeypatch.setattr(lr, "RUN_BYTES", 1 << 17)
    store = ucp_store.open_store(str(tmp_path / "s"), create=True, chunk_target_bytes=128 << 10)
    g = torch.Generator().manual_seed(5)
    state = {f"l{i}.w": random_bits((1024, 256), torch.float32, g) for i in range(3)}
    state["small"] = random_bits((4, 4), torch.bfloat16, g)
    store.save("r", 1, state, state="weight")
    streamed = []
    real = lr.LocalArray.read_streamed
    monkeypatch.setattr(lr.LocalArray, "read_streamed", lambda self, box: (streamed.append(box), real(self, box))[1])
    sd = store.checkpoint("r@1").state_dict("weight")
    assert sd.keys() == state.keys()
    for n, t in state.items():
        assert sd[n].dtype == t.dtype and dtypes.to_numpy(sd[n]).tobytes() == dtypes.to_numpy(t).tobytes()
    assert len(streamed) == 3  # the three 1 MiB arrays, never the small one
    info = store.checkpoint("r@1").info("l1.w", "weight")
    path = next(p for p in (Path(store.location.root) / info.array / "c").rglob("*") if p.is_file())
    flip_byte(path, 100)
    with pytest.raises(ChecksumError, match=r"tensor 'l1.w' state 'weight' of checkpoint .* chunk \[0, 0\]"):
        store.checkpoint("r@1").state_dict("weight")


def test_small_chunk_target_store_reads_rows(tmp_path):
    """A store may choose inner chunks down to 128 KiB (rows then cost a quarter of the default's bytes)."""
    store = ucp_store.open_store(str(tmp_path / "s"), create=True, chunk_target_bytes=256 << 10)
    w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(4))
    store.save("r", 1, {"w": w}, state="fp32")
    h = store.checkpoint("r@1").tensor("w", "fp32")
    assert math.prod(h.info.chunk_shape) * 4 <= 256 << 10
    assert isinstance(h.ts(), LocalArray)
    assert torch.equal(h[300], w[300]) and torch.equal(h[:, 7], w[:, 7]) and torch.equal(h.read(), w)


def test_held_handle_row_reads_go_through_the_mapping(tmp_path, monkeypatch):
    """A row through a held handle, chunks of whole rows (as the policy cuts a large parameter, whose 1 MiB
    chunks take this path; here the size threshold is lowered): one chunk through the held mapping of its
    shard file (crc32c in place, only the row copied), the same bytes as written, and a flipped byte in
    that chunk still a ChecksumError naming the array and the chunk."""
    import ucp_store.io.localread as lr

    monkeypatch.setattr(lr, "MAP_MIN_CHUNK_BYTES", 1)
    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(8))
    store.save("r", 1, {"w": w}, state="fp32")
    h = store.checkpoint("r@1").tensor("w", "fp32")
    assert h.info.chunk_shape[1:] == (1024,) and h.info.chunk_shape[0] > 1
    calls = []
    real = LocalArray._read_single_mapped
    monkeypatch.setattr(LocalArray, "_read_single_mapped",
                        lambda self, *a: (calls.append(a[0]), real(self, *a))[1])
    for row in (0, 300, 1023, -1, -1024):
        assert torch.equal(h[row], w[row])
    assert torch.equal(h[5:9], w[5:9]) and torch.equal(h[7, 3:900], w[7, 3:900])
    assert len(calls) == 7
    path = str(Path(store.location.root) / h.info.array / "c" / "0" / "0")
    assert path in lr._maps  # held: the next read of this shard maps nothing
    with pytest.raises(ucp_store.errors.ValidationError, match="out of bounds"):
        h[1024]
    flip_byte(Path(path), 5)  # in chunk [0, 0], rows 0 .. chunk_shape[0] - 1
    with pytest.raises(ChecksumError, match=r"chunk \[0, 0\]"):
        h[1]
    assert torch.equal(h[1023], w[1023])  # another chunk of the same shard still reads
    v = torch.arange(100, dtype=torch.int64)
    store.save("v", 1, {"v": v}, state="fp32")
    hv = store.checkpoint("v@1").tensor("v", "fp32")
    assert hv[3].shape == () and int(hv[3]) == 3 and int(hv[-1]) == 99 and torch.equal(hv[2:5], v[2:5])
    assert int(hv[7]) == 7 and hv[7].dtype == torch.int64  # held: the one-row path gives a 0-d tensor


def test_default_policy_cuts_a_large_parameter_into_mapped_row_chunks():
    """The default policy gives a 256 MiB fp32 parameter 256 KiB chunks of whole rows: a row read touches
    one chunk, large enough for the mapped single-chunk path."""
    import ucp_store.io.localread as lr
    from ucp_store.io.chunking import DEFAULT_TARGET, choose_chunking

    c = choose_chunking((8192, 8192), 4)
    assert c.chunk_shape == (8, 8192) and math.prod(c.chunk_shape) * 4 == DEFAULT_TARGET == 256 << 10
    assert math.prod(c.chunk_shape) * 4 >= lr.MAP_MIN_CHUNK_BYTES


@pytest.mark.parametrize("case", ["index byte", "index crc", "entry past end of file", "missing chunk",
                                  "truncated", "missing shard"])
def test_held_handle_sees_index_changes_after_caching(where, single_path, case):
    """A held LocalArray caches each shard's checked index; a later change to the file is still caught."""
    import time

    loc, _ = where
    x = random_bits(SHAPE, torch.float32, torch.Generator().manual_seed(5))
    rel, layout = _write(where, x, CHUNK, PER_SHARD)
    local, _ = _both(where, rel, layout)
    assert local.read(((0, 40), (0, 30))).tobytes() == x.numpy().tobytes()  # every index now cached
    assert local.read(((25, 26), (12, 13))).tobytes() == x.numpy()[25:26, 12:13].tobytes()
    path = _shard_path(loc, rel, (1, 0))
    saved = path.read_bytes()
    time.sleep(0.02)  # past the filesystem's timestamp granularity: the write below changes mtime/ctime
    _corrupt(case, path)
    url = loc.display(rel)
    try:
        for box in [((0, 40), (0, 30)), ((25, 26), (12, 13))]:
            with pytest.raises(ChecksumError, match=r"chunk \[") as exc:
                fmt.read_box(local, layout, box, what="tensor 'x' state 'fp32'", array_url=url)
            assert url in str(exc.value)
    finally:
        time.sleep(0.02)
        path.write_bytes(saved)
    assert local.read(((0, 40), (0, 30))).tobytes() == x.numpy().tobytes()


def test_held_handle_sees_a_replaced_shard(where, single_path):
    """A shard file replaced by another with the same size (a re-save) is read as it is now."""
    loc, ctx = where
    x = random_bits(SHAPE, torch.float32, torch.Generator().manual_seed(6))
    y = random_bits(SHAPE, torch.float32, torch.Generator().manual_seed(7))
    rel, layout = _write(where, x, CHUNK, PER_SHARD)
    rel_y, _ = _write(where, y, CHUNK, PER_SHARD)
    local, _ = _both(where, rel, layout)
    assert local.read(((0, 40), (0, 30))).tobytes() == x.numpy().tobytes()
    for sidx in [(0, 0), (1, 0), (2, 0), (3, 0)]:
        src, dst = _shard_path(loc, rel_y, sidx), _shard_path(loc, rel, sidx)
        if src.exists():
            tmp = dst.with_suffix(".new")
            tmp.write_bytes(src.read_bytes())
            tmp.replace(dst)
    assert local.read(((0, 40), (0, 30))).tobytes() == y.numpy().tobytes()
    assert local.read(((25, 26), (12, 13))).tobytes() == y.numpy()[25:26, 12:13].tobytes()


# --- whole-row reads (chunks of whole rows) and the slow-copy distance ---------------------------------

ROWS_SHAPE, ROWS_CHUNK, ROWS_PER_SHARD = (40, 6, 5), (4, 6, 5), (3, 1, 1)  # 10 chunks of whole rows, 4 shards


@pytest.mark.parametrize("scratch_all", [False, True])
@pytest.mark.parametrize("per_shard", [ROWS_PER_SHARD, (3, 2, 1)])
def test_whole_row_reads_match_tensorstore(where, monkeypatch, scratch_all, per_shard):
    """Boxes of whole rows take the per-shard vectorized path (``_read_rows``): every start/stop against
    the chunk edges, the array's edge chunk, shards whose grid also spans trailing dims, and every chunk
    read through scratch (the slow-distance fallback) or in place."""
    import ucp_store.io.localread as lr

    if scratch_all:
        monkeypatch.setattr(lr, "_BAD_DISTANCE", lr.PAGE + 1)  # every in-place chunk counts as slow
    shape = (38,) + ROWS_SHAPE[1:]  # 38 rows: the last chunk is an edge chunk (2 of its 4 rows)
    x = random_bits(shape, torch.float32, torch.Generator().manual_seed(11))
    rel, layout = _write(where, x, ROWS_CHUNK, per_shard)
    local, ts_handle = _both(where, rel, layout)
    assert local._slab
    calls = []
    real = local._read_rows
    monkeypatch.setattr(local, "_read_rows",
                        lambda lo, hi, out, flags=0: (calls.append((lo, hi)), real(lo, hi, out, flags))[1])
    for lo in range(0, 38, 3):
        for hi in range(lo + 1, 39, 5):
            box = ((lo, hi), (0, 6), (0, 5))
            want = ts_handle[fmt.box_index(box)].read().result()
            assert local.read(box).tobytes() == want.tobytes(), box
    assert len(calls) > 20  # the multi-chunk boxes went through _read_rows


def test_scratch_placement_and_copy_match_the_file_offset():
    import ucp_store.io.localread as lr

    buf, addr = lr._scratch_buffer(8 * (100 + lr.PAGE))
    pos = 0
    for off in (0, 4100, 9, 8191):
        enc, pos = lr._placed(buf, addr, pos, off, 100)
        assert (enc.ctypes.data - off) % lr.PAGE == 0 and len(enc) == 100
        half, pos = lr._placed(buf, addr, pos, off, 100, lr._HALF_PAGE)
        assert (half.ctypes.data - off) % lr.PAGE == lr._HALF_PAGE  # both copies half a page apart
    assert lr.bad_distance(4096 + 16, 0) and lr.bad_distance(20, 4) and not lr.bad_distance(0, 0)
    assert not lr.bad_distance(4, 20) and not lr.bad_distance(64, 0)
    for dtype in (np.float32, np.float16, np.int64, np.bool_, np.complex128):
        src = (np.arange(4096) % 7).astype(dtype).reshape(64, 64)
        dst = np.zeros((64, 128), dtype)[:, ::2]
        lr.copy_into(dst, src)
        assert np.array_equal(dst, src)


ROWS_CASES = ["chunk byte", "chunk crc", "index byte", "truncated", "missing shard", "entry past end of file",
              "missing chunk"]


@pytest.mark.parametrize("case", ROWS_CASES)
def test_whole_row_read_corruption_same_error(where, case):
    """The whole-row path checks every index entry (vectorized) and every crc: same ChecksumError as
    TensorStore, naming chunk [4, 0, 0] (shard file c/1/0/0, its second chunk)."""
    loc, _ = where
    x = random_bits(ROWS_SHAPE, torch.float32, torch.Generator().manual_seed(12))
    rel, layout = _write(where, x, ROWS_CHUNK, ROWS_PER_SHARD)
    local, ts_handle = _both(where, rel, layout)
    path = _shard_path(loc, rel, (1, 0, 0))
    saved = path.read_bytes()
    n = ROWS_PER_SHARD[0]
    raw, start = _index(path, n)
    off, nb = struct.unpack_from("<QQ", raw, start + 16)
    if case == "chunk byte":
        flip_byte(path, off + 5)
    elif case == "chunk crc":
        flip_byte(path, off + nb - 2)
    elif case == "index byte":
        flip_byte(path, start + 16 + 3)
    elif case == "truncated":
        path.write_bytes(raw[:len(raw) - 7])
    elif case == "missing shard":
        path.unlink()
    elif case == "entry past end of file":
        _set_entry(path, n, 1, len(raw) + 100, nb)
    else:
        _set_entry(path, n, 1, 2**64 - 1, 2**64 - 1)
    url = loc.display(rel)
    try:
        for box in [((0, 40), (0, 6), (0, 5)), ((13, 29), (0, 6), (0, 5))]:
            msgs = []
            for handle in (local, ts_handle):
                with pytest.raises(ChecksumError) as exc:
                    fmt.read_box(handle, layout, box, what="tensor 'x' state 'fp32'", array_url=url)
                msgs.append(str(exc.value))
            assert msgs[0] == msgs[1] and url in msgs[0], (case, box)
            if case not in ("index byte", "truncated", "missing shard"):
                assert "chunk [4, 0, 0]" in msgs[0]
        # rows in untouched shards still read
        assert local.read(((0, 12), (0, 6), (0, 5))).tobytes() == x.numpy()[:12].tobytes()
    finally:
        path.write_bytes(saved)
    assert local.read(((0, 40), (0, 6), (0, 5))).tobytes() == x.numpy().tobytes()


def _layer_store(tmp_path, n: int, shape: tuple, *, dim: int, seed: int, **store_kw):
    """A store holding ``n`` fp32 tensors ``layers.<i>.w`` of ``shape``, each on layer ``i`` and partitioned
    along ``dim`` (checkpoint ``r@1``), and the tensors."""
    store = ucp_store.open_store(str(tmp_path / "s"), create=True, **store_kw)
    g = torch.Generator().manual_seed(seed)
    ws = {f"layers.{i}.w": torch.randn(*shape, generator=g) for i in range(n)}
    with store.begin("r", 1) as w:
        for i, (name, t) in enumerate(ws.items()):
            w.write(name, "fp32", t, pattern={"kind": "partitioned", "dim": dim, "placement": {"layer": i}})
    return store, ws


def test_load_shard_batches_small_reads_and_holds_readers(tmp_path, monkeypatch):
    """Small local reads go to the pool in batches; a read failing mid-batch is named (ChecksumError for
    its tensor), the reads before it still land; readers are held per process and see a repaired file."""
    from ucp_store.io import read as io
    from ucp_store.topology import Topology

    monkeypatch.setattr(io, "_BATCH_READS", 3)
    store, ws = _layer_store(tmp_path, 8, (16, 8), dim=0, seed=9)
    topo = Topology(tp=2)
    ck = store.checkpoint("r@1")
    first = ck.load_shard(topo, 1)
    for name, t in ws.items():
        assert torch.equal(first[(name, "fp32")], t[8:])
    held = dict(io._held)
    infos = {i.name: i for i in ck.tensors()}
    assert all(any(k[1] == infos[n].array for k in held) for n in ws)
    bad = infos["layers.4.w"]
    path = Path(store.location.root) / bad.array / "c" / "0" / "0"
    saved = path.read_bytes()
    flip_byte(path, 40)
    try:
        with pytest.raises(ChecksumError, match=r"layers\.4\.w") as exc:
            store.checkpoint("r@1").load_shard(topo, 1)
        assert "chunk [" in str(exc.value)
    finally:
        path.write_bytes(saved)
    again = store.checkpoint("r@1").load_shard(topo, 1)
    assert all(torch.equal(again[(n, "fp32")], t[8:]) for n, t in ws.items())
    assert all(io._held[k][1] is held[k][1] for k in held)  # the same held readers served the reload


def test_new_store_records_the_default_chunk_target(tmp_path):
    """A new store records the default inner-chunk target in its catalog; an explicit or earlier recorded
    target is kept on reopening; one outside the policy's range is refused naming the range."""
    from ucp_store.errors import ConfigurationError
    from ucp_store.io.chunking import DEFAULT_TARGET, MIN_TARGET

    store = ucp_store.open_store(str(tmp_path / "a"), create=True)
    assert store.settings["chunk_target_bytes"] == DEFAULT_TARGET
    assert ucp_store.open_store(str(tmp_path / "a")).settings["chunk_target_bytes"] == DEFAULT_TARGET
    rep = {"kind": "replicated"}  # no split dims: only the target cuts the chunks
    with store.begin("r", 1) as w:
        w.write("w", "fp32", torch.zeros(1024, 1024), pattern=rep)  # 4 MiB
    assert math.prod(store.checkpoint("r@1").info("w", "fp32").chunk_shape) * 4 == DEFAULT_TARGET
    small = ucp_store.open_store(str(tmp_path / "b"), create=True, chunk_target_bytes=MIN_TARGET)
    assert ucp_store.open_store(str(tmp_path / "b"), create=True).settings["chunk_target_bytes"] == MIN_TARGET
    with small.begin("r", 1) as w:
        w.write("w", "fp32", torch.zeros(1024, 1024), pattern=rep)
    assert math.prod(small.checkpoint("r@1").info("w", "fp32").chunk_shape) * 4 == MIN_TARGET
    with pytest.raises(ConfigurationError, match="128 KiB to 8 MiB"):
        ucp_store.open_store(str(tmp_path / "c"), create=True, chunk_target_bytes=64 << 10)


# --- rows inside one chunk: one preadv straight into place (``read_rows`` / ``_rows_in_chunk``) ---------

ONE_SHAPE, ONE_CHUNK, ONE_PER_SHARD = (24, 3, 8), (8, 3, 8), (2, 1, 1)  # 3 chunks of 8 whole rows, 2 shards


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lo=st.integers(0, 23), n=st.integers(1, 8), shift=st.sampled_from([0, 4, 8, 60, 64, 100, 2048, 4092]),
       flat=st.booleans())
def test_rows_in_one_chunk_read_into_place(where, lo, n, shift, flat):
    """``read_rows`` for rows of one chunk: the rows land straight in the destination (1-d or shaped, at
    every distance from the file offset, the slow ones through the scratch path) and agree with
    TensorStore; nothing outside the destination is written."""
    key = ("rows_one", where[0].root)
    if key not in _ONE:
        x = random_bits(ONE_SHAPE, torch.float32, torch.Generator().manual_seed(21))
        _ONE[key] = (x, *_both(where, *_write(where, x, ONE_CHUNK, ONE_PER_SHARD)))
    x, local, ts_handle = _ONE[key]
    hi = min(lo + n, (lo // 8 + 1) * 8)  # inside lo's chunk
    box = ((lo, hi), (0, 3), (0, 8))
    want = ts_handle[fmt.box_index(box)].read().result()
    count = (hi - lo) * 24
    big = np.zeros(count * 4 + 8192, np.uint8)
    dest = big[shift:shift + count * 4].view(np.float32)
    out = dest if flat else dest.reshape(hi - lo, 3, 8)
    local.read_rows(lo, hi, out)
    assert dest.tobytes() == want.tobytes()
    assert not big[:shift].any() and not big[shift + count * 4:].any()


_ONE: dict = {}


@pytest.mark.parametrize("where_in_chunk", ["before the rows", "in the rows", "after the rows", "crc"])
def test_rows_in_one_chunk_catch_every_flipped_byte(where, monkeypatch, where_in_chunk):
    """A flipped byte anywhere in the chunk (the bytes read into scratch before or after the rows, the rows
    read into place, the stored crc32c) fails the read with TensorStore's ChecksumError naming the chunk;
    the read went through the one-preadv path (not the scratch fallback)."""
    import ucp_store.io.localread as lr

    loc, _ = where
    x = random_bits(ONE_SHAPE, torch.float32, torch.Generator().manual_seed(22))
    rel, layout = _write(where, x, ONE_CHUNK, ONE_PER_SHARD)
    local, ts_handle = _both(where, rel, layout)
    taken = []
    real = lr.LocalArray._rows_in_chunk

    def spy(self, *a):
        taken.append(None)
        taken[-1] = real(self, *a)  # None left when it raised
        return taken[-1]
    monkeypatch.setattr(lr.LocalArray, "_rows_in_chunk", spy)
    path = _shard_path(loc, rel, (0, 0, 0))
    raw, start = _index(path, ONE_PER_SHARD[0])
    off, nb = struct.unpack_from("<QQ", raw, start + 16)  # chunk [1, 0, 0]: rows 8..15
    row = 3 * 8 * 4
    flip_byte(path, off + {"before the rows": row, "in the rows": 3 * row + 5, "after the rows": 7 * row + 1,
                           "crc": nb - 1}[where_in_chunk])
    url = loc.display(rel)
    box = ((10, 13), (0, 3), (0, 8))
    msgs = []
    for handle in (local, ts_handle):
        with pytest.raises(ChecksumError) as exc:
            fmt.read_box(handle, layout, box, what="tensor 'x' state 'fp32'", array_url=url)
        msgs.append(str(exc.value))
    assert msgs[0] == msgs[1] and "chunk [1, 0, 0]" in msgs[0]
    with pytest.raises(lr.LocalReadError, match=r"chunk \[1, 0, 0\].*crc32c"):
        local.read_rows(10, 13, np.zeros(72, np.float32))
    assert len(taken) >= 2 and all(t is None for t in taken)  # every local read failed inside the one-preadv path
    out = np.zeros(96, np.float32)
    local.read_rows(16, 20, out)
    assert taken[-1] is True and out.tobytes() == x.numpy()[16:20].tobytes()  # the other shard still reads


def _spy_reads(monkeypatch, method: str, forced=lambda i: None) -> tuple[list, list]:
    """Record every answer of ``LocalArray.<method>`` (``rows_cached`` / ``box_cached``; ``forced(i)``: the
    i-th call's answer in place of the real one, None for the real one) and the size of every batch the
    small-read pool gets."""
    from ucp_store.io import localread as lr
    from ucp_store.io import read as io

    answers: list = []
    batches: list = []
    real, real_batch = getattr(lr.LocalArray, method), io._read_batch

    def spy(self, *a):
        f = forced(len(answers))
        answers.append(real(self, *a) if f is None else f)
        return answers[-1]

    monkeypatch.setattr(lr.LocalArray, method, spy)
    monkeypatch.setattr(io, "_read_batch", lambda batch: (batches.append(len(batch)), real_batch(batch))[1])
    return answers, batches


@pytest.mark.parametrize("cached", [True, False])
def test_load_shard_rows_in_place_when_cached_else_on_the_pool(tmp_path, monkeypatch, cached):
    """load_shard reads rows the page cache holds in place at once (``rows_cached``); rows it does not hold
    go to the pool in small batches, and after one such read the next ones go there untried
    (``io._COLD_SKIP``). Both give the same tensors (ZeRO-3 fragments and TP row boxes), and a flipped byte
    is a ChecksumError naming the tensor and chunk either way."""
    from ucp_store.io import read as io
    from ucp_store.topology import Topology

    store, ws = _layer_store(tmp_path, 6, (16, 8), dim=0, seed=31)
    results, batches = _spy_reads(monkeypatch, "rows_cached", lambda i: None if cached else False)
    z3, tp2 = Topology(dp=2, zero_stage=3, layers=6), Topology(tp=2)
    for topo in (z3, tp2):
        got = store.checkpoint("r@1").load_shard(topo, 1)
        for name, t in ws.items():
            want = t.reshape(-1)[64:] if topo is z3 else t[8:]
            assert torch.equal(got[(name, "fp32")], want), (topo, name)
    if cached:
        assert len(results) == 12 and any(results)  # just written: in the page cache
    else:
        assert results == [False, False]  # one try per load, the rest untried
        assert sum(batches) == 12 and max(batches) <= io._COLD_BATCH_READS
    bad = store.checkpoint("r@1").info("layers.2.w", "fp32")
    path = Path(store.location.root) / bad.array / "c" / "0" / "0"
    flip_byte(path, 16 * 8 * 4 - 3)  # in rows 8..15, which both ranks of both topologies read
    for topo in (z3, tp2):
        with pytest.raises(ChecksumError, match=r"layers\.2\.w.*chunk \[0, 0\]"):
            store.checkpoint("r@1").load_shard(topo, 1)


# --- boxes inside one chunk the page cache holds: read at once in the caller (``box_cached``) --------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=arrays_and_boxes(), mapped=st.booleans())
def test_box_cached_reads_every_box_like_tensorstore(where, case, mapped):
    """``box_cached`` reads any box of cached shard files as TensorStore does (every dtype, strided
    destinations included; a box inside one chunk of a mapped array by ``pread``, as the mapping's page
    faults cannot be told not to wait) and declines (None, the destination untouched) only a 0-d array."""
    import ucp_store.io.localread as lr

    dtype, shape, chunk, per_shard, box, seed = case
    saved = lr.MAP_MIN_CHUNK_BYTES
    lr.MAP_MIN_CHUNK_BYTES = 0 if mapped else 1 << 62
    try:
        x = random_bits(shape, dtype, torch.Generator().manual_seed(seed))
        rel, layout = _write(where, x, chunk, per_shard)
        local, ts_handle = _both(where, rel, layout)
    finally:
        lr.MAP_MIN_CHUNK_BYTES = saved
    want = ts_handle[fmt.box_index(box)].read().result()
    one_chunk = bool(shape) and all((hi - 1) // c == lo // c for (lo, hi), c in zip(box, chunk))
    big = np.zeros(tuple(2 * n for n in want.shape), local.dtype)
    out = big[tuple(slice(None, None, 2) for _ in want.shape)]  # strided: every other element
    if not lr._NOWAIT:
        pytest.skip("no RWF_NOWAIT on this platform: box_cached never reads")
    got = local.box_cached(box, out)
    assert got is (True if shape else None), (shape, chunk, box)  # never False: the file was just written
    if mapped and one_chunk:
        assert local._mapped_ok
    if got:
        assert out.tobytes() == want.tobytes()
        assert not big[tuple(slice(1, None, 2) for _ in want.shape)].any()  # nothing outside the view
    else:
        assert not big.reshape(-1).view(np.uint8).any()


def _resident_pages(path: Path) -> int:
    """How many of a file's pages the page cache holds (``mincore`` over a mapping of it that touches none)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        anchor = ctypes.c_char.from_buffer(mm)
        vec = (ctypes.c_ubyte * pages)()
        try:
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            del anchor  # the mapping closes only once nothing points into it
        return sum(v & 1 for v in vec)


def _evicted(path: Path) -> bool:
    """Drop a file's pages from the page cache (written back first: dirty pages stay), checked with
    ``mincore``; tried again a few times, as a page still in a CPU's LRU batch is not dropped at once.
    False where the pages stay anyway (tmpfs keeps file pages in memory)."""
    import time

    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        for _ in range(50):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if not _resident_pages(path):
                return True
            time.sleep(0.01)
        return False
    finally:
        os.close(fd)


def test_box_cached_declines_what_the_page_cache_lacks(where):
    """Neither the shard index nor the chunk cached: False, the destination untouched; the blocking read
    brings both in and box_cached then reads; the index held and the chunk evicted again: False again."""
    import ucp_store.io.localread as lr

    if not lr._NOWAIT or not hasattr(os, "posix_fadvise"):
        pytest.skip("no RWF_NOWAIT or posix_fadvise on this platform")
    loc, _ = where
    x = random_bits(SHAPE, torch.float32, torch.Generator().manual_seed(5))
    rel, layout = _write(where, x, CHUNK, PER_SHARD)
    local, _ = _both(where, rel, layout)
    path = _shard_path(loc, rel, (1, 0))
    box = ((25, 27), (12, 15))  # inside chunk [3, 1], shard file c/1/0
    want = x.numpy()[25:27, 12:15].tobytes()
    if not _evicted(path):
        pytest.skip("this filesystem keeps file pages in memory (tmpfs): nothing to evict")
    out = np.zeros((2, 3), np.float32)
    assert local.box_cached(box, out) is False and not out.any()
    local.read_into(box, out)  # the blocking read, as the pool's
    assert out.tobytes() == want
    again = np.zeros((2, 3), np.float32)
    assert local.box_cached(box, again) is True and again.tobytes() == want
    assert _evicted(path)
    evicted = np.zeros((2, 3), np.float32)
    assert local.box_cached(box, evicted) is False and not evicted.any()
    # a box over several chunks of two shard files (c/0/0 and c/1/0): one of them evicted is enough
    wide, want_wide = ((10, 30), (5, 25)), x.numpy()[10:30, 5:25].tobytes()
    assert _evicted(path)
    out = np.zeros((20, 20), np.float32)
    assert local.box_cached(wide, out) is False
    local.read_into(wide, out)
    assert out.tobytes() == want_wide
    again = np.zeros((20, 20), np.float32)
    assert local.box_cached(wide, again) is True and again.tobytes() == want_wide


def test_rows_cached_reads_a_mapped_arrays_chunk_by_pread(where, monkeypatch):
    """A mapped array's rows inside one chunk (large chunks: blocking reads go through the mapping) are
    read by ``rows_cached`` with a ``pread``, as the mapping's page faults cannot be told not to wait."""
    import ucp_store.io.localread as lr

    if not lr._NOWAIT:
        pytest.skip("no RWF_NOWAIT on this platform")
    monkeypatch.setattr(lr, "MAP_MIN_CHUNK_BYTES", 0)
    x = random_bits(ONE_SHAPE, torch.float32, torch.Generator().manual_seed(24))
    local, ts_handle = _both(where, *_write(where, x, ONE_CHUNK, ONE_PER_SHARD))
    assert local._mapped_ok
    mapped = []
    monkeypatch.setattr(lr, "_mapped", lambda *a: mapped.append(a))  # the mapping is not used
    want = ts_handle[fmt.box_index(((9, 14), (0, 3), (0, 8)))].read().result().tobytes()
    flat = np.zeros(5 * 24, np.float32).view(np.uint8)
    assert local.rows_cached(9, 14, flat, flat.ctypes.data) is True and flat.tobytes() == want and not mapped


def test_rows_cached_over_several_chunks(where):
    """Rows over several chunks and shard files: read at once when cached (and equal to TensorStore's),
    False when a shard file is not in the page cache, read at once again after the blocking read."""
    import ucp_store.io.localread as lr

    if not lr._NOWAIT or not hasattr(os, "posix_fadvise"):
        pytest.skip("no RWF_NOWAIT or posix_fadvise on this platform")
    loc, _ = where
    x = random_bits(ONE_SHAPE, torch.float32, torch.Generator().manual_seed(23))
    rel, layout = _write(where, x, ONE_CHUNK, ONE_PER_SHARD)  # chunks of 8 rows, 2 chunks a shard file
    local, ts_handle = _both(where, rel, layout)
    want = ts_handle[fmt.box_index(((4, 21), (0, 3), (0, 8)))].read().result().tobytes()
    flat = np.zeros(17 * 24, np.float32).view(np.uint8)
    assert local.rows_cached(4, 21, flat, flat.ctypes.data) is True and flat.tobytes() == want
    path = _shard_path(loc, rel, (1, 0, 0))  # rows 16..23
    if not _evicted(path):
        pytest.skip("this filesystem keeps file pages in memory (tmpfs): nothing to evict")
    flat = np.zeros(17 * 24, np.float32).view(np.uint8)
    assert local.rows_cached(4, 21, flat, flat.ctypes.data) is False
    local.read_rows(4, 21, flat.view(np.float32))
    assert flat.tobytes() == want
    again = np.zeros(17 * 24, np.float32).view(np.uint8)
    assert local.rows_cached(4, 21, again, again.ctypes.data) is True and again.tobytes() == want


@pytest.mark.parametrize("box", [((25, 26), (12, 13)), ((20, 32), (5, 25))], ids=["one chunk", "several chunks"])
@pytest.mark.parametrize("case", CASES)
def test_box_cached_raises_what_the_blocking_read_raises(where, case, box):
    """Every corruption of a chunk's shard file fails ``box_cached`` (a reader holding no index yet) with
    the error ``read_into`` gives, for a box in that chunk and one over several chunks; nothing is read as
    zeros."""
    import ucp_store.io.localread as lr

    if not lr._NOWAIT:
        pytest.skip("no RWF_NOWAIT on this platform: box_cached never reads")
    loc, _ = where
    x = random_bits(SHAPE, torch.float32, torch.Generator().manual_seed(6))
    rel, layout = _write(where, x, CHUNK, PER_SHARD)
    path = _shard_path(loc, rel, (1, 0))
    saved = path.read_bytes()
    _corrupt(case, path)  # chunk [3, 1], which both boxes cover
    shape = tuple(hi - lo for lo, hi in box)
    try:
        blocking, _ = _both(where, rel, layout)
        with pytest.raises(LocalReadError) as want:
            blocking.read_into(box, np.zeros(shape, np.float32))
        cached, _ = _both(where, rel, layout)
        with pytest.raises(LocalReadError) as got:
            cached.box_cached(box, np.zeros(shape, np.float32))
        assert str(got.value) == str(want.value) and "c/1/0" in str(got.value)
    finally:
        path.write_bytes(saved)


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("chunks", ["one", "several"])
def test_load_shard_column_boxes_in_place_when_cached_else_on_the_pool(tmp_path, monkeypatch, cached, chunks):
    """TP column slices (boxes of part of each row, inside one chunk or over several) that the page cache
    holds are read in the calling thread (``box_cached``), the rest on the pool (after one read the cache
    lacked, untried); the same tensors either way, and a flipped byte is a ChecksumError naming the tensor
    and chunk either way."""
    from ucp_store.io import localread as lr
    from ucp_store.io.chunking import MIN_TARGET
    from ucp_store.topology import Topology

    shape = (16, 8) if chunks == "one" else (256, 256)  # 256 KiB: chunks of columns, a TP half covers several
    store, ws = _layer_store(tmp_path, 6, shape, dim=1, seed=32, chunk_target_bytes=MIN_TARGET)
    chunk = store.checkpoint("r@1").info("layers.0.w", "fp32").chunk_shape
    assert (shape[1] // 2 > chunk[1]) == (chunks == "several"), chunk
    results, batches = _spy_reads(monkeypatch, "box_cached", lambda i: None if cached else False)
    got = store.checkpoint("r@1").load_shard(Topology(tp=2), 1)
    half = shape[1] // 2
    for name, t in ws.items():
        assert torch.equal(got[(name, "fp32")], t[:, half:]), name
    if cached and lr._NOWAIT:
        assert results == [True] * 6 and not batches  # just written: in the page cache, every read here
    elif cached:
        assert results == [None] * 6 and sum(batches) == 6  # no RWF_NOWAIT here: never tried
    else:
        assert results == [False] and sum(batches) == 6  # one try, the rest untried
    # flip a byte of the last element (last row, last column: rank 1 reads it), found in its shard file
    bad = store.checkpoint("r@1").info("layers.2.w", "fp32")
    last = ws["layers.2.w"][-1, -1].numpy().tobytes()
    (path, at), = [(f, f.read_bytes().find(last)) for f in (Path(store.location.root) / bad.array / "c").rglob("*")
                   if f.is_file() and last in f.read_bytes()]
    flip_byte(path, at + 1)
    with pytest.raises(ChecksumError, match=r"layers\.2\.w.*chunk \["):
        store.checkpoint("r@1").load_shard(Topology(tp=2), 1)


def test_a_read_the_cache_lacked_sends_the_next_ones_to_the_pool_untried(tmp_path, monkeypatch):
    """After a small read that would wait for the disk, the next ``io._COLD_SKIP`` go to the pool without
    a try in the calling thread (a cold load's reads, opens included, then wait in parallel); the one after
    is tried again, so a load that meets a warm cache again reads in place again."""
    from ucp_store.io import localread as lr
    from ucp_store.io import read as io
    from ucp_store.topology import Topology

    if not lr._NOWAIT:
        pytest.skip("no RWF_NOWAIT on this platform: nothing is tried in the calling thread")
    monkeypatch.setattr(io, "_COLD_SKIP", 2)
    store, ws = _layer_store(tmp_path, 8, (16, 8), dim=1, seed=33)
    tries, batches = _spy_reads(monkeypatch, "box_cached", lambda i: False if i == 0 else None)  # 1st would wait
    got = store.checkpoint("r@1").load_shard(Topology(tp=2), 1)
    assert all(torch.equal(got[(n, "fp32")], t[:, 4:]) for n, t in ws.items())
    assert tries == [False] + [True] * 5 and sum(batches) == 3  # read 1 tried, 2-3 untried, 4-8 tried


@pytest.mark.parametrize("cached", [True, False])
def test_small_whole_reads_and_casts_in_place_when_cached_else_on_the_pool(tmp_path, monkeypatch, cached):
    """Reads through sinks (``state_dict``'s small tensors into fresh memory, a ``load_shard`` cast to bf16)
    that the page cache holds are done in the calling thread (``box_cached``), the rest on the pool; the
    same tensors either way, and a flipped byte is a ChecksumError naming the tensor either way."""
    from ucp_store.io import localread as lr
    from ucp_store.topology import Topology

    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    g = torch.Generator().manual_seed(34)
    ws = {f"layers.{i}.w": torch.randn(16, 8, generator=g) for i in range(5)} | {"scale": torch.tensor(2.5)}
    store.save("r", 1, ws)
    tries, batches = _spy_reads(monkeypatch, "box_cached", lambda i: None if cached else False)
    got = store.checkpoint("r@1").state_dict("weight")
    assert got.keys() == ws.keys() and all(torch.equal(got[k], v) for k, v in ws.items())
    if cached and lr._NOWAIT:
        assert tries == [True] * 5 + [None] and sum(batches) == 1  # the 0-d one is not tried: to the pool
    elif not cached:
        assert tries == [False] and sum(batches) == 6
    tries.clear()
    batches.clear()
    cast = store.checkpoint("r@1").load_shard(Topology(), 0, dtype=torch.bfloat16)
    assert all(torch.equal(cast[(k, "weight")], v.bfloat16()) for k, v in ws.items())
    if cached and lr._NOWAIT:
        assert tries == [True] * 5 + [None] and sum(batches) == 1
    bad = store.checkpoint("r@1").info("layers.3.w", "weight")
    flip_byte(Path(store.location.root) / bad.array / "c" / "0" / "0", 100)
    with pytest.raises(ChecksumError, match=r"layers\.3\.w"):
        store.checkpoint("r@1").state_dict("weight")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_read_pools_work_in_a_forked_child(tmp_path):
    """A child forked after the parent used the read pools makes pools of its own: the inherited ones have
    no threads, and a read submitted to them would wait forever (the child is killed after 60 s)."""
    import time

    from ucp_store.topology import Topology

    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    big = torch.arange(5 << 20, dtype=torch.float32).reshape(-1, 1024)  # 20 MiB: split over the read pool
    small = {f"layers.{i}.w": torch.full((64, 64), float(i)) for i in range(40)}
    store.save("r", 1, {"big": big, **small})

    def read_all() -> bool:
        ck = store.checkpoint("r@1")
        got = ck.state_dict("weight")  # the stream and read pools
        shard = ck.load_shard(Topology(dp=2, zero_stage=3, layers=40), 1)  # the small-read pool
        # numpy compares: torch's OpenMP team is not usable in a forked child (libgomp is not fork-safe)
        ok = np.array_equal(got["big"].numpy(), big.numpy()) and all(
            np.array_equal(got[k].numpy(), v.numpy()) for k, v in small.items())
        return ok and len(shard.tensors) == len(small) + 1

    assert read_all()  # the parent's pools now exist, their threads idle
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only when its reads complete and match
        code = 1
        try:
            code = 0 if read_all() else 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("a read in the forked child did not finish in 60 s (an inherited pool without threads)")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


@pytest.mark.parametrize("size", [0, 1, 63, 4096, 1 << 20, (4 << 20) + 3])
def test_crc_library_agrees_with_google_crc32c(size):
    """The local paths' CRC32C (``_crc.value``, the crc32c package where it is hardware-based) gives
    google_crc32c's value (zarr's, TensorStore's) over whole buffers and continued over pieces."""
    from ucp_store.io import crc as _crc

    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    want = google_crc32c.value(data.tobytes())
    assert _crc.value(data) == want == _crc.google_value(data)
    cut = size // 3
    assert _crc.value(data[cut:], _crc.value(data[:cut])) == want == _crc.google_value(data[cut:],
                                                                                       _crc.google_value(data[:cut]))
    assert _crc.value(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_crc_library_is_the_fast_one_here():
    """crc32c is a dependency: on a CPU with CRC instructions (every x86-64 since 2008, ARMv8.1) it is the
    one used, not the fallback."""
    import crc32c

    from ucp_store.io import crc as _crc

    assert _crc.LIBRARY == ("crc32c" if crc32c.hardware_based else "google_crc32c")
