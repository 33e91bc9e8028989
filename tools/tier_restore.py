"""Node loss and restore from the nearest copies (issue 38), on simulated nodes of one machine.

    .venv/bin/python tools/tier_restore.py                      # the demo model, folder + S3 (moto) durable
    .venv/bin/python tools/tier_restore.py --dim 512 --ffn 1408 --layers 4 --vocab 8192   # ~256 MiB of state

4 nodes x 2 gloo ranks (``UCP_NODE`` per rank), each node's fast tier its own folder under /dev/shm, the
durable tier a folder or moto's S3 server over real HTTP, the catalog PostgreSQL (``UCP_TEST_POSTGRES_URL``;
else SQLite, said so). Per durable tier:

1. the uninterrupted run: the demo's GPT (TP=2 x FSDP2 dp=4) trains steps 1..N without saving: its losses;
2. the same run saves every ``--every`` steps with ``tier="fast", replicas=1`` (each save waits for
   ``durable`` after its blocking part is timed; the first save also times a durable ``dcp.save`` of the same
   state beside it); once step K's save is durable, node n3's two ranks are SIGKILLed, its fast folder
   removed, and the rest of the job killed;
3. the restart: 3 nodes x 2 ranks at TP=2 x dp=3 picks ``newest_restorable``, loads it from the nearest copies
   (bytes per tier), ``verify``s it bit for bit, loads the same version again from the durable tier alone
   (timed, verified), and trains K+1..N: its losses must follow the uninterrupted run (``ucp demo``'s rule).

Prints one table of figures per durable tier and a verdict; exits non-zero on a failed check. Figures are
timings of this machine under its current load (``uptime`` printed beside them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RUN = "tiers"


# ----------------------------------------------------------------------------------------- one rank
def rank_main(rank: int, job: dict, port: int) -> None:
    world = job["tp"] * job["dp"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), UCP_NODE=job["nodes"][rank],
                      UCP_DIST_TIMEOUT=str(job.get("timeout_s", 60)))
    os.environ.pop("UCP_FAST_TIER", None)
    import datetime
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # FSDP2 on the root's logits
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    out: dict = {"rank": rank, "saves": [], "losses": {}}
    path = Path(job["out"]) / f"rank{rank}.json"
    try:
        _train(rank, world, job, out, path)
    except BaseException as exc:  # noqa: BLE001 - reported to the orchestrator
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["trace"] = traceback.format_exc()[-3000:]
    _dump(path, out)
    if "error" not in out:
        dist.destroy_process_group()


def _dump(path: Path, out: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, path)


def _train(rank: int, world: int, job: dict, out: dict, path: Path) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ucp_store.demo import model as M
    from ucp_store.demo import text

    tp, dp = job["tp"], job["dp"]
    cfg = M.ModelConfig(**job["cfg"])
    model = M.parallelize(M.build_model(cfg, seed=0), M.make_mesh(tp=tp, dp=dp, device_type="cpu"), tp=tp, dp=dp)
    opt = M.build_optimizer(model, lr=1e-3)
    sampler = text.Sampler(cfg, seed=0, dp_rank=rank // tp, dp=dp,
                           next_sample=0 if job.get("resume") else (rank // tp) * (cfg.batch_size // dp))

    def state() -> dict:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd, "sampler": sampler.state_dict()}

    start = 0
    if job.get("resume"):
        sd = state()
        start = _restore(sd, job, out)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        sampler.load_state_dict(sd["sampler"])
        _dump(path, out)
    for step in range(start + 1, job["end"] + 1):
        inputs, targets = sampler.next_batch("cpu")
        local = M.train_step(model, opt, inputs, targets)
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        torch.distributed.all_gather(every, torch.tensor([local], dtype=torch.float64))
        out["losses"][step] = sum(float(every[d * tp].item()) for d in range(dp)) / dp
        if step in job.get("saves", ()):
            _save(state(), job, step, out)
        _dump(path, out)
        if step == job.get("hold_after"):  # the job is killed here (the orchestrator SIGKILLs every rank)
            time.sleep(3600)


def _save(sd: dict, job: dict, step: int, out: dict) -> None:
    import torch.distributed as dist

    import ucp_store.distributed as ucpd

    dist.barrier()
    t0 = time.perf_counter()
    res: Any = ucpd.save(sd, store=job["store"], run=RUN, step=step, tier="fast", replicas=1, fast_tier=job["fast"],
                         progress=False)  # a TieredResult
    blocked = time.perf_counter() - t0
    rec: dict = {"step": step, "id": str(res), "safety": res.safety, "blocked_s": blocked,
                 "phases": dict(res.timings)}
    dist.barrier()
    rec["blocked_max_s"] = _max(blocked)
    rec["waited"] = res.wait("durable", timeout=600)
    if job.get("dcp_at") == step:  # the same state, a durable DCP save beside it, and an async tiered save
        import torch.distributed.checkpoint as dcp

        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, checkpoint_id=os.path.join(job["dcp_dir"], f"step{step}"))
        rec["dcp_s"] = _max(time.perf_counter() - t0)
        dist.barrier()  # what the training loop waits for with async_save, and when the version is replicated
        t0 = time.perf_counter()
        handle = ucpd.async_save(sd, store=job["store"], run=f"{RUN}-async", step=step, tier="fast", replicas=1,
                                 fast_tier=job["fast"], drain=False)
        rec["async_blocked_s"] = _max(time.perf_counter() - t0)
        handle.result().wait("replicated", timeout=600)
        rec["async_replicated_s"] = _max(time.perf_counter() - t0)
    out["saves"].append(rec)


def _max(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _restore(sd: dict, job: dict, out: dict) -> int:
    """Pick, load from the nearest copies, verify; again from the durable tier alone. Returns the step."""
    import copy
    import importlib

    import torch.distributed as dist

    import ucp_store.distributed as ucpd
    from ucp_store.demo import text
    from ucp_store.distributed import restore

    # What any first load imports (the store and checkpoint classes, SQLAlchemy: about 0.3 CPU-s per process),
    # loaded before either timed load: the second load would otherwise find them warm and the first pay for them
    importlib.import_module("ucp_store.registry.checkpoint")
    importlib.import_module("ucp_store.store")
    policy = {"sampler": ucpd.reshard(text.resplit)}
    pick = restore.newest_restorable(job["store"], RUN)
    out["pick"] = {"ref": pick.ref, "safety": pick.safety, "note": pick.note}
    spare = copy.deepcopy(sd)
    dist.barrier()
    t0 = time.perf_counter()
    res = ucpd.load(sd, store=job["store"], ref=pick.ref, fast_tier=job["fast"], progress=False, per_rank=policy)
    out["nearest_s"] = _max(time.perf_counter() - t0)
    out["tier_bytes"], out["job_tier_bytes"], out["bad"] = res.tier_bytes, res.job_tier_bytes, res.bad_copies
    out["tier_seconds"], out["bytes_read"] = res.tier_seconds, res.bytes_read
    report = ucpd.verify(sd, pick.ref, store=job["store"], fast_tier=job["fast"], progress=False, per_rank=policy)
    out["verify_nearest"] = [report.ok, str(report)[:400]]
    if pick.safety == "durable":  # the same version from the durable tier alone
        dist.barrier()
        t0 = time.perf_counter()
        ucpd.load(spare, store=job["store"], ref=pick.ref, progress=False, per_rank=policy)
        out["durable_s"] = _max(time.perf_counter() - t0)
        report = ucpd.verify(spare, pick.ref, store=job["store"], progress=False, per_rank=policy)
        out["verify_durable"] = [report.ok, str(report)[:400]]
    return int(pick.ref.rsplit("@", 1)[1])


# ----------------------------------------------------------------------------------------- the orchestrator
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(job: dict, env: dict) -> list[subprocess.Popen]:
    Path(job["out"]).mkdir(parents=True, exist_ok=True)
    port = free_port()
    world = job["tp"] * job["dp"]
    return [subprocess.Popen([sys.executable, __file__, "--rank", str(r), json.dumps(job), str(port)],
                             env={**os.environ, **env}) for r in range(world)]


def wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def read_outs(job: dict) -> list[dict]:
    outs = []
    for r in range(job["tp"] * job["dp"]):
        path = Path(job["out"]) / f"rank{r}.json"
        try:
            outs.append(json.loads(path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            outs.append({})
    return outs


def kill_after(procs: list[subprocess.Popen], job: dict, step: int, node_ranks: list[int], timeout: float) -> None:
    """Once every rank has recorded step ``step``'s save (durable), SIGKILL ``node_ranks``, then the rest."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        outs = read_outs(job)
        if all(any(s["step"] == step for s in o.get("saves", ())) for o in outs):
            break
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a rank exited before step {step} was saved: {[o.get('error') for o in outs]}")
        time.sleep(0.2)
    else:
        raise SystemExit(f"step {step} was not saved within {timeout} s")
    for r in node_ranks:
        os.kill(procs[r].pid, signal.SIGKILL)
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
    wait_all(procs, 30)


