"""Progress bars for long work (rich). Off when not asked for or when stderr is not a terminal."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from ucp_store import config

__all__ = ["wanted", "track"]

T = TypeVar("T")


def wanted(enabled: bool | None) -> bool:
    """Draw a bar? The ``progress`` setting or ``UCP_PROGRESS=0/1`` decides (``config.progress``);
    otherwise ``enabled`` and stderr being a terminal."""
    forced = config.progress()
    if forced is not None:
        return forced
    return bool(enabled) and sys.stderr.isatty()


def track(items: Iterable[T], description: str, *, enabled: bool | None = True, total: int | None = None,
          weight: Callable[[T], int] | None = None) -> Iterator[T]:
    """Iterate with a progress bar on stderr; ``weight`` advances by bytes instead of items."""
    if not wanted(enabled):
        yield from items
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    items = list(items)
    count_col = DownloadColumn() if weight else MofNCompleteColumn()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), count_col, TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=sum(weight(i) for i in items) if weight else (total or len(items)))
        for item in items:
            yield item
            bar.advance(task, weight(item) if weight else 1)
