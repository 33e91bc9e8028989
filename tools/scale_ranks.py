"""N gloo ranks forked from one interpreter, each saving and loading a tiny state through one store, with
what each rank did counted: catalog connections (SQLAlchemy ``connect`` events), SQLite catalog opens (an
audit hook on ``open`` / ``sqlite3.connect``), ``torch.distributed`` collectives (the outermost calls of the
wrapped functions), the coordinator payload bytes (``ucp_store.distributed.coord.STATS``) and wall time.

The harness of tests/test_scale.py (4 ranks) and ``tools/bench_scale.py real`` (up to 64): torch and
``ucp_store.distributed`` are imported once here and every rank is ``os.fork``ed (2 cores cannot import torch 64
times). Each rank writes ``<out>/rank<r>.json``: per phase, its counters and outcome.

Phases (``spec["phases"]``), each run by every rank in order: ``{"op": "save" | "load" | "verify",
"tensors": T, "step": S, "app": NAME, "kind": "ddp", "change": "key" | "shape"}``; ``kind: ddp`` saves a
DDP-style state (every tensor replicated on every rank, ``_ddp_state``), ``change`` alters its layout;
``app`` sets PostgreSQL's ``application_name`` on the catalog URL
(rank 0 then counts the server's connections under that name while every rank still holds its pools).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

#: the torch.distributed functions counted (the outermost call of a nest: an ``*_object`` call's own
#: tensor collectives are not counted again)
COLLECTIVES = ("broadcast", "all_reduce", "reduce", "gather", "scatter", "all_gather", "all_gather_object",
               "gather_object", "broadcast_object_list", "scatter_object_list", "barrier", "all_to_all",
               "reduce_scatter", "all_gather_into_tensor", "send", "recv")


class Counters:
    def __init__(self) -> None:
        self.collectives: dict[str, int] = {}
        #: the subset the calling (main) thread ran: an async save's call, not its background writer
        self.caller: dict[str, int] = {}
        self.connects = 0
        self.statements = 0  # catalog round trips: SQL statements sent (commits and rollbacks not counted)
        self.catalog_opens: list[str] = []
        self._depth = threading.local()

    def reset(self) -> None:
        self.collectives, self.connects, self.statements, self.catalog_opens = {}, 0, 0, []
        self.caller = {}

    def install(self, catalog_file: str | None) -> None:
        import torch.distributed as dist
        from sqlalchemy import event
        from sqlalchemy.engine import Engine

        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))

        @event.listens_for(Engine, "connect")
        def _connect(dbapi_conn, record):  # noqa: ARG001 - the event's signature
            self.connects += 1

        @event.listens_for(Engine, "before_cursor_execute")
        def _statement(*args):  # noqa: ARG001 - the event's signature
            self.statements += 1

        if catalog_file:
            base = os.path.basename(catalog_file)

            def hook(event_name: str, args: tuple) -> None:
                if event_name == "sqlite3.connect" or (event_name == "open" and args and
                                                       isinstance(args[0], str) and
                                                       os.path.basename(args[0]).startswith(base)):
                    self.catalog_opens.append(f"{event_name} {args[0] if args else ''}")

            sys.addaudithook(hook)

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                self.collectives[name] = self.collectives.get(name, 0) + 1
                if threading.current_thread() is threading.main_thread():
                    self.caller[name] = self.caller.get(name, 0) + 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted


def _state(tensors: int, rank: int, world: int, mesh, step: int):
    """A tiny state: ``tensors`` DTensors sharded over the mesh (odd row counts), a replicated DTensor, a
    per-rank RNG-like tensor and a shared value."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ucp_store.distributed import layout as lay

    sd: dict = {"model": {}, "rng": torch.full((4,), float(rank)), "step": step}
    for i in range(tensors):
        rows = 3 * world + (i % 5)  # uneven shards
        full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 1000 * i + step
        idx = lay.dim_indices((rows,), (world,), [{"type": "shard", "dim": 0}], (rank,))[0]
        lo, hi = (idx[0], idx[-1] + 1) if len(idx) else (0, 0)
        sd["model"][f"w{i}"] = DTensor.from_local(full[lo:hi].clone(), mesh, [Shard(0)], run_check=False,
                                                  shape=full.shape, stride=full.stride())
    sd["model"]["rep"] = DTensor.from_local(torch.arange(64, dtype=torch.float32) + step, mesh, [Replicate()],
                                            run_check=False)
    return sd


