"""The store past one machine: a PostgreSQL catalog, arrays in an S3-compatible bucket.

Real peers only: the PostgreSQL server that tools/test.sh starts (UCP_TEST_POSTGRES_URL; each test gets a
schema of its own) and moto's S3 server on 127.0.0.1, spoken to by TensorStore's own s3 kvstore driver
over HTTP (no mocking inside the process under test). Every test that needs PostgreSQL is marked
``postgres`` and skips only when no server URL is given.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import textwrap
import time
from urllib.parse import quote

import pytest
import torch

import ucp_store
from ucp_store.catalog import new_id
from ucp_store.errors import InvalidNameError, UcpError
from ucp_store.io.location import Location
from ucp_store.topology import Topology

from ucp_test_helpers import REPO, bits, moto_s3, postgres_schema_url, python_env

BUCKET = "ucp-test"


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def pg_catalog():
    """A PostgreSQL catalog URL in a fresh schema, dropped afterwards."""
    with postgres_schema_url() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def catalog_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/catalog.db"
    return request.getfixturevalue("pg_catalog")


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on a free local port, with dummy credentials in the environment."""
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture
def s3(s3_server):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture
def s3_store(s3, s3_server, catalog_url):
    prefix = f"stores/{new_id(8)}"
    url = f"s3://{BUCKET}/{prefix}?endpoint={s3_server}&region=us-east-1"
    store = ucp_store.open_store(url, create=True, catalog=catalog_url)
    store.test_prefix = prefix
    store.test_url = url
    store.test_catalog = catalog_url
    return store


def bucket_keys(client, prefix: str = "") -> list[str]:
    keys, token = [], None
    while True:
        kw = {"Bucket": BUCKET, "Prefix": prefix}
        if token:
            kw["ContinuationToken"] = token
        page = client.list_objects_v2(**kw)
        keys += [o["Key"] for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return keys
        token = page["NextContinuationToken"]


def sample_tensors(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb.weight": {"fp32": torch.randn(300, 64, generator=g),
                       "exp_avg": torch.randn(300, 64, generator=g),
                       "weight": torch.randn(300, 64, generator=g).bfloat16()},
        "norm.bias": torch.randn(64, generator=g).half(),
        "step": torch.tensor(7, dtype=torch.int64),
    }


# ------------------------------------------------------------------------------------------ URL parsing


def test_s3_url_needs_a_catalog(monkeypatch):
    with pytest.raises(UcpError, match="needs a catalog URL"):
        Location.parse("s3://bucket/prefix")
    monkeypatch.setenv("UCP_CATALOG", "postgresql+psycopg2://u:p@db/x")
    loc = Location.parse("s3://bucket/some/prefix/?endpoint=http://h:9000&region=eu-west-1")
    assert (loc.kind, loc.bucket, loc.root, loc.endpoint, loc.region) == \
        ("s3", "bucket", "some/prefix", "http://h:9000", "eu-west-1")
    assert loc.catalog_url == "postgresql+psycopg2://u:p@db/x"
    spec = loc.kvstore("arrays/a/b.zarr")
    assert spec == {"driver": "s3", "bucket": "bucket", "path": "some/prefix/arrays/a/b.zarr/",
                    "endpoint": "http://h:9000", "aws_region": "eu-west-1",
                    "context": {"s3_request_retries": {"max_retries": 4, "initial_delay": "0.2s", "max_delay": "2s"}}}
    with pytest.raises(InvalidNameError):
        loc.kvstore("arrays/../../other")
    with pytest.raises(UcpError, match="no bucket"):
        Location.parse("s3:///prefix?catalog=sqlite:///x.db")


# ---------------------------------------------------------------------------------- PostgreSQL catalog


