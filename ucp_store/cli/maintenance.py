"""Maintenance commands: ``gc``, ``retention``, ``db`` (catalog schema). Catalog-only: nothing heavy is imported."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ucp_store import config
from ucp_store.cli.common import EXIT_OK, Command, open_from_args
from ucp_store.cli.output import fmt_bytes, print_json
from ucp_store.errors import UcpError

__all__ = ["COMMANDS", "cmd_gc", "cmd_retention", "cmd_db", "cmd_delta"]


def cmd_gc(args: Any) -> int:
    """Apply retention, drop unfinished saves, delete unreferenced arrays (``--dry-run``: only report)."""
    _check_retention_flags(args)
    from ucp_store.registry.room import with_room

    opened: list = []

    def run_gc(store):
        opened.append(store)
        return store.gc(run=args.run, keep_last=args.keep_last, keep_every=args.keep_every,
                        keep_tagged=not args.no_keep_tagged, dry_run=args.dry_run)

    # on a full disk, the files of the versions retention removes go first to make room (registry/room.py)
    report = with_room(lambda: open_from_args(args), lambda: open_from_args(args, read_only=True),
                       lambda ro: ro.retention_victims(args.run, keep_last=args.keep_last, keep_every=args.keep_every,
                                                       keep_tagged=not args.no_keep_tagged), run_gc)
    store = opened[-1]
    if args.json:
        print_json(report.to_json())
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {len(report.removed_checkpoints)} version(s), {len(report.removed_pending)} unfinished "
              f"save(s), {report.removed_arrays} array(s), {fmt_bytes(report.freed_bytes)}")
    if report.left:  # what gc cannot tie to this catalog: said on stderr (also with --json), never deleted
        shown = ", ".join(report.left[:5]) + (f" and {len(report.left) - 5} more" if len(report.left) > 5 else "")
        print(f"ucp gc: left {len(report.left)} entr{'y' if len(report.left) == 1 else 'ies'} under "
              f"{store.location.display('arrays')} that this catalog does not own (not deleted): {shown}",
              file=sys.stderr)
    if getattr(args, "fast_tier", None):
        _gc_fast(store, args)
    return EXIT_OK


def _gc_fast(store, args: Any) -> None:
    """``ucp gc --fast-tier``: one node's fast tier (issue 38, ``tiers/gc.py``)."""
    from ucp_store.tiers.gc import sweep_fast
    from ucp_store.tiers.node import fast_tier_root, node_name

    node = node_name(args.node)
    root = fast_tier_root(args.fast_tier, node)
    assert root is not None  # --fast-tier given
    fast = sweep_fast(store.catalog, root, node, dry_run=args.dry_run)
    if args.json:
        print_json({"fast_tier": fast.to_json()})
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(f"fast tier {root} (node {node}): {verb} {len(fast.deleted)} evicted cop(ies), "
              f"{fmt_bytes(fast.freed_bytes)}; kept {fast.kept}")
    if fast.untied:
        print(f"ucp gc: left {len(fast.untied)} file(s) under {root} that this catalog does not tie to a copy "
              f"(not deleted): {', '.join(fast.untied[:5])}", file=sys.stderr)


def cmd_retention(args: Any) -> int:
    """Store a run's retention policy (``gc`` applies it)."""
    _check_retention_flags(args)
    policy = open_from_args(args).set_retention(args.run, keep_last=args.keep_last, keep_every=args.keep_every,
                                               keep_tagged=not args.no_keep_tagged)
    print(f"retention of {args.run}: {json.dumps(policy)} (applied by `ucp gc`)")
    return EXIT_OK


def cmd_delta(args: Any) -> int:
    """Set (or show) a run's delta policy: saves that pass no ``delta=`` store tensor-states as deltas of the
    parent version where small enough (``auto``) or in full (``off``); imports follow it too."""
    store = open_from_args(args)
    policy = store.run_delta(args.run) if args.mode is None else store.run_delta(args.run, args.mode)
    print(f"delta policy of {args.run}: {policy}")
    return EXIT_OK


def _delta_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("run")
    sp.add_argument("mode", nargs="?", choices=["auto", "off"], default=None,
                    help="auto: deltas of the parent version where small enough; off: full arrays (none: show)")


def _check_retention_flags(args: Any) -> None:
    """--keep-last and --keep-every count versions and steps: 0 or a negative one would make gc remove
    nearly every version, so they are refused before the store is opened."""
    for flag, value in (("--keep-last", args.keep_last), ("--keep-every", args.keep_every)):
        if value is not None and not 1 <= value <= 2**63 - 1:
            raise UcpError(f"{flag} {value}: expected an integer from 1 to 2^63-1 (omit it for no such rule)")


def cmd_db(args: Any) -> int:
    """Show the catalog's schema revision, or upgrade it."""
    from ucp_store.catalog import db
    from ucp_store.io.location import Location

    location = Location.parse(args.store or config.store_url() or "./ucp-store", args.catalog)
    if args.action == "upgrade":
        before, after = db.upgrade(location.catalog_url)
        print(f"catalog {db.display_url(location.catalog_url)}: {before or 'empty'} -> {after}")
        return EXIT_OK
    rev = db.revision_at(location.catalog_url)
    if rev is None:
        raise UcpError(f"catalog {db.display_url(location.catalog_url)} has no schema revision (not a ucp catalog, "
                       "or not created yet: `ucp init`)")
    state = "up to date" if rev == db.head_revision() else (
        "older: run `ucp db upgrade`" if rev in db.known_revisions() else "newer than this ucp_store")
    print(f"catalog {db.display_url(location.catalog_url)}: revision {rev}, code knows {db.head_revision()} ({state})")
    return EXIT_OK


def _gc_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--run", default=None)
    _retention_flags(sp)
    sp.add_argument("--dry-run", action="store_true")
    sp.add_argument("--fast-tier", default=None, metavar="PATH",
                    help="also this node's fast tier (a folder; may contain {node}): evicted copies removed, "
                         "files no catalog row ties reported")
    sp.add_argument("--node", default=None, help="the node whose fast tier --fast-tier names (default: UCP_NODE, "
                                                 "else the host name)")


def _retention_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("run")
    _retention_flags(sp)


def _retention_flags(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--keep-last", type=int, default=None, metavar="N", help="keep the newest N versions (N >= 1)")
    sp.add_argument("--keep-every", type=int, default=None, metavar="K",
                    help="keep every step divisible by K (K >= 1)")
    sp.add_argument("--no-keep-tagged", action="store_true")


def _db_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("action", choices=["upgrade", "revision"])


COMMANDS = {
    "gc": Command(cmd_gc, "apply retention, drop unfinished saves, delete unreferenced arrays", _gc_args),
    "retention": Command(cmd_retention, "store a run's retention policy (applied by gc)", _retention_args,
                         json_flag=False),
    "db": Command(cmd_db, "catalog schema: show the revision or upgrade it", _db_args, json_flag=False),
    "delta": Command(cmd_delta, "set or show a run's delta policy (versions as deltas of their parent)", _delta_args,
                     json_flag=False),
}
