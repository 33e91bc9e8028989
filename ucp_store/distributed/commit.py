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

import atexit
import contextlib
import datetime as _dt
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ucp_store import config
from ucp_store.errors import ConfigurationError, UcpError

__all__ = ["EXCHANGES", "agree", "all_ok", "control_group", "default_timeout", "distributed_begin",
           "distributed_commit", "exchange_straddling", "gather_errors", "in_model_order", "settle"]

_GROUPS: dict[tuple, object] = {}
_GROUPS_LOCK = threading.Lock()


def _release_groups() -> None:
    """Drop the cached groups while the interpreter is alive (at exit): a group kept until finalisation is
    destroyed then, and a gloo worker thread that frees a Python-owned tensor at that moment takes the GIL of
    a dying interpreter, which aborts the process ("terminate called without an active exception")."""
    with _GROUPS_LOCK:
        _GROUPS.clear()


atexit.register(_release_groups)


def _drop_destroyed_groups() -> None:
    """Forget cached groups that ``destroy_process_group`` has destroyed (a job that re-initialises, as after a
    rank failure, gets new groups instead of dead ones). Holds ``_GROUPS_LOCK``."""
    live = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    if live is None:
        return
    for key in [k for k, pg in _GROUPS.items() if pg not in live]:
        del _GROUPS[key]


def default_timeout() -> float:
    """Seconds a ucp_store collective may wait: the ``dist_timeout`` setting, else ``$UCP_DIST_TIMEOUT``,
    else 300 (``config.dist_timeout``)."""
    return config.dist_timeout()


@contextlib.contextmanager
def collective_errors(what: str):
    """Turn a failed collective (a rank died, or the bounded timeout passed) into a ``UcpError`` naming ``what``."""
    try:
        yield
    except RuntimeError as exc:
        raise UcpError(f"{what}: a collective with the other ranks failed (a rank died, or none answered within "
                       f"UCP_DIST_TIMEOUT={default_timeout():g} s): {str(exc).splitlines()[0][:300]}") from exc


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
        _drop_destroyed_groups()
        pg = _GROUPS.get(key)
        if pg is None:
            pg = _GROUPS[key] = _new_group(ranks, seconds, tag)
    return pg


def _new_group(ranks: tuple[int, ...], seconds: float, tag: str):
    """``dist.new_group`` bounded like every other collective here: its rendezvous waits on the default
    group's store, whose own timeout (often minutes) would otherwise decide how long the survivors of a rank
    that died right then wait, and torch's store or gloo error would name neither the call nor the cause."""
    store = None
    try:
        store = dist.distributed_c10d._get_default_store()
        before = store.timeout  # type: ignore[attr-defined]  # a property torch.distributed.Store has, unstubbed
        store.set_timeout(_dt.timedelta(seconds=seconds))
    except Exception:  # noqa: BLE001 - a launcher without a default store: the group's own timeout applies
        store = None
    try:
        with collective_errors(f"creating the {tag} group of ranks {list(ranks)[:8]}"):
            return dist.new_group(list(ranks), backend="gloo", timeout=_dt.timedelta(seconds=seconds))
    finally:
        if store is not None:
            store.set_timeout(before)


def all_ok(ok: bool, group=None) -> bool:
    """True when ``ok`` holds on every rank of ``group`` (a collective)."""
    return _all_ok(ok, group)


def gather_errors(error: BaseException | None, group=None) -> list[tuple[int, str]]:
    """Every rank's error message as ``(rank, message)`` (empty when none failed); a collective.

    Each rank's message goes to the coordinator (one gather of JSON bytes), which broadcasts the failures:
    no rank receives more than the failures, and no pickle is exchanged."""
    failed = agree(_message(error), lambda msgs: [[r, m] for r, m in enumerate(msgs) if m is not None], group)
    return [(int(r), str(m)) for r, m in failed]


def agree(mine: Any, decide: Callable[[list], Any], group=None) -> Any:
    """``decide(every rank's mine)``, run by the coordinator (group rank 0), on every rank: one gather of JSON
    bytes to the coordinator, one broadcast of its answer (four collectives: ``coord.gather_bytes`` and
    ``coord.broadcast_bytes``; no rank but the coordinator receives more than the answer). ``mine`` and the
    answer are JSON values (tuples come back as lists). When ``decide`` fails, every rank raises."""
    from ucp_store.distributed import coord

    parts = coord.gather_bytes(coord.encode(mine), group)
    failure, payload = _decided(parts, lambda everyone: [decide(everyone)], 1)
    answer = coord.decode(coord.broadcast_bytes(None if parts is None else payload[0], group))
    return _answered(answer, failure, "agreeing with the other ranks")


