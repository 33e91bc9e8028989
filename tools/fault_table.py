"""Print the fault tables of issues 16 and 30 as Markdown: the adversarial corpus by outcome and surface, the
registry under concurrent load, kill points tried and survived per catalog x storage, corruptions caught.

    .venv/bin/python tools/fault_table.py [TABLE ...] [--pg postgresql+psycopg2://...]

TABLE is any of ``corpus`` (every case of tests/adversarial, the same runner and checks as CI), ``stress``
(tests/registry_load.py at issue 30's full size: 8 savers x 25 saves, a reader, an rm loop and a gc loop,
on SQLite and PostgreSQL), ``killpoints`` (tests/killpoint_driver.py with EVERY kill point on SQLite and
PostgreSQL, on a folder and an S3 bucket: moto's server, started here) and ``corruption``
(tests/test_corruption.py); none: all four. PostgreSQL comes from ``--pg`` or ``$UCP_TEST_POSTGRES_URL``;
without one its rows say "not run". CI runs the corpus itself, a smaller stress run through the same code
(tests/test_registry_load.py) and a cheaper subset of the kill-point matrix (tests/test_killpoints.py).
The exit status is 1 when any case, check or kill point failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLES = ("corpus", "stress", "killpoints", "corruption")


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


def corpus_table() -> int:
    """Run every corpus case; print the counts by outcome x surface and the failures. The failures' count."""
    sys.path.insert(0, str(REPO / "tests"))
    os.environ["UCP_PROGRESS"] = "0"
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "corpus")  # the unreachable-bucket cases: no credential lookups
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "corpus")
    from adversarial import CASES
    from adversarial.framework import OUTCOMES, SURFACES, failure, make_ctx, make_fixtures, run_case

    cells: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    failed = []
    with tempfile.TemporaryDirectory(prefix="ucp-corpus-") as tmp:
        good, templates = make_fixtures(Path(tmp) / "fixtures")
        for n, case in enumerate(CASES):
            ctx = make_ctx(Path(tmp) / f"c{n}", good, templates)
            why = failure(run_case(case, ctx), ctx)
            for key in ((case.outcome, case.surface), (case.outcome, "all"), ("all", case.surface), ("all", "all")):
                cells[key][0] += 1
                cells[key][1] += why is None
            if why is not None:
                failed.append((case, why))
    cols = [*SURFACES, "all"]
    print("Adversarial corpus (tests/adversarial): cases passed / cases, by expected outcome and surface\n")
    print("| outcome | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for outcome in (*OUTCOMES, "all"):
        row = [f"{cells[(outcome, c)][1]} / {cells[(outcome, c)][0]}" if cells[(outcome, c)][0] else "-"
               for c in cols]
        print(f"| {outcome} | " + " | ".join(row) + " |")
    issue30 = [c for c in CASES if c.issue.startswith("30.")]
    print(f"\n{len(CASES)} cases ({len(issue30)} from issue 30, "
          f"{len({c.issue for c in issue30})} of its items), {len(CASES) - len(failed)} passed, {len(failed)} failed")
    for case, why in failed:
        print(f"\nFAILED {case.id} ({case.surface}, {case.outcome}{', issue ' + case.issue if case.issue else ''}): "
              f"{why.splitlines()[0][:400]}")
    return len(failed)


def stress_table(pg: str | None) -> int:
    """tests/registry_load.py at full size on SQLite and PostgreSQL; the number of failed runs."""
    sys.path.insert(0, str(REPO / "tests"))
    import registry_load

    rows, failures = [], 0
    for name, url in (("SQLite", None), ("PostgreSQL", pg)):
        if name == "PostgreSQL" and not url:
            rows.append((name, None, "not run (no PostgreSQL URL)"))
            continue
        try:
            rows.append((name, _stress_run(registry_load, url), "ok"))
        except (AssertionError, subprocess.CalledProcessError) as e:
            failures += 1
            rows.append((name, None, f"FAILED: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}"))
    keys = ["committed", "retries", "step_conflicts", "tag_conflicts", "reads", "rm_saves", "rms", "gcs", "verified",
            "seconds"]
    print(f"\nRegistry under load ({registry_load.SAVERS} savers x {registry_load.SAVES} saves, "
          f"{registry_load.READERS} reader, an rm loop and a gc loop, all processes; afterwards every save committed "
          "or raised a clear error and every listed version passes ucp verify)\n")
    print("| catalog | " + " | ".join(keys) + " | result |")
    print("|---|" + "---|" * (len(keys) + 1))
    for name, counts, result in rows:
        print(f"| {name} | " + " | ".join(str(counts[k]) if counts else "-" for k in keys) + f" | {result} |")
    return failures


def _stress_run(registry_load, pg: str | None) -> dict:
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    from ucp_store.catalog import new_id

    with tempfile.TemporaryDirectory(prefix="ucp-stress-") as tmp:
        store, out = str(Path(tmp) / "store"), Path(tmp) / "result.json"
        catalog, schema, admin = None, None, None
        if pg:  # a fresh schema, dropped afterwards (as tests/ucp_test_helpers.postgres_schema_url)
            schema, admin = f"ucp_stress_{new_id(12)}", create_engine(pg, poolclass=NullPool)
            with admin.begin() as conn:
                conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
            catalog = make_url(pg).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
                hide_password=False)
        try:
            subprocess.run([sys.executable, str(REPO / "tests" / "registry_load.py"), store, catalog or "", str(out)],
                           check=True, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO), UCP_PROGRESS="0"),
                           timeout=1800)
            return registry_load.check(json.loads(out.read_text()), store, catalog)
        finally:
            if admin is not None:
                with admin.begin() as conn:
                    conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
                admin.dispose()


