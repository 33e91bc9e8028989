"""Load a stored version straight into an initialised DeepSpeed engine of any DP / ZeRO / PP topology.

``load(engine, ref)`` is what DeepSpeed's ``load_checkpoint`` with ``load_universal`` does from a
``ds_to_universal`` folder, without the folder: every rank builds its :class:`~ucp_store.topology.Topology`
from the engine (pp, dp, ZeRO stage, layer-to-stage map, ZeRO alignment), asks ``load_shard`` for exactly
its ZeRO partition of the fp32 master and of every optimizer moment (the planner lays the flat group
buffers out as DeepSpeed does: record order, ``alignment * dp`` padding for ZeRO-1/2, ``ceil(numel/dp)``
per parameter for ZeRO-3), and copies them into the optimizer's flat buffers. Then, like DeepSpeed:
the step and the param-group hyper-parameters, the loss scaler, low-precision weights from the fp32
master (``update_lp_params`` / ZeRO-3 partitions), buffers and frozen weights, the LR scheduler,
``global_steps`` / ``global_samples`` / ``skipped_steps``; the client state is returned.

    import ucp_store.deepspeed as ucpds
    client_state = ucpds.load(engine, "llama@1000", store="/ckpt/store")
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ucp_store.errors import ConfigurationError, ReferenceNotFound, UcpError

__all__ = ["load", "rng_state", "optimizer_groups", "param_names", "OptimizerGroups"]

_FLAT_STATES = ("fp32", "exp_avg", "exp_avg_sq")


class OptimizerGroups(NamedTuple):
    """A DeepSpeed ZeRO / bf16 optimizer's parameter groups as the load fills them."""

    kind: str  #: the optimizer class name, or ``"zero3"``
    lp_groups: list  #: per group, the low-precision (module) parameters in flat order
    hp_flats: list  #: per group, this rank's fp32 flat partition (the optimizer's master buffer)
    inner: Any  #: the wrapped torch optimizer, which holds the moments and the step per flat buffer


def optimizer_groups(engine) -> OptimizerGroups:
    """The :class:`OptimizerGroups` of a DeepSpeed ZeRO (stage 1-3) or bf16 optimizer."""
    opt = engine.optimizer
    kind = type(opt).__name__
    if kind == "BF16_Optimizer":
        return OptimizerGroups(kind, opt.bf16_groups, opt.fp32_groups_flat_partition, opt.optimizer)
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
        return OptimizerGroups("zero3", opt.fp16_groups, opt.fp32_partitioned_groups_flat, opt.optimizer)
    if hasattr(opt, "single_partition_of_fp32_groups"):
        return OptimizerGroups(kind, opt.bit16_groups, opt.single_partition_of_fp32_groups, opt.optimizer)
    raise ConfigurationError(f"ucp_store.deepspeed.load: engine optimizer {kind} is not a ZeRO (stage 1-3) or "
                             "bf16 optimizer")


def param_names(engine) -> dict:
    """param -> name of an engine's parameters (the optimizer's ``param_names`` when it has them)."""
    names = getattr(engine.optimizer, "param_names", None)
    if names:
        return names
    return {p: n for n, p in engine.module.named_parameters()}


# ------------------------------------------------------------------------------------ phase records
@dataclass
class LoadSource:
    """The version being loaded: its reference, the opened checkpoint and its stored objects."""

    ref: str
    ck: Any  #: the store's Checkpoint of ``ref``
    objs: dict[str, Any]  #: the version's objects (``deepspeed/layout``, counters, client state, ...)
    layout: dict[str, Any]  #: ``deepspeed/layout``: the saving topology


@dataclass
class EngineTarget:
    """The live engine the version loads into: its topology, rank and optimizer groups."""

    engine: Any
    topo: Any  #: the engine's :class:`~ucp_store.topology.Topology`
    rank: int
    groups: OptimizerGroups
    names: dict  #: param -> name
    zero_groups: dict[str, str]  #: name of every optimizer-owned parameter -> its flat group ``g<i>``

    @property
    def zero3(self) -> bool:
        return self.groups.kind == "zero3"


@dataclass
class RankState:
    """What this rank restores besides tensors: its client state (jsonable) and, if asked, its RNG state."""

    client: Any
    rng: torch.Tensor | None


