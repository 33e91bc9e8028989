"""Output helpers of the ``ucp`` command: tables, JSON, byte counts, and quiet exits on a closed pipe.

Only ``rich`` (for tables) is imported, and only when a table is drawn: a catalog-only command stays
cheap to start.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["fmt_bytes", "print_json", "table", "quiet_stdout"]


def fmt_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``None`` -> ``"-"``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON (non-JSON values as their ``str``)."""
    print(json.dumps(obj, indent=2, default=str, allow_nan=True))


def table(rows: list[list[Any]], headers: list[str]) -> None:
    """Print rows under bold headers, without borders (``None`` shows as ``-``)."""
    from rich.console import Console
    from rich.table import Table

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich would exit 1 here; hand the closed pipe to ``main``, which exits quietly with 0
            self.quiet = True
            raise BrokenPipeError

    t = Table(*headers, box=None, pad_edge=False, header_style="bold")
    for r in rows:
        t.add_row(*["-" if v is None else str(v) for v in r])
    _Console(width=max(120, os.get_terminal_size(1).columns if sys.stdout.isatty() else 160)).print(t)


def quiet_stdout() -> None:
    """After a ``BrokenPipeError`` (``ucp ls | head -1``): point stdout at /dev/null, so that the flush at
    interpreter exit cannot raise again and print a traceback (the convention of the Python docs)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (a test's capture): nothing to flush
        pass
