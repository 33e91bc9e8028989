"""The async save in flight (at most one per process): its handle, and ``wait`` for it.

A separate home so that ``save`` and ``load`` (``api``) can wait for it without importing the async
machinery (``asyncsave``), which itself builds on ``api``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ucp_store.distributed import snapshot as snap_mod

__all__ = ["AsyncSaveHandle", "set_pending", "wait"]

_LOCK = threading.Lock()
_PENDING: AsyncSaveHandle | None = None


class AsyncSaveHandle:
    """The future of one ``async_save``: ``result()`` gives the version id or raises the background error."""

    def __init__(self, run: str, step: int, mode: str):
        self.run, self.step, self.mode = run, step, mode
        self._event = threading.Event()
        self._id: str | None = None
        self._error: BaseException | None = None
        #: seconds the caller was blocked (planning + staging)
        self.blocked_s = 0.0
        #: bytes this rank staged
        self.staged_bytes = 0
        #: the lazy snapshot (None when the call copied everything)
        self.snapshot: snap_mod.Snapshot | None = None

    @property
    def gate_wait_s(self) -> float:
        """Seconds optimizer steps waited for this save's lazy snapshot (0 for an eager save)."""
        return self.snapshot.gate_wait_s if self.snapshot is not None else 0.0

    def _finish(self, cid: str | None, error: BaseException | None) -> None:
        self._id, self._error = cid, error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> str:
        """Wait for the commit; returns the version id, or raises what failed (on any rank)."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"async save of {self.run}@{self.step} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._id  # type: ignore[return-value]

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"AsyncSaveHandle({self.run}@{self.step}, {self.mode}, {state})"


def set_pending(handle: AsyncSaveHandle) -> None:
    """Record ``handle`` as the save in flight (the next ``save``, ``load`` or ``async_save`` waits for it)."""
    global _PENDING
    with _LOCK:
        _PENDING = handle


def wait() -> None:
    """Wait for the async save in flight, if any (its error stays on its handle)."""
    with _LOCK:
        pending = _PENDING
    if pending is not None:
        pending._event.wait()