def _ddp_state(tensors: int, rank: int, world: int, mesh, step: int, change: str | None = None):
    """A DDP-style state: every tensor replicated on every rank (equal contents; sizes from 1 to about 20
    thousand elements), a quarter of them as ``Replicate`` DTensors, the rest plain tensors; a shared value.
    ``change``: ``"key"`` adds an entry, ``"shape"`` grows one tensor (a layout change), ``"diverge"`` makes
    the ``rng`` entry differ across ranks (the same layout, another content decision)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    del world
    sd: dict = {"model": {}, "step": step,  # "diverge": an RNG-like entry differs across ranks (same layout)
                "rng": torch.full((4,), float(rank) if change == "diverge" else 0.0)}
    for i in range(tensors):
        n = ((i * 7919) % 97 + 1) * 200 + (1 if change == "shape" and i == 0 else 0)
        t = torch.arange(n, dtype=torch.float32) * 0.5 + i + step
        sd["model"][f"p{i}"] = DTensor.from_local(t, mesh, [Replicate()], run_check=False) if i % 4 == 3 else t
    if change == "key":
        sd["model"]["extra"] = torch.full((300,), float(step))
    return sd


def _equal_states(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_states(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        la = a.to_local() if hasattr(a, "to_local") else a
        lb = b.to_local() if hasattr(b, "to_local") else b
        return torch.equal(la, lb)
    return a == b


class _Written:
    """Bytes this rank hands to its writer (boxes and per-rank objects), counted at ``CheckpointWriter``."""

    total = 0

    @classmethod
    def install(cls) -> None:
        from ucp_store.save.writer import CheckpointWriter

        region = CheckpointWriter.write_region

        def write_region(self, name, state, data, *args, **kwargs):
            cls.total += int(data.numel()) * int(data.element_size())
            return region(self, name, state, data, *args, **kwargs)

        CheckpointWriter.write_region = write_region  # type: ignore[method-assign,assignment]


def _catalog_url(spec: dict, app: str | None) -> str | None:
    url = spec.get("catalog")
    if url and app:
        url += ("&" if "?" in url else "?") + f"application_name={app}"
    return url


def _server_connections(spec: dict, app: str) -> int:
    import psycopg2

    dsn = spec["catalog"].replace("postgresql+psycopg2://", "postgresql://")
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("select count(*) from pg_stat_activity where application_name = %s", (app,))
        return int(cur.fetchone()[0])


def _phase(ph: dict, spec: dict, rank: int, world: int, mesh, counters: Counters) -> dict:
    import torch.distributed as dist

    import ucp_store
    import ucp_store.distributed as ucpd
    from ucp_store.distributed import coord

    store_url = spec["store"]
    app = ph.get("app")
    url = _catalog_url(spec, app)
    # a Store per phase on rank 0 only would hide a second connection: pass the URL, as a training job does
    if url:
        os.environ["UCP_CATALOG"] = url
    def make(step: int):
        if ph.get("kind") == "ddp":
            return _ddp_state(ph["tensors"], rank, world, mesh, step, ph.get("change"))
        return _state(ph["tensors"], rank, world, mesh, step)

    sd = make(ph.get("step", 0))
    counters.reset()
    _Written.total = 0
    for k in coord.STATS:
        coord.STATS[k] = 0
    t0 = time.perf_counter()
    out: dict = {"op": ph["op"], "tensors": ph["tensors"]}
    try:
        if ph["op"] == "save":
            out["id"] = ucpd.save(sd, store=store_url, run=spec.get("run", "scale"), step=ph.get("step", 0),
                                  progress=False)
        elif ph["op"] == "async_save":  # the collectives its call waits for, apart from the background's
            handle = ucpd.async_save(sd, store=store_url, run=spec.get("run", "scale"), step=ph.get("step", 0))
            out["call_collectives"] = dict(counters.caller)
            out["id"] = handle.result()
        else:
            fresh = make(-1)
            if ph["op"] == "load":
                ucpd.load(fresh, store=store_url, ref=f"{spec.get('run', 'scale')}@{ph.get('step', 0)}",
                          progress=False)
                out["exact"] = _equal_states(fresh, sd)
            else:
                rep = ucpd.verify(sd, f"{spec.get('run', 'scale')}@{ph.get('step', 0)}", store=store_url,
                                  progress=False)
                out["exact"] = rep.ok
        out["error"] = None
    except BaseException as exc:  # noqa: BLE001 - recorded for the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["wall_s"] = time.perf_counter() - t0
    out["collectives"] = dict(counters.collectives)
    out["connects"] = counters.connects
    out["statements"] = counters.statements
    out["catalog_opens"] = list(counters.catalog_opens)
    out["payload"] = dict(coord.STATS)
    out["bytes_written"] = _Written.total
    if app and spec.get("catalog", "").startswith("postgresql"):
        dist.barrier()  # every rank still holds whatever pools it opened
        if rank == 0:
            out["server_connections"] = _server_connections(spec, app)
        dist.barrier()
    del ucp_store
    return out


def rank_main(spec: dict, rank: int, world: int, port: int) -> int:
    import datetime as _dt

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    counters = Counters()
    catalog_file = None if spec.get("catalog") else os.path.join(spec["store"], "catalog.db")
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=_dt.timedelta(seconds=spec.get("timeout", 300)))
    mesh = init_device_mesh("cpu", (world,))
    counters.install(catalog_file)
    _Written.install()
    results = []
    for ph in spec["phases"]:
        results.append(_phase(ph, spec, rank, world, mesh, counters))
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    return 0


def launch(spec: dict, world: int, timeout: float = 600) -> list[list[dict]]:
    """Fork ``world`` ranks running ``spec``; their results (rank order). Raises if a rank fails or hangs."""
    import torch  # noqa: F401 - loaded once, before the forks
    import torch.distributed.tensor  # noqa: F401


    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(spec["out"], exist_ok=True)
    pids = []
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = rank_main(spec, r, world, port)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    deadline = time.monotonic() + timeout
    failed = []
    left = dict.fromkeys(pids)
    while left:
        for pid in list(left):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del left[pid]
                if status != 0:
                    failed.append(pids.index(pid))
        if time.monotonic() > deadline:
            for pid in left:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            raise RuntimeError(f"scale ranks {[pids.index(p) for p in left]} still running after {timeout} s")
        time.sleep(0.05)
    if failed:
        raise RuntimeError(f"scale rank(s) {sorted(failed)} failed (see stderr)")
    out = []
    for r in range(world):
        with open(os.path.join(spec["out"], f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


if __name__ == "__main__":
    spec_ = json.loads(sys.argv[1])
    print(json.dumps(launch(spec_, spec_["world"], spec_.get("launch_timeout", 600))))
