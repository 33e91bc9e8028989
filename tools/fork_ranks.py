"""Run phases of DeepSpeed jobs on ranks forked from one interpreter that has torch and DeepSpeed loaded.

A torchrun launch starts one fresh interpreter per rank plus its own, and each pays the imports (about
2.5 CPU-seconds for torch and DeepSpeed): 8 ranks, then 2 more for a resume, cost 25 CPU-seconds before any
job runs. Here the imports happen once, in this process, which stays single-threaded (nothing runs a
torch op, opens a process group or a TensorStore context), and every rank of every phase is ``os.fork``ed
from it with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``: a fresh port per phase). Each rank then runs the harness's ``main`` (default
``ucp_store.demo.ds_train``: ``deepspeed.init_distributed`` over gloo, the jobs, tear-down) exactly as under
torchrun.

Phases (a JSON list, ``--phases FILE``), in order, each waiting for the previous one:

- ``{"ranks": N, "jobs": [...], "harness": "ucp_store.demo.ds_train"}``: N ranks run the jobs;
- ``{"ucp": [ARGS...]}``: one forked child runs ``ucp ARGS...`` (``ucp_store.cli.main``);
- ``{"module": NAME, "argv": [ARGS...]}``: one forked child runs ``python -m NAME ARGS...`` (``runpy``), e.g.
  ``deepspeed.checkpoint.ds_to_universal``.

Bounded: a rank or command that exits non-zero stops its phase's other ranks (SIGKILL to the pids started
here) and this launcher exits 1 naming it; so does a phase past ``--timeout`` seconds (all phases together).

``launch(phases, where, timeout)`` runs it as ``python tools/fork_ranks.py`` (the tests' entry:
tests/deepspeed/test_3d.py, test_moe_tp.py); ``tools/fork_ranks.py`` is the command line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback

# What a DeepSpeed rank imports, loaded once here: besides torch and DeepSpeed themselves, the engine and the
# optimizers pull in torch._dynamo / _inductor / functorch, FSDP and DTensor modules (1500 modules, more
# than the base imports). None of them starts a thread at import (checked in main()).
PRELOAD = ["torch", "torch.distributed", "deepspeed", "deepspeed.comm", "deepspeed.runtime.pipe",
           "deepspeed.checkpoint", "ucp_store.demo.ds_train", "ds_moe"]
PRELOAD_OPTIONAL = ["torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.async_compile",
                    "torch._dynamo.backends.common", "torch._functorch.aot_autograd", "torch.distributed.fsdp",
                    "torch.distributed.tensor", "torch.onnx", "torch.utils.cpp_extension", "deepspeed.runtime.engine",
                    "deepspeed.runtime.pipe.engine", "deepspeed.runtime.zero.stage_1_and_2",
                    "deepspeed.runtime.bf16_optimizer", "deepspeed.module_inject", "deepspeed.moe.layer",
                    "deepspeed.ops.op_builder.all_ops", "deepspeed.checkpoint.ds_to_universal"]


CPU_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "UCP_PROGRESS": "0", "TORCH_CPP_LOG_LEVEL": "ERROR",
           "PYTHONWARNINGS": "ignore"}


def launch(phases: list, where: str | os.PathLike, timeout: float, *, env: dict | None = None) -> dict:
    """Run ``phases`` in a launcher process (DeepSpeed on CPU: ``CPU_ENV`` over ``env`` or the environment);
    returns its wall times per phase. Raises ``RuntimeError`` with the launcher's output when it fails."""
    import subprocess
    from pathlib import Path

    path = Path(where) / "phases.json"
    path.write_text(json.dumps(phases, indent=1))
    full = {**(os.environ if env is None else env), **CPU_ENV}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--phases", str(path), "--timeout",
                           str(timeout)], env=full, capture_output=True, text=True, timeout=timeout + 60, cwd=where)
    if proc.returncode != 0:
        raise RuntimeError(f"fork_ranks failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("fork_ranks timings (s): "))
    timings: dict = json.loads(line.split(": ", 1)[1])
    return timings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(fn, *args) -> None:
    """In a forked child: run ``fn(*args)`` and leave with its exit code (never returns)."""
    code = 1
    try:
        rc = fn(*args)
        code = rc if isinstance(rc, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - report anything, then leave
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_rank(harness: str, rank: int, world: int, port: int, jobs: list) -> int:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    argv: list[str] = []
    for job in jobs:
        argv += ["--job", json.dumps(job)]
    importlib.import_module(harness).main(argv)
    return 0


def _run_ucp(args: list) -> int:
    from ucp_store import cli

    return int(cli.main([str(a) for a in args]))


def _run_module(name: str, args: list) -> int:
    sys.argv = [name, *map(str, args)]
    runpy.run_module(name, run_name="__main__", alter_sys=True)
    return 0


def _wait(pids: dict[int, str], deadline: float) -> None:
    """Wait for every pid; on a failure or the deadline, SIGKILL the rest and exit 1 naming the culprit."""
    left = dict(pids)
    while left:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                _kill(left)
                sys.exit(f"fork_ranks: {', '.join(left.values())} still running at the deadline; stopped")
            time.sleep(0.05)
            continue
        what = left.pop(pid, None)
        if what is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            _kill(left)
            sys.exit(f"fork_ranks: {what} exited {code}")


def _kill(pids: dict[int, str]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", required=True, help="JSON file: a list of phases")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for all phases together")
    args = ap.parse_args(argv)
    with open(args.phases) as f:
        phases = json.load(f)
    deadline = time.monotonic() + args.timeout
    t0 = time.time()
    for name in PRELOAD:
        importlib.import_module(name)
    for name in PRELOAD_OPTIONAL:  # only a speed-up: a rank imports what is missing itself
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if threading.active_count() != 1:
        sys.exit(f"fork_ranks: the preloaded imports started threads {threading.enumerate()}; forking is unsafe")
    timings = {"preload": round(time.time() - t0, 2)}
    for i, phase in enumerate(phases):
        t1 = time.time()
        sys.stdout.flush()
        sys.stderr.flush()
        pids: dict[int, str] = {}
        if "ucp" in phase:
            pid = os.fork()
            if pid == 0:
                child(_run_ucp, phase["ucp"])
            pids[pid] = f"phase {i} (ucp {' '.join(map(str, phase['ucp'][:2]))})"
        elif "module" in phase:
            pid = os.fork()
            if pid == 0:
                child(_run_module, phase["module"], phase.get("argv", []))
            pids[pid] = f"phase {i} (python -m {phase['module']})"
        else:
            world, port = int(phase["ranks"]), _free_port()
            harness = phase.get("harness", "ucp_store.demo.ds_train")
            for rank in range(world):
                pid = os.fork()
                if pid == 0:
                    child(_run_rank, harness, rank, world, port, phase["jobs"])
                pids[pid] = f"phase {i} rank {rank} of {world}"
        _wait(pids, deadline)
        timings[f"phase{i}"] = round(time.time() - t1, 2)
    print("fork_ranks timings (s): " + json.dumps(timings), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
