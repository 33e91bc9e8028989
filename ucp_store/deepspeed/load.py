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
from typing import Any

import torch

from ucp_store.errors import ConfigurationError, ReferenceNotFound, UcpError

__all__ = ["load", "rng_state"]

_FLAT_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _optimizer_groups(engine):
    """(kind, lp groups, hp flat partitions, inner torch optimizer) of a DeepSpeed ZeRO / bf16 optimizer."""
    opt = engine.optimizer
    kind = type(opt).__name__
    if kind == "BF16_Optimizer":
        return kind, opt.bf16_groups, opt.fp32_groups_flat_partition, opt.optimizer
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
        return "zero3", opt.fp16_groups, opt.fp32_partitioned_groups_flat, opt.optimizer
    if hasattr(opt, "single_partition_of_fp32_groups"):
        return kind, opt.bit16_groups, opt.single_partition_of_fp32_groups, opt.optimizer
    raise ConfigurationError(f"ucp_store.deepspeed.load: engine optimizer {kind} is not a ZeRO (stage 1-3) or "
                             "bf16 optimizer")


def _names(engine) -> dict:
    names = getattr(engine.optimizer, "param_names", None)
    if names:
        return names
    return {p: n for n, p in engine.module.named_parameters()}


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
    ``per_rank`` policy matching ``rng``, else an error; see :func:`rng_state`)."""
    from ucp_store import open_store
    from ucp_store.deepspeed.engine import UcpCheckpointEngine, engine_topology
    from ucp_store.dtypes import torch_dtype
    from ucp_store.io.read import execute
    from ucp_store.plan.planner import plan as make_plan
    from ucp_store.safe_pickle import from_jsonable
    from ucp_store.topology import Topology

    ce = getattr(engine, "checkpoint_engine", None)
    if isinstance(ce, UcpCheckpointEngine):
        ce.wait()  # a background save of this engine must be durable before we read the store
        if store is None:
            store = ce.store
    if store is None:
        raise ConfigurationError(
            "ucp_store.deepspeed.load: give store= (no ucp engine is attached to this engine)")
    if isinstance(store, (str, os.PathLike)):
        store = open_store(os.fspath(store))
    ck = store.checkpoint(ref)
    objs = ck.objects()
    layout = objs.get("deepspeed/layout")
    if not isinstance(layout, dict):
        raise UcpError(f"{ref}: version {ck.id} holds no DeepSpeed checkpoint (no deepspeed/layout object); save it "
                       "through the ucp engine or `ucp import deepspeed`")
    # a version saved at any TP degree loads at any other: the planner cuts every rank's TP slices out of the
    # logical arrays by their patterns (column/row-parallel, replicated, averaged) before the ZeRO partitioning
    topo = topology if topology is not None else Topology(**engine_topology(engine))
    kind, lp_groups, hp_flats, inner = _optimizer_groups(engine)
    names = _names(engine)
    zero3 = kind == "zero3"
    import deepspeed.comm as dist

    from ucp_store.deepspeed.engine import _coords

    rank, _, _ = _coords(engine)
    from ucp_store.deepspeed.perrank import restore_client
    from ucp_store.deepspeed.perrank import topology as rank_topology

    # per-rank client state first: a missing policy raises before anything of the engine changes
    live = rank_topology(topo.tp, topo.pp, topo.dp)
    client = restore_client(objs, live, dist.get_rank(), per_rank, what=f"load {ref}")
    rng = rng_state(objs, live, dist.get_rank(), per_rank, what=f"load {ref}") if restore_rng else None
    zero_groups = {}
    for g, group in enumerate(lp_groups):
        for p in group:
            zero_groups[names[p]] = f"g{g}"
    records = ck.plan_records(topo, rank)
    stored = {i.name for i in records}
    present = {i.state for i in records}
    missing = sorted(n for n in zero_groups if n not in stored)
    if missing:
        raise ReferenceNotFound(f"{ref}: the engine's parameter(s) {missing[:5]} are not in version {ck.id} "
                                f"(stored: {sorted(stored)[:5]}...); is it the same model?")
    states = list(_FLAT_STATES) if load_optimizer_states else ["fp32"]
    wanted = [st for st in (*states, "weight", "step") if st in present]
    plan = make_plan(records, topo, rank, states=wanted, zero_groups=lambda n: zero_groups.get(n, "g_other"))
    by_key = {(b.group, b.state): b for b in plan.buffers}
    for g, hp in enumerate(hp_flats):
        for st in states:
            b = by_key.get((f"g{g}", st))
            if b is None:
                if hp.numel() == 0:
                    continue
                raise UcpError(f"{ref}: no {st} partition planned for parameter group {g}")
            if b.numel != hp.numel():
                raise UcpError(f"{ref}: parameter group {g} state {st}: the planned partition has {b.numel} "
                               f"elements, DeepSpeed's flat buffer {hp.numel()} (alignment or grouping differs)")
    # one state at a time, read straight into the optimizer's flat buffers where they are host fp32 (no
    # second copy of the optimizer state); a moment the optimizer has not created yet is the buffer read
    for st in states:
        into: dict[str, torch.Tensor] = {}
        after: list[tuple[int, Any, torch.Tensor | None]] = []
        for g, hp in enumerate(hp_flats):
            b = by_key.get((f"g{g}", st))
            if b is None:
                continue
            dst = hp.data if st == "fp32" else inner.state[hp].get(st)
            if (dst is not None and dst.device.type == "cpu" and dst.dtype == torch_dtype(b.dtype)
                    and dst.is_contiguous()):
                into[b.key] = dst
            else:
                after.append((g, b, dst))
        part = execute(ck, plan, only={(tp.name, tp.state) for tp in plan.tensors if tp.state == st},
                       infos=records, into=into)
        for g, b, dst in after:
            buf = part.buffers[b.key]
            hp = hp_flats[g]
            if dst is not None:
                dst.copy_(buf.to(dst.dtype).view_as(dst))
            else:
                inner.state[hp][st] = buf.to(device=hp.device, dtype=hp.dtype).view_as(hp)
        del part
    small = execute(ck, plan, only={(tp.name, tp.state) for tp in plan.tensors if tp.state in ("weight", "step")},
                    infos=records)
    for g, hp in enumerate(hp_flats):
        # the optimizer step: the same for every parameter of the group (DeepSpeed asserts it)
        if load_optimizer_states:
            step = None
            for p in lp_groups[g]:
                key = (names[p], "step")
                if key in small.tensors:
                    step = small.tensors[key]
                    break
            if step is not None:
                old = inner.state[hp].get("step")
                inner.state[hp]["step"] = (step.to(device=old.device, dtype=old.dtype).reshape(old.shape).clone()
                                           if isinstance(old, torch.Tensor) else step.clone())
    # param-group hyper-parameters (lr, betas, weight decay, ...) as load_universal restores them
    groups_saved = objs.get("param_groups")
    if load_optimizer_states and isinstance(groups_saved, list):
        saved = [from_jsonable(g_) for g_ in groups_saved]
        targets = inner.param_groups
        for i, pg in enumerate(targets):
            src = saved[0] if zero3 else (saved[i] if i < len(saved) else None)
            if src is None:
                continue
            for k, v in src.items():
                # hyper-parameters only: a group's identity (its name, e.g. MoE's ep_size_<ep>, and its moe
                # flag) is the live engine's, which may have another ep than the saving one
                if k not in ("params", "name", "moe"):
                    pg[k] = tuple(v) if isinstance(pg.get(k), tuple) and isinstance(v, list) else v
    opt = engine.optimizer
    scaler = objs.get("loss_scaler")
    if isinstance(scaler, dict) and hasattr(opt, "loss_scaler"):
        _restore_scaler(opt.loss_scaler, from_jsonable(scaler))
    # low-precision weights from the fp32 master
    if zero3:
        for sg in range(len(opt.fp32_partitioned_groups_flat)):
            fp32 = opt.fp32_partitioned_groups_flat[sg]
            if fp32.numel() > 0:
                opt.fp16_partitioned_groups_flat[sg].data.copy_(fp32.data)
        for sg in range(len(opt.fp16_partitioned_groups_flat)):
            updated = opt.unflatten(opt.fp16_partitioned_groups_flat[sg], opt.fp16_partitioned_groups[sg])
            for part, q in zip(opt.fp16_partitioned_groups[sg], updated):
                part.data = q.data
    else:
        opt.update_lp_params()
    # buffers and frozen parameters (whole tensors; ZeRO-3 frozen partitions stay as initialised)
    owned = set(zero_groups)
    with torch.no_grad():
        mod_params = dict(engine.module.named_parameters())
        mod_bufs = dict(engine.module.named_buffers())
        for (name, st), t in small.tensors.items():
            if st != "weight" or name in owned:
                continue
            dst = mod_bufs.get(name, mod_params.get(name))
            if dst is None or (zero3 and dst.numel() != t.numel()):
                continue
            dst.data.copy_(t.to(dst.dtype).view_as(dst))
    # engine counters, scheduler, client state
    if load_lr_scheduler_states and engine.lr_scheduler is not None and objs.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(from_jsonable(objs["lr_scheduler"]))
    for k in ("global_steps", "global_samples", "skipped_steps"):
        if objs.get(k) is not None:
            setattr(engine, k, int(objs[k]))
    if hasattr(engine, "loaded_checkpoint_dp_world_size"):
        engine.loaded_checkpoint_dp_world_size = int(layout.get("dp", 1))
    if rng is not None:
        torch.set_rng_state(rng)
    return from_jsonable(client)


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
