"""Helpers shared by the foundation tests (format, store, CLI, crash, concurrency, security).

A module of its own, not conftest.py: ``tests/deepspeed/conftest.py`` would shadow ``from conftest import``.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
#: the DeepSpeed and rank harnesses that tests and benchmarks share (not part of the wheel)
TOOLS = REPO / "tools"


def tools_on_path() -> None:
    """Make ``tools/`` importable (``fork_ranks``, ``ds_moe``, ``ds_autoep``, ``scale_ranks``)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
PG_ENV = "UCP_TEST_POSTGRES_URL"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fork_jobs(jobs: list[dict], nproc: int, where: Path, name: str, *, timeout: float = 600,
              harness: str = "ucp_store.demo.ds_train") -> None:
    """``nproc`` DeepSpeed ranks running ``jobs`` in order (``harness``'s ``main``: the ``--job`` arguments of
    ``ucp_store.demo.ds_train``), forked by tools/fork_ranks.py from one interpreter that imported torch and
    DeepSpeed once (torchrun starts a fresh one per rank); the launch folder is ``where / name``."""
    import pytest

    tools_on_path()
    from fork_ranks import launch

    folder = Path(where) / name
    folder.mkdir(parents=True, exist_ok=True)
    try:
        launch([{"ranks": nproc, "jobs": jobs, "harness": harness}], folder, timeout)
    except RuntimeError as exc:
        pytest.fail(f"{name}: {exc}")


def ds_env() -> dict:
    """The environment of a DeepSpeed job on CPU (gloo): this checkout importable, no progress bars."""
    env = dict(os.environ)
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "UCP_PROGRESS": "0",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
                "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore"})
    return env


