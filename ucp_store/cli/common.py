"""What every ``ucp`` command shares: the ``--store``/``--catalog``/``--no-progress`` options and opening the store.

Opening a store needs SQLAlchemy only (``ucp_store.store`` loads torch and TensorStore on first tensor
use), so this module and the catalog-only command modules import nothing heavy.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from ucp_store.store import Store

__all__ = ["EXIT_OK", "EXIT_FAIL", "Command", "add_common", "open_from_args", "progress_wanted", "mib_bytes"]

EXIT_OK, EXIT_FAIL = 0, 1


def add_common(p: argparse.ArgumentParser, top: bool) -> None:
    """Add the options every command accepts, before or after the subcommand."""
    default = None if top else argparse.SUPPRESS
    p.add_argument("--store", default=default, metavar="URL",
                   help="store folder or URL (default: $UCP_STORE or ./ucp-store)")
    p.add_argument("--catalog", default=default, metavar="URL", help="catalog URL (default: $UCP_CATALOG or "
                   "<store>/catalog.db)")
    p.add_argument("--sqlite-journal", default="auto" if top else argparse.SUPPRESS, choices=("auto", "wal", "delete"),
                   help="SQLite catalog journal: auto (default) runs WAL, or DELETE on a network/cluster filesystem "
                   "(WAL needs every process on one host); wal or delete force it")
    p.add_argument("--no-progress", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="no progress bars")


#: commands that only read: their store is opened read-only (nothing written, not even a journal mode), so a
#: read-only mount or a full disk can still be listed, shown, verified and exported from
READ_ONLY_COMMANDS = frozenset({"ls", "show", "log", "query", "read", "stats", "diff", "verify", "export", "plan",
                                "plot"})


def reads_only(args: Any) -> bool:
    """Whether the command line only reads the store (``gc --dry-run`` included)."""
    command = getattr(args, "command", None)
    return command in READ_ONLY_COMMANDS or (command == "gc" and bool(getattr(args, "dry_run", False)))


def open_from_args(args: Any, *, create: bool = False, **settings: Any) -> Store:
    """The store named by ``--store`` / ``--catalog`` (or their environment defaults); read-only for the
    commands that only read (:func:`reads_only`)."""
    from ucp_store.store import open_store

    if not create and reads_only(args):
        settings["read_only"] = True
    return open_store(args.store, create=create, catalog=args.catalog,
                      sqlite_journal=getattr(args, "sqlite_journal", "auto"), **settings)


def mib_bytes(value: float | None, flag: str) -> int | None:
    """``value`` MiB (an option given as a float) in bytes, or None when the option was not given; a value
    that is not a positive finite number (argparse's ``float`` reads ``nan``, ``inf`` and ``0``) is refused
    naming the option. The range itself is the API's to check."""
    from ucp_store.errors import ConfigurationError

    if value is None:
        return None
    if not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{flag} {value}: expected a positive, finite number of MiB")
    return int(value * (1 << 20))


def progress_wanted(args: Any) -> bool:
    """Draw progress bars unless ``--no-progress``."""
    return not args.no_progress


class Command(NamedTuple):
    """One subcommand: what runs it, its help line, and the arguments it adds to its parser."""

    run: Callable[[Any], int]
    help: str
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    json_flag: bool = True
