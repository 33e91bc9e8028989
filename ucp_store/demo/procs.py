"""Start the ranks of one demo training run as spawned processes and collect what rank 0 reports.

Each run gets a fresh free port and `world` processes (`multiprocessing` spawn context: no fork of a
parent that may hold threads or a TensorStore context). Rank 0's step losses drive a rich progress bar.
The parent never waits without bound: a rank that exits non-zero, or a run past its deadline, stops
every rank of the run and raises `DemoError` with the failing rank's message.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_mod
import socket
import time
from contextlib import closing

from ..errors import UcpError

__all__ = ["DemoError", "free_port", "run_job"]


class DemoError(UcpError):
    """A demo run failed, or a resumed run diverged beyond its tolerance."""


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (for the run's rendezvous)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(job: dict, world: int, *, progress=None, task=None, timeout_s: float = 600.0) -> tuple[dict, dict]:
    """Run `job` on `world` processes; returns rank 0's ({step: loss}, info). Raises DemoError on failure."""
    from .worker import entry

    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=entry, args=(r, world, port, job, q), name=f"ucp-demo-{job['key']}-rank{r}")
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    result = None
    error = None
    failed_at = None
    try:
        while True:
            try:
                msg = q.get(timeout=0.2)
            except queue_mod.Empty:
                msg = None
            if msg is not None:
                if msg[0] == "step":
                    if progress is not None:
                        progress.update(task, advance=1, loss=f"{msg[3]:.4f}")
                elif msg[0] == "done":
                    result = (msg[2], msg[3])
                elif msg[0] == "error" and error is None:
                    error = msg
                continue  # drain before looking at exit codes
            codes = [p.exitcode for p in procs]
            if all(c == 0 for c in codes):
                break
            if any(c not in (None, 0) for c in codes) and failed_at is None:
                failed_at = time.monotonic()
            # give the other ranks a moment to report their own error (or time out), then stop them
            if failed_at is not None and (all(c is not None for c in codes) or time.monotonic() > failed_at + 20):
                break
            if time.monotonic() > deadline:
                raise DemoError(f"run {job['label']}: no result after {timeout_s:.0f} s; stopped its {world} processes")
    finally:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)
        q.close()
    if error is not None:
        _, _, rank, message, tb = error
        raise DemoError(f"run {job['label']}: rank {rank} failed: {message}\n{tb.rstrip()}")
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes) or result is None:
        raise DemoError(f"run {job['label']}: processes exited with codes {codes} and rank 0 reported "
                        f"{'no result' if result is None else 'a result'}")
    losses = {int(k): v for k, v in result[0].items()}
    return losses, result[1]
