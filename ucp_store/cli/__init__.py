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

from ucp_store import config
from ucp_store.cli import demo, maintenance, plan, registry, tensors, transfer
from ucp_store.cli.common import EXIT_FAIL, EXIT_OK, Command, add_common
from ucp_store.cli.output import fmt_bytes as _fmt_bytes
from ucp_store.cli.output import print_json as _print_json
from ucp_store.cli.output import quiet_stdout
from ucp_store.cli.output import table as _table
from ucp_store.errors import UcpError
from ucp_store.redact import redact

__all__ = ["main", "build_parser", "COMMANDS", "EXIT_OK", "EXIT_FAIL"]

#: every subcommand, in the order ``ucp --help`` lists them
COMMANDS: dict[str, Command] = {}
for _name in ("init", "ls", "show", "read", "stats", "diff", "tag", "rm", "gc", "retention", "delta", "verify", "log",
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


#: what a command line names as its input, in the order an error message names them
_INPUT_ARGS = ("kind", "source", "ref", "dest", "config", "map")
#: failures that parsing a foreign file or a value can raise where no check caught it first (a JSON
#: document nested too deeply, a number too large to convert, memory for an absurd declared size); the
#: known sites refuse these inputs with a UcpError, and this is the net that keeps the rest one line
_INPUT_FAILURES = (RecursionError, MemoryError, OverflowError, ValueError)


def _inputs(args: argparse.Namespace) -> str:
    """``ucp <command> <its inputs>``, for an error message that has no better name for the input."""
    parts = [str(args.command)] + [repr(v) if v == "" else str(v) for a in _INPUT_ARGS
                                   if isinstance(v := getattr(args, a, None), str)]
    return "ucp " + " ".join(parts)


def _raised_at(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ucp_store that the exception passed through (for a report)."""
    tb, where = exc.__traceback__, ""
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if "ucp_store" in path:
            where = f"{path[path.rindex('ucp_store'):]}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where or "?"


def _catalog_failure(exc: BaseException, args: argparse.Namespace) -> str | None:
    """The error line for a failure of the SQL catalog that no UcpError wrapped (a page of an SQLite file
    corrupted after the store was opened: "database disk image is malformed"), or None when it is not one.
    Integrity and programming errors stay tracebacks: they are bugs, not bad input."""
    mod = sys.modules.get("sqlalchemy.exc")
    if mod is None or not isinstance(exc, mod.DatabaseError):
        return None
    if isinstance(exc, (mod.IntegrityError, mod.ProgrammingError)):
        return None
    store = getattr(args, "store", None) or config.store_url() or "./ucp-store"
    catalog = getattr(args, "catalog", None) or config.catalog_url() or f"{store}/catalog.db"
    return redact(f"catalog {catalog} failed: {getattr(exc, 'orig', exc)} (a corrupt catalog file, or the database "
                  "server refused the query)")


def main(argv: list[str] | None = None) -> int:
    """Run one ``ucp`` command line; the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.ucp_main = main  # the entry point itself, for a command that runs others (the demo's tour)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # ``ucp ls | head -1``: the reader is gone; exit quietly (before OSError below)
        quiet_stdout()
        return EXIT_OK
    except UcpError as exc:  # every line shown is masked: a message may quote a URL with its credentials
        print(f"ucp: error: {redact(exc)}", file=sys.stderr)
        return EXIT_FAIL
    except OSError as exc:  # e.g. --out into a missing folder: still one line, no traceback
        print(f"ucp: error: {redact(exc)}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        print("ucp: interrupted", file=sys.stderr)
        return 130
    except _INPUT_FAILURES as exc:
        text = str(exc).splitlines()[0][:300] if str(exc) else "out of memory" if isinstance(exc, MemoryError) else ""
        print(redact(f"ucp: error: {_inputs(args)}: {type(exc).__name__}: {text} (raised at {_raised_at(exc)} where "
                     "no check refused this input first: please report it)"), file=sys.stderr)
        return EXIT_FAIL
    except Exception as exc:
        line = _catalog_failure(exc, args)
        if line is None:
            raise
        print(f"ucp: error: {_inputs(args)}: {line}", file=sys.stderr)
        return EXIT_FAIL
