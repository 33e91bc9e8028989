"""One rank of tests/deepspeed/test_one_client.py (run under torchrun, CPU, gloo): count what each rank does to
the catalog during a DeepSpeed engine save through the ucp engine, its load, an MoE-free ``load`` into a fresh
engine, and a multi-rank ``ucp import deepspeed`` (``ucp_store.deepspeed.source.main``, as torchrun runs it).

Counted per rank and per phase: SQLAlchemy ``connect`` events (every catalog connection a rank opens), for a
SQLite catalog every ``open`` / ``sqlite3.connect`` of ``catalog.db*`` (an audit hook), and every pickled
collective (``all_gather_object`` and friends) that ucp_store code calls. With a PostgreSQL
catalog (``spec["catalog"]``: ``UCP_CATALOG`` carries an ``application_name`` per phase), rank 0 also counts the
server's connections under that name while every rank still holds whatever it opened.

    torchrun --nproc_per_node=2 tests/deepspeed/one_client_worker.py SPEC.json
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

PICKLED = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")


class Counters:
    def __init__(self) -> None:
        self.connects = 0
        self.opens: list[str] = []
        self.pickled: list[str] = []  # pickled collectives called from ucp_store code: "module.function"

    def reset(self) -> None:
        self.connects, self.opens, self.pickled = 0, [], []

    def install(self) -> None:
        import torch.distributed as tdist
        from sqlalchemy import event
        from sqlalchemy.engine import Engine

        for name in PICKLED:
            setattr(tdist, name, self._watch(name, getattr(tdist, name)))

        @event.listens_for(Engine, "connect")
        def _connect(dbapi_conn, record):  # noqa: ARG001 - the event's signature
            self.connects += 1

        def hook(name: str, args: tuple) -> None:
            if name == "sqlite3.connect" or (name == "open" and args and isinstance(args[0], (str, bytes))
                                             and os.path.basename(os.fsdecode(args[0])).startswith("catalog.db")):
                self.opens.append(f"{name} {args[0] if args else ''}")

        sys.addaudithook(hook)

    def _watch(self, name: str, fn):
        def watched(*args, **kwargs):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith("ucp_store"):
                self.pickled.append(f"{module}.{caller.f_code.co_name}: {name}")
            return fn(*args, **kwargs)

        return watched


def _server_connections(app: str) -> int:
    import psycopg2

    dsn = os.environ["UCP_TEST_POSTGRES_URL"].replace("postgresql+psycopg2://", "postgresql://")
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("select count(*) from pg_stat_activity where application_name = %s", (app,))
        return int(cur.fetchone()[0])


def main(spec_path: str) -> int:
    import deepspeed
    import deepspeed.comm as dist
    import torch

    import ucp_store.deepspeed as ucpds
    from ucp_store.deepspeed import source
    from ucp_store.deepspeed.load import load as ds_load
    from ucp_store.demo import ds_train

    with open(spec_path) as f:
        spec = json.load(f)
    counters = Counters()
    counters.install()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    job = {"model": "mlp", "zero": 1, "dtype": "bf16"}
    store = spec["store"]
    out: dict[str, Any] = {}

    def begin(name: str) -> None:
        """Count from here; a PostgreSQL catalog gets this phase's application_name."""
        if spec.get("catalog"):
            os.environ["UCP_CATALOG"] = f"{spec['catalog']}&application_name={spec['app']}{name}"
        dist.barrier()
        counters.reset()

    def phase(name: str) -> None:
        dist.barrier()  # every rank is done with the phase (and still holds what it opened)
        out[name] = {"connects": counters.connects, "opens": list(counters.opens), "pickled": list(counters.pickled)}
        if spec.get("catalog") and rank == 0:
            out[name]["server_connections"] = _server_connections(f"{spec['app']}{name}")
        dist.barrier()

    engine, dp_rank, dp, micro, gas = ds_train.make_engine(job)
    ds_train.train_steps(engine, job, 0, 2, dp_rank, dp, micro, gas)
    engine.save_checkpoint(spec["files"], tag="files")  # DeepSpeed's own files, for the import below

    begin("save")
    ce = ucpds.attach(engine, store=store, run="direct", progress=False)
    engine.save_checkpoint()
    phase("save")
    ref = f"direct@{int(engine.global_steps)}"
    out["id"] = ce.last_id
    ucpds.detach(engine)

    fresh, *_ = ds_train.make_engine(job)
    begin("load")
    client = ds_load(fresh, ref, store=store)
    phase("load")
    out["loaded_steps"] = int(fresh.global_steps)
    out["client"] = sorted(client)

    begin("import")
    source.main([store, os.path.join(spec["files"], "files"), "--run", "imported"])
    phase("import")

    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f, indent=1)
    dist.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
