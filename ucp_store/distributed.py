"""Saving one checkpoint from many ``torch.distributed`` ranks (one commit, by rank 0).

    w = distributed_begin(store, "run", step)          # rank 0 begins, the others join
    w.write_shard(name, "fp32", local, shape=..., pattern=..., topology=topo, rank=dist.get_rank())
    ck_id = distributed_commit(w)                      # barrier, origin ranks hash and record, commit

If any rank fails, every rank aborts and nothing is listed. Ranks agree through collectives on the
group passed (default: the default process group; gloo works on CPU); the only objects exchanged are
checkpoint ids, flags and small metadata.

Every collective of a save or load must end in bounded time, so that a dead rank gives an error and
never a hang: :func:`control_group` makes (once per group and timeout) a gloo group over the same ranks
with a timeout (``UCP_DIST_TIMEOUT`` seconds, default 300). Being gloo, it also carries the CPU flags and
objects of a job whose default backend is NCCL.
"""

from __future__ import annotations

import datetime as _dt
import os
import threading

import torch
import torch.distributed as dist

from .errors import ConfigurationError, UcpError

__all__ = ["all_ok", "control_group", "default_timeout", "distributed_begin", "distributed_commit", "gather_errors"]

_GROUPS: dict[tuple, object] = {}
_GROUPS_LOCK = threading.Lock()


def default_timeout() -> float:
    """Seconds a ucp_store collective may wait: ``$UCP_DIST_TIMEOUT`` or 300."""
    raw = os.environ.get("UCP_DIST_TIMEOUT", "300")
    try:
        value = float(raw)
    except ValueError:
        raise ConfigurationError(f"UCP_DIST_TIMEOUT={raw!r}: expected a number of seconds") from None
    if value <= 0:
        raise ConfigurationError(f"UCP_DIST_TIMEOUT={raw!r}: expected a positive number of seconds")
    return value


def control_group(group=None, *, timeout: float | None = None, tag: str = "control"):
    """A gloo group over ``group``'s ranks (default: the world) whose collectives time out after ``timeout`` s.

    Created on first use (a collective: every rank of ``group`` must call it in the same order, with the
    same ``tag``) and cached. Different ``tag`` values give independent groups, so a background thread
    can run its collectives beside the caller's without interleaving them."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigurationError("control_group: torch.distributed is not initialised")
    seconds = default_timeout() if timeout is None else float(timeout)
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    key = (ranks, seconds, tag)
    with _GROUPS_LOCK:
        pg = _GROUPS.get(key)
        if pg is None:
            pg = dist.new_group(list(ranks), backend="gloo", timeout=_dt.timedelta(seconds=seconds))
            _GROUPS[key] = pg
    return pg


def all_ok(ok: bool, group=None) -> bool:
    """True when ``ok`` holds on every rank of ``group`` (a collective)."""
    return _all_ok(ok, group)


def gather_errors(error: BaseException | None, group=None) -> list[tuple[int, str]]:
    """Every rank's error message as ``(rank, message)`` (empty when none failed); a collective."""
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, None if error is None else f"{type(error).__name__}: {error}", group=group)
    return [(r, msg) for r, msg in enumerate(parts) if msg is not None]


def _all_ok(ok: bool, group=None) -> bool:
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=group)
    return int(flag.item()) == 0


def distributed_begin(store, run: str, step: int, *, group=None, **kwargs):
    """Rank 0 begins a pending checkpoint; every other rank joins it. If rank 0 cannot begin (or a rank
    cannot join), every rank raises."""
    rank = dist.get_rank(group)
    writer, error = None, None
    if rank == 0:
        try:
            writer = store.begin(run, step, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - the other ranks must learn about it
            error = exc
    box = [writer.id if writer is not None else None, None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if error is not None:
        raise error
    if box[0] is None:
        raise UcpError(f"rank 0 could not begin the save of {run}@{step}: {box[1]}")
    if writer is None:
        try:
            writer = store.join(box[0])
        except BaseException as exc:  # noqa: BLE001
            error = exc
    if not _all_ok(error is None, group):
        if writer is not None and rank == 0:
            writer.abort()
        raise UcpError(f"a rank could not join the save of {run}@{step}; aborted") from error
    return writer


def distributed_commit(writer, *, group=None) -> str:
    """Finish a distributed save on every rank; returns the committed checkpoint id (same on all ranks)."""
    rank = dist.get_rank(group)
    error: BaseException | None = None
    try:
        writer.flush()
    except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
        error = exc
    if not _all_ok(error is None, group):
        writer.abort()
        raise UcpError(f"distributed save {writer.id} failed on some rank; aborted") from error
    try:
        writer.finish_shards()
    except BaseException as exc:  # noqa: BLE001
        error = exc
    if not _all_ok(error is None, group):
        if rank == 0:
            writer.abort()
        raise UcpError(f"distributed save {writer.id} failed while recording arrays; aborted") from error
    if rank == 0:
        try:
            writer.commit()
        except BaseException as exc:  # noqa: BLE001
            error = exc
    else:
        writer._closed = True
    if not _all_ok(error is None, group):
        raise UcpError(f"distributed save {writer.id} failed to commit") from error
    return writer.id
