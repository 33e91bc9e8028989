"""Print the fault tables of issue 16: kill points tried and survived per catalog x storage, corruptions caught.

    .venv/bin/python tools/fault_table.py [--pg postgresql+psycopg2://...] [--skip-corruption]

Runs tests/killpoint_driver.py with EVERY kill point on SQLite and PostgreSQL (``--pg`` or
``$UCP_TEST_POSTGRES_URL``; without one the PostgreSQL rows say "not run") and on a folder and an S3
bucket (moto's server, started here), then tests/test_corruption.py, and prints both tables as Markdown.
CI runs a cheaper subset of the same matrix (tests/test_killpoints.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_driver(catalog: str, backend: str, work: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO), UCP_PROGRESS="0")
    env.pop("UCP_KILL_AT", None)
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "killpoint_driver.py"), "--work", work,
                           "--catalog", catalog, "--backend", backend], capture_output=True, text=True, env=env,
                          cwd=str(REPO), timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"driver failed ({catalog}, {backend}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def corruption_rows() -> list[tuple[str, str, str, str]]:
    sys.path.insert(0, str(REPO / "tests"))
    from test_corruption import CORRUPTIONS

    env = dict(os.environ, PYTHONPATH=str(REPO), UCP_PROGRESS="0", UCP_FAULTS_QUICK="0")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-n", "0", "-p", "no:cacheprovider",
                           "tests/test_corruption.py"], capture_output=True, text=True, env=env, cwd=str(REPO),
                          timeout=1800)
    status = {}
    for m in re.finditer(r"^(PASSED|FAILED|ERROR) tests/test_corruption.py::"
                         r"(test_corruption_is_caught_on_both_read_paths_and_by_verify|"
                         r"test_corruption_in_a_bucket_is_caught)\[(\w+)\]", proc.stdout, re.M):
        status[(m.group(2).endswith("caught"), m.group(3))] = m.group(1)

    def word(key) -> str:
        return "caught" if status.get(key) == "PASSED" else status.get(key, "not run")

    return [(kind, what, word((False, kind)), word((True, kind))) for kind, (what, _) in CORRUPTIONS.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pg", default=os.environ.get("UCP_TEST_POSTGRES_URL"))
    ap.add_argument("--skip-corruption", action="store_true")
    args = ap.parse_args()
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = f"http://{host}:{port}"
    rows = []
    all_results = []
    try:
        with tempfile.TemporaryDirectory(prefix="ucp-faults-") as work:
            for catalog_name, catalog in (("SQLite", "sqlite"), ("PostgreSQL", args.pg)):
                for backend_name, backend in (("folder", "folder"), ("S3 (moto)", s3)):
                    if not catalog:
                        rows.append((catalog_name, backend_name, "-", "-", "-", "not run (no PostgreSQL URL)"))
                        continue
                    results = run_driver(catalog, backend,
                                         os.path.join(work, f"{catalog_name}-{backend_name[:2]}"))
                    all_results += results
                    killed = sum(r["killed"] for r in results)
                    survived = sum(r["survived"] for r in results)
                    failed = ", ".join(r["point"] for r in results if not r["survived"]) or "-"
                    rows.append((catalog_name, backend_name, f"{len(results)}", f"{killed}", f"{survived}", failed))
    finally:
        server.stop()
    print("Kill points (each: a real process SIGKILLed at the point, then the checks of tests/killpoint_driver.py)\n")
    print("| catalog | storage | points tried | killed there | survived | failed |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    failures = [r for r in all_results if not r["survived"]]
    for r in failures:
        print(f"\nFAILED {r['catalog']}/{r['backend']} {r['point']}: {r['failures']}")
    if not args.skip_corruption:
        print("\nCorruption (reads on every path, Checkpoint.verify, ucp verify and --json; SQLite catalog)\n")
        print("| case | damage | folder: localread + TensorStore | S3 (moto): TensorStore |")
        print("|---|---|---|---|")
        for kind, what, folder, bucket in corruption_rows():
            print(f"| {kind} | {what} | {folder} | {bucket} |")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