@dataclass
class ReadPlan:
    """What this rank reads: the planner's plan over the version's records, and the flat states it fills."""

    records: list  #: the version's tensor records at the engine's topology
    plan: Any  #: the planner's :class:`~ucp_store.plan.planner` plan for this rank
    states: list[str]  #: the flat optimizer states read into the groups (``fp32`` and, if asked, moments)
    by_key: dict[tuple[str, str], Any]  #: (group, state) -> the plan's flat buffer


# ------------------------------------------------------------------------------------------- load
def load(engine, ref: str, *, store=None, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
         restore_rng: bool = False, progress: bool = False, topology=None, per_rank: dict | None = None) -> dict:
    """Load ``ref`` (``run@step``, ``run@tag``, ``run`` = latest, or a version id) into ``engine``.

    ``store``: a ``Store`` or URL; default the store the engine's ucp checkpoint engine saves into.
    ``topology``: the engine's :class:`~ucp_store.topology.Topology` when ``engine_topology`` cannot tell it
    (an AutoEP engine's ``ep``: ``ucp_store.deepspeed.autoep.load_engine`` passes it).
    Returns the client state (what ``save_checkpoint(client_state=...)`` stored). Client-state keys saved per
    rank (values that differed across ranks) give each rank its own on the saving topology; on another one
    ``per_rank`` maps key patterns (``"client_state.sampler*"``) to policies as in ``ucp_store.distributed.load``
    (``"by-coordinate:dp"``, ``"rank0"``, ``"fresh"``, a reshard callable), and a key without one raises before
    the engine is touched (:mod:`ucp_store.deepspeed.perrank`). ``restore_rng=True`` restores the CPU RNG state the ucp
    engine saved per rank by the same rules (key ``rng``: each rank its own on the saving topology, else the
    ``per_rank`` policy matching ``rng``, else an error; see :func:`rng_state`).

    The phases: open the version, describe the engine, choose the per-rank state (which may refuse before
    the engine changes), plan the reads, read the flat optimizer states, then restore the rest."""
    from ucp_store.safe_pickle import from_jsonable

    src = _open_version(engine, ref, store)
    target = _engine_target(engine, topology)
    rank_state = _rank_state(src, target, per_rank, restore_rng)
    reads = _plan_reads(src, target, load_optimizer_states)
    _read_flat_states(src, target, reads)
    small = _read_small_tensors(src, reads)
    if load_optimizer_states:
        _restore_steps(target, small)
        _restore_param_groups(src.objs, target)
    _restore_low_precision(engine, src.objs, target.zero3)
    _restore_module_tensors(engine, small, set(target.zero_groups), target.zero3)
    _restore_engine_counters(engine, src, load_lr_scheduler_states)
    if rank_state.rng is not None:
        torch.set_rng_state(rank_state.rng)
    return from_jsonable(rank_state.client)


def _open_version(engine, ref: str, store) -> LoadSource:
    """Open ``ref`` in ``store`` (default: the store the engine's ucp checkpoint engine saves into), after
    that engine's background save is durable; refuse a version without a DeepSpeed layout.

    Over several ranks only the coordinator (rank 0) opens the store and reads the version's rows and objects;
    the others get them in one broadcast (``coord.version_everywhere``) and never touch the catalog."""
    from ucp_store.deepspeed.engine import UcpCheckpointEngine

    ce = getattr(engine, "checkpoint_engine", None)
    if isinstance(ce, UcpCheckpointEngine):
        ce.wait()  # a background save of this engine must be durable before we read the store
        if store is None:
            store = ce.store
    if store is None:
        raise ConfigurationError(
            "ucp_store.deepspeed.load: give store= (no ucp engine is attached to this engine)")
    ck, objs = open_version_everywhere(store, ref, f"load of {ref}")
    layout = objs.get("deepspeed/layout")
    if not isinstance(layout, dict):
        raise UcpError(f"{ref}: version {ck.id} holds no DeepSpeed checkpoint (no deepspeed/layout object); save it "
                       "through the ucp engine or `ucp import deepspeed`")
    return LoadSource(ref, ck, objs, layout)