def scenario(args, durable: str, work: Path, env: dict) -> dict:
    """One durable tier: uninterrupted run, run with saves and a node loss, restart on 3 nodes; the figures."""
    from ucp_store.demo import report

    cfg = {"vocab": args.vocab, "dim": args.dim, "heads": args.heads, "layers": args.layers, "ffn": args.ffn,
           "seq": 16, "batch_size": 12}
    fast = f"/dev/shm/ucp-tier-restore-{os.getpid()}-{work.name}/{{node}}"
    per = args.per_node
    nodes = [f"n{r // per}" for r in range(4 * per)]
    saves = list(range(args.every, args.steps + 1, args.every))
    kill_step = max(s for s in saves if s < args.steps)
    base = {"tp": 2, "dp": 2 * per, "nodes": nodes, "cfg": cfg, "end": args.steps, "store": durable, "fast": fast}
    try:
        job = {**base, "out": str(work / "base")}
        wait_all(launch(job, env), args.timeout)
        base_losses = {int(k): v for k, v in read_outs(job)[0].get("losses", {}).items()}
        job = {**base, "out": str(work / "run"), "saves": saves, "dcp_at": saves[0], "dcp_dir": str(work / "dcp"),
               "hold_after": kill_step}
        kill_after(launch(job, env), job, kill_step, [r for r, n in enumerate(nodes) if n == "n3"], args.timeout)
        saved = read_outs(job)
        shutil.rmtree(fast.replace("{node}", "n3"), ignore_errors=True)  # node n3 is gone, its fast tier with it
        tp = 2 if per == 2 else 1  # another DP degree (and with one rank per node another TP degree too)
        job = {**base, "tp": tp, "dp": 3, "nodes": [f"n{r // per}" for r in range(3 * per)],
               "out": str(work / "restart"), "resume": True}
        wait_all(launch(job, env), args.timeout)
        restarted = read_outs(job)
    finally:
        shutil.rmtree(Path(fast).parent, ignore_errors=True)
    errors = [o.get("trace") or o.get("error") for o in restarted + saved if o.get("error")]
    first = restarted[0]
    resumed = {int(k): v for k, v in first.get("losses", {}).items()}
    verdict = report.compare("restart", f"3 nodes x {per}", "relative", base_losses, resumed) if resumed else None
    save0 = saved[0]["saves"][0] if saved[0].get("saves") else {}
    return {"durable": durable, "errors": errors, "base": base_losses, "resumed": resumed, "pick": first.get("pick"),
            "verdict": verdict.describe() if verdict else "no resumed losses", "ok": bool(verdict and verdict.ok),
            "blocked_s": max((s["blocked_max_s"] for s in saved[0].get("saves", ())), default=None),
            "saves": saved[0].get("saves", []), "dcp_s": save0.get("dcp_s"), "kill_step": kill_step,
            "async_blocked_s": save0.get("async_blocked_s"), "async_replicated_s": save0.get("async_replicated_s"),
            "nearest_s": first.get("nearest_s"), "durable_s": first.get("durable_s"),
            "tier_seconds": first.get("tier_seconds"),
            "job_tier_bytes": first.get("job_tier_bytes"), "bad": [b for o in restarted for b in o.get("bad", [])],
            "verify": [o.get("verify_nearest") for o in restarted] + [o.get("verify_durable") for o in restarted]}


