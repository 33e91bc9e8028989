"""Output helpers of the ``ucp`` command: tables, JSON, byte counts, and quiet exits on a closed pipe.

``--json`` output is always strict JSON: NaN, Infinity and -Infinity are printed as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"`` (a number where the value is finite), and complex values as
``[re, im]`` pairs (``ucp read``).

Only ``rich`` (for tables) is imported, and only when a table is drawn: a catalog-only command stays
cheap to start.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

__all__ = ["fmt_bytes", "json_safe", "print_json", "table", "quiet_stdout", "NONFINITE"]


def fmt_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``None`` -> ``"-"``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


#: how ``--json`` spells the floats JSON has no number for (the names JavaScript and Python's ``json`` use)
NONFINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def json_safe(obj: Any) -> Any:
    """``obj`` with every NaN, Infinity and -Infinity float (also inside dicts, lists and tuples, and numpy
    scalars) replaced by the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``: strict JSON has no
    number for them, and a bare ``NaN`` token makes the whole output unreadable to a strict parser."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else NONFINITE[repr(float(obj))]
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if getattr(obj, "shape", None) == () and hasattr(obj, "item"):  # a numpy scalar (numpy is not imported here)
        return json_safe(obj.item())
    return obj


def print_json(obj: Any) -> None:
    """Print ``obj`` as indented, strict JSON (``allow_nan=False`` holds): non-finite floats as the strings
    of :func:`json_safe`, other non-JSON values as their ``str``."""
    try:
        text = json.dumps(obj, indent=2, default=_default, allow_nan=False)
    except ValueError:  # a non-finite float somewhere: walk the value only then (a large read is long)
        text = json.dumps(json_safe(obj), indent=2, default=_default, allow_nan=False)
    print(text)


def _default(obj: Any) -> Any:
    safe = json_safe(obj)  # a numpy scalar becomes its Python value; anything else is returned as it is
    return str(obj) if safe is obj else safe


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
