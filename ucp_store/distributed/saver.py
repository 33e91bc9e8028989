"""``save`` of live DTensor / FSDP2 / TP state dicts on every rank (DCP's ``state_dict_saver``).

On every rank:
1. plan (``planner.py``): flatten the dict (``statedict.py``), describe each tensor's boxes (``tensors.py``,
   ``layout.py``), and learn from the coordinator which boxes this rank writes;
2. stage the boxes it writes to host memory (device tensors are copied to host, pinned buffers when
   asynchronous: ``asyncsave.py``) and write them with ``CheckpointWriter.write_region`` into the pending
   version (``write_plan``);
3. rank 0 commits after every rank's arrays are durable (``commit.py``); on an error anywhere, every rank
   raises and nothing is listed.

Without a process group (or with a world of one) everything runs locally with no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ucp_store import dtypes
from ucp_store._killpoints import killpoint
from ucp_store.distributed.commit import collective_errors
from ucp_store.distributed.context import Ctx, resolve_store
from ucp_store.distributed.inflight import wait
from ucp_store.distributed.planner import SavePlan, forget_plan, plan_save, plan_still_holds
from ucp_store.distributed.publish import Published, check_mode, publish_deltas, remember
from ucp_store.distributed.statedict import STATE_DICT_OBJECT
from ucp_store.distributed.tensors import host_copy
from ucp_store.errors import ConfigurationError, StalePlanError, UcpError

__all__ = ["open_everywhere", "save", "set_region_hashes", "write_plan"]


def write_plan(store, plan: SavePlan, staged: list[torch.Tensor], ctx: Ctx, *, run: str, step: int,
                message: str | None, parent: str | None, progress: bool, delta: str | None = "off") -> str:
    """Begin/join, write every staged box, rank 0 writes the objects, commit (all ranks or none)."""
    from ucp_store.progress import track

    msg = message or f"ucp_store.distributed.save from {ctx.world} rank(s)"
    if ctx.dist is None and callable(store):
        store = store()
    if ctx.dist is None:
        writer = store.begin(run, step, parent=parent, message=msg, provenance=plan.provenance)
    else:
        from ucp_store.distributed.commit import distributed_begin

        # distributed_begin raises on every rank when rank 0 cannot begin or a rank cannot join
        with collective_errors(f"save of {run}@{step} (begin)"):
            writer = distributed_begin(store, run, step, group=ctx.group, parent=parent, message=msg,
                                       provenance=plan.provenance, straddling=False)  # boxes of whole files
    error = None
    published: Published | None = None
    try:
        pairs = list(zip(plan.items, staged))
        # positions in the state dict's order, each tensor's states together (the commit merges the ranks')
        writer.positions.set_order(tuple(o["tensor"]) for o in plan.objects if "tensor" in o)
        if delta != "off":  # deltas of the parent where small enough (publish.py: two collectives)
            published = publish_deltas(writer, pairs, ctx, delta, f"save of {run}@{step}")
            pairs = [(it, data) for it, data in pairs if (it.name, it.state) not in published.kept]
        writer.open_regions([(it.name, it.state, dtypes.zarr_name(data.dtype, what=it.name), it.shape, it.pattern,
                              it.boundaries) for it, data in pairs])  # every array at once
        for it, data in track(pairs, f"save {run}@{step}", enabled=progress and ctx.rank == 0,
                              weight=lambda pair: pair[1].numel() * pair[1].element_size()):
            writer.write_region(it.name, it.state, data, shape=it.shape, offset=it.offset, pattern=it.pattern,
                                boundaries=it.boundaries, origin=it.origin)
            killpoint("dist.mid_write")
        for name, value in plan.rank_objects:  # the per-rank contents this rank owns
            writer.write_object(name, value)
        if ctx.rank == 0:
            manifest: dict[str, Any] = {"format": 1, "leaves": plan.objects}
            if plan.per_rank is not None:
                manifest.update(format=2, per_rank=plan.per_rank)
            writer.write_object(STATE_DICT_OBJECT, manifest)
        writer.drain()  # a failed write is this rank's error before the vote below (never a hang in a gather)
    except BaseException as exc:  # noqa: BLE001
        error = exc
    if ctx.dist is None:
        if error is not None:
            writer.abort()
            raise error
        try:
            set_region_hashes(writer, [writer.region_digests()])
        except BaseException:
            writer.abort()
            raise
        version = writer.commit().id
        if published is not None:
            remember(writer, published, version)
        return version
    from ucp_store.distributed.commit import distributed_commit

    mine = _CommitPart.of(writer, plan, error)
    if mine.error is not None and error is None:
        error = mine.error_exc
    try:  # one round to the coordinator: every rank's outcome, digests and cached-plan check; its answer back
        answer = ctx.settle(mine.to_json(), lambda parts: _decide_commit(plan.check, parts),
                            f"save of {run}@{step} (commit)")
    except BaseException:  # a failed round, or the coordinator's own failure to decide (raised on every rank)
        writer.abort()
        raise
    if answer["failed"]:
        writer.abort()
        if error is not None:
            raise error
        raise UcpError(f"save of {run}@{step} failed on another rank; aborted (nothing listed)")
    if answer["stale"]:
        writer.abort()
        forget_plan(ctx)
        raise StalePlanError(f"save of {run}@{step}: the state dict's layout or which entries are equal "
                             "on every rank changed since the cached plan; aborted to plan afresh")
    try:
        _apply_hashes(writer, answer)
        with collective_errors(f"save of {run}@{step} (commit)"):
            version = distributed_commit(writer, group=ctx.group)
        if published is not None:
            remember(writer, published, version)
        return version
    except UcpError:
        writer.abort()
        raise


@dataclass
class _CommitPart:
    """What one rank sends the coordinator at a multi-rank save's commit (one gather, JSON): its error, the unit
    digests of every array it wrote boxes of, the dtype and shape of the arrays it is origin of (element 0:
    it records their hash), and a cached plan's check."""

    error: str | None
    digests: list  # [name, state, {unit: hex digest} | None]
    origin: list  # [name, state, dtype, shape]
    check: dict | None
    error_exc: BaseException | None = None

    @classmethod
    def of(cls, writer, plan: SavePlan, error: BaseException | None) -> _CommitPart:
        check = None if plan.check is None else {k: plan.check[k] for k in ("key_ok", "digests")}
        if error is not None:
            return cls(f"{type(error).__name__}: {error}", [], [], check)
        try:
            digests = [[k[0], k[1], None if d is None else {str(u): v.hex() for u, v in d.items()}]
                       for k, d in writer.region_digests().items()]
            origin = [[k[0], k[1], writer.shards.sharded[k][2].dtype, list(writer.shards.sharded[k][2].shape)]
                      for k in sorted(writer.shards.origin)]
        except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
            return cls(f"{type(exc).__name__}: {exc}", [], [], check, exc)
        return cls(None, digests, origin, check)

    def to_json(self) -> dict:
        return {"error": self.error, "digests": self.digests, "origin": self.origin, "check": self.check}