@pytest.mark.postgres
def test_folder_store_with_postgres_catalog(tmp_path, pg_catalog, monkeypatch, ucp):
    root = tmp_path / "store"
    store = ucp_store.open_store(str(root), create=True, catalog=pg_catalog)
    t = sample_tensors()
    store.save("pg", 1, t)
    store.save("pg", 2, {**t, "norm.bias": t["norm.bias"] + 1})
    store.tag("pg@1", "best")
    assert not (root / "catalog.db").exists(), "the catalog must live in PostgreSQL, not next to the arrays"

    # a second process-level open finds the versions through UCP_CATALOG alone
    monkeypatch.setenv("UCP_CATALOG", pg_catalog)
    again = ucp_store.open_store(str(root))
    assert [c["step"] for c in again.list_checkpoints("pg")] == [1, 2]
    ck = again.checkpoint("pg:best")
    assert bits(ck.read("emb.weight", state="weight")) == bits(t["emb.weight"]["weight"])
    assert bits(ck.tensor("emb.weight", state="fp32")[10:20, 3]) == bits(t["emb.weight"]["fp32"][10:20, 3])

    rc, out, err = ucp("--store", str(root), "diff", "pg@1", "pg@2", "--json")
    assert rc == 0, err
    assert '"changed"' in out and "norm.bias" in out
    rc, out, err = ucp("--store", str(root), "query", "SELECT count(*) AS n FROM checkpoints")
    assert rc == 0, err
    assert "2" in out
    rc, out, err = ucp("--store", str(root), "query", "DELETE FROM checkpoints")
    assert rc != 0 and "read-only" in (err + out).lower()
    assert len(again.list_checkpoints("pg")) == 2

    # dedup across versions and reference-counted rm/gc on PostgreSQL
    again.rm("pg@2")
    again.gc()
    ck = again.checkpoint("pg@1")
    assert bits(ck.read("norm.bias")) == bits(t["norm.bias"])
    assert ck.verify() == []


@pytest.mark.postgres
def test_first_saves_of_a_run_race_on_postgres(tmp_path, pg_catalog):
    """Another writer has inserted the run row but not committed yet: our first save of the same run
    waits on the unique name, then uses the winner's row instead of failing (deterministic race)."""
    import threading

    from sqlalchemy import create_engine, func, select
    from sqlalchemy.orm import Session
    from sqlalchemy.pool import NullPool

    from ucp_store.catalog import models as m

    store = ucp_store.open_store(str(tmp_path / "store"), create=True, catalog=pg_catalog)
    engine = create_engine(pg_catalog, poolclass=NullPool)
    other = Session(engine)
    other.add(m.Run(name="race"))
    other.flush()  # row inserted, transaction open
    result = {}

    def save():
        try:
            result["ck"] = store.save("race", 1, {"w": torch.ones(4)})
        except Exception as exc:  # reported below
            result["error"] = exc

    t = threading.Thread(target=save)
    t.start()
    t.join(1.5)
    assert t.is_alive(), f"the save should wait for the other transaction: {result}"
    other.commit()
    other.close()
    t.join(60)
    assert "error" not in result, result.get("error")
    with store.catalog.session() as s:
        assert s.scalar(select(func.count()).select_from(m.Run).where(m.Run.name == "race")) == 1
    assert [c["step"] for c in store.list_checkpoints("race")] == [1]
    engine.dispose()


CHILD = textwrap.dedent("""
    import sys, time, torch, ucp_store
    root, i, start_at = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    store = ucp_store.open_store(root)
    time.sleep(max(0.0, start_at - time.time()))  # all first saves of the run at once: the run row races
    for j in range(4):
        g = torch.Generator().manual_seed(100 * i + j)
        store.save("shared", 10 * i + j, {"w": torch.randn(64, 64, generator=g),
                                           "frozen": torch.ones(128, 128)})
""")


@pytest.mark.postgres
def test_processes_saving_into_one_postgres_catalog_lose_nothing(tmp_path, pg_catalog):
    root = tmp_path / "store"
    ucp_store.open_store(str(root), create=True, catalog=pg_catalog)
    env = python_env(UCP_CATALOG=pg_catalog)
    start_at = time.time() + 8
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(i), str(start_at)], env=env, cwd=str(REPO),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    store = ucp_store.open_store(str(root), catalog=pg_catalog)
    assert sorted(c["step"] for c in store.list_checkpoints("shared")) == sorted(
        10 * i + j for i in range(3) for j in range(4))
    for i in range(3):
        for j in range(4):
            g = torch.Generator().manual_seed(100 * i + j)
            assert bits(store.checkpoint(f"shared@{10 * i + j}").read("w")) == bits(torch.randn(64, 64, generator=g))
    frozen_arrays = {t["array"] for c in store.list_checkpoints("shared")
                     for t in store.checkpoint(c["id"]).manifest()["tensors"] if t["name"] == "frozen"}
    # dedup under concurrency may keep a copy per process that raced; never one per save
    assert 1 <= len(frozen_arrays) <= 3


