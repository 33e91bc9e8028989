"""Corruption of every file kind the store writes, on both read paths (issue 16, "Corruption").

Each case damages a copy of one small store: a flipped byte in an inner chunk, in a shard index and in
``zarr.json``; a truncated shard; a deleted shard; a zero-length shard and a zero-length ``zarr.json``; a
catalog row whose content hash does not match its data. Then, through the local pread path and through
TensorStore (``config.override(local_read=False)``), every read either fails with the array and a chunk named or returns
the exact bytes saved, never other numbers; ``Checkpoint.verify`` and ``ucp verify`` report the case and
exit 1; and ``ucp verify --json`` lists every bad chunk, not only the first. The same damaged files in an
S3 bucket (moto's server) are read through TensorStore's s3 driver (``slow``).
``CORRUPTIONS`` doubles as the table's rows (tools/fault_table.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

import ucp_store
from ucp_store import config
from ucp_store.errors import ChecksumError, UcpError
from ucp_store.io import format as fmt
from ucp_store.save.writer import CheckpointWriter

from ucp_test_helpers import flip_byte, moto_s3, shard_file_and_range

SHAPE, CHUNK, SHARD = (32, 6), (4, 6), (16, 6)  # 8 chunks in 2 shard files (c/0/0: chunks 0-3, c/1/0: 4-7)
X = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
Y = torch.arange(12, dtype=torch.int32).reshape(3, 4)  # the default layout: untouched by every case

# name -> (what it damages, the chunks verify must list for tensor "x" (None: an array-level problem))
CORRUPTIONS = {
    "chunk_byte": ("a flipped byte in two inner chunks (1 and 6)", [[1, 0], [6, 0]]),
    "shard_index_byte": ("a flipped byte in shard c/0/0's index", [[0, 0], [1, 0], [2, 0], [3, 0]]),
    "zarr_json_byte": ("a flipped byte in zarr.json", None),
    "truncated_shard": ("shard c/1/0 cut to half its length", [[4, 0], [5, 0], [6, 0], [7, 0]]),
    "deleted_shard": ("shard c/1/0 deleted", [[4, 0], [5, 0], [6, 0], [7, 0]]),
    "zero_length_shard": ("shard c/0/0 truncated to 0 bytes", [[0, 0], [1, 0], [2, 0], [3, 0]]),
    "zero_length_zarr_json": ("zarr.json truncated to 0 bytes", None),
    "catalog_hash": ("the tensor row's content hash does not match its data", None),
}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = tmp_path_factory.mktemp("corruption") / "store"
    store = ucp_store.open_store(str(root), create=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CheckpointWriter, "_layout",
                   lambda self, shape, dtype, pattern, **kw: fmt.ArrayLayout(dtype, tuple(shape), CHUNK, SHARD)
                   if tuple(shape) == SHAPE else fmt.plan_layout(shape, dtype))
        ck = store.save("c", 1, {"x": X, "y": Y})
    store.catalog.engine.dispose()
    return root, ck.id


def _damage(root: Path, kind: str, info) -> None:
    zarr_json = root / info.array / "zarr.json"
    if kind == "chunk_byte":
        for idx in ((1, 0), (6, 0)):
            path, off, length = shard_file_and_range(root, info, idx)
            flip_byte(path, off + length // 2)
    elif kind == "shard_index_byte":
        path, _, _ = shard_file_and_range(root, info, (0, 0))
        flip_byte(path, path.stat().st_size - 12)
    elif kind == "zarr_json_byte":
        text = zarr_json.read_bytes()
        flip_byte(zarr_json, text.index(b'"shape"') + 2)  # inside a key: the JSON no longer parses as zarr
    elif kind == "truncated_shard":
        path, _, _ = shard_file_and_range(root, info, (4, 0))
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    elif kind == "deleted_shard":
        shard_file_and_range(root, info, (4, 0))[0].unlink()
    elif kind == "zero_length_shard":
        shard_file_and_range(root, info, (0, 0))[0].write_bytes(b"")
    elif kind == "zero_length_zarr_json":
        zarr_json.write_bytes(b"")
    elif kind == "catalog_hash":
        with sqlite3.connect(root / "catalog.db") as db:
            db.execute("UPDATE tensors SET content_hash = 'xxh3-128:' || printf('%032x', 7) WHERE name = 'x'")
    else:
        raise ValueError(kind)


@pytest.fixture
def damaged(template, tmp_path, request):
    root, cid = template
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    kind = request.param
    store = ucp_store.open_store(str(copy))
    info = store.checkpoint(cid).info("x")
    _damage(copy, kind, info)
    store = ucp_store.open_store(str(copy))  # a fresh handle: nothing cached from before the damage
    return kind, store, cid, copy


@pytest.fixture(scope="module")
def moto_endpoint():
    with moto_s3("bad") as endpoint:
        yield endpoint


def _upload(folder: Path, endpoint: str, prefix: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    for path in sorted((folder / "arrays").rglob("*")):
        if path.is_file():
            client.put_object(Bucket="bad", Key=f"{prefix}/{path.relative_to(folder).as_posix()}",
                              Body=path.read_bytes())


def _reads(handle) -> list:
    """Whole tensor, each chunk row, and a slice across the two shards."""
    return [()] + [(slice(r, r + CHUNK[0]),) for r in range(0, SHAPE[0], CHUNK[0])] + [(slice(10, 22), slice(2, 5))]


def _check_reads(kind: str, store, cid: str, local: bool) -> None:
    """Every read fails naming the array and a bad chunk, or returns exactly the saved bytes."""
    from ucp_store.io import localread

    handle = store.checkpoint(cid).tensor("x")
    reader = localread.open_reader(store.location, handle.info.array, handle.layout, store.context)
    assert isinstance(reader, localread.LocalArray) == local  # the path this pass means to test
    bad = CORRUPTIONS[kind][1] or []
    failures = 0
    for index in _reads(handle):
        want = X.numpy()[index]
        try:
            got = handle.read_numpy(index)
        except ChecksumError as exc:
            failures += 1
            msg = str(exc)
            assert handle.array_url in msg and "'x'" in msg
            assert [c for c in bad if f"chunk {c}" in msg], f"{kind}: the error names no bad chunk: {msg}"
            continue
        # no error: the bytes must be exactly the ones saved, and no bad chunk was in the region
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), f"{kind}: wrong numbers for {index}"
        rows = index[0] if index else slice(0, SHAPE[0])
        assert not [c for c in bad if rows.start < (c[0] + 1) * CHUNK[0] and c[0] * CHUNK[0] < rows.stop]
    assert (failures > 0) == bool(bad)
    assert np.array_equal(store.checkpoint(cid).read("y").numpy(), Y.numpy())  # the other array is intact


def _check_verify(kind: str, store, cid: str) -> list:
    url = store.checkpoint(cid).tensor("x").array_url
    problems = store.checkpoint(cid).verify()
    assert problems and all(p["tensor"] == "x" and p["array"] == url for p in problems), problems
    bad = CORRUPTIONS[kind][1]
    if bad is None:
        assert all(p["chunk"] is None for p in problems)
    else:
        assert sorted(p["chunk"] for p in problems) == bad
    return problems


@pytest.mark.parametrize("damaged", list(CORRUPTIONS), indirect=True)
def test_corruption_is_caught_on_both_read_paths_and_by_verify(damaged, monkeypatch, ucp):
    kind, store, cid, root = damaged
    for local in (True, False):
        with config.override(local_read=local):
            _check_reads(kind, store, cid, local)
            problems = _check_verify(kind, store, cid)
            _check_cli_verify(kind, store, cid, root, problems, ucp)


def _check_cli_verify(kind, store, cid, root, problems, ucp):
    """``ucp verify`` reports what ``Checkpoint.verify`` found: the array named, every bad chunk and shard."""
    url = store.checkpoint(cid).tensor("x").array_url
    rc, out, err = ucp("verify", "c@1", "--store", root)
    assert rc == 1 and "FAIL x" in err and url in err
    rc, out, _ = ucp("verify", "c@1", "--json", "--store", root)
    assert rc == 1
    report = json.loads(out)
    assert report["ok"] is False
    assert [p["chunk"] for p in report["problems"]] == [p["chunk"] for p in problems]
    bad = CORRUPTIONS[kind][1]
    if bad is not None:
        assert sorted(p["chunk"] for p in report["problems"]) == bad  # every bad chunk, not the first one
        assert {p["shard"] for p in report["problems"]} == {fmt.ArrayLayout("float32", SHAPE, CHUNK, SHARD)
                                                             .shard_key(tuple(c)) for c in bad}


# every case in the bucket too; UCP_FAULTS_QUICK=1 keeps one case per file kind there
BUCKET_CASES = (list(CORRUPTIONS) if os.environ.get("UCP_FAULTS_QUICK") != "1"
                else ["chunk_byte", "deleted_shard", "zero_length_zarr_json"])


@pytest.mark.slow
@pytest.mark.parametrize("damaged", BUCKET_CASES, indirect=True)
def test_corruption_in_a_bucket_is_caught(damaged, moto_endpoint, monkeypatch, ucp):
    """The same damaged files in an S3 bucket (moto), read through TensorStore's s3 driver."""
    kind, _, cid, root = damaged
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    prefix = f"s/{kind}"
    _upload(root, moto_endpoint, prefix)
    url = f"s3://bad/{prefix}?endpoint={moto_endpoint}&region=us-east-1"
    catalog = f"sqlite:///{root}/catalog.db"
    store = ucp_store.open_store(url, catalog=catalog)
    _check_reads(kind, store, cid, local=False)
    problems = _check_verify(kind, store, cid)
    monkeypatch.setenv("UCP_CATALOG", catalog)
    rc, out, _ = ucp("verify", "c@1", "--json", "--store", url)
    assert rc == 1 and [p["chunk"] for p in json.loads(out)["problems"]] == [p["chunk"] for p in problems]