def open_version_everywhere(store, ref: str, what: str) -> tuple[Any, dict[str, Any]]:
    """``(checkpoint, objects)`` of ``ref`` in ``store`` (a ``Store`` or URL) on every rank. One process:
    opened here. Several (``torch.distributed`` initialised): a collective of every rank, on the bounded
    gloo control group, in which rank 0 alone opens the store and reads the catalog; the other ranks get
    the rows and objects in one broadcast of JSON bytes and read arrays through a store without a catalog
    (their ``store`` is not opened: it may be the detached store an attached engine holds there)."""
    import torch.distributed as tdist

    def open_version():
        from ucp_store import open_store

        st = open_store(os.fspath(store)) if isinstance(store, (str, os.PathLike)) else store
        return st.checkpoint(ref)

    if not (tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1):
        ck = open_version()
        return ck, ck.objects()
    from ucp_store.distributed import coord
    from ucp_store.distributed.commit import control_group

    return coord.version_everywhere(open_version, control_group(), what)


def _engine_target(engine, topology) -> EngineTarget:
    """The engine's topology (``topology`` when given), rank, optimizer groups and parameter names."""
    import deepspeed.comm as dist

    from ucp_store.deepspeed.engine import engine_topology
    from ucp_store.topology import Topology

    # a version saved at any TP degree loads at any other: the planner cuts every rank's TP slices out of the
    # logical arrays by their patterns (column/row-parallel, replicated, averaged) before the ZeRO partitioning
    topo = topology if topology is not None else Topology(**engine_topology(engine))
    groups = optimizer_groups(engine)
    names = param_names(engine)
    zero_groups = {names[p]: f"g{g}" for g, group in enumerate(groups.lp_groups) for p in group}
    return EngineTarget(engine, topo, dist.get_rank(), groups, names, zero_groups)


def _rank_state(src: LoadSource, target: EngineTarget, per_rank: dict | None, restore_rng: bool) -> RankState:
    """This rank's client state and RNG state, chosen first: a missing per-rank policy raises before anything
    of the engine changes."""
    from ucp_store.deepspeed.perrank import restore_client
    from ucp_store.deepspeed.perrank import topology as rank_topology

    topo, what = target.topo, f"load {src.ref}"
    live = rank_topology(topo.tp, topo.pp, topo.dp)
    client = restore_client(src.objs, live, target.rank, per_rank, what=what)
    rng = rng_state(src.objs, live, target.rank, per_rank, what=what) if restore_rng else None
    return RankState(client, rng)


def _plan_reads(src: LoadSource, target: EngineTarget, load_optimizer_states: bool) -> ReadPlan:
    """Plan this rank's reads: every engine parameter must be stored, and every flat group's planned
    partition must have the size of DeepSpeed's flat buffer."""
    from ucp_store.plan.planner import plan as make_plan

    ref, ck, zero_groups = src.ref, src.ck, target.zero_groups
    records = ck.plan_records(target.topo, target.rank)
    stored = {i.name for i in records}
    present = {i.state for i in records}
    missing = sorted(n for n in zero_groups if n not in stored)
    if missing:
        raise ReferenceNotFound(f"{ref}: the engine's parameter(s) {missing[:5]} are not in version {ck.id} "
                                f"(stored: {sorted(stored)[:5]}...); is it the same model?")
    states = list(_FLAT_STATES) if load_optimizer_states else ["fp32"]
    wanted = [st for st in (*states, "weight", "step") if st in present]
    plan = make_plan(records, target.topo, target.rank, states=wanted,
                     zero_groups=lambda n: zero_groups.get(n, "g_other"))
    by_key = {(b.group, b.state): b for b in plan.buffers}
    for g, hp in enumerate(target.groups.hp_flats):
        for st in states:
            b = by_key.get((f"g{g}", st))
            if b is None:
                if hp.numel() == 0:
                    continue
                raise UcpError(f"{ref}: no {st} partition planned for parameter group {g}")
            if b.numel != hp.numel():
                raise UcpError(f"{ref}: parameter group {g} state {st}: the planned partition has {b.numel} "
                               f"elements, DeepSpeed's flat buffer {hp.numel()} (alignment or grouping differs)")
    return ReadPlan(records, plan, states, by_key)


