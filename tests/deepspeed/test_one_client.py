"""Issue 27 item 1: one catalog client per job on the DeepSpeed paths (real DeepSpeed, 2 gloo ranks on CPU).

``tests/deepspeed/one_client_worker.py`` runs, under torchrun, a save through the ucp engine (``attach`` +
``save_checkpoint``), a ``load`` of it into a fresh engine, and the multi-rank ``ucp import deepspeed`` of the
same step's DeepSpeed files (``ucp_store.deepspeed.source.main``, what torchrun runs), counting per rank the
catalog connections (SQLAlchemy ``connect`` events) and the opens of ``catalog.db``. Only the coordinator (rank
0) may touch the catalog: with SQLite the other rank never opens catalog.db; with PostgreSQL every phase opens
exactly one connection in the whole job (counted on every rank, and by the server under the phase's
``application_name``). The ranks exchange JSON bytes: ucp_store calls no pickled collective on these paths.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ucp_test_helpers import postgres_schema_url, torchrun

WORKER = Path(__file__).with_name("one_client_worker.py")
PHASES = ("save", "load", "import")


def _launch(tmp_path: Path, **spec) -> list[dict]:
    pytest.importorskip("deepspeed")
    out = tmp_path / "out"
    out.mkdir()
    spec.update(store=str(tmp_path / "store"), files=str(tmp_path / "files"), out=str(out))
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    torchrun([str(WORKER), str(path)], 2, timeout=900, cwd=tmp_path)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _check_loaded(results: list[dict]) -> None:
    for r in results:
        assert r["id"] and r["id"] == results[0]["id"]
        assert r["loaded_steps"] == 2, r


def test_sqlite_only_the_coordinator_opens_the_catalog(tmp_path):
    results = _launch(tmp_path)
    _check_loaded(results)
    others = {name: {k: results[1][name][k] for k in ("connects", "opens")} for name in PHASES}
    assert others == {name: {"connects": 0, "opens": []} for name in PHASES}, others
    assert all(results[0][name]["connects"] >= 1 for name in PHASES), results[0]  # the coordinator's own
    # what the ranks exchange is JSON bytes: no pickled collective on any of these paths
    pickled = {(r, name): got[name]["pickled"] for r, got in enumerate(results) for name in PHASES}
    assert not any(pickled.values()), pickled


def test_postgres_one_catalog_connection_per_save_load_and_import(tmp_path):
    with postgres_schema_url() as url:
        results = _launch(tmp_path, catalog=url, app=f"ucp27ds{os.urandom(3).hex()}")
    _check_loaded(results)
    connects = {name: [r[name]["connects"] for r in results] for name in PHASES}
    assert connects == {name: [1, 0] for name in PHASES}, connects
    server = {name: results[0][name]["server_connections"] for name in PHASES}
    assert server == {name: 1 for name in PHASES}, server


def test_wire_round_trip_and_refusal():
    """The tagged JSON the ranks exchange rebuilds tuples, tuple- and int-keyed dicts, bytes, tensors (bf16
    included, bit for bit) and numpy arrays, and refuses anything else by name (never a pickle)."""
    import numpy as np
    import torch

    from ucp_store.distributed import coord
    from ucp_store.errors import UcpError

    value = {"shapes": [("w", (3, 4))], "digests": {("w", "fp32"): {0: b"\x00\xff", 7: b""}},
             "step": torch.tensor(3.0), "lp": torch.tensor([1.5, -0.0], dtype=torch.bfloat16),
             "arr": np.arange(6, dtype=np.int16).reshape(2, 3), "nan": float("nan"), "big": 2 ** 70,
             "__ucp_tuple__": "a key that looks like a tag"}
    back = coord.from_wire(coord.decode(coord.encode(coord.to_wire(value))))
    assert back["shapes"] == [("w", (3, 4))] and isinstance(back["shapes"][0][1], tuple)
    assert back["digests"] == {("w", "fp32"): {0: b"\x00\xff", 7: b""}}
    assert back["step"].dtype == torch.float32 and back["step"].shape == () and back["step"].item() == 3.0
    assert back["lp"].dtype == torch.bfloat16
    assert torch.equal(back["lp"].view(torch.int16), value["lp"].view(torch.int16))
    assert back["arr"].dtype == np.int16 and (back["arr"] == value["arr"]).all()
    assert back["nan"] != back["nan"] and back["big"] == 2 ** 70
    assert back["__ucp_tuple__"] == value["__ucp_tuple__"]

    class Opaque:
        pass

    with pytest.raises(UcpError, match=r"rank 1's part\.x.*Opaque.*never a pickle"):
        coord.to_wire({"x": Opaque()}, "rank 1's part")
