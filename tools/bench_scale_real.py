"""Real N-rank runs of issue 27 (item 4): N forked gloo ranks save twice and load once through one store
(tiny state: ``--tensors`` uneven-sharded DTensors, a replicated one, a per-rank tensor and a value), on
PostgreSQL (``--postgres-url``; give a server whose ``max_connections`` is low, e.g. 20, to show that a
64-rank job needs one connection) and on SQLite. Per save and load: wall time (slowest rank), catalog
connections (clients' connects, all ranks; and the server's count under the phase's application_name),
catalog statements (rank 0's SQL statements: round trips; bulk COPYs not counted), collectives per rank and
bytes broadcast (``ucp_store.distributed.coord.STATS``).

    python tools/bench_scale_real.py --ranks 4 16 64 --postgres-url postgresql+psycopg2://ucp:ucp@127.0.0.1:5433/ucp_scale

``--faults`` (issue 27 item 5): per rank count and catalog, a launch that saves step 1 and then SIGKILLs
one rank (``--victim``, default the middle one) in the save of step 2, and a restarted launch that saves
``--saves`` times and loads the last while ``ucp gc`` runs in a loop; prints each survivor's error and its
delay after the death, what the catalog lists, the gc runs that overlapped a save, and every committed
version's ``Checkpoint.verify`` problems (docs/scale.md, "Faults at 64 ranks").

    python tools/bench_scale_real.py --faults --ranks 64 --dist-timeout 30 --postgres-url ...

``tools/bench_scale.py ranks`` is meant to call :func:`run_ranks`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(spec: dict, world: int) -> list[list[dict]]:
    env = {**os.environ, "UCP_PROGRESS": "0", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    env.pop("UCP_CATALOG", None)
    spec = {**spec, "world": world, "launch_timeout": 1800}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "scale_ranks.py"), json.dumps(spec)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=1900)
    if proc.returncode != 0:
        raise SystemExit(f"ucp: error: {world} ranks failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(results: list[list[dict]], i: int) -> dict:
    phase = [r[i] for r in results]
    errors = [p["error"] for p in phase if p["error"]]
    return {"op": phase[0]["op"], "wall_s": max(p["wall_s"] for p in phase),
            "connections_clients": sum(p["connects"] for p in phase),
            "connections_server": phase[0].get("server_connections"),
            "statements_rank0": phase[0]["statements"],
            "collectives_per_rank": sum(phase[-1]["collectives"].values()),
            "collectives": phase[-1]["collectives"],
            "bytes_broadcast": phase[-1]["payload"]["broadcast_bytes"],
            "bytes_gathered_per_rank": phase[-1]["payload"]["gathered_bytes"],
            "exact": all(p.get("exact", True) for p in phase), "errors": errors[:3]}


@contextlib.contextmanager
def _schema(url: str, schema: str):
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    admin = create_engine(url, poolclass=NullPool)
    with admin.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        yield make_url(url).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
            hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


def run_ranks(args: argparse.Namespace) -> dict:
    out: dict = {"machine": f"{platform.machine()} {os.cpu_count()} cpus", "runs": []}
    catalogs = [("sqlite", None)] + ([("postgresql", args.postgres_url)] if args.postgres_url else [])
    for world in args.ranks:
        for label, url in catalogs:
            with tempfile.TemporaryDirectory(prefix="ucp-scale-") as tmp:
                tag = f"{os.getpid()}x{world}{label[0]}{int(time.time())}"
                phases = [{"op": "save", "tensors": args.tensors, "step": 1, "app": f"s1{tag}"},
                          {"op": "save", "tensors": args.tensors, "step": 2, "app": f"s2{tag}"},
                          {"op": "load", "tensors": args.tensors, "step": 2, "app": f"l{tag}"}]
                spec = {"store": os.path.join(tmp, "store"), "out": os.path.join(tmp, "out"), "run": f"scale{tag}",
                        "phases": phases, "timeout": args.timeout}
                t0 = time.perf_counter()
                if url:  # a fresh schema per run: a catalog belongs to one store root (its rows name relative paths)
                    with _schema(url, f"scale_{tag}") as spec["catalog"]:
                        results = _launch(spec, world)
                else:
                    results = _launch(spec, world)
                runs = [_summary(results, i) for i in range(len(phases))]
                out["runs"].append({"ranks": world, "catalog": label, "launch_s": time.perf_counter() - t0,
                                    "phases": runs})
                for r in runs:
                    print(f"{world:>4} ranks {label:<10} {r['op']:<5} {r['wall_s']:7.2f} s  connections "
                          f"{r['connections_clients']} (server {r['connections_server']})  statements "
                          f"{r['statements_rank0']}  collectives/rank {r['collectives_per_rank']}  broadcast "
                          f"{r['bytes_broadcast']} B  exact {r['exact']} {r['errors'] or ''}", flush=True)
    return out


def _kill_run(spec: dict, world: int, victim: int, tensors: int) -> dict:
    """Step 1 saved, then ``victim`` SIGKILLed in the save of step 2 (after two boxes, ``dist.mid_write:2``):
    each survivor's error and how long after the death it came; what the catalog lists afterwards."""
    from ucp_store.store import open_store

    phases = [{"op": "save", "tensors": tensors, "step": 1},
              {"op": "save_kill_rank", "tensors": tensors, "step": 2, "rank": victim, "at": "dist.mid_write:2"}]
    results = _launch({**spec, "phases": phases, "out": spec["out"] + "-kill"}, world)
    reaped = results[victim][-1]["reaped_at"]
    survivors = [r[-1] for i, r in enumerate(results) if i != victim]
    errors = [p["error"] or "" for p in survivors]
    after = sorted(p["t_end"] - reaped for p in survivors)
    st = open_store(spec["store"], catalog=spec.get("catalog"))
    try:
        rows = st.list_checkpoints(include_pending=True)
        listed = [c["step"] for c in st.list_checkpoints()]
    finally:
        st.catalog.close()
    return {"victim": victim, "first_save_s": max(r[0]["wall_s"] for r in results),
            "survivors": len(survivors), "ucp_errors": sum(e.startswith("UcpError:") and "a rank died" in e
                                                          for e in errors),
            "error_example": min(errors, key=len)[:240], "error_after_kill_s": {
                "min": after[0], "median": after[len(after) // 2], "max": after[-1]},
            "listed_steps": listed, "catalog_rows": [(c["step"], c["status"]) for c in rows]}


def _restart_run(spec: dict, world: int, tensors: int, saves: int) -> dict:
    """The job restarted: ``saves`` saves (steps 2..) and a load of the last, while ``ucp gc`` (the CLI, a
    process per run) runs in a loop; then every committed version is verified from this process."""
    from ucp_store.store import open_store

    steps = list(range(2, 2 + saves))
    phases = [{"op": "save", "tensors": tensors, "step": s} for s in steps] + [
        {"op": "load", "tensors": tensors, "step": steps[-1]}]
    out = spec["out"] + "-restart"
    results = _launch({**spec, "phases": phases, "out": out, "gc": {"interval": 0.2, "start": "now"}}, world)
    with open(os.path.join(out, "gc.json")) as f:
        gc_runs = json.load(f)
    windows = [(p["t_start"], p["t_end"]) for p in results[0][:saves]]
    st = open_store(spec["store"], catalog=spec.get("catalog"))
    try:
        committed = st.list_checkpoints()
        problems = {c["step"]: len(st.checkpoint(c["id"]).verify()) for c in committed}
    finally:
        st.catalog.close()
    return {"save_s": [max(r[i]["wall_s"] for r in results) for i in range(saves)],
            "save_errors": [p["error"] for r in results for p in r if p["error"]][:3],
            "load_exact": all(r[-1].get("exact") for r in results),
            "gc_runs": len(gc_runs), "gc_failed": sum(g["rc"] != 0 for g in gc_runs),
            "gc_during_saves": sum(any(g["t_start"] < e and g["t_end"] > b for b, e in windows) for g in gc_runs),
            "committed_steps": [c["step"] for c in committed],
            "returned_ids_listed": {r[i]["id"] for r in results for i in range(saves)} <= {c["id"] for c in committed},
            "verify_problems": problems}


def run_faults(args: argparse.Namespace) -> dict:
    """Issue 27 item 5 at ``--ranks`` (each): a rank killed mid-save, then the job restarted with gc running."""
    out: dict = {"machine": f"{platform.machine()} {os.cpu_count()} cpus", "dist_timeout": args.dist_timeout,
                 "runs": []}
    catalogs = [("sqlite", None)] + ([("postgresql", args.postgres_url)] if args.postgres_url else [])
    for world in args.ranks:
        for label, url in catalogs:
            with tempfile.TemporaryDirectory(prefix="ucp-faults-") as tmp:
                tag = f"{os.getpid()}x{world}{label[0]}{int(time.time())}"
                spec = {"store": os.path.join(tmp, "store"), "out": os.path.join(tmp, "out"), "run": "scale",
                        "timeout": args.timeout, "dist_timeout": args.dist_timeout}
                victim = world // 2 if args.victim is None else args.victim
                with (_schema(url, f"faults_{tag}") if url else contextlib.nullcontext()) as spec["catalog"]:
                    if spec["catalog"] is None:
                        del spec["catalog"]
                    t0 = time.perf_counter()
                    kill = _kill_run(spec, world, victim, args.tensors)
                    restart = _restart_run(spec, world, args.tensors, args.saves)
                run = {"ranks": world, "catalog": label, "launch_s": time.perf_counter() - t0, "kill": kill,
                       "restart": restart}
                out["runs"].append(run)
                print(json.dumps(run, indent=1), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--tensors", type=int, default=10)
    ap.add_argument("--postgres-url", default=None)
    ap.add_argument("--timeout", type=int, default=600, help="collective timeout, seconds (default 600)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--faults", action="store_true", help="issue 27 item 5: a rank killed mid-save, then the job "
                    "restarted with ucp gc running while it saves (see run_faults)")
    ap.add_argument("--dist-timeout", type=int, default=30, help="--faults: UCP_DIST_TIMEOUT, seconds (default 30)")
    ap.add_argument("--victim", type=int, default=None, help="--faults: the rank killed (default ranks // 2)")
    ap.add_argument("--saves", type=int, default=4, help="--faults: saves of the restarted job (default 4)")
    args = ap.parse_args(argv)
    if any(n < 2 for n in args.ranks):
        ap.error("--ranks must be >= 2")
    res = run_faults(args) if args.faults else run_ranks(args)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