def _decide_commit(check: dict | None, parts: list[dict]) -> list[dict]:
    """The coordinator's answer to every rank's :class:`_CommitPart`: whether any rank failed, whether a cached
    plan still holds (``plan_still_holds``), and to each origin rank the content hashes of its arrays
    (``fmt.chunk_tree_hash``: ``units_hash`` of every rank's unit digests, merged) or, where some unit is
    missing, the merged digests (the origin reads back only the rest). An array that some rank could not
    digest (None) gets neither: its origin reads it back."""
    from ucp_store.io import format as fmt

    world = len(parts)
    if any(p["error"] is not None for p in parts):
        return [{"failed": True, "stale": False}] * world
    if check is not None and not plan_still_holds(check, [p["check"] or {"key_ok": False} for p in parts]):
        return [{"failed": False, "stale": True}] * world
    merged: dict[tuple[str, str], dict | None] = {}
    for p in parts:
        for name, state, digests in p["digests"]:
            key = (name, state)
            so_far = merged.get(key, {})
            if digests is None or so_far is None:
                merged[key] = None
            elif key in merged:
                so_far.update(digests)
            else:
                merged[key] = dict(digests)
    answers: list[dict] = [{"failed": False, "stale": False, "hashes": [], "digests": []} for _ in parts]
    for rank, p in enumerate(parts):
        for name, state, dtype, shape in p["origin"]:
            hexes = merged.get((name, state))
            if not hexes:
                continue
            digests = {int(u): bytes.fromhex(d) for u, d in hexes.items()}
            h = fmt.units_hash(dtype, tuple(shape), digests)  # fmt.chunk_tree_hash of the array's layout
            if h is not None:
                answers[rank]["hashes"].append([name, state, h])
            else:  # the origin reads back only the units of the content hash that no box held whole
                answers[rank]["digests"].append([name, state, hexes])
    return answers


def _apply_hashes(writer, answer: dict) -> None:
    """The coordinator's hashes (or merged digests) of the arrays this rank is origin of, for ``finish_shards``."""
    for name, state, h in answer["hashes"]:
        writer.set_region_hash(name, state, h)
    for name, state, hexes in answer["digests"]:
        writer.set_chunk_digests(name, state, {int(u): bytes.fromhex(d) for u, d in hexes.items()})