def test_a_clean_copy_verifies(template, ucp):
    root, cid = template
    assert ucp_store.open_store(str(root)).checkpoint(cid).verify() == []
    rc, out, _ = ucp("verify", "c@1", "--json", "--store", root)
    assert rc == 0 and json.loads(out) == {"id": cid, "ok": True, "problems": []}


def test_catalog_hash_mismatch_on_the_arrays_row_is_reported(template, tmp_path):
    root, cid = template
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    with sqlite3.connect(copy / "catalog.db") as db:
        db.execute("UPDATE arrays SET content_hash = 'xxh3-128:' || printf('%032x', 9) "
                   "WHERE id = (SELECT array_id FROM tensors WHERE name = 'y')")
    problems = ucp_store.open_store(str(copy)).checkpoint(cid).verify()
    assert [p["tensor"] for p in problems] == ["y"] and "catalog array row" in problems[0]["error"]


def test_read_errors_are_ucp_errors(template, tmp_path, monkeypatch):
    """A zarr.json that is damaged does not matter to reads (the catalog's layout stands in), while a shard
    that is gone stops every read of its chunks with a UcpError, never zeros."""
    root, cid = template
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    store = ucp_store.open_store(str(copy))
    info = store.checkpoint(cid).info("x")
    shard_file_and_range(copy, info, (0, 0))[0].unlink()
    with pytest.raises(UcpError):
        store.checkpoint(cid).read("x", index=(slice(0, 2),))
    for local in (True, False):  # both read paths say the shard is missing, not that a crc failed
        with config.override(local_read=local), \
                pytest.raises(ChecksumError, match=r"chunk \[0, 0\] \(shard file c/0/0\) is missing"):
            ucp_store.open_store(str(copy)).checkpoint(cid).read("x")
