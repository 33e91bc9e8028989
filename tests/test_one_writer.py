"""Issue 27 item 0: in a multi-rank save every shard object and every ``zarr.json`` has exactly one writer.

Three real gloo ranks (tests/one_writer_ranks.py) save, through ``ucp_store.distributed`` and through DCP with
``UcpStorageWriter``, DTensors split unevenly by ``Shard(d)`` (4/4/2 rows,
3/3/1 columns, ...), a replicated DTensor and per-rank tensors, with ``localwrite.record_writes`` on, on a
folder store and on S3 (moto's server); the merged write logs show one writer per object, and a load on the
same ranks is bit-exact. A shard that straddled a rank's box edge, or a ``zarr.json`` created by every rank
that writes a box of the array (as before), would show two writers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest
from test_backends import s3, s3_server  # noqa: F401 - fixtures

from ucp_test_helpers import REPO


def _run(tmp_path, store: str, catalog: str | None = None, api: str = "dist") -> list[dict]:
    env = {**os.environ, "UCP_PROGRESS": "0", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    env.pop("UCP_CATALOG", None)
    if catalog:
        env["UCP_CATALOG"] = catalog
    spec = {"world": 3, "store": store, "out": str(tmp_path / "out"), "api": api}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "one_writer_ranks.py"), json.dumps(spec)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_one_writer(results: list[dict]) -> None:
    writers: dict[str, set[int]] = defaultdict(set)
    for rank, res in enumerate(results):
        assert res["exact"], f"rank {rank} loaded different bits"
        for key in res["written"]:
            writers[key].add(rank)
    shared = {k: sorted(v) for k, v in writers.items() if len(v) > 1}
    assert not shared, f"objects with several writers: {dict(list(shared.items())[:6])}"
    jsons = [k for k in writers if k.endswith("/zarr.json")]
    shards = [k for k in writers if not k.endswith("/zarr.json")]
    # every rank wrote shard files (the uneven boxes), and every array written has its one zarr.json
    assert {r for k in shards for r in writers[k]} == {0, 1, 2}
    assert {k.rsplit("/c", 1)[0] for k in shards} <= {k.rsplit("/", 1)[0] for k in jsons}
    assert len(jsons) >= 6


def test_dist_save_one_writer_per_object_folder(tmp_path):
    _check_one_writer(_run(tmp_path, str(tmp_path / "store")))


def test_dist_save_one_writer_per_object_s3(tmp_path, s3, s3_server):  # noqa: F811 - fixtures
    bucket = "ucp-one-writer"  # its own bucket: test_backends checks that nothing lands outside its prefixes
    if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/{os.urandom(4).hex()}?endpoint={s3_server}&region=us-east-1"
    _check_one_writer(_run(tmp_path, url, f"sqlite:///{tmp_path}/catalog.db"))


def test_dcp_storage_save_one_writer_per_object_folder(tmp_path):
    """``dcp.save`` through ``UcpStorageWriter`` on 3 ranks: each shard object and each ``zarr.json`` has one
    writer (the coordinator writes every ``zarr.json`` at ``finish``), and ``dcp.load`` is bit-exact."""
    _check_one_writer(_run(tmp_path, str(tmp_path / "store"), api="dcp"))


def test_dcp_storage_save_one_writer_per_object_s3(tmp_path, s3, s3_server):  # noqa: F811 - fixtures
    bucket = "ucp-one-writer-dcp"
    if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/{os.urandom(4).hex()}?endpoint={s3_server}&region=us-east-1"
    _check_one_writer(_run(tmp_path, url, f"sqlite:///{tmp_path}/catalog.db", api="dcp"))


def test_writer_aligned_shards_divide_split_points_over_the_shard_target():
    """A split point (600 rows) beyond the planned shard (256 rows of 8-row chunks): the shard extent divides
    it (200 rows), so no shard file straddles two ranks' boxes (``min(shard, 600)`` kept 256: 512..768
    straddled 600)."""
    from ucp_store.io import format as fmt
    from ucp_store.save.shards import writer_aligned_shards as _writer_aligned_shards

    layout = fmt.ArrayLayout("float32", (1200, 4), (8, 4), (256, 4), "none")
    assert _writer_aligned_shards(layout, {0: [600]}) == (200, 4)
    assert _writer_aligned_shards(layout, {0: [96, 600]}) == (24, 4)
    assert _writer_aligned_shards(layout, {0: [100]}) == (256, 4)  # 100 is not whole chunks: unchanged


@pytest.fixture(autouse=True)
def _no_catalog_env(monkeypatch):
    monkeypatch.delenv("UCP_CATALOG", raising=False)


@pytest.mark.parametrize("deferred,flag", [(False, False), (True, True)])
def test_zero_fragments_zarr_json_has_one_writer(tmp_path, deferred, flag):
    """ZeRO-1 fragments of dp=3 ranks (the DeepSpeed engine's and torchrun imports' ``write_shard`` path), each
    rank a writer of one pending version: with ``open_shards(create=())``, or with ``origin_writes_metadata``
    (what ``distributed_begin`` sets on every rank of a multi-rank save) and no ``open_shards``, no rank writes
    a ``zarr.json`` up front and the origin (the writer of element 0) writes it once, in ``finish_shards``."""
    import torch

    import ucp_store
    from ucp_store import patterns as pat
    from ucp_store.io import localwrite
    from ucp_store.topology import Topology

    store = ucp_store.open_store(str(tmp_path / "s"), create=True)
    topo = Topology(dp=3, zero_stage=1)
    g = torch.Generator().manual_seed(3)
    params = {"odd": torch.randn(7, 13, generator=g), "w": torch.randn(64, 40, generator=g),
              "b": torch.randn(11, generator=g)}
    names = list(params)
    group = pat.zero_group_layout([params[n].numel() for n in names], topo.dp, 1)
    owner = store.begin("zero", 1)
    writers = [owner, store.join(owner.id), store.join(owner.id)]
    logs: dict[str, set[int]] = defaultdict(set)
    rows: list = []
    try:
        for rank, w in enumerate(writers):
            log = localwrite.record_writes(rank)
            assert log is not None
            if deferred:
                w.defer_durability()
            if flag:
                w.origin_writes_metadata()
            else:
                w.open_shards([(n, "fp32", tuple(params[n].shape), torch.float32, None) for n in names],
                              topology=topo, create=())
            for i, n in enumerate(names):
                f = group.fragment(i, rank)
                if f is not None and f.slot:
                    piece = params[n].reshape(-1)[f.start:f.stop].clone()
                    w.write_shard(n, "fp32", piece, shape=tuple(params[n].shape), pattern=None, topology=topo,
                                  rank=rank, fragment=f, position=i)
            if rank:
                rows += w.export_rows()
            for key in log.entries:
                logs[key].add(rank)
        log = localwrite.record_writes(0)
        assert log is not None
        ck = owner.commit(extra_rows=rows)
        for key in log.entries:
            logs[key].add(0)
    finally:
        localwrite.record_writes(None)
    jsons = {k: sorted(v) for k, v in logs.items() if k.endswith("/zarr.json")}
    # one writer each: the rank holding element 0 ("b" lies wholly in rank 2's fragment)
    assert len(jsons) == 3 and all(len(v) == 1 for v in jsons.values()), jsons
    assert sorted(v[0] for v in jsons.values()) == [0, 0, 2]
    for n in names:
        assert torch.equal(ck.read(n, "fp32").view(torch.int32), params[n].view(torch.int32)), n
    assert ck.verify() == []
