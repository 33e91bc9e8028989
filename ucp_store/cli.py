"""The ``ucp`` command. Exit 0 on success; 1 with a one-line ``ucp: error: ...`` otherwise.

``--store URL`` (or ``$UCP_STORE``, default ``./ucp-store``) may stand before or after the subcommand.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Callable

from .errors import UcpError

EXIT_OK, EXIT_FAIL = 0, 1


def _common(p: argparse.ArgumentParser, top: bool) -> None:
    default = None if top else argparse.SUPPRESS
    p.add_argument("--store", default=default, metavar="URL",
                   help="store folder or URL (default: $UCP_STORE or ./ucp-store)")
    p.add_argument("--catalog", default=default, metavar="URL", help="catalog URL (default: $UCP_CATALOG or "
                   "<store>/catalog.db)")
    p.add_argument("--no-progress", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="no progress bars")


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str, allow_nan=True))


def _table(rows: list[list[Any]], headers: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(*headers, box=None, pad_edge=False, header_style="bold")
    for r in rows:
        t.add_row(*["-" if v is None else str(v) for v in r])
    Console(width=max(120, os.get_terminal_size(1).columns if sys.stdout.isatty() else 160)).print(t)


def _store(args, *, create: bool = False):
    from .store import open_store

    return open_store(args.store, create=create, catalog=args.catalog)


def _progress(args) -> bool:
    return not args.no_progress


# --- commands -----------------------------------------------------------------------------------

def cmd_init(args) -> int:
    from .store import open_store

    store = open_store(args.store, create=True, catalog=args.catalog, compression=args.compression,
                       chunk_target_bytes=int(args.chunk_mib * (1 << 20)) if args.chunk_mib else None)
    print(f"store ready at {store.location.url} (catalog {store.catalog.display_url}, "
          f"compression {store.settings['compression']})")
    return EXIT_OK


def cmd_ls(args) -> int:
    store = _store(args)
    if args.run is None and not args.all:
        runs = store.runs()
        if args.json:
            _print_json(runs)
        else:
            _table([[r["run"], r["checkpoints"], r["latest_step"]] for r in runs], ["run", "versions", "latest step"])
        return EXIT_OK
    rows = store.list_checkpoints(args.run, include_pending=args.pending)
    if args.json:
        _print_json(rows)
    else:
        _table([[r["run"], r["step"], r["id"], r["status"], _fmt_bytes(r["nbytes"]), ",".join(r["tags"]),
                 r["parent"], r["created_at"][:19], r["message"]] for r in rows],
               ["run", "step", "id", "status", "bytes", "tags", "parent", "created", "message"])
    return EXIT_OK


def cmd_show(args) -> int:
    from .schema import validate

    ck = _store(args).checkpoint(args.ref)
    manifest = ck.manifest()
    validate("manifest", manifest)
    if args.json:
        _print_json(manifest)
        return EXIT_OK
    print(f"{ck.run}@{ck.step}  id {ck.id}  {_fmt_bytes(ck.nbytes)}  tags: {', '.join(ck.tags) or '-'}  "
          f"parent: {ck.parent or '-'}  source: {(ck.provenance or {}).get('source_kind')}")
    _table([[t["name"], t["state"], "x".join(map(str, t["shape"])) or "()", t["dtype"],
             (t["pattern"] or {}).get("kind", "-"), _fmt_bytes(t["nbytes"]), t["array"]] for t in manifest["tensors"]],
           ["name", "state", "shape", "dtype", "pattern", "bytes", "array"])
    return EXIT_OK


def cmd_read(args) -> int:
    import numpy as np

    from .checkpoint import parse_slice

    ck = _store(args).checkpoint(args.ref)
    handle = ck.tensor(args.name, args.state)
    index = parse_slice(args.slice) if args.slice else ()
    data = handle.read_numpy(index)
    if args.out:
        tmp = args.out + ".tmp.npy"
        np.save(tmp, np.asarray(data), allow_pickle=False)
        os.replace(tmp, args.out)
        print(f"wrote {args.out}: {list(np.shape(data))} {handle.info.dtype}")
    elif args.json:
        _print_json({"name": handle.info.name, "state": handle.info.state, "shape": list(np.shape(data)),
                     "dtype": handle.info.dtype, "values": np.asarray(data).astype(np.float64).tolist()
                     if data.dtype.kind not in "biu" else np.asarray(data).tolist()})
    else:
        with np.printoptions(threshold=200, edgeitems=4, linewidth=120):
            print(np.asarray(data).astype(np.float32) if handle.info.dtype == "bfloat16" else np.asarray(data))
    return EXIT_OK


def cmd_stats(args) -> int:
    ck = _store(args).checkpoint(args.ref)
    stats = ck.stats(args.name, args.state, progress=_progress(args))
    if args.json:
        _print_json([s.to_json() for s in stats])
        return EXIT_OK
    f = lambda v: "-" if v is None else f"{v:.6g}"  # noqa: E731
    _table([[s.name, s.state, s.dtype, "x".join(map(str, s.shape)) or "()", f(s.min), f(s.max), f(s.mean), f(s.std),
             f(s.norm), s.nan, s.inf] for s in stats],
           ["name", "state", "dtype", "shape", "min", "max", "mean", "std", "norm", "nan", "inf"])
    return EXIT_OK


def cmd_diff(args) -> int:
    from .checkpoint import diff

    store = _store(args)
    rows = diff(store.checkpoint(args.ref_a), store.checkpoint(args.ref_b), progress=_progress(args))
    if args.json:
        _print_json(rows)
        return EXIT_OK
    counts = {k: sum(r["status"] == k for r in rows) for k in ("same", "changed", "added", "removed")}
    shown = rows if args.all else [r for r in rows if r["status"] != "same"]
    _table([[r["name"], r["state"], r["status"], "-" if r.get("relative_change") is None
             else f"{r['relative_change']:.3e}", r.get("detail", "")] for r in shown],
           ["name", "state", "status", "rel. change", "detail"])
    print(", ".join(f"{v} {k}" for k, v in counts.items()))
    return EXIT_OK


def cmd_tag(args) -> int:
    store = _store(args)
    if args.delete:
        run, _, tag = args.ref.partition(":")
        store.untag(run, tag or args.tag)
        print(f"removed tag {run}:{tag or args.tag}")
        return EXIT_OK
    if not args.tag:
        raise UcpError("ucp tag REF TAG: missing TAG")
    cid = store.tag(args.ref, args.tag, force=args.force)
    print(f"tagged {cid} as {args.tag}")
    return EXIT_OK


def cmd_rm(args) -> int:
    store = _store(args)
    for ref in args.refs:
        cid = store.rm(ref, force=args.force)
        print(f"removed {ref} ({cid})")
    return EXIT_OK


def cmd_gc(args) -> int:
    store = _store(args)
    report = store.gc(run=args.run, keep_last=args.keep_last, keep_every=args.keep_every,
                      keep_tagged=not args.no_keep_tagged, dry_run=args.dry_run)
    if args.json:
        _print_json(report.to_json())
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {len(report.removed_checkpoints)} version(s), {len(report.removed_pending)} unfinished "
              f"save(s), {report.removed_arrays} array(s), {_fmt_bytes(report.freed_bytes)}")
    return EXIT_OK


def cmd_retention(args) -> int:
    policy = _store(args).set_retention(args.run, keep_last=args.keep_last, keep_every=args.keep_every,
                                        keep_tagged=not args.no_keep_tagged)
    print(f"retention of {args.run}: {json.dumps(policy)} (applied by `ucp gc`)")
    return EXIT_OK


def cmd_verify(args) -> int:
    ck = _store(args).checkpoint(args.ref)
    problems = ck.verify(progress=_progress(args))
    if args.json:
        _print_json({"id": ck.id, "ok": not problems, "problems": problems})
    elif problems:
        for p in problems:
            where = f" chunk {p['chunk']} (shard {p.get('shard')})" if p.get("chunk") is not None else ""
            print(f"FAIL {p['tensor']} [{p['state']}] array {p['array']}{where}: {p['error']}", file=sys.stderr)
    else:
        print(f"ok: {ck.run}@{ck.step} ({ck.id}): every chunk checksum and content hash matches")
    return EXIT_FAIL if problems else EXIT_OK


def cmd_import(args) -> int:
    store = _store(args, create=True)
    if args.kind == "torch":
        from .adapters.torch_file import import_torch_file

        if args.step is None:
            raise UcpError("ucp import torch FILE: --step N is required")
        ck = import_torch_file(store, args.source, args.run, args.step, state=args.state or "weight",
                               message=args.message, progress=_progress(args))
        cid = ck.id
    elif args.kind == "deepspeed":
        from .adapters.deepspeed import import_deepspeed

        cid = import_deepspeed(store, args.source, args.run, args.step, message=args.message,
                               progress=_progress(args))
    else:
        from .adapters.deepspeed_universal import import_universal

        cid = import_universal(store, args.source, args.run, args.step)
    cid = getattr(cid, "id", cid)
    ck = store.checkpoint(cid)
    print(f"imported {args.source} as {ck.run}@{ck.step} ({ck.id}, {len(ck.tensors())} tensor-states, "
          f"{_fmt_bytes(ck.nbytes)})")
    return EXIT_OK


def cmd_export(args) -> int:
    store = _store(args)
    ck = store.checkpoint(args.ref)
    if args.kind == "torch":
        from .adapters.torch_file import export_torch_file

        n = export_torch_file(ck, args.dest, state=args.state, progress=_progress(args))
        print(f"wrote {n} tensors to {args.dest}")
    else:
        from .adapters.deepspeed_universal import export_universal

        path = export_universal(ck, args.dest, tag=args.tag)
        print(f"wrote DeepSpeed universal checkpoint {path}")
    return EXIT_OK


def cmd_query(args) -> int:
    cols, rows = _store(args).query(args.sql)
    if args.json:
        _print_json([dict(zip(cols, r)) for r in rows])
    else:
        _table([list(r) for r in rows], cols)
    return EXIT_OK


def cmd_log(args) -> int:
    """Lineage: a version and its ancestors through ``parent``."""
    store = _store(args)
    ck = store.checkpoint(args.ref)
    chain = []
    while ck is not None:
        chain.append({"id": ck.id, "run": ck.run, "step": ck.step, "tags": ck.tags, "message": ck.message,
                      "source": (ck.provenance or {}).get("source_kind")})
        ck = store.checkpoint(ck.parent) if ck.parent else None
    if args.json:
        _print_json(chain)
    else:
        _table([[c["run"], c["step"], c["id"], ",".join(c["tags"]), c["source"], c["message"]] for c in chain],
               ["run", "step", "id", "tags", "source", "message"])
    return EXIT_OK


def cmd_db(args) -> int:
    from .catalog import db
    from .location import Location

    location = Location.parse(args.store or os.environ.get("UCP_STORE") or "./ucp-store", args.catalog)
    if args.action == "upgrade":
        before, after = db.upgrade(location.catalog_url)
        print(f"catalog {db.display_url(location.catalog_url)}: {before or 'empty'} -> {after}")
    else:
        from sqlalchemy import create_engine, text

        engine = create_engine(location.catalog_url)
        try:
            with engine.connect() as conn:
                rev = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except Exception as exc:  # no catalog, or no alembic_version table
            raise UcpError(f"catalog {db.display_url(location.catalog_url)} has no schema revision: "
                           f"{str(exc).splitlines()[0]}") from None
        finally:
            engine.dispose()
        state = "up to date" if rev == db.head_revision() else (
            "older: run `ucp db upgrade`" if rev in db.known_revisions() else "newer than this ucp_store")
        print(f"catalog {db.display_url(location.catalog_url)}: revision {rev}, code knows {db.head_revision()} ({state})")
    return EXIT_OK


def cmd_plan(args) -> int:
    from .plan_cli import run_plan

    return run_plan(args, _store(args))


def cmd_demo(args) -> int:
    from .demo import main as demo_main

    return demo_main(args)


# --- parser -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ucp", description="universal checkpoints: chunked Zarr arrays + SQL catalog")
    _common(p, top=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable, help_: str, *, json_flag: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        _common(sp, top=False)
        if json_flag:
            sp.add_argument("--json", action="store_true", help="print JSON records")
        sp.set_defaults(func=fn)
        return sp

    sp = add("init", cmd_init, "create a store", json_flag=False)
    sp.add_argument("--compression", choices=["none", "zstd", "blosc"], default=None)
    sp.add_argument("--chunk-mib", type=float, default=None, help="inner chunk target, 1 to 8 MiB")

    sp = add("ls", cmd_ls, "list runs, or the versions of RUN")
    sp.add_argument("run", nargs="?")
    sp.add_argument("--all", action="store_true", help="every version of every run")
    sp.add_argument("--pending", action="store_true", help="include unfinished saves")

    sp = add("show", cmd_show, "show a version's tensors, patterns and arrays")
    sp.add_argument("ref")

    sp = add("read", cmd_read, "read a tensor or a slice of it (only the chunks it touches)")
    sp.add_argument("ref")
    sp.add_argument("name")
    sp.add_argument("--state", default=None, help="state (default fp32, else weight)")
    sp.add_argument("--slice", default=None, help='numpy-style slice, e.g. "3:5,:"')
    sp.add_argument("--out", default=None, help="write a .npy file")

    sp = add("stats", cmd_stats, "min/max/mean/std/norm/NaN/Inf, computed chunk by chunk")
    sp.add_argument("ref")
    sp.add_argument("name", nargs="?")
    sp.add_argument("--state", default=None)

    sp = add("diff", cmd_diff, "compare two versions tensor by tensor")
    sp.add_argument("ref_a")
    sp.add_argument("ref_b")
    sp.add_argument("--all", action="store_true", help="list unchanged tensors too")

    sp = add("tag", cmd_tag, "tag a version (RUN:TAG names it afterwards)", json_flag=False)
    sp.add_argument("ref")
    sp.add_argument("tag", nargs="?")
    sp.add_argument("--force", action="store_true", help="move an existing tag")
    sp.add_argument("--delete", action="store_true", help="remove tag RUN:TAG")

    sp = add("rm", cmd_rm, "remove versions (arrays are freed when nothing else references them)", json_flag=False)
    sp.add_argument("refs", nargs="+")
    sp.add_argument("--force", action="store_true", help="remove even if tagged")

    sp = add("gc", cmd_gc, "apply retention, drop unfinished saves, delete unreferenced arrays")
    sp.add_argument("--run", default=None)
    sp.add_argument("--keep-last", type=int, default=None)
    sp.add_argument("--keep-every", type=int, default=None)
    sp.add_argument("--no-keep-tagged", action="store_true")
    sp.add_argument("--dry-run", action="store_true")

    sp = add("retention", cmd_retention, "store a run's retention policy (applied by gc)", json_flag=False)
    sp.add_argument("run")
    sp.add_argument("--keep-last", type=int, default=None)
    sp.add_argument("--keep-every", type=int, default=None)
    sp.add_argument("--no-keep-tagged", action="store_true")

    sp = add("verify", cmd_verify, "check every chunk checksum and content hash (exit 1 on mismatch)")
    sp.add_argument("ref")

    sp = add("log", cmd_log, "lineage of a version")
    sp.add_argument("ref")

    sp = add("query", cmd_query, "run read-only SQL against the catalog")
    sp.add_argument("sql")

    for verb, fn in (("import", cmd_import), ("export", cmd_export)):
        sp = add(verb, fn, f"{verb} checkpoints", json_flag=False)
        kinds = sp.add_subparsers(dest="kind", required=True, metavar="KIND")
        for kind in ("torch", "deepspeed", "deepspeed-universal"):
            if verb == "export" and kind == "deepspeed":
                continue
            kp = kinds.add_parser(kind, help=f"{verb} {kind}")
            _common(kp, top=False)
            if verb == "import":
                kp.add_argument("source")
                kp.add_argument("--run", required=True)
                kp.add_argument("--step", type=int, default=None)
                kp.add_argument("--message", default=None)
                kp.add_argument("--state", default=None)
            else:
                kp.add_argument("ref")
                kp.add_argument("dest")
                kp.add_argument("--state", default=None)
                kp.add_argument("--tag", default=None)

    sp = add("db", cmd_db, "catalog schema: show the revision or upgrade it", json_flag=False)
    sp.add_argument("action", choices=["upgrade", "revision"])

    sp = add("plan", cmd_plan, "read plan of a version for a target topology")
    sp.add_argument("ref")
    for flag in ("tp", "pp", "dp", "sp", "ep"):
        sp.add_argument(f"--{flag}", type=int, default=1)
    sp.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    sp.add_argument("--vocab-multiple", type=int, default=1)
    sp.add_argument("--layers", type=int, default=None, help="number of layers (default: inferred)")
    sp.add_argument("--rank", type=int, default=None, help="one rank (default: all)")
    sp.add_argument("--states", default=None, help="comma-separated states (default: all)")
    sp.add_argument("--plot", default=None, metavar="FILE.png", help="draw which ranks read which chunks")
    sp.add_argument("--param", default=None, help="parameter to draw (default: the largest)")

    from .demo import add_arguments as demo_arguments

    demo_arguments(add("demo", cmd_demo, "train in parallel, save, resume on other meshes, compare the losses",
                       json_flag=False))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UcpError as exc:
        print(f"ucp: error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except OSError as exc:  # e.g. --out into a missing folder: still one line, no traceback
        print(f"ucp: error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        print("ucp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
