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

Faults (issue 27 item 5): ``{"op": "save_kill_rank", "rank": R, "at": "dist.mid_write:2"}`` is a save in
which rank ``R`` SIGKILLs itself at the kill point ``at`` (``ucp_store._killpoints``; ``name:N`` is its N-th
hit), or ``"after": SECONDS`` into the phase (a timer in that rank). It must be the last phase: the process
group is broken afterwards, so every surviving rank records its outcome (the error it raised, when) and
stops. The launcher expects rank ``R`` to die of SIGKILL (anything else fails the launch) and appends
``{"op": "save_kill_rank", "killed": true, "reaped_at": T}`` to its results. ``spec["dist_timeout"]`` sets
``UCP_DIST_TIMEOUT`` in every rank. ``spec["gc"] = {"interval": S, "mode": "cli" | "api", "start": "now"}``
runs gc over the store in a loop while the ranks run (``ucp gc``, a process per run; or ``Store.gc()`` in a
loop in one other process), from rank 0's first finished phase (or at once) until the last rank exits
(:class:`GcDriver`); each run's start, end, exit status and output tail go to ``<out>/gc.json``. Every phase
records ``t_start`` / ``t_end`` (``time.time()``, comparable across the ranks and the gc runs).
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


def _arm_kill(ph: dict, rank: int) -> None:
    """In the rank a ``save_kill_rank`` phase names: arm its kill point, or a timer that SIGKILLs this rank
    ``after`` seconds into the phase (what a node loss or the OOM killer does: no ``finally`` runs)."""
    if ph["op"] != "save_kill_rank" or rank != ph["rank"]:
        return
    if ph.get("at"):
        from ucp_store import _killpoints

        _killpoints.rearm(ph["at"])
    else:
        timer = threading.Timer(float(ph["after"]), os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()


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
    out: dict = {"op": ph["op"], "tensors": ph["tensors"], "t_start": time.time()}
    _arm_kill(ph, rank)
    try:
        if ph["op"] in ("save", "save_kill_rank"):
            out["id"] = ucpd.save(sd, store=store_url, run=spec.get("run", "scale"), step=ph.get("step", 0),
                                  progress=False)
        elif ph["op"] == "async_save":  # the collectives its call waits for, apart from the background's
            handle = ucpd.async_save(sd, store=store_url, run=spec.get("run", "scale"), step=ph.get("step", 0),
                                     check=ph.get("check", "background"))
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
    out["t_end"] = time.time()
    out["collectives"] = dict(counters.collectives)
    out["connects"] = counters.connects
    out["statements"] = counters.statements
    out["catalog_opens"] = list(counters.catalog_opens)
    out["payload"] = dict(coord.STATS)
    out["bytes_written"] = _Written.total
    if app and spec.get("catalog", "").startswith("postgresql") and ph["op"] != "save_kill_rank":
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
    if spec.get("dist_timeout"):  # read at each collective group's creation (config.dist_timeout)
        os.environ["UCP_DIST_TIMEOUT"] = str(spec["dist_timeout"])
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
        _write_results(spec, rank, results)  # after each phase: a killed rank leaves the phases it finished
        if ph["op"] == "save_kill_rank":
            # a rank died: the group is broken, and tearing it down could wait on the dead peer; exit as a job
            # whose launcher restarts it would (the launcher's os._exit skips the rest)
            return 0
    dist.destroy_process_group()
    return 0


def _write_results(spec: dict, rank: int, results: list[dict]) -> None:
    path = os.path.join(spec["out"], f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(path + ".tmp", path)  # whole or absent, even if this rank is killed while writing


class GcDriver:
    """gc run again and again over the spec's store while the ranks save, from rank 0's first finished phase
    (the store and its catalog exist) until :meth:`stop`. ``spec["gc"]["mode"]``: ``"cli"`` (default) runs
    ``ucp gc`` as a process per run, ``interval`` seconds apart; ``"api"`` runs one process calling
    ``Store.gc()`` in a loop (:func:`gc_loop`: many more runs per second, no interpreter start between them).
    Each run's ``t_start``, ``t_end`` (``time.time()``), exit status (``rc``) and output tail are kept."""

    def __init__(self, spec: dict) -> None:
        self.spec, self.runs = spec, []
        self.mode = spec["gc"].get("mode", "cli")
        self.interval = float(spec["gc"].get("interval", 0.5))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gc-driver", daemon=True)

    def start(self) -> GcDriver:
        self._thread.start()
        return self

    def command(self) -> list[str]:
        if self.mode == "api":
            return [sys.executable, os.path.abspath(__file__), "--gc-loop", self.spec["store"],
                    self.spec.get("catalog") or "", self._go(), os.path.join(self.spec["out"], "gc.stop"),
                    str(self.interval)]
        cmd = [sys.executable, "-m", "ucp_store.cli", "--store", self.spec["store"], "--no-progress"]
        if self.spec.get("catalog"):
            cmd += ["--catalog", self.spec["catalog"]]
        return [*cmd, "gc", "--json"]

    def _go(self) -> str:
        """The file whose existence starts the runs: rank 0's results after its first phase (the store and its
        catalog exist by then), or none (``"start": "now"``: the store exists already)."""
        return "" if self.spec["gc"].get("start") == "now" else os.path.join(self.spec["out"], "rank0.json")

    def _loop(self) -> None:
        import subprocess

        if self.spec["gc"].get("start") != "now" and self.mode == "cli":
            while not self._stop.is_set() and not os.path.exists(self._go()):
                time.sleep(0.05)
        while not self._stop.is_set():
            t = time.time()
            proc = subprocess.run(self.command(), capture_output=True, text=True)
            if self.mode == "api":  # one line per run, then the loop's own exit status
                self.runs += [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
                if proc.returncode:
                    self.runs.append({"t_start": t, "t_end": time.time(), "rc": proc.returncode,
                                      "stderr": proc.stderr[-1500:]})
                return
            self.runs.append({"t_start": t, "t_end": time.time(), "rc": proc.returncode,
                              "stdout": proc.stdout[-400:], "stderr": proc.stderr[-1500:]})
            self._stop.wait(self.interval)

    def stop(self) -> list[dict]:
        with open(os.path.join(self.spec["out"], "gc.stop"), "w"):
            pass
        self._stop.set()
        self._thread.join()
        with open(os.path.join(self.spec["out"], "gc.json"), "w") as f:
            json.dump(self.runs, f)
        return self.runs


def gc_loop(store: str, catalog: str, go_file: str, stop_file: str, interval: float) -> int:
    """``Store.gc()`` over ``store`` from when ``go_file`` exists (at once if empty) until ``stop_file`` does
    (the driver's ``api`` mode, its own process, its imports done before the wait): one JSON line per run
    (times, what it removed, or the error). Exit status 1 if any run failed."""
    from ucp_store.store import open_store

    while go_file and not os.path.exists(go_file):
        if os.path.exists(stop_file):
            return 0
        time.sleep(0.05)
    st = open_store(store, catalog=catalog or None)
    failed = 0
    while not os.path.exists(stop_file):
        t, rec = time.time(), {}
        try:
            rep = st.gc()
            rec = {"rc": 0, "removed_pending": rep.removed_pending, "removed_checkpoints": rep.removed_checkpoints,
                   "removed_arrays": rep.removed_arrays}
        except Exception as exc:  # noqa: BLE001 - recorded, the loop goes on
            failed, rec = 1, {"rc": 1, "stderr": f"{type(exc).__name__}: {exc}"[:1500]}
        print(json.dumps({"t_start": t, "t_end": time.time(), **rec}), flush=True)
        time.sleep(interval)
    return failed


def _doomed(spec: dict) -> set[int]:
    """The ranks a ``save_kill_rank`` phase kills."""
    return {int(ph["rank"]) for ph in spec["phases"] if ph["op"] == "save_kill_rank"}


def _fork_ranks(spec: dict, world: int) -> list[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
    return pids


def _reap(pids: list[int], doomed: set[int], timeout: float) -> tuple[list[int], dict[int, float]]:
    """Wait for every rank; returns the ranks that failed and, for each rank killed as planned, when it was
    reaped (``time.time()``). A planned victim that exits any other way has failed (its kill never came)."""
    deadline = time.monotonic() + timeout
    failed, killed = [], {}
    left = dict.fromkeys(pids)
    while left:
        for pid in list(left):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del left[pid]
                r = pids.index(pid)
                if r in doomed and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                    killed[r] = time.time()
                elif status != 0 or r in doomed:
                    failed.append(r)
        if time.monotonic() > deadline:
            for pid in left:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            raise RuntimeError(f"scale ranks {[pids.index(p) for p in left]} still running after {timeout} s")
        time.sleep(0.05)
    return failed, killed


def launch(spec: dict, world: int, timeout: float = 600) -> list[list[dict]]:
    """Fork ``world`` ranks running ``spec``; their results (rank order). Raises if a rank fails or hangs (a
    rank that a ``save_kill_rank`` phase kills must die of SIGKILL; its results end with that phase, marked
    ``killed``)."""
    import torch  # noqa: F401 - loaded once, before the forks
    import torch.distributed.tensor  # noqa: F401

    os.makedirs(spec["out"], exist_ok=True)
    pids = _fork_ranks(spec, world)
    gc = GcDriver(spec).start() if spec.get("gc") else None  # after the forks: no rank inherits its thread
    try:
        failed, killed = _reap(pids, _doomed(spec), timeout)
    finally:
        if gc is not None:
            gc.stop()
    if failed:
        raise RuntimeError(f"scale rank(s) {sorted(failed)} failed (see stderr)")
    out = []
    for r in range(world):
        path = os.path.join(spec["out"], f"rank{r}.json")
        got = []
        if r not in killed or os.path.exists(path):
            with open(path) as f:
                got = json.load(f)
        if r in killed:
            got.append({"op": "save_kill_rank", "killed": True, "reaped_at": killed[r], "error": None})
        out.append(got)
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--gc-loop":
        sys.exit(gc_loop(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], float(sys.argv[6])))
    spec_ = json.loads(sys.argv[1])
    print(json.dumps(launch(spec_, spec_["world"], spec_.get("launch_timeout", 600))))
