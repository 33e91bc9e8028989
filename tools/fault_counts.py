"""Counts for issue 16's closing note: bad inputs refused (per importer / surface) and versions committed
under concurrency (per catalog).

    .venv/bin/python tools/fault_counts.py                 # corpus + registry load on SQLite
    UCP_TEST_POSTGRES_URL=postgresql+psycopg2://... .venv/bin/python tools/fault_counts.py   # + PostgreSQL
    .venv/bin/python tools/fault_counts.py --corpus-only | --load-only

Runs the same cases and checks as tests/bad_inputs/ and tests/test_registry_load.py (their modules are
imported from tests/), and prints two tables.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "bad_inputs")]
os.environ["UCP_PROGRESS"] = "0"
os.environ.setdefault("AWS_ACCESS_KEY_ID", "corpus")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "corpus")


def corpus() -> list[tuple[str, int, int]]:
    import bad_input_cases as bic
    import torch
    import torch.distributed.checkpoint as dcp

    import ucp_store

    rows: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        good = Path(tmp) / "good_dcp"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}, "step": 7},
                     checkpoint_id=str(good))
        template = Path(tmp) / "template"
        ucp_store.open_store(str(template), create=True).catalog.engine.dispose()
        for n, case in enumerate(bic.CASES):
            ctx = bic.make_ctx(Path(tmp) / f"c{n}", good, template)
            out = bic.run_case(case, ctx)
            rows[case.kind][0] += 1
            try:
                bic.check(out, ctx)
                rows[case.kind][1] += 1
            except AssertionError as e:
                failed.append(f"{case.id}: {e}")
    for f in failed:
        print("NOT REFUSED AS EXPECTED:", f)
    return [(k, *v) for k, v in sorted(rows.items())]


def load(catalog_name: str, catalog: str | None) -> dict:
    import registry_load

    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, str(REPO / "tests" / "registry_load.py"), store, catalog or "", str(out)],
                       check=True, cwd=str(REPO))
        return registry_load.check(json.loads(out.read_text()), store, catalog)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus-only", action="store_true")
    ap.add_argument("--load-only", action="store_true")
    args = ap.parse_args()
    if not args.load_only:
        rows = corpus()
        print("\nbad inputs             cases  refused (right error, names it, nothing left behind)")
        for kind, n, ok in rows:
            print(f"  {kind:<20} {n:>5}  {ok:>5}")
        print(f"  {'total':<20} {sum(r[1] for r in rows):>5}  {sum(r[2] for r in rows):>5}")
    if not args.corpus_only:
        catalogs = [("sqlite", None)]
        pg = os.environ.get("UCP_TEST_POSTGRES_URL")
        if pg:
            from ucp_test_helpers import postgres_schema_url

            catalogs.append(("postgresql", pg))
        results = []
        for name, url in catalogs:
            if url is None:
                results.append((name, load(name, None)))
            else:
                with postgres_schema_url() as schema_url:
                    results.append((name, load(name, schema_url)))
        keys = ["committed", "own", "contested_won", "step_conflicts", "tag_conflicts", "retries", "reads",
                "racer_saves", "rms", "gcs", "seconds"]
        print("\nregistry under load (8 savers x 25 saves, 1 reader, 1 rm/gc racer)")
        print("  catalog     " + "  ".join(f"{k:>14}" for k in keys))
        for name, counts in results:
            print(f"  {name:<11} " + "  ".join(f"{counts[k]:>14}" for k in keys))


if __name__ == "__main__":
    main()
