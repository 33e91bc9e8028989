"""The process-group facts of one ``ucp_store.distributed`` call (``Ctx``: rank, world, the bounded-timeout gloo
control group and its JSON-bytes collectives), the errors raised alike on every rank, and the store a call opens.
Shared by the saver, the loader and the verifier."""

from __future__ import annotations

import os
from typing import Any

from ucp_store.distributed.commit import collective_errors
from ucp_store.errors import ConfigurationError, UcpError

__all__ = ["Ctx", "raise_failures", "resolve_store"]


class Ctx:
    """Process-group facts for one call: rank, world size and the bounded-timeout gloo group."""

    def __init__(self, group=None, *, tag: str = "control", timeout: float | None = None):
        import torch.distributed as dist

        self.dist = None
        self.rank, self.world, self.group = 0, 1, None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            from ucp_store.distributed.commit import control_group

            self.dist = dist
            self.group = control_group(group, timeout=timeout, tag=tag)
            self.rank = dist.get_rank(self.group)
            self.world = dist.get_world_size(self.group)

    def gather(self, obj: Any, what: str = "collective") -> list:
        """Every rank's ``obj`` (a JSON value: tuples come back as lists), by rank, on every rank: for small
        values alone (each rank receives all of them); :meth:`agree` and :meth:`settle` send the coordinator's
        decision instead. JSON bytes, never a pickle."""
        return self.agree(obj, lambda everyone: everyone, what)

    def agree(self, obj: Any, decide, what: str = "collective") -> Any:
        """``decide(every rank's obj)``, run by the coordinator, on every rank (``commit.agree``: one gather of
        JSON bytes, one broadcast of the answer, on the bounded-timeout control group)."""
        if self.dist is None:
            return decide([obj])
        from ucp_store.distributed.commit import agree

        with collective_errors(what):
            return agree(obj, decide, self.group)

    def settle(self, obj: Any, decide, what: str = "collective") -> Any:
        """``decide(every rank's obj)[rank]``: the coordinator decides one answer per rank and each rank
        receives only its own (``commit.settle``: one gather, one scatter of JSON bytes)."""
        if self.dist is None:
            return decide([obj])[0]
        from ucp_store.distributed.commit import settle

        with collective_errors(what):
            return settle(obj, decide, self.group)

    def raise_if_any_failed(self, error: BaseException | None, what: str) -> None:
        """A collective: every rank raises when any rank failed (naming each failing rank)."""
        if self.dist is None:
            if error is not None:
                raise error
            return
        from ucp_store.distributed.commit import gather_errors

        with collective_errors(what):
            failures = gather_errors(error, self.group)
        raise_failures(failures, error, what)


def raise_failures(failures: list, error: BaseException | None, what: str) -> None:
    """Raise when ``failures`` (``(rank, message)`` of every failed rank, the same on every rank) is not empty:
    this rank's own ``error`` in its own class, else an error naming each failing rank."""
    if not failures:
        return
    if error is not None:
        raise error
    detail = "; ".join(f"rank {r}: {msg}" for r, msg in failures)
    raise UcpError(f"{what} failed on {len(failures)} rank(s): {detail}")


def resolve_store(store, *, create: bool):
    from ucp_store.store import Store, open_store

    if isinstance(store, Store):
        return store
    if store is None or isinstance(store, (str, os.PathLike)):
        return open_store(None if store is None else os.fspath(store), create=create)
    raise ConfigurationError(f"store must be a URL, a path or a Store, got {type(store).__name__}")