def settle(mine: Any, decide: Callable[[list], list], group=None) -> Any:
    """``decide(every rank's mine)[r]`` on rank ``r``: ``decide`` runs on the coordinator (group rank 0) and
    returns one answer per rank; one gather of JSON bytes to the coordinator, one scatter of the answers
    (four collectives: ``coord.gather_bytes`` and ``coord.scatter_bytes``), so each rank receives its own
    answer alone. When ``decide`` fails, every rank raises."""
    from ucp_store.distributed import coord

    parts = coord.gather_bytes(coord.encode(mine), group)
    failure, payload = _decided(parts, decide, None if parts is None else len(parts))
    answer = coord.decode(coord.scatter_bytes(None if parts is None else payload, group))
    return _answered(answer, failure, "settling with the other ranks")


def _decided(parts: list[bytes] | None, decide: Callable[[list], list],
             count: int | None) -> tuple[BaseException | None, list[bytes]]:
    """On the coordinator (``parts`` not None): the ``count`` encoded answers ``{"ok": ...}`` that ``decide``
    returns over the decoded parts, or, when it fails, its error as each answer (the other ranks must not
    wait for one)."""
    from ucp_store.distributed import coord

    if parts is None:
        return None, []
    try:
        answers = decide([coord.decode(p) for p in parts])
        if len(answers) != count:
            raise UcpError(f"the coordinator decided {len(answers)} answer(s), expected {count}")
        return None, [coord.encode({"ok": a}) for a in answers]
    except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
        return exc, [coord.encode(coord.error_payload(exc))] * (count or 0)


def _answered(answer: dict, failure: BaseException | None, what: str) -> Any:
    from ucp_store.distributed import coord

    if failure is not None:
        raise failure
    if "error" in answer:
        coord.raise_remote(answer, what)
    return answer["ok"]


def _all_ok(ok: bool, group=None) -> bool:
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=group)
    return int(flag.item()) == 0


def _src(group) -> int:
    return dist.get_global_rank(group, 0) if group is not None else 0