def set_region_hashes(writer, parts: list[dict]) -> None:
    """Combine every rank's chunk digests into each array's content hash (no read-back of what was written).

    An array whose boxes did not fall on whole chunks on some rank (None) keeps the read-back hash."""
    from ucp_store.io import format as fmt

    merged: dict = {}
    for part in parts:
        for key, digests in part.items():
            if digests is None or merged.get(key, {}) is None:
                merged[key] = None
            else:
                merged.setdefault(key, {}).update(digests)
    for key, (_, _, layout, _) in writer.shards.sharded.items():
        digests = merged.get(key)
        if digests:
            h = fmt.chunk_tree_hash(layout, digests)
            if h is not None:
                writer.set_region_hash(key[0], key[1], h)
            else:  # the origin reads back only the units of the content hash that no box held whole
                writer.set_chunk_digests(key[0], key[1], digests)


def open_everywhere(store, create: bool, ctx: Ctx):
    """The store a save writes to. One rank: the opened store. Several: an opener that only the coordinator
    (group rank 0) calls, inside ``distributed_begin``; the other ranks never touch the catalog (they get
    the store's location and settings in begin's one broadcast)."""
    if ctx.dist is None:
        return resolve_store(store, create=create)
    return lambda: resolve_store(store, create=create)


def _stale_opener():
    raise StalePlanError("save: the state dict's layout changed on the coordinator since the cached plan; "
                         "planning afresh")


def save(state_dict: dict, *, store: Any = None, run: str, step: int, message: str | None = None,
         parent: str | None = "auto", group=None, progress: bool = True, create: bool = True, mesh=None,
         delta: str | None = "off", tier: str = "durable", **tiered: Any) -> str:
    """Save a (sharded) training state dict as ``run@step``; call on every rank. Returns the version id.

    ``state_dict`` is what ``get_state_dict(model, optimizer)`` returns (or any nested dict of DTensors,
    tensors and JSON values). Each rank writes only the boxes it owns; replicated data is written once.
    The version is committed only after every rank's arrays are durable; on an error anywhere every rank
    raises and nothing is listed. ``store`` is a URL, a folder or a ``Store`` (created if missing).

    Per-rank state: a plain tensor or value whose content differs across ranks (RNG states, dataloader
    positions), or that only some ranks hold, is stored per rank (once per distinct content), keyed by the
    rank and its coordinates in ``mesh`` (a ``DeviceMesh``; default: the mesh of the state dict's DTensors
    that spans every rank). Equal contents are stored once. ``load`` restores it by policy.

    ``delta="auto"`` publishes the version as deltas of its parent where they are small enough (each rank XORs
    its own boxes with the parent's, from memory when this process published the parent; keyframes and the
    size bound as ``Store.save(delta="auto")``); None takes the run's setting; ``"off"`` (default) stores every
    tensor-state in full. A puller then moves between versions reading only changed chunks (``ucp_store.pull``).

    ``tier="fast"`` (issue 38): each rank writes to its node's fast tier, the version is replicated to another
    node and drained to the store in the background; returns a ``TieredResult`` (the id, with ``safety`` and
    ``wait(level)``). Its options (``replicas``, ``node``, ``fast_tier``, ``fast_keep``, ``drain``, ...):
    ``ucp_store.distributed.tiered.save``."""
    if tier != "durable" or tiered:
        if tier != "fast" or delta != "off":
            raise ConfigurationError(f"tier={tier!r}: expected 'durable' (the store's location) or 'fast' (a node's "
                                     "fast tier, then replicated and drained; delta='off' only)")
        from ucp_store.distributed import tiered as tiered_save

        return tiered_save.save(state_dict, write=write_plan, store=store, run=run, step=step, message=message,
                                parent=parent, group=group, progress=progress, create=create, mesh=mesh, **tiered)
    check_mode(delta)
    wait()  # an async save in flight commits first
    ctx = Ctx(group)
    for _ in range(2):  # a cached plan that no longer holds is dropped on every rank: the second plans afresh
        plan = plan_save(state_dict, ctx, mesh, cache=True)
        st = open_everywhere(store, create, ctx)
        if plan.check is not None and not plan.check["key_ok"] and ctx.rank == 0:
            st = _stale_opener  # begin's broadcast tells every rank, before anyone writes
        staged = [host_copy(src[sl] if sl else src) for src, sl in plan.sources]
        try:
            return write_plan(st, plan, staged, ctx, run=run, step=step, message=message, parent=parent,
                              progress=progress, delta=delta)
        except StalePlanError:  # every rank raised it (the commit's check, or begin's broadcast)
            forget_plan(ctx)
            continue
    raise UcpError(f"save of {run}@{step}: planning did not settle")  # unreachable: a fresh plan is never checked