def _read_flat_states(src: LoadSource, target: EngineTarget, reads: ReadPlan) -> None:
    """Read the flat states one at a time, straight into the optimizer's flat buffers where they are host
    fp32 (no second copy of the optimizer state); a moment the optimizer has not created yet is the buffer
    read."""
    from ucp_store.dtypes import torch_dtype
    from ucp_store.io.read import execute

    hp_flats, inner = target.groups.hp_flats, target.groups.inner
    for st in reads.states:
        into: dict[str, torch.Tensor] = {}
        after: list[tuple[int, Any, torch.Tensor | None]] = []
        for g, hp in enumerate(hp_flats):
            b = reads.by_key.get((f"g{g}", st))
            if b is None:
                continue
            dst = hp.data if st == "fp32" else inner.state[hp].get(st)
            if (dst is not None and dst.device.type == "cpu" and dst.dtype == torch_dtype(b.dtype)
                    and dst.is_contiguous()):
                into[b.key] = dst
            else:
                after.append((g, b, dst))
        part = execute(src.ck, reads.plan, only={(tp.name, tp.state) for tp in reads.plan.tensors if tp.state == st},
                       infos=reads.records, into=into)
        for g, b, dst in after:
            buf = part.buffers[b.key]
            hp = hp_flats[g]
            if dst is not None:
                dst.copy_(buf.to(dst.dtype).view_as(dst))
            else:
                inner.state[hp][st] = buf.to(device=hp.device, dtype=hp.dtype).view_as(hp)
        del part


def _read_small_tensors(src: LoadSource, reads: ReadPlan) -> dict[tuple[str, str], torch.Tensor]:
    """The whole tensors besides the flat states: (name, state) -> weights (buffers, frozen parameters) and
    optimizer steps."""
    from ucp_store.io.read import execute

    plan = reads.plan
    small = execute(src.ck, plan, only={(tp.name, tp.state) for tp in plan.tensors if tp.state in ("weight", "step")},
                    infos=reads.records)
    return small.tensors


def _restore_steps(target: EngineTarget, small: dict[tuple[str, str], torch.Tensor]) -> None:
    """The optimizer step of every group: the same for every parameter of the group (DeepSpeed asserts it),
    so the first stored one."""
    groups, names = target.groups, target.names
    for g, hp in enumerate(groups.hp_flats):
        step = None
        for p in groups.lp_groups[g]:
            key = (names[p], "step")
            if key in small:
                step = small[key]
                break
        if step is not None:
            old = groups.inner.state[hp].get("step")
            groups.inner.state[hp]["step"] = (step.to(device=old.device, dtype=old.dtype).reshape(old.shape).clone()
                                              if isinstance(old, torch.Tensor) else step.clone())


def _restore_param_groups(objs: dict[str, Any], target: EngineTarget) -> None:
    """Param-group hyper-parameters (lr, betas, weight decay, ...) as load_universal restores them."""
    from ucp_store.safe_pickle import from_jsonable

    groups_saved = objs.get("param_groups")
    if not isinstance(groups_saved, list):
        return
    saved = [from_jsonable(g_) for g_ in groups_saved]
    for i, pg in enumerate(target.groups.inner.param_groups):
        src = saved[0] if target.zero3 else (saved[i] if i < len(saved) else None)
        if src is None:
            continue
        for k, v in src.items():
            # hyper-parameters only: a group's identity (its name, e.g. MoE's ep_size_<ep>, and its moe
            # flag) is the live engine's, which may have another ep than the saving one
            if k not in ("params", "name", "moe"):
                pg[k] = tuple(v) if isinstance(pg.get(k), tuple) and isinstance(v, list) else v


def _restore_low_precision(engine, objs: dict[str, Any], zero3: bool) -> None:
    """The loss scaler's state, then the low-precision weights from the fp32 master (``update_lp_params``,
    or ZeRO-3's partitions)."""
    from ucp_store.safe_pickle import from_jsonable

    opt = engine.optimizer
    scaler = objs.get("loss_scaler")
    if isinstance(scaler, dict) and hasattr(opt, "loss_scaler"):
        _restore_scaler(opt.loss_scaler, from_jsonable(scaler))
    if not zero3:
        opt.update_lp_params()
        return
    for sg in range(len(opt.fp32_partitioned_groups_flat)):
        fp32 = opt.fp32_partitioned_groups_flat[sg]
        if fp32.numel() > 0:
            opt.fp16_partitioned_groups_flat[sg].data.copy_(fp32.data)
    for sg in range(len(opt.fp16_partitioned_groups_flat)):
        updated = opt.unflatten(opt.fp16_partitioned_groups_flat[sg], opt.fp16_partitioned_groups[sg])
        for part, q in zip(opt.fp16_partitioned_groups[sg], updated):
            part.data = q.data