def _message(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def distributed_begin(store, run: str, step: int, *, group=None, straddling: bool = True, **kwargs):
    """Rank 0 begins a pending checkpoint; every other rank joins it (one broadcast: joining reads nothing,
    rank 0's commit checks the checkpoint is still pending). If rank 0 cannot begin, every rank raises.

    Only rank 0 touches the catalog: ``store`` is a :class:`~ucp_store.store.Store` or a callable opening one
    (called on rank 0 alone, so the other ranks never connect). The broadcast (JSON bytes, no pickle) carries
    the version id, the store's location and settings; the other ranks' writers do array I/O on a store
    without a catalog (``coord.detached_store``) and hand their rows to rank 0's commit.

    ``straddling`` (on several ranks): ``write_shard`` keeps the parts of shard files a box only cuts for the
    exchange (``exchange_straddling``) that gives each file one writer; a caller writing only boxes of whole
    shard files (``write_region`` on aligned layouts) turns it off and saves the exchange's collectives."""
    from ucp_store.distributed import coord
    from ucp_store.save.writer import CheckpointWriter

    tier = getattr(store, "tier", None)  # a tiered save (distributed/tiered.py): each rank writes to its node's folder

    def work():
        st = store() if callable(store) else store
        begun = st.begin(run, step, **kwargs)
        answer = {"id": begun.id, "store": coord.store_facts(st)}
        if tier is not None:
            answer["durable"] = tier.durable_facts()
        return begun, answer

    writer, answer = coord.from_coordinator(work, group, f"the begin of the save of {run}@{step}")
    if writer is None:
        facts = answer["store"] if tier is None else tier.relocate_facts(answer["store"], answer["durable"])
        writer = CheckpointWriter(coord.detached_store(facts), str(answer["id"]), owner=False)
    if tier is not None:
        tier.joined(writer)
    if dist.get_world_size(group) > 1:
        writer.origin_writes_metadata()  # each zarr.json written by one rank (issue 27 item 0)
        if straddling:
            writer.hold_straddling()  # and each shard file
    return writer


#: what this process's straddling exchanges did: runs, pieces and bytes sent, shard files written as owner
EXCHANGES: dict[str, int] = {"exchanges": 0, "pieces_sent": 0, "bytes_sent": 0, "files_owned": 0}


def exchange_straddling(writer, group=None, error: BaseException | None = None) -> BaseException | None:
    """Give every shard file a ``write_shard`` box only cut one writer (issue 27 item 0; the index math is
    :mod:`ucp_store.save.straddle`): hand each piece this rank held (``hold_straddling``) to its file's owner and
    write the files this rank owns. A collective of ``group``: every rank of the save calls it once, after its
    ``write_shard`` calls and before agreeing its writes are done (``distributed_commit`` runs it when the caller
    did not). One ``settle`` of the pieces' descriptions through the coordinator (4 collectives, JSON), then,
    only when some bytes must move, one ``all_to_all_single`` of their raw bytes: the straddling bytes alone.
    ``error``: this rank already failed (it takes part, moving nothing). Returns ``error`` or this step's
    failure; a failed collective raises ``UcpError``."""
    from ucp_store.distributed import coord
    from ucp_store.save import straddle

    pieces = writer.shards.take_straddling()
    mine = {"failed": error is not None, "pieces": [straddle.describe(p) for p in pieces]}

    def decide(parts: list) -> list:
        if any(p["failed"] for p in parts):
            return [None] * len(parts)  # nothing moves; the agreement that follows fails every rank
        return straddle.plan_exchange([p["pieces"] for p in parts])

    me, world = dist.get_rank(group), dist.get_world_size(group)
    with collective_errors(f"save {writer.id}: handing cut shard files to their one writer"):
        plan = settle(mine, decide, group)
        EXCHANGES["exchanges"] += 1
        if plan is None:
            return error
        sends: list[list] = [[] for _ in range(world)]
        for p, dst in zip(pieces, plan["send"]):
            if dst != me:
                sends[dst].append(p)
        descs = {int(src): d for src, d in plan["recv"].items()}
        arrived = coord.all_to_all_bytes([[p.data for p in s] for s in sends],
                                         [sum(int(d[6]) for d in descs.get(r, ())) for r in range(world)],
                                         group) if plan["moves"] else []
    EXCHANGES["pieces_sent"] += sum(len(s) for s in sends)
    EXCHANGES["bytes_sent"] += sum(int(p.data.nbytes) for s in sends for p in s)
    if error is not None:
        return error
    try:
        owned = [p for p, dst in zip(pieces, plan["send"]) if dst == me]
        for src in sorted(descs):
            owned += straddle.received(descs[src], arrived[src], writer.shards.numpy_dtype)
        EXCHANGES["files_owned"] += len({p.key for p in owned})
        writer.shards.write_owned(owned)
    except BaseException as exc:  # noqa: BLE001 - every rank learns of it in the agreement that follows
        return exc
    return None


def _dedup_joined(writer, rows: list[dict]) -> list[str]:
    """Rank 0's deduplication of the arrays the joined ranks wrote (they have no catalog to look in): an
    array whose content a committed version (or an earlier array of this save) already holds is dropped
    and its rows point at that one. Returns the folders of the dropped arrays (removed after the commit)."""
    arrays = [r for r in rows if r.get("_table") == "array" and r.get("content_hash")]
    known = writer.dedup.local_arrays
    writer.dedup.lookup_hashes([a["content_hash"] for a in arrays if a["content_hash"] not in known])
    remap: dict[str, str] = {}
    for a in arrays:
        existing = writer.dedup.find(a["content_hash"], a["dtype"], a["shape"])
        if existing is not None and existing != a["id"]:
            remap[a["id"]] = existing
        else:
            writer.dedup.local_arrays[a["content_hash"]] = a["id"]
    if not remap:
        return []
    dropped = [r["path"] for r in arrays if r["id"] in remap]
    rows[:] = [r for r in rows if not (r.get("_table") == "array" and r["id"] in remap)]
    for r in rows:
        if r.get("array_id") in remap:
            r["array_id"] = remap[r["array_id"]]
    return dropped


def in_model_order(writer, orders: list[list], extra: list[dict]) -> None:
    """Rank 0's positions of a distributed save in model order: every rank's order (``writer.positions``,
    its state dict's) merged into one (``records.merge_orders``), and the tensor rows of this writer (not yet
    recorded) and of the joined ranks (``extra``) numbered by it, each tensor's states together. Without any
    rank's order (callers passing explicit positions: the DeepSpeed engine) nothing changes."""
    from ucp_store.catalog import models as m
    from ucp_store.records import merge_orders, model_order

    keyed = [[(str(n), str(st)) for n, st in order] for order in orders if order]
    if not keyed:
        return
    pos = model_order(merge_orders(keyed))
    last = len(pos)
    for row in writer.shards.rows:  # the rows not recorded yet (the list every collaborator fills)
        if isinstance(row, m.Tensor):
            row.position = pos.get((row.name, row.state), last + int(row.position or 0))
    for d in extra:
        if d.get("_table") == "tensor":
            d["position"] = pos.get((d["name"], d["state"]), last + int(d.get("position") or 0))


def distributed_commit(writer, *, group=None, error: BaseException | None = None, synced: bool = False,
                       stats: dict | None = None, t0: float | None = None) -> str:
    """Finish a distributed save on every rank; returns the committed checkpoint id (same on all ranks).

    Each rank makes everything it wrote durable; after a barrier (every rank's writes are in place), the
    origin rank of each sharded array hashes it; one gather (JSON bytes) brings every rank's rows (plain
    dicts) and outcome to rank 0, which deduplicates the joined ranks' arrays, records them all and commits
    in ONE catalog transaction (or aborts, when any rank failed); one broadcast tells every rank the outcome.
    ``error``: this rank already failed (the others learn it in the gather). ``synced=True``: the caller
    already agreed, after every rank's writes returned, that all succeeded (a collective), so the barrier
    round is skipped. ``stats``: the seconds since ``t0`` at which each step ended are recorded there
    (``rows_s``, ``gathered_s``, ``committed_s``)."""
    from ucp_store.distributed import coord

    rank = dist.get_rank(group)
    if writer.exchange_due:  # the caller did not run the exchange: every rank of the save runs it here
        error = exchange_straddling(writer, group, error)

    def mark(key: str) -> None:
        if stats is not None:
            stats[key] = time.perf_counter() - (t0 or 0.0)

    if not synced:
        if error is None:
            try:
                writer.arrays.drain()
                writer.durability.make_durable()
            except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
                error = exc
        if not _all_ok(error is None, group):
            writer.abort()
            raise UcpError(f"distributed save {writer.id} failed on some rank; aborted") from error
    tier = getattr(writer, "tier", None)
    if tier is not None:  # every rank's files are in place: where they are goes into the commit's transaction
        error = tier.before_commit(writer, group, error)
    rows: list = []
    if error is None:
        try:
            if rank == 0:  # hash its origin arrays and make all durable now, beside the other ranks
                if writer.shards.origin:
                    writer.finish_shards(record=False)
                writer._settle()
            else:
                rows = writer.export_rows()
        except BaseException as exc:  # noqa: BLE001
            error = exc
    mark("rows_s")
    parts = coord.gather_bytes(coord.encode([_message(error), rows, writer.positions.keys]), group)
    mark("gathered_s")
    outcome: list = [None, None]
    if rank == 0:
        assert parts is not None
        decoded = [coord.decode(p) for p in parts]
        failed = [(r, p[0]) for r, p in enumerate(decoded) if p[0] is not None]
        if failed:
            writer.abort()
            outcome[1] = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        else:
            try:
                extra = [row for p in decoded[1:] for row in p[1]]
                in_model_order(writer, [p[2] for p in decoded], extra)
                dropped = _dedup_joined(writer, extra)
                writer.commit(extra_rows=extra, reload=False)
                outcome[0] = writer.id
                for rel in dropped:  # identical content is stored already (best effort: gc sweeps leftovers)
                    try:
                        writer.store.location.delete_tree(rel)
                    except Exception:  # noqa: BLE001
                        pass
            except BaseException as exc:  # noqa: BLE001 - commit aborted; every rank must learn about it
                error = exc
                outcome[1] = f"rank 0: {_message(exc)}"
    mark("committed_s")
    outcome = coord.decode(coord.broadcast_bytes(coord.encode(outcome) if rank == 0 else None, group))
    if outcome[0] is None:
        if rank != 0:
            writer.abort()
        raise UcpError(f"distributed save {writer.id} failed ({outcome[1]}); aborted, nothing listed") from error
    return writer.id
