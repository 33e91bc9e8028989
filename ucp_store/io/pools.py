"""Process-wide thread pools of the I/O paths: each made on first use, sized once, forgotten in a forked child.

Why one home: the read, stream, small-read and write pools were four copies of the same lazy, locked
construction, and only the write pool forgot itself after ``fork``. A child inherits the pool object but
not its threads; its idle-thread count says workers are free, so a submitted read would wait forever. Here
every pool is dropped in the child and made again on its first use there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["LazyPool"]

_all: list[LazyPool] = []


class LazyPool:
    """A ``ThreadPoolExecutor`` made on the first :meth:`get`, with ``size()`` threads: the ``setting`` of
    ``ucp_store.config`` when set, else ``default(cpu count)``."""

    def __init__(self, prefix: str, setting: str, default: Callable[[int], int]):
        self.prefix, self.setting, self.default = prefix, setting, default
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        _all.append(self)

    def size(self) -> int:
        from ucp_store import config

        value = getattr(config.current(), self.setting)
        return int(value) if value is not None else self.default(os.cpu_count() or 1)

    def get(self) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None:
            with self._lock:
                pool = self._pool
                if pool is None:
                    pool = self._pool = ThreadPoolExecutor(self.size(), thread_name_prefix=self.prefix)
        return pool

    def _forget(self) -> None:
        self._pool = None
        self._lock = threading.Lock()


def _after_fork_in_child() -> None:
    for p in _all:
        p._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
