"""Start the ranks of one demo training run as spawned processes and collect what rank 0 reports.

Each run gets a fresh free port and `world` processes, forked from a fork server that has the ranks'
imports loaded (never forked from the parent, which may hold threads or a TensorStore context; spawned
where there is no fork server). Rank 0's step losses drive a rich progress bar.
The parent never waits without bound: a rank that exits non-zero, or a run past its deadline, stops
every rank of the run and raises `DemoError` with the failing rank's message.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_mod
import socket
import time
from contextlib import closing

from ucp_store.errors import UcpError

__all__ = ["DemoError", "free_port", "run_job"]


class DemoError(UcpError):
    """A demo run failed, or a resumed run diverged beyond its tolerance."""


# Imported once by the fork server, so that every rank starts with them loaded: a fresh interpreter pays
# about 7 CPU-seconds for torch, FSDP and ucp_store.distributed, and the demo starts 15 ranks on 2 cores.
PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
           "torch.distributed.checkpoint.state_dict", "ucp_store.distributed", "ucp_store.demo.model",
           "ucp_store.demo.text", "ucp_store.demo.worker"]


def _context():
    """A fork server with the ranks' imports preloaded where the platform has one (Linux, macOS), else spawn.

    The server is a fresh single-threaded interpreter, so forking it is safe: CUDA, gloo and TensorStore
    threads start only in the ranks."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (for the run's rendezvous)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(job: dict, world: int, *, progress=None, task=None, timeout_s: float = 600.0) -> tuple[dict, dict]:
    """Run `job` on `world` processes; returns rank 0's ({step: loss}, info);
    info["boxes"] lists each rank's boxes when the job asks for them (`boxes_of`). Raises DemoError on failure."""
    from ucp_store.demo.worker import entry

    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=entry, args=(r, world, port, job, q), name=f"ucp-demo-{job['key']}-rank{r}")
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    result = None
    errors: list[tuple] = []
    failed_at = None
    boxes: dict[int, dict] = {}
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
                elif msg[0] == "boxes":
                    boxes[msg[2]] = msg[3]
                elif msg[0] == "error":
                    errors.append(msg)
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
    if errors:
        raise DemoError(f"run {job['label']}: " + _describe_errors(errors, [p.exitcode for p in procs]))
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes) or result is None:
        raise DemoError(f"run {job['label']}: processes exited with codes {codes} and rank 0 reported "
                        f"{'no result' if result is None else 'a result'}")
    losses = {int(k): v for k, v in result[0].items()}
    info = dict(result[1])
    if boxes:
        info["boxes"] = [boxes[r] for r in sorted(boxes)]
    return losses, info


_COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "failed on rank")


def _describe_errors(errors: list[tuple], codes: list) -> str:
    """Every rank's error in one line each, and the traceback of the likely cause (not a peer's hang-up)."""
    cause = next((e for e in errors if not any(c in e[3] for c in _COLLATERAL)), errors[0])
    lines = [f"rank {e[2]} failed: {e[3].splitlines()[0] if e[3] else '?'}" for e in sorted(errors, key=lambda e: e[2])]
    silent = [r for r, c in enumerate(codes) if c not in (0, None) and r not in {e[2] for e in errors}]
    if silent:
        lines.append(f"rank(s) {silent} died without a report (exit codes {[codes[r] for r in silent]})")
    return "; ".join(lines) + f"\ntraceback of rank {cause[2]}:\n{cause[4].rstrip()}"