# ------------------------------------------------------------------------------------------- S3 arrays


def test_s3_store_round_trip_slices_and_urls(s3_store, s3):
    t = sample_tensors()
    ck = s3_store.save("s3run", 5, t)
    keys = bucket_keys(s3)
    ours = [k for k in keys if k.startswith(s3_store.test_prefix + "/")]
    assert ours, "nothing was written to the bucket"
    # the arrays, and the store's identity file at the prefix's root (issue 40)
    assert all(k.startswith(s3_store.test_prefix + "/arrays/") or k == s3_store.test_prefix + "/ucp-store.json"
               for k in ours), ours

    again = ucp_store.open_store(s3_store.test_url, catalog=s3_store.test_catalog)
    ck = again.checkpoint("s3run@latest")
    for name, states in t.items():
        states = states if isinstance(states, dict) else {ck.info(name).state: states}
        for state, value in states.items():
            assert bits(ck.read(name, state=state)) == bits(value), (name, state)
    emb = t["emb.weight"]["fp32"]
    h = ck.tensor("emb.weight", state="fp32")
    for sl in [(slice(17, 33), slice(None)), (slice(None), 5), (slice(299, 300), slice(60, 64)),
               (slice(3, 250, 7), slice(1, 50, 3))]:
        assert bits(h[sl]) == bits(emb[sl])
    shown = ck.manifest()
    arrays = [x["array"] for x in shown["tensors"]]
    assert all(a.startswith(f"s3://{BUCKET}/{s3_store.test_prefix}/arrays/") for a in arrays), arrays
    assert ck.verify() == []


def test_s3_store_zarr_metadata_is_plain_zarr_v3(s3_store, s3):
    s3_store.save("meta", 1, {"w": torch.randn(8, 8).bfloat16()})
    meta_keys = [k for k in bucket_keys(s3, s3_store.test_prefix) if k.endswith("zarr.json")]
    assert len(meta_keys) == 1
    meta = json.loads(s3.get_object(Bucket=BUCKET, Key=meta_keys[0])["Body"].read())
    assert meta["zarr_format"] == 3 and meta["data_type"] == "bfloat16" and meta["shape"] == [8, 8]


def test_s3_flipped_byte_is_caught_by_read_and_verify(s3_store, s3, ucp):
    w = torch.randn(256, 64, generator=torch.Generator().manual_seed(3))
    s3_store.save("bad", 1, {"w": w})
    shard_keys = [k for k in bucket_keys(s3, s3_store.test_prefix) if "/c/" in k]
    assert shard_keys
    key = shard_keys[0]
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[20] ^= 0xFF  # inside the first inner chunk (the shard index sits at the end)
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))

    ck = ucp_store.open_store(s3_store.test_url, catalog=s3_store.test_catalog).checkpoint("bad@1")
    with pytest.raises(UcpError) as e:
        ck.read("w")
    assert "w" in str(e.value) and "chunk" in str(e.value)
    problems = ck.verify()
    assert problems and problems[0]["chunk"] is not None and problems[0]["tensor"] == "w"
    # the catalog URL can ride inside the store URL, percent-encoded like any query value
    store_url = f"{s3_store.test_url}&catalog={quote(s3_store.test_catalog, safe='')}"
    rc, out, err = ucp("--store", store_url, "verify", "bad@1")
    assert rc == 1
    assert "chunk" in (out + err)