def _restore_module_tensors(engine, small: dict[tuple[str, str], torch.Tensor], owned: set[str],
                            zero3: bool) -> None:
    """Buffers and frozen parameters (whole tensors; ZeRO-3 frozen partitions stay as initialised)."""
    with torch.no_grad():
        mod_params = dict(engine.module.named_parameters())
        mod_bufs = dict(engine.module.named_buffers())
        for (name, st), t in small.items():
            if st != "weight" or name in owned:
                continue
            dst = mod_bufs.get(name, mod_params.get(name))
            if dst is None or (zero3 and dst.numel() != t.numel()):
                continue
            dst.data.copy_(t.to(dst.dtype).view_as(dst))


def _restore_engine_counters(engine, src: LoadSource, load_lr_scheduler_states: bool) -> None:
    """The LR scheduler, ``global_steps`` / ``global_samples`` / ``skipped_steps`` and the saving DP size."""
    from ucp_store.safe_pickle import from_jsonable

    objs = src.objs
    if load_lr_scheduler_states and engine.lr_scheduler is not None and objs.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(from_jsonable(objs["lr_scheduler"]))
    for k in ("global_steps", "global_samples", "skipped_steps"):
        if objs.get(k) is not None:
            setattr(engine, k, int(objs[k]))
    if hasattr(engine, "loaded_checkpoint_dp_world_size"):
        engine.loaded_checkpoint_dp_world_size = int(src.layout.get("dp", 1))


def rng_state(objs, live, rank: int, per_rank: dict | None, *, what: str):
    """The CPU RNG state (a uint8 tensor) loading rank ``rank`` of topology ``live`` restores, or None under
    a ``fresh`` policy. The engine saved one state per global rank (``deepspeed/rng``) on the topology of
    ``deepspeed/layout``; they are chosen like any per-rank key (path ``rng``): on the saving topology each
    rank its own, on another the ``per_rank`` policy matching ``rng``. Raises ``ConfigurationError`` naming
    the key and both topologies when none fits, and when the version holds no RNG state at all."""
    import base64

    import numpy as np

    from ucp_store.deepspeed.perrank import topology as rank_topology
    from ucp_store.distributed.perrank import parse_policies
    from ucp_store.distributed.rankstate import (
        PerRankEntry,
        PerRankKey,
        RankTarget,
        SavedRankState,
        choose_source,
        policy_for,
        same,
    )

    saved_states = (objs.get("deepspeed/rng") or {}).get("torch_cpu") or {}
    layout = objs.get("deepspeed/layout") or {}
    if not saved_states:
        raise ConfigurationError(f"{what}: restore_rng=True, but the version holds no RNG state (deepspeed/rng; "
                                 "only the ucp checkpoint engine records it); pass restore_rng=False")
    saved = rank_topology(int(layout.get("tp", 1)), int(layout.get("pp", 1)), int(layout.get("dp", 1)))
    key = PerRankKey(("rng",), tuple(PerRankEntry(int(r), "value", str(r)) for r in sorted(saved_states, key=int)))
    found = policy_for(key.path, parse_policies(per_rank))
    policy = found[1] if found is not None else same()

    def decode(b64: str):
        return torch.from_numpy(np.frombuffer(base64.b64decode(b64), dtype=np.uint8).copy())

    if policy.kind == "fresh":
        return None
    if policy.kind == "reshard":
        assert policy.fn is not None
        states = [SavedRankState(e.rank, saved.coords(e.rank), key.path, decode(saved_states[e.object]))
                  for e in key.entries]
        out = policy.fn(states, RankTarget(rank, live.coords(rank), key.path, live.world, live, saved))
        return out if isinstance(out, torch.Tensor) else torch.as_tensor(out, dtype=torch.uint8)
    try:
        src = choose_source(policy, key, saved, live, rank)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{what}: the RNG state (per-rank key 'rng') saved on {saved.describe()} cannot be "
                                 f"restored on {live.describe()} (rank {rank}): {exc}; pass per_rank={{'rng': "
                                 "'by-coordinate:<dims>' | 'rank0' | 'fresh' | fn}} or restore_rng=False") from None
    return decode(saved_states[str(src)])


def _restore_scaler(scaler: Any, saved: Any) -> None:
    """Copy the saved loss scaler's numeric state (cur_scale, cur_iter, ...) onto the live one."""
    state = saved if isinstance(saved, dict) else getattr(saved, "__dict__", {})
    if isinstance(state, dict) and "state" in state and isinstance(state["state"], dict):
        state = state["state"]
    for k, v in (state or {}).items():
        if hasattr(scaler, k) and isinstance(v, (int, float, bool)):
            setattr(scaler, k, v)
