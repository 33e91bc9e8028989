"""Bounded windows: futures in flight and records read ahead, both capped in bytes.

Writing and reading checkpoints overlaps I/O with compute by keeping several operations in flight, but
never more than a byte budget, so memory stays bounded whatever the checkpoint's size. Two shapes:

- :class:`FutureWindow`: a FIFO of futures (TensorStore reads or writes). ``submit`` adds one and, past
  the budget, completes the oldest first; ``drain`` completes all; ``cancel`` waits for all and drops
  their results (used on abort: no write may still be landing once the caller deletes its files).
- :func:`prefetch`: runs a generator in a background thread, at most ``max_bytes`` (and ``max_items``)
  ahead of the consumer, so reading and merging a source overlaps the writes of what was read before.
  An exception in the thread is raised in the consumer; closing the consumer stops the thread.

:func:`read_failed` is the one wording of "reading X failed" errors. Nothing here imports a heavy module.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from ucp_store.errors import ReadError

__all__ = ["FutureWindow", "prefetch", "read_failed"]

T = TypeVar("T")


def read_failed(what: str, url: str, exc: BaseException) -> ReadError:
    """The error for a failed read of ``url`` (``what`` names the tensor-state): raise it ``from None``."""
    return ReadError(f"{what}: reading {url} failed: {exc}")


class FutureWindow(Generic[T]):
    """Futures in submission order with at most ``max_bytes`` in flight (``None``: no bound).

    ``complete(future, item)`` runs for each future in order when it is completed (it calls
    ``future.result()`` and handles the value or the error); ``item`` is what ``submit`` was given."""

    def __init__(self, max_bytes: int | None, complete: Callable[[Any, T], None]):
        self.max_bytes = max_bytes
        self._complete = complete
        self._inflight: deque[tuple[Any, T, int]] = deque()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._inflight)

    def submit(self, future: Any, nbytes: int, item: T) -> None:
        """Add a future; past the budget, complete the oldest ones until it fits again."""
        self._inflight.append((future, item, nbytes))
        self.bytes += nbytes
        while self.max_bytes is not None and self.bytes > self.max_bytes and self._inflight:
            self.complete_one()

    def complete_one(self) -> None:
        """Complete the oldest future (its bytes leave the window even if ``complete`` raises)."""
        future, item, nbytes = self._inflight.popleft()
        self.bytes -= nbytes
        self._complete(future, item)

    def drain(self) -> None:
        """Complete every future in order; the first error propagates (the rest stay in the window)."""
        while self._inflight:
            self.complete_one()

    def cancel(self) -> None:
        """Wait for every future and drop results and errors alike (abort paths)."""
        while self._inflight:
            future, _, _ = self._inflight.popleft()
            try:
                future.result()
            except Exception:  # noqa: BLE001 - the caller is already failing or aborting
                pass
        self.bytes = 0


def prefetch(items: Iterable[T], *, nbytes: Callable[[T], int], max_bytes: int = 96 << 20, max_items: int = 64,
             name: str = "ucp-prefetch") -> Iterator[T]:
    """Iterate ``items`` in a background thread, holding at most ``max_bytes`` / ``max_items`` ahead.

    One item larger than ``max_bytes`` still passes (alone). Errors raised by ``items`` are re-raised
    here, in order; closing this generator early stops the thread and discards what it read ahead."""
    q: queue.Queue = queue.Queue()
    slots = threading.Semaphore(max_items)
    size = [0]
    cond = threading.Condition()
    done = object()
    stop = threading.Event()

    def work() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                nb = nbytes(item)
                with cond:
                    while size[0] > 0 and size[0] + nb > max_bytes and not stop.is_set():
                        cond.wait(0.1)
                    size[0] += nb
                while not slots.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                q.put((item, nb))
            q.put(done)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            q.put(exc)

    th = threading.Thread(target=work, name=name, daemon=True)
    th.start()
    try:
        while True:
            got = q.get()
            if got is done:
                return
            if isinstance(got, BaseException):
                raise got
            item, nb = got
            slots.release()
            with cond:
                size[0] -= nb
                cond.notify_all()
            yield item
    finally:
        stop.set()
        with cond:
            cond.notify_all()
        while th.is_alive():
            try:
                q.get_nowait()
                slots.release()
            except queue.Empty:
                th.join(0.05)
