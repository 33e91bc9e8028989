"""Issue 27 item 0 for ZeRO flat fragments: in a multi-rank DeepSpeed save (the ucp engine) and a multi-rank
``ucp import deepspeed`` (torchrun), every shard object and every ``zarr.json`` has exactly one writer, and the
stored state is bit-exact.

Four real gloo ranks (``one_writer_ds_worker.py``, real DeepSpeed on CPU) train the ``mlp`` model, whose odd
sizes put fragment edges mid-row over dp=4, save through the engine and import DeepSpeed's own files of the same
step, with ``localwrite.record_writes`` on, on a folder store and on S3 (moto's server). The cut shard files went
through the exchange (``distributed.commit.exchange_straddling``: bytes moved; the import splits whole
parameters over the ranks, so nothing is cut there), no object has two writers, and each version equals,
bit for bit, a single-process import of the same files (no exchange there: one writer by construction).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from test_backends import s3, s3_server  # noqa: F401 - fixtures

from ucp_test_helpers import torchrun

WORKER = Path(__file__).with_name("one_writer_ds_worker.py")
WORLD = 4  # dp=4 (the demo batch of 8 splits over it); the mlp's odd sizes put fragment edges mid-row


def _launch(tmp_path: Path, store: str, zero: list[int], catalog: str | None = None) -> list[dict]:
    pytest.importorskip("deepspeed")
    out = tmp_path / "out"
    out.mkdir()
    spec = {"store": store, "files": str(tmp_path / "files"), "out": str(out), "zero": zero}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    old = os.environ.get("UCP_CATALOG")
    if catalog:
        os.environ["UCP_CATALOG"] = catalog
    try:
        torchrun([str(WORKER), str(path)], WORLD, timeout=900, cwd=tmp_path)
    finally:
        if catalog:
            os.environ.pop("UCP_CATALOG", None)
            if old is not None:
                os.environ["UCP_CATALOG"] = old
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _check(results: list[dict], store_url: str, tmp_path: Path, catalog: str | None) -> None:
    import ucp_store
    from ucp_store.deepspeed import import_deepspeed

    store = ucp_store.open_store(store_url, catalog=catalog) if catalog else ucp_store.open_store(store_url)
    for zero in results[0]:
        for path in ("engine", "import"):
            writers: dict[str, set[int]] = defaultdict(set)
            for rank, res in enumerate(results):
                for key in res[zero][path]["written"]:
                    writers[key].add(rank)
            shared = {k: sorted(v) for k, v in writers.items() if len(v) > 1}
            assert not shared, (zero, path, dict(list(shared.items())[:6]))
            shards = [k for k in writers if not k.endswith("/zarr.json")]
            assert len({r for k in shards for r in writers[k]}) > 1, (zero, path)  # several writers of the version
            moved = [res[zero][path]["moved"] for res in results]
            assert all(m["exchanges"] == 1 for m in moved), (zero, path, moved)  # every rank took part, once
            if path == "engine":  # fragment edges cut shard files: the exchange handed them to their owners
                assert sum(m["bytes_sent"] for m in moved) > 0 and sum(m["files_owned"] for m in moved) > 0, \
                    (zero, moved)
            else:  # the torchrun import writes whole parameters, each by one rank: nothing is cut, nothing moves
                assert sum(m["bytes_sent"] for m in moved) == 0, (zero, moved)
        # bit-exact: both multi-rank versions equal a single-process import of the same files
        reference = import_deepspeed(store, str(tmp_path / "files" / f"z{zero}" / "files"), f"single{zero}",
                                     distributed=False, progress=False)
        ref = store.checkpoint(reference)
        for run in (f"direct{zero}", f"imported{zero}"):
            ck = store.checkpoint(store.list_checkpoints(run)[-1]["id"])
            assert ck.verify() == [], (zero, run)
            keys = {(i.name, i.state) for i in ref.tensors()}
            assert keys and keys <= {(i.name, i.state) for i in ck.tensors()}, (zero, run)
            for name, state in sorted(keys):
                a, b = ref.read(name, state), ck.read(name, state)
                assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), \
                    (zero, run, name, state)


@pytest.fixture(autouse=True)
def _no_catalog_env(monkeypatch):
    monkeypatch.delenv("UCP_CATALOG", raising=False)


def test_zero_saves_and_imports_one_writer_per_object_folder(tmp_path):
    url = str(tmp_path / "store")
    _check(_launch(tmp_path, url, [2, 3]), url, tmp_path, None)


def test_zero_save_and_import_one_writer_per_object_s3(tmp_path, s3, s3_server):  # noqa: F811 - fixtures
    bucket = "ucp-one-writer-ds"  # its own bucket: test_backends checks that nothing lands outside its prefixes
    if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/{os.urandom(4).hex()}?endpoint={s3_server}&region=us-east-1"
    catalog = f"sqlite:///{tmp_path}/catalog.db"
    _check(_launch(tmp_path, url, [1], catalog), url, tmp_path, catalog)