def test_s3_rm_and_gc_delete_objects_but_keep_shared_data(s3_store, s3):
    frozen = torch.randn(200, 200, generator=torch.Generator().manual_seed(1))
    s3_store.save("gc", 1, {"frozen": frozen, "w": torch.zeros(50)})
    s3_store.save("gc", 2, {"frozen": frozen, "w": torch.ones(50)})
    s3_store.save("gc", 3, {"frozen": frozen, "w": torch.full((50,), 2.0)})
    before = set(bucket_keys(s3, s3_store.test_prefix))
    s3_store.rm("gc@1")
    s3_store.rm("gc@2")
    after_rm = set(bucket_keys(s3, s3_store.test_prefix))
    assert after_rm < before, "rm must delete the objects only those versions used"
    ck = s3_store.checkpoint("gc@3")
    assert bits(ck.read("frozen")) == bits(frozen), "the deduplicated frozen array must survive"

    # a save that died before commit leaves objects the catalog never lists; gc reclaims them
    w = s3_store.begin("gc", 4)
    w.write("big", "fp32", torch.randn(100, 100))
    w.flush()
    pending_id = w.id
    w.close()
    assert [c["step"] for c in s3_store.list_checkpoints("gc")] == [3]
    leftover = {k for k in bucket_keys(s3, s3_store.test_prefix) if f"/arrays/{pending_id}/" in k}
    assert leftover
    report = s3_store.gc(pending_timeout=dt.timedelta(0))
    assert pending_id in report.removed_pending
    remaining = set(bucket_keys(s3, s3_store.test_prefix))
    assert not {k for k in remaining if f"/arrays/{pending_id}/" in k}
    assert remaining == after_rm
    assert bits(s3_store.checkpoint("gc@3").read("frozen")) == bits(frozen)


@pytest.mark.parametrize("run,name", [("../../evil", "w"), ("ok", "../../../evil"), ("ok", "/abs/evil"),
                                      ("/abs", "w")])
def test_s3_names_never_escape_the_prefix(s3_store, s3, run, name):
    with pytest.raises(InvalidNameError):
        s3_store.save(run, 1, {name: torch.ones(3)})
    outside = [k for k in bucket_keys(s3) if not k.startswith("stores/")]
    assert outside == []
    assert s3_store.list_checkpoints() == []


def test_s3_load_shard_reads_a_rank_slice(s3_store):
    w = torch.randn(512, 96, generator=torch.Generator().manual_seed(5))
    s3_store.save("tp", 1, {"lin.weight": w}, patterns={"lin.weight": {"kind": "partitioned", "dim": 0}})
    ck = s3_store.checkpoint("tp@1")
    shards = [ck.load_shard(Topology(tp=4), rank, states=["weight"]) for rank in range(4)]
    got = torch.cat([s.tensors[("lin.weight", "weight")] for s in shards], dim=0)
    assert bits(got) == bits(w)


def test_pipeline_stage_rows_from_either_catalog(tmp_path, catalog_url):
    """tensors.layer filtering on SQLite and on PostgreSQL: each stage fetches its layers plus the tied
    tensor, and the pipeline ranks together load every layer exactly as saved."""
    store = ucp_store.open_store(str(tmp_path / "store"), create=True, catalog=catalog_url)
    g = torch.Generator().manual_seed(7)
    tensors = {f"layers.{i}.w": torch.randn(8, 4, generator=g) for i in range(5)}
    tensors["emb.weight"] = torch.randn(16, 4, generator=g)
    patterns = {f"layers.{i}.w": {"kind": "partitioned", "dim": 0, "placement": {"layer": i}} for i in range(5)}
    patterns["emb.weight"] = {"kind": "vocab", "original_size": 16, "placement": {"stages": ["first", "last"]}}
    store.save("pp", 1, tensors, patterns=patterns)
    topo = Topology(tp=2, pp=2, layers=5)  # stage 0: layers 0-2, stage 1: layers 3-4
    loaded = {}
    for rank in range(topo.world_size):
        ck = store.checkpoint("pp@1")
        names = {i.name for i in ck.plan_records(topo, rank)}
        stage = topo.coords(rank)["pp"]
        assert names == {"emb.weight"} | {f"layers.{i}.w" for i in topo.layers_of_stage(stage)}, (rank, names)
        shard = ck.load_shard(topo, rank, states=["weight"])
        for (name, _), t in shard.tensors.items():
            loaded.setdefault(name, {})[topo.coords(rank)["tp"]] = t
    for i in range(5):
        got = torch.cat([loaded[f"layers.{i}.w"][r] for r in range(2)], dim=0)
        assert bits(got) == bits(tensors[f"layers.{i}.w"])
