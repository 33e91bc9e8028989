"""The ``ucp`` command. Exit 0 on success; 1 with a one-line ``ucp: error: ...`` otherwise.

``--store URL`` (or ``$UCP_STORE``, default ``./ucp-store``) may stand before or after the subcommand.

One module per group of commands, each a table ``COMMANDS`` of ``Command(run, help, arguments)``:
``registry`` (init, ls, show, log, tag, rm, query), ``maintenance`` (gc, retention, db), ``tensors``
(read, stats, diff, verify), ``transfer`` (import, export), ``plan`` (``plot`` draws its picture) and ``demo``;
``output`` holds the tables, JSON and byte formatting, ``common`` the shared options. A command calls the
API and prints; it does no work of its own.

Start-up cost is part of the interface: the catalog-only commands (``ls``, ``show``, ``log``, ``tag``,
``query``, ``db``, ``retention``, ``rm``, ``gc --dry-run``) import none of torch, TensorStore, zarr,
ml_dtypes, numcodecs or matplotlib, so they answer at once. Every heavy import is inside the command
that needs it.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import UcpError
from . import demo, maintenance, plan, registry, tensors, transfer
from .common import EXIT_FAIL, EXIT_OK, Command, add_common
from .output import fmt_bytes as _fmt_bytes
from .output import print_json as _print_json
from .output import quiet_stdout
from .output import table as _table

__all__ = ["main", "build_parser", "COMMANDS", "EXIT_OK", "EXIT_FAIL"]

#: every subcommand, in the order ``ucp --help`` lists them
COMMANDS: dict[str, Command] = {}
for _name in ("init", "ls", "show", "read", "stats", "diff", "tag", "rm", "gc", "retention", "verify", "log",
              "query", "import", "export", "db", "plan", "demo"):
    for _group in (registry, maintenance, tensors, transfer, plan, demo):
        if _name in _group.COMMANDS:
            COMMANDS[_name] = _group.COMMANDS[_name]
            break

# the helpers' old private names, for code written against the single-module cli
_ = (_fmt_bytes, _print_json, _table)


def build_parser() -> argparse.ArgumentParser:
    """The ``ucp`` argument parser: common options, then one subparser per command."""
    p = argparse.ArgumentParser(prog="ucp", description="universal checkpoints: chunked Zarr arrays + SQL catalog")
    add_common(p, top=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        sp = sub.add_parser(name, help=cmd.help, description=cmd.help)
        add_common(sp, top=False)
        if cmd.json_flag:
            sp.add_argument("--json", action="store_true", help="print JSON records")
        sp.set_defaults(func=cmd.run)
        if cmd.arguments is not None:
            cmd.arguments(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one ``ucp`` command line; the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # ``ucp ls | head -1``: the reader is gone; exit quietly (before OSError below)
        quiet_stdout()
        return EXIT_OK
    except UcpError as exc:
        print(f"ucp: error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except OSError as exc:  # e.g. --out into a missing folder: still one line, no traceback
        print(f"ucp: error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        print("ucp: interrupted", file=sys.stderr)
        return 130
