"""Benchmark the command line: wall time of catalog-only ``ucp`` commands beside trivial processes.

Each command runs in a fresh subprocess (what a user waits for: interpreter start, imports, the catalog
query, the output), ``--repeats`` times; the table shows the best and the median. The store is real: a
small torch file imported with ``ucp import torch`` by the ``ucp`` under test, so the same script
measures another checkout's ``ucp`` (``--ucp /work/main/.venv/bin/ucp``) for a before/after figure.

    python tools/bench_cli.py [--ucp PATH] [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["main", "time_command"]


def time_command(cmd: list[str], repeats: int, env: dict[str, str]) -> list[float]:
    """Wall seconds of ``repeats`` runs of ``cmd`` (output discarded; a non-zero exit is an error)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        out.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.decode()[-500:]}")
    return out


def _make_store(ucp: str, folder: str, env: dict[str, str]) -> None:
    import torch

    src = os.path.join(folder, "model.pt")
    torch.save({f"layers.{i}.weight": torch.randn(64, 64) for i in range(20)}, src)
    store = os.path.join(folder, "store")
    for args in (["init"], ["import", "torch", src, "--run", "bench", "--step", "1"],
                 ["import", "torch", src, "--run", "bench", "--step", "2"], ["tag", "bench@2", "best"]):
        subprocess.run([ucp, "--store", store, *args], check=True, stdout=subprocess.DEVNULL, env=env)


def main(argv: list[str] | None = None) -> int:
    """Build a small store, time the commands, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ucp", default=os.path.join(os.path.dirname(sys.executable), "ucp"),
                    help="the ucp executable to measure (default: the one beside this Python)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    ucp = os.path.abspath(args.ucp)
    py = os.path.join(os.path.dirname(ucp), "python")
    env = {**os.environ, "UCP_PROGRESS": "0"}
    env.pop("UCP_STORE", None)
    with tempfile.TemporaryDirectory(prefix="ucp-bench-cli-") as tmp:
        _make_store(ucp, tmp, env)
        store = os.path.join(tmp, "store")
        commands = [
            ("git --version", [shutil.which("git") or "git", "--version"]),
            ("python -c pass", [py, "-c", "pass"]),
            ("python -c 'import ucp_store'", [py, "-c", "import ucp_store"]),
            # the floor of any command that reads the catalog through SQLAlchemy (a core dependency)
            ("python -c 'import sqlalchemy'", [py, "-c", "import sqlalchemy"]),
            ("python -c 'import sqlalchemy.orm'", [py, "-c", "import sqlalchemy.orm"]),
            ("ucp --help", [ucp, "--help"]),
            ("ucp ls", [ucp, "--store", store, "ls"]),
            ("ucp ls bench", [ucp, "--store", store, "ls", "bench"]),
            ("ucp show bench@2", [ucp, "--store", store, "show", "bench@2"]),
            ("ucp log bench:best", [ucp, "--store", store, "log", "bench:best"]),
        ]
        print(f"ucp: {ucp}; best and median of {args.repeats} runs, seconds")
        print(f"{'command':32} {'best':>7} {'median':>7}")
        print("-" * 48)
        for label, cmd in commands:
            times = time_command(cmd, args.repeats, env)
            print(f"{label:32} {min(times):7.3f} {statistics.median(times):7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