def killpoint_table(pg: str | None) -> int:
    """Every kill point on SQLite / PostgreSQL x folder / S3 (moto); the number of points that failed."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = f"http://{host}:{port}"
    rows = []
    all_results = []
    try:
        with tempfile.TemporaryDirectory(prefix="ucp-faults-") as work:
            for catalog_name, catalog in (("SQLite", "sqlite"), ("PostgreSQL", pg)):
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
    print("\nKill points (each: a real process SIGKILLed at the point, then the checks of tests/killpoint_driver.py)\n")
    print("| catalog | storage | points tried | killed there | survived | failed |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    failures = [r for r in all_results if not r["survived"]]
    for r in failures:
        print(f"\nFAILED {r['catalog']}/{r['backend']} {r['point']}: {r['failures']}")
    return len(failures)


def corruption_table() -> int:
    print("\nCorruption (reads on every path, Checkpoint.verify, ucp verify and --json; SQLite catalog)\n")
    print("| case | damage | folder: localread + TensorStore | S3 (moto): TensorStore |")
    print("|---|---|---|---|")
    missed = 0
    for kind, what, folder, bucket in corruption_rows():
        print(f"| {kind} | {what} | {folder} | {bucket} |")
        missed += (folder, bucket) != ("caught", "caught")
    return missed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="*", metavar="TABLE", help=f"any of {', '.join(TABLES)} (default: all)")
    ap.add_argument("--pg", default=os.environ.get("UCP_TEST_POSTGRES_URL"))
    args = ap.parse_args()
    unknown = sorted(set(args.tables) - set(TABLES))
    if unknown:
        ap.error(f"unknown table(s) {', '.join(unknown)}; choose from {', '.join(TABLES)}")
    wanted = args.tables or list(TABLES)
    failed = 0
    if "corpus" in wanted:
        failed += corpus_table()
    if "stress" in wanted:
        failed += stress_table(args.pg)
    if "killpoints" in wanted:
        failed += killpoint_table(args.pg)
    if "corruption" in wanted:
        failed += corruption_table()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
