"""The catalog position of each tensor-state a writer records: model order (``records.model_order``).

A caller that knows its tensors' order (a state dict's, a source file's) hands it over once
(``CheckpointWriter.positions.set_order``) before writing; positions then follow it, each tensor's states
together, whatever order the writes (or the origin rank's hashing, in key order) happen in. Without one, a
tensor-state's position is the order in which it was first written. An explicit ``position=`` (ZeRO group
layouts) always wins.
"""

from __future__ import annotations

from collections.abc import Iterable

from ucp_store.errors import UcpError
from ucp_store.records import model_order

__all__ = ["Positions"]

Key = tuple[str, str]


class Positions:
    """Hands out positions (1, 2, ...) per ``(name, state)``: the caller's order first, then first touch."""

    def __init__(self) -> None:
        self._keys: list[Key] = []
        self._order: dict[Key, int] = {}
        self._touched: dict[Key, int] = {}
        self._next = 1

    def set_order(self, keys: Iterable[Key]) -> None:
        """Positions follow ``keys`` (each tensor's states together); call before the first write."""
        if self._touched:
            raise UcpError("writer order: the tensor order must be set before the first tensor-state is written "
                           f"({len(self._touched)} written already)")
        self._keys = list(dict.fromkeys((str(n), str(s)) for n, s in keys))
        self._order = model_order(self._keys)
        self._next = len(self._order) + 1

    @property
    def keys(self) -> list[Key]:
        """The order set by ``set_order`` (empty when none was)."""
        return list(self._keys)

    def of(self, key: Key, explicit: int | None = None) -> int:
        """The position of ``key``: ``explicit`` when given, its place in the order, else its first touch."""
        if explicit is not None:
            return int(explicit)
        got = self._order.get(key)
        if got is None:
            got = self._touched.get(key)
        if got is None:
            got = self._touched[key] = self._next
            self._next += 1
        return got

    def touch(self, key: Key) -> None:
        """``key`` is being written: fix its first-touch position now (writes come in the caller's order;
        rows may be recorded later in another)."""
        if key not in self._order:
            self.of(key)