def torchrun(args: list[str], nproc: int, *, timeout: int = 600, cwd: Path | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run`` of ``args`` on ``nproc`` local processes (``ds_env``, a free
    rendezvous port); with ``check``, a non-zero exit fails the test with the ends of both streams."""
    import pytest

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           *args]
    proc = subprocess.run(cmd, env=ds_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if check and proc.returncode != 0:
        pytest.fail(f"torchrun {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-6000:]}")
    return proc


@contextmanager
def postgres_schema_url():
    """A PostgreSQL URL whose search_path is a fresh schema, dropped on exit; skips without a server."""
    import pytest
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    from ucp_store.catalog import new_id

    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"{PG_ENV} is not set (e.g. postgresql+psycopg2://ucp:ucp@localhost/ucp_test)")
    schema = f"ucp_test_{new_id(12)}"
    admin = create_engine(base, poolclass=NullPool)
    with admin.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        yield make_url(base).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
            hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


def bits(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor (C order), independent of ucp_store's own conversions."""
    fresh = torch.empty(t.shape, dtype=t.dtype)  # standard strides, whatever the source's (size-1 dims)
    fresh.copy_(t.detach())
    return fresh.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def random_bits(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are uniformly random (NaN payloads, -0.0, Inf, subnormals...)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def shard_file_and_range(store_root: Path, info, chunk_index) -> tuple[Path, int, int]:
    """Where inner chunk ``chunk_index`` of a sharded array lies: (shard file, byte offset, length).

    Computed from the zarr v3 sharding spec (index at the end: per chunk (offset, nbytes) uint64 LE,
    followed by a crc32c), not from ucp_store's helpers.
    """
    chunk, shard = info.chunk_shape, info.shard_shape
    per_shard = [s // c for s, c in zip(shard, chunk)]
    shard_idx = [i // p for i, p in zip(chunk_index, per_shard)]
    inner = [i % p for i, p in zip(chunk_index, per_shard)]
    path = store_root / info.array / "c" / Path(*map(str, shard_idx))
    raw = path.read_bytes()
    n = math.prod(per_shard)
    index = np.frombuffer(raw[len(raw) - 4 - 16 * n:len(raw) - 4], dtype="<u8").reshape(*per_shard, 2)
    offset, length = (int(v) for v in index[tuple(inner)])
    assert offset != 2**64 - 1, f"chunk {chunk_index} is not stored (empty chunk)"
    return path, offset, length


def flip_chunk_byte(store_root: Path, info, chunk_index, at: int = 3) -> tuple[Path, int]:
    """Flip one byte inside an inner chunk's encoded bytes; returns (file, position) for flipping back."""
    path, offset, length = shard_file_and_range(store_root, info, chunk_index)
    pos = offset + min(at, length - 1)
    flip_byte(path, pos)
    return path, pos


def flip_byte(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))


def tree_digest(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``folder``."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def array_folders(store_root: Path) -> set[str]:
    """``arrays/<checkpoint>/<array>.zarr`` folders present on disk."""
    base = Path(store_root) / "arrays"
    return {f"arrays/{p.parent.name}/{p.name}" for p in base.glob("*/*.zarr")}


def python_env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("UCP_STORE", None)
    env.pop("UCP_CATALOG", None)
    env["UCP_PROGRESS"] = "0"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_python(args: list[str], *, timeout: float = 180, **env) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` (this interpreter) in a real subprocess."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=python_env(**env), cwd=str(REPO))


def wait_for(predicate, *, timeout: float = 180, what: str = "condition", procs=()) -> None:
    """Poll until ``predicate()``; fails (never hangs) if it does not happen or a child dies first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            if p.poll() is not None:
                out, err = p.communicate()
                raise AssertionError(f"child exited (rc {p.returncode}) before {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


#: what every rank imports, loaded once by the launcher before it forks the ranks
RANK_PRELOAD = ("torch.distributed", "torch.distributed.tensor", "torch.distributed.device_mesh",
                "torch.distributed.checkpoint", "ucp_store.distributed", "tensorstore", "sqlalchemy")


def _rank_body(rank_main, script: str, rank: int, spec: dict, port: int) -> None:
    """A forked rank: ``rank_main`` as ``script --rank R SPEC PORT`` would run it, then the atexit handlers a
    finished interpreter runs (``fork_ranks.child`` then leaves with its exit code)."""
    import atexit
    import json

    try:
        sys.argv = [script, "--rank", str(rank), json.dumps(spec), str(port)]
        rank_main(rank, spec, port)
    finally:
        atexit._run_exitfuncs()


def _start_ranks(script: str, rank_main, spec: dict, port: int) -> list:
    """``spec["world"]`` rank processes: forked from this interpreter once it holds ``RANK_PRELOAD`` (each rank
    saves the imports, about 2.5 CPU-seconds), or, where it cannot fork or already runs a thread besides the
    one torch starts at import, fresh ``script --rank R`` interpreters. Returns ``[(pid or Popen)]``."""
    import importlib
    import json

    world = spec["world"]
    if hasattr(os, "fork") and not spec.get("spawn"):
        for name in RANK_PRELOAD:
            importlib.import_module(name)
        import threading

        if threading.active_count() == 1:
            sys.stdout.flush()
            sys.stderr.flush()
            tools_on_path()
            from fork_ranks import child

            pids = []
            for r in range(world):
                pid = os.fork()
                if pid == 0:
                    child(_rank_body, rank_main, script, r, spec, port)  # never returns
                pids.append(pid)
            return pids
    return [subprocess.Popen([sys.executable, script, "--rank", str(r), json.dumps(spec), str(port)])
            for r in range(world)]


def _poll(proc) -> int | None:
    """A rank's exit code (negative: the signal that killed it), or None while it runs."""
    if isinstance(proc, int):
        done, status = os.waitpid(proc, os.WNOHANG)
        return None if done == 0 else os.waitstatus_to_exitcode(status)
    return proc.poll()


def rank_main_or_launch(script: str, rank_main) -> None:
    """The ``main`` of a gloo worker script: as ``script --rank R SPEC PORT``, run ``rank_main(R, spec, port)``;
    as ``script SPEC``, start ``spec["world"]`` ranks (forked, see ``_start_ranks``; ``spec["spawn"]``: fresh
    interpreters), so a rank that dies leaves the others running to report their errors; wait up to
    ``spec["timeout"]`` (240 s) and exit with 4 when ranks hung, the first failing rank's code (a signal as
    128 + its number) or 0."""
    import json
    import signal

    if sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]))
        return
    spec = json.loads(sys.argv[1])
    os.makedirs(spec["out"], exist_ok=True)
    port = free_port()
    procs = _start_ranks(script, rank_main, spec, port)
    codes: list[int | None] = [None] * len(procs)
    deadline = time.monotonic() + spec.get("timeout", 240)
    while time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if codes[r] is None:
                codes[r] = _poll(p)
        if all(c is not None for c in codes):
            break
        time.sleep(0.05)
    hung = [r for r, c in enumerate(codes) if c is None]
    for r in hung:
        p = procs[r]
        if isinstance(p, int):
            os.kill(p, signal.SIGKILL)
            os.waitpid(p, 0)
        else:
            p.kill()
            p.wait()
    if hung:
        print(f"ranks {hung} did not finish in time", file=sys.stderr)
        sys.exit(4)
    bad = [(r, c) for r, c in enumerate(codes) if c]
    if bad:  # a rank killed by a signal has a negative code, which max() over the ranks would hide
        print(f"ranks exited with {', '.join(f'rank {r}: {c}' for r, c in bad)}", file=sys.stderr)
        sys.exit(bad[0][1] if bad[0][1] > 0 else 128 - bad[0][1])
    sys.exit(0)


@contextmanager
def store_on(catalog: str, folder):
    """An open store in ``folder``, its catalog on SQLite (``"sqlite"``, inside the folder) or on a fresh
    PostgreSQL schema (``"postgres"``; skips without a server), closed before the schema is dropped."""
    import ucp_store

    if catalog == "sqlite":
        yield ucp_store.open_store(str(folder), create=True)
        return
    with postgres_schema_url() as url:
        store = ucp_store.open_store(str(folder), create=True, catalog=url)
        yield store
        store.catalog.close()


#: the dummy credentials moto's S3 server accepts
MOTO_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


@contextmanager
def moto_s3(*buckets: str):
    """moto's S3 server over real HTTP on a free local port, with ``buckets`` made and the dummy credentials in
    the environment (restored after); yields its endpoint URL. Skips the test where moto is not installed."""
    import pytest

    moto_server = pytest.importorskip("moto.server")
    saved = {k: os.environ.get(k) for k in MOTO_ENV}
    os.environ.update(MOTO_ENV)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        if buckets:
            import boto3

            client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            for b in buckets:
                client.create_bucket(Bucket=b)
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
