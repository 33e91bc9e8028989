"""Saving one checkpoint from many ``torch.distributed`` ranks (one commit, by rank 0).

    w = distributed_begin(store, "run", step)          # rank 0 begins, the others join
    w.write_shard(name, "fp32", local, shape=..., pattern=..., topology=topo, rank=dist.get_rank())
    ck_id = distributed_commit(w)                      # barrier, origin ranks hash and record, commit

If any rank fails, every rank aborts and nothing is listed. Ranks agree through collectives on the
default process group (gloo works on CPU); the only objects exchanged are checkpoint ids and flags.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import UcpError


def _all_ok(ok: bool, group=None) -> bool:
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=group)
    return int(flag.item()) == 0


def distributed_begin(store, run: str, step: int, *, group=None, **kwargs):
    """Rank 0 begins a pending checkpoint; every other rank joins it."""
    rank = dist.get_rank(group)
    writer = store.begin(run, step, **kwargs) if rank == 0 else None
    box = [writer.id if writer is not None else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return writer if writer is not None else store.join(box[0])


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