def checks(r: dict) -> list[str]:
    """What must hold for one durable tier; the failures."""
    bad = []
    if r["errors"]:
        bad.append(f"rank errors: {r['errors'][:2]}")
    if not r["ok"]:
        bad.append(f"losses: {r['verdict']}")
    if not r["pick"] or r["pick"]["ref"] != f"{RUN}@{r['kill_step']}":
        bad.append(f"resumed from {r['pick']}, expected {RUN}@{r['kill_step']}")
    if not all(v and v[0] for v in r["verify"]):
        bad.append(f"verify: {[v for v in r['verify'] if not (v and v[0])][:2]}")
    if not r["job_tier_bytes"] or r["job_tier_bytes"]["durable"] != 0:
        bad.append(f"bytes from the durable tier: {r['job_tier_bytes']}")
    return bad


def table(r: dict, load: str) -> str:
    mib = 1 << 20
    jb = r["job_tier_bytes"] or {}
    rows = [("durable tier", r["durable"].split("?")[0]),
            ("blocking time until `replicated` (slowest rank, max over saves)", f"{r['blocked_s']:.3f} s"),
            ("durable `dcp.save` of the same state (first save's step)", f"{r['dcp_s']:.3f} s"),
            ("`async_save(tier=\"fast\")`: the call blocks / until `replicated`",
             f"{r['async_blocked_s']:.3f} s / {r['async_replicated_s']:.3f} s"),
            ("async ratio: blocked / `dcp.save` (goal <= 0.2)", f"{r['async_blocked_s'] / r['dcp_s']:.3f}"),
            ("ratio (goal <= 0.2)", f"{r['blocked_s'] / r['dcp_s']:.3f}"),
            (f"restore of {r['pick']['ref'] if r['pick'] else '?'} after node n3's loss: bytes local / peer / durable",
             f"{jb.get('local', 0) / mib:.1f} / {jb.get('peer', 0) / mib:.1f} / {jb.get('durable', 0) / mib:.1f} MiB"),
            ("restore wall time: nearest copies", f"{r['nearest_s']:.3f} s"),
            ("restore wall time: durable tier alone", f"{r['durable_s']:.3f} s" if r["durable_s"] else "-"),
            ("speed-up (goal >= 3x with S3)", f"{r['durable_s'] / r['nearest_s']:.2f}x" if r["durable_s"] else "-"),
            ("losses after the restart", r["verdict"]), ("load (uptime)", load)]
    return "\n".join(["| figure | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--durable", choices=["folder", "s3", "both"], default="both")
    ap.add_argument("--per-node", type=int, choices=[1, 2], default=2, help="ranks per node (4 nodes)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--dim", type=int, default=40)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=88)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--work", help="keep the runs' files in this folder (default: a temporary one, removed)")
    args = ap.parse_args()
    failures, results = 0, []
    with tempfile.TemporaryDirectory(prefix="ucp-tier-restore-") as scratch:
        tmp = args.work or scratch
        for kind in (["folder", "s3"] if args.durable == "both" else [args.durable]):
            with _catalog(Path(tmp) / kind) as (catalog, note), _durable(kind, Path(tmp)) as (url, env):
                print(note)
                r = scenario(args, url, Path(tmp) / kind, {**env, "UCP_CATALOG": catalog})
            load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
            bad = checks(r)
            failures += len(bad)
            r["checks"] = bad
            results.append(r)
            try:
                print(f"\n### durable tier: {kind}\n\n{table(r, load)}\n")
                for sv in r["saves"]:  # where a save's time went (rank 0), and the restore's (rank 0)
                    print(f"save {sv['step']} phases: " + ", ".join(f"{k} {v:.3f}" for k, v in sv["phases"].items()))
                print(f"restore phases (rank 0, s): {r['tier_seconds']}")
            except (TypeError, KeyError, ZeroDivisionError):  # a run that failed has no figures
                print(f"\n### durable tier: {kind}: no figures ({r['errors'][:1]})")
            print("checks: " + ("all hold" if not bad else "FAILED: " + "; ".join(bad)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 1 if failures else 0


@contextmanager
def _catalog(work: Path) -> Iterator[tuple[str, str]]:
    """A fresh PostgreSQL schema (``UCP_TEST_POSTGRES_URL``), else a SQLite file (said so)."""
    base = os.environ.get("UCP_TEST_POSTGRES_URL")
    work.mkdir(parents=True, exist_ok=True)
    if not base:
        yield f"sqlite:///{work}/catalog.db", "catalog: SQLite (set UCP_TEST_POSTGRES_URL for PostgreSQL)"
        return
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    schema = f"ucp_tiers_{os.getpid()}_{work.name}"
    admin = create_engine(base, poolclass=NullPool)
    with admin.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False), f"catalog: PostgreSQL (schema {schema})"
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


@contextmanager
def _durable(kind: str, tmp: Path) -> Iterator[tuple[str, dict]]:
    """The durable tier: a folder, or a bucket on moto's S3 server over real HTTP (started here)."""
    if kind == "folder":
        yield str(tmp / kind / "store"), {}
        return
    import boto3
    from moto.server import ThreadedMotoServer

    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
    os.environ.update(env)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="ucp-tiers")
        yield f"s3://ucp-tiers/store?endpoint={endpoint}&region=us-east-1", env
    finally:
        server.stop()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(main())
