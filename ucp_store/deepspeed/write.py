"""One rank's share of a DeepSpeed save, written straight into the store (used by ``ds_engine``).

``write_rank_share`` turns the state dicts DeepSpeed handed to :class:`~ucp_store.deepspeed.engine.UcpCheckpointEngine`
(the rank's ``*_optim_states.pt`` dict, and where DeepSpeed would write them its model-state and pipeline
layer dicts) into ``write_shard`` calls on the logical arrays, with the file importer's names, states,
patterns, positions and objects, so that the version equals ``ucp import deepspeed`` of the files.

Ranks exchange metadata only (parameter names, shapes, fragment addresses), never tensors, as JSON bytes
(``coord.to_wire``; never a pickle) through rank 0: a gather and a broadcast to plan (``commit.agree``), a
gather and a scatter to agree (``commit.settle``). A save runs in phases that hand each other the records of
:mod:`ucp_store.deepspeed.write_plan`:

1. *stage*: the staged state dicts sorted by file (:class:`StagedFiles`), this rank's :class:`RankPart`;
2. *plan*: every rank's part (gathered to rank 0, broadcast back), the global :class:`SavePlan` (and at TP > 1
   its ``TPPlan``);
3. *begin*: the writer (all ranks join one pending checkpoint);
4. *write*: every fragment this rank holds (:class:`_ShareWriter`, its findings a :class:`ShareResult`);
5. *agree*: every rank's :class:`RankReport` gathered to rank 0 (outcome, metadata, chunk digests), each rank's
   outcome and chunk digests scattered back;
6. *objects*: the low-precision weights that are not the fp32 master cast down (rare), rank 0's objects;
7. *commit*: durable, then committed (:class:`PendingCommit`, which the caller may run later, on a thread).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ucp_store import safe_pickle as sp
from ucp_store.deepspeed.files import SHARDED_KEYS, UCI
from ucp_store.deepspeed.merge import UniversalInfo, with_placement
from ucp_store.deepspeed.reader import DeepSpeedReader, lp_dtype, step_value
from ucp_store.deepspeed.write_plan import (
    FrozenSpec,
    ParamSpec,
    RankPart,
    RankReport,
    RankSnapshot,
    SavePlan,
    SaveTarget,
    ShareResult,
    StagedFiles,
    dtype_name,
    numel,
)
from ucp_store.deepspeed.write_tp import TPPlan
from ucp_store.errors import SourceFormatError, UcpError
from ucp_store.patterns import Fragment
from ucp_store.topology import Topology

__all__ = ["PendingCommit", "write_rank_share"]


class _MemReader(DeepSpeedReader):
    """The file importer's ``objects()`` over in-memory state dicts (no folder, no files)."""

    def __init__(self, model_states: dict[str, dict], optim: dict, *, zero_stage: int, pp: int, dp: int, prefix: str,
                 optim_files: list[str], layer_files: list[str], params: list[dict], frozen: dict, buffers: list,
                 tp: int = 1, notes: list[str] | None = None):
        self.tag_dir = "<ucp engine>"
        self.lp_weights = "auto"
        self.notes = list(notes or [])
        self.model_states = model_states
        self._optim0 = optim
        self.zero_stage, self.tp, self.pp, self.dp, self.prefix = zero_stage, tp, pp, dp, prefix
        first = model_states[next(iter(model_states))]
        self.ds_config = first.get("ds_config") if isinstance(first.get("ds_config"), dict) else {}
        self.lp_dtype = lp_dtype(self.ds_config)
        self.ds_version = None if first.get("ds_version") is None else str(first.get("ds_version"))
        self.global_steps = first.get("global_steps")
        self.uci = first.get(UCI) if isinstance(first.get(UCI), dict) else None
        self.info = UniversalInfo(self.uci, tp)
        self.optim_files = {(0, i): f for i, f in enumerate(optim_files)}
        self.layer_files = {(i, 0): f for i, f in enumerate(layer_files)}
        self.params, self.frozen, self.buffers = params, frozen, buffers

    def _optim(self, key):
        sd = self._optim0
        osd = {k: (v if k in SHARDED_KEYS else _standins(v)) for k, v in sd["optimizer_state_dict"].items()}
        return {**sd, "optimizer_state_dict": osd}


def _standins(obj: Any) -> Any:
    """Live DeepSpeed objects (``LossScaler``, ...) as the allow-list stand-ins the file importer gets from the
    unpickler, so that both encode to the same JSON. Tensors and plain values pass through untouched."""
    if isinstance(obj, (torch.Tensor, str, int, float, bool, type(None))):
        return obj
    if isinstance(obj, dict):
        return type(obj)((k, _standins(v)) for k, v in obj.items()) if type(obj) is dict else \
            {k: _standins(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_standins(v) for v in obj)
    stand = sp.allowed_globals().get(f"{type(obj).__module__}.{type(obj).__qualname__}")
    if isinstance(stand, type) and issubclass(stand, sp.StandIn) and hasattr(obj, "__dict__"):
        out = stand.__new__(stand)
        out.__setstate__(obj.__getstate__() if hasattr(type(obj), "__getstate__") and
                         type(obj).__getstate__ is not object.__getstate__ else dict(vars(obj)))
        return out
    return obj


def _file_record(sd: dict, fname: str, notes: list) -> dict:
    """The per-file JSON record ``DeepSpeedReader.objects`` stores under ``deepspeed/model_states/<file>``."""
    rec = {}
    for k, v in sd.items():
        if k in ("module", "frozen_param_fragments"):
            rec[k] = None if v is None else {"__ucp_module__": [
                [n, dtype_name(t.dtype), list(t.shape)] for n, t in v.items()]}
        else:
            rec[k] = sp.to_jsonable(v, notes=notes, where=f"{fname}:{k}")
    return rec


def write_rank_share(target: SaveTarget, staged: dict[str, Any], snap: RankSnapshot) -> PendingCommit:
    """Write this rank's share of one ``save_checkpoint`` and agree on it with the other ranks; returns the
    commit still to run (a collective: every rank calls it, at once or later on any thread, and gets the id).

    When this returns, every byte of the save is written (in the page cache) and the ranks agreed on it; the
    live engine state (``staged``, ``snap.lp``) is not read after that."""
    t0 = time.time()
    tp0 = time.perf_counter()  # every phase in target.stats is seconds since here (cumulative)
    topo = Topology(**dict(snap.topo))
    files = StagedFiles.classify(staged)
    plan = _plan(_exchange(target.group, _local_part(snap, files, topo.zero_stage)), topo)
    writer = _begin(target, snap, files, plan, tp0)
    share = _ShareWriter(target, writer, plan, files, snap, tp0)
    error = share.run()
    multi = target.group is not None
    if error is not None and not multi:
        writer.abort()
        raise error
    # the fsync pass over all of it runs on a thread from here, beside the agreement, weights and objects
    syncing = writer.make_durable_async() if error is None else None
    agreed = _agree(target, writer, share, files, snap, error, tp0)
    # TP slices of low-precision weights may cut shard files too: one more exchange, on every rank alike (the
    # agreement gave all of them the same findings)
    lp_exchange = multi and bool(agreed.lp_differs) and plan.tp is not None
    if lp_exchange:
        writer.hold_straddling()
    try:
        _write_lp_weights(writer, plan, snap, agreed.lp_differs)
    except BaseException as exc:  # noqa: BLE001 - every rank learns of it in the commit
        error = exc
    if lp_exchange:
        from ucp_store.distributed.commit import exchange_straddling

        error = exchange_straddling(writer, target.group, error)
    try:
        if error is not None:
            raise error
        if snap.rank == 0:
            _write_objects(target, writer, plan, files, agreed.reports, t0)
        writer.drain()  # the low-precision weights are live module state: written before returning
    except BaseException as exc:  # noqa: BLE001 - every rank learns of it in the commit
        error = exc
    target.stats["objects_s"] = time.perf_counter() - tp0
    return PendingCommit(writer, target.group, target.stats, tp0, syncing, error)


# ------------------------------------------------------------------------- phases 1-2: stage, plan
def _local_part(snap: RankSnapshot, files: StagedFiles, zero: int) -> RankPart:
    """What this rank tells the others about its share (the metadata of its files, no tensors)."""
    model_sd, osd = files.model_sd, files.osd
    param_shapes = None if model_sd is None else [[(n, tuple(int(x) for x in s)) for n, s in g.items()]
                                                  for g in (model_sd.get("param_shapes") or [])]
    weights = None
    if snap.dp_rank == 0 and zero < 3:  # the whole weights this rank would send at TP > 1 (frozen parameters, buffers)
        owned = {n for g in (param_shapes or []) for n, _ in g}
        weights = [(n, dtype_name(t.dtype), tuple(int(x) for x in t.shape))
                   for n, t in files.module().items() if n not in owned]
    # what a TP save needs besides: the model's universal_checkpoint_info, each group's flat states (name,
    # dtype) and optimizer step, and the dtype of the low-precision module weights
    flat: list | None = None
    gsteps: list | None = None
    if zero < 3:
        flat, gsteps = [], []
        for g in range(len(osd["param_slice_mappings"])):
            f, st = files.flat_states(g)
            flat.append([(k, dtype_name(v.dtype)) for k, v in f.items()])
            gsteps.append(st)
    lp = next(iter(snap.lp.values()), None)
    return RankPart(
        rank=snap.rank, stage=snap.stage, dp=snap.dp_rank, tp=int(snap.tp_rank), optim_file=files.optim_name,
        layer_files=files.layer_names, model_file=files.model_name, param_shapes=param_shapes,
        frozen_shapes=None if model_sd is None else [(n, tuple(int(x) for x in s)) for n, s in
                                                     (model_sd.get("frozen_param_shapes") or {}).items()],
        buffers=None if model_sd is None else list(model_sd.get("buffer_names") or []),
        uci=model_sd is not None and bool(UniversalInfo(model_sd.get(UCI) if isinstance(model_sd.get(UCI), dict)
                                                        else None, 1).has_patterns),
        mappings=None if zero >= 3 else [{n: (int(a.start), int(a.numel)) for n, a in g.items()}
                                         for g in osd["param_slice_mappings"]],
        uci_raw=None if model_sd is None or not isinstance(model_sd.get(UCI), dict) else _standins(model_sd[UCI]),
        flat=flat, gsteps=gsteps, lp_dtype=None if lp is None else dtype_name(lp.dtype),
        weights=weights)


def _exchange(group: Any, local: RankPart) -> list[RankPart]:
    """Every rank's part, by rank: one gather of JSON bytes to rank 0 and one broadcast of them all
    (``commit.agree``; every rank plans the whole save: a fragment's offset is what the lower DP ranks hold).
    Never a pickle."""
    if group is None:
        return [local]
    from ucp_store.distributed.commit import agree

    return [_part_from_wire(d) for d in agree(_part_to_wire(local), lambda parts: parts, group)]


def _part_to_wire(part: RankPart) -> dict:
    from ucp_store.distributed import coord

    return {f.name: coord.to_wire(getattr(part, f.name), f"rank {part.rank}'s save part: {f.name}")
            for f in dataclasses.fields(RankPart)}


def _part_from_wire(data: dict) -> RankPart:
    from ucp_store.distributed import coord

    return RankPart(**{k: coord.from_wire(v) for k, v in data.items()})


def _plan(parts: list[RankPart], topo: Topology) -> SavePlan:
    """The global plan from every rank's part, alike on every rank (the file importer's ``_plan``)."""
    tpx = TPPlan(parts, topo) if topo.tp > 1 or any(p.uci for p in parts) else None
    by_stage: dict[int, RankPart] = {}
    for p in sorted(parts, key=lambda p: (p.stage, p.tp, p.dp)):
        if p.param_shapes is not None:
            by_stage.setdefault(p.stage, p)
    if sorted(by_stage) != list(range(topo.pp)):
        raise UcpError(f"no model states for pipeline stages {sorted(set(range(topo.pp)) - set(by_stage))}")
    params: list[ParamSpec] = []
    seen: dict[str, int] = {}
    stages_of: dict[str, list[int]] = {}
    for pp in range(topo.pp):
        for g, group_shapes in enumerate(by_stage[pp].param_shapes or []):
            for name, shape in group_shapes:
                stages_of.setdefault(name, []).append(pp)
                if name in seen:
                    continue  # tied across pipeline stages: stored once (first stage)
                seen[name] = len(params)
                params.append(ParamSpec(name=name, stage=pp, group=g, shape=shape))
    frozen: dict[str, FrozenSpec] = {}
    buffers: list[str] = []
    for pp in range(topo.pp):
        for name, shape in by_stage[pp].frozen_shapes or []:
            if name not in frozen and name not in seen:
                frozen[name] = FrozenSpec(stage=pp, shape=shape)
        for b in by_stage[pp].buffers or []:
            if b not in buffers:
                buffers.append(b)
    piped = bool(topo.layers) or any(p.layer_files for p in parts)
    if tpx is not None:
        tpx.plan(params, buffers, stages_of, piped)
    everything = list(dict.fromkeys([p.name for p in params] + list(frozen) + buffers))
    return SavePlan(topo=topo, parts=parts, by_stage=by_stage, params=params, seen=seen, stages_of=stages_of,
                    frozen=frozen, buffers=buffers, piped=piped, position={n: i for i, n in enumerate(everything)},
                    tp=tpx)


# ------------------------------------------------------------------------- phase 3: begin
def _begin(target: SaveTarget, snap: RankSnapshot, files: StagedFiles, plan: SavePlan, tp0: float):
    """Every rank joins one pending checkpoint (``distributed_begin``; a plain ``begin`` in one process)."""
    from ucp_store.distributed.commit import distributed_begin

    topo = plan.topo
    zero = topo.zero_stage
    ds_version = None if files.model_sd is None else files.model_sd.get("ds_version")
    world = len(plan.parts)
    prov = {"source_kind": "deepspeed", "source_path": f"ucp-engine:{target.tag or ''}",
            "source_topology": {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "zero_stage": zero},
            "library_versions": {"deepspeed": str(ds_version or "")},
            "extra": {"zero_stage": zero, "direct": True, "ranks": world, "tag": target.tag}}
    msg = target.message or f"DeepSpeed save_checkpoint (tag {target.tag}) through the ucp engine"
    step = int(snap.step)
    target.stats["gather_s"] = time.perf_counter() - tp0
    if target.group is not None:
        writer = distributed_begin(target.store, target.run, step, group=target.group, parent="auto", message=msg,
                                   provenance=prov)
    else:
        writer = target.store.begin(target.run, step, parent="auto", message=msg, provenance=prov)
    # no fsync per file: every rank makes all it wrote durable in one parallel pass (flush, before agreeing)
    writer.defer_durability()
    target.stats["begin_s"] = time.perf_counter() - tp0
    return writer


# ------------------------------------------------------------------------- phase 4: write
class _ShareWriter:
    """The write phase: every fragment of every parameter-state this rank holds, opened at once
    (``open_shards``) and written through ``write_shard``; at TP > 1 the gathered parameters merged on their
    stage's first rank; the whole weights from DP rank 0 of each stage. Its findings go to ``result``."""

    def __init__(self, target: SaveTarget, writer, plan: SavePlan, files: StagedFiles, snap: RankSnapshot,
                 tp0: float):
        self.target, self.writer, self.plan, self.files, self.snap, self.tp0 = target, writer, plan, files, snap, tp0
        self.result = ShareResult()
        # (name, state, local tensor, logical shape, pattern, fragment, position): written by write_pending
        self.pending: list[tuple] = []
        # (name, flat fp32, start, n, low-precision weight, k): compared after submitting (check_lp)
        self.lp_checks: list[tuple] = []

    def run(self) -> BaseException | None:
        """Write it all and wait for the writes; returns the failure (every rank must learn of it), if any."""
        stats = self.target.stats
        error: BaseException | None = None
        try:
            self._write_all()
        except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
            error = exc
        if self.target.group is not None:  # every rank: the shard files its fragments only cut, to one writer each
            from ucp_store.distributed.commit import exchange_straddling

            try:
                error = exchange_straddling(self.writer, self.target.group, error)
            except BaseException as exc:  # noqa: BLE001
                error = exc
        if error is not None:
            return error
        try:
            stats["submit_s"] = time.perf_counter() - self.tp0
            self.writer.drain()  # every array write of this rank has returned (its bytes are in the page cache)
            stats["writes_s"] = time.perf_counter() - self.tp0
        except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
            return exc
        return None

    def _write_all(self) -> None:
        plan, snap, tpx = self.plan, self.snap, self.plan.tp
        mine = [p for p in plan.params if p.stage == snap.stage]
        if tpx is not None:  # TP > 1 or universal_checkpoint_info patterns: merged by the importer's rules
            tpx.gather_merge_write(self.target.group, self.writer, self.files, snap, plan.position, self.result)
            mine = [p for p in mine if p.name in tpx.direct]
        if plan.topo.zero_stage < 3:
            before = [p for p in plan.parts if p.stage == snap.stage and p.dp < snap.dp_rank and p.tp == snap.tp_rank]
            for spec in self._track(mine):
                self._zero12_param(spec, before)
        else:
            inner = self.files.osd["optimizer_state_dict"].get("state", {})
            sg_offsets: dict[tuple[int, str], int] = {}
            for sg, group_shapes in enumerate(plan.by_stage[snap.stage].param_shapes or []):
                off = 0
                for name, shape in group_shapes:
                    sg_offsets[(sg, name)] = off
                    off += math.ceil(numel(shape) / plan.topo.dp)
            for spec in self._track(mine):
                self._zero3_param(spec, inner, sg_offsets[(spec.group, spec.name)])
            self._zero3_frozen()
        self._write_pending()
        self._check_lp()
        self._whole_weights()

    def _track(self, specs: list[ParamSpec]):
        from ucp_store.progress import track

        show = self.target.progress and self.snap.rank == 0
        return track(specs, f"save {self.target.run}@{self.snap.step}", enabled=show)

    def _shard(self, name, state, local_t, shape, pattern, frag, pos) -> None:
        self.pending.append((name, state, local_t, shape, pattern, frag, pos))

    def _zero12_param(self, spec: ParamSpec, before: list[RankPart]) -> None:
        """ZeRO-1/2: this rank's fragment of every flat state of ``spec``; ``before``: the parts of the lower DP
        ranks of this stage and TP rank (the fragment's offset in the parameter is the elements they hold)."""
        plan, files, res, tpx = self.plan, self.files, self.result, self.plan.tp
        name, g, shape = spec.name, spec.group, spec.shape
        maps = files.osd["param_slice_mappings"]
        addr = maps[g].get(name) if g < len(maps) else None
        res.kinds[name] = "param"
        res.metas[name] = {"cat_dim": 0} if tpx is None else tpx.direct[name][1]
        if addr is None:
            return
        start, n = int(addr.start), int(addr.numel)
        k = sum(m[1] for q in before if (m := q.mapping(g, name)) is not None)
        flat, st = files.flat_states(g)
        frag = Fragment(k, k + n, start, n)
        pattern = with_placement(None if tpx is None else tpx.direct[name][0], plan.placement(name))
        base = plan.position[name] * 16
        for j, (state, t) in enumerate(flat.items()):
            if start + n > t.numel():
                raise SourceFormatError(f"{files.optim_name}: fragment of {name!r} [{start}, {start + n}) lies "
                                        f"outside the flat {state} partition ({t.numel()} elements)")
            self._shard(name, state, t.narrow(0, start, n), shape, pattern, frag, base + j)
        step_t, typ = step_value(st)
        if typ is not None:
            res.steps[name] = typ
            if k == 0 and self.snap.tp_rank == 0:
                self.writer.write(name, "step", step_t.cpu(), pattern=with_placement(None, plan.placement(name)),
                                  position=base + len(flat))
        lp = self.snap.lp.get(name)
        if lp is not None:
            self.lp_checks.append((name, flat["fp32"], start, n, lp, k))

    def _zero3_param(self, spec: ParamSpec, inner: dict, off: int) -> None:
        """ZeRO-3: this rank's ``ceil(numel / dp)`` partition of every flat state of ``spec`` (at ``off`` in its
        sub-group)."""
        plan, res, dp_rank = self.plan, self.result, self.snap.dp_rank
        name, sg, shape = spec.name, spec.group, spec.shape
        n = numel(shape)
        part = math.ceil(n / plan.topo.dp)
        st = inner.get(sg, inner.get(str(sg), {}))
        flat = {"fp32": self.files.osd["fp32_flat_groups"][sg]}
        for key, v in st.items():
            if key != "step" and isinstance(v, torch.Tensor) and v.dim() == 1:
                flat[key] = v
        lo, hi = min(dp_rank * part, n), min((dp_rank + 1) * part, n)
        frag = Fragment(lo, hi, off, part)
        pattern = with_placement(None, plan.placement(name))
        base = plan.position[name] * 16
        res.kinds[name] = "param"
        res.metas[name] = {"raw": True}
        for j, (state, t) in enumerate(flat.items()):
            if off + part > t.numel():
                raise SourceFormatError(f"{self.files.optim_name}: {name!r} partition [{off}, {off + part}) outside "
                                        f"sub-group {sg} ({t.numel()} elements)")
            self._shard(name, state, t.narrow(0, off, part), shape, pattern, frag, base + j)
        step_t, typ = step_value(st.get("step"))
        if typ is not None:
            res.steps[name] = typ
            if lo == 0:
                self.writer.write(name, "step", step_t.cpu(), pattern=pattern, position=base + len(flat))

    def _zero3_frozen(self) -> None:
        """ZeRO-3 frozen parameters: every rank its partition (``frozen_param_fragments``)."""
        plan, files, dp_rank = self.plan, self.files, self.snap.dp_rank
        frs = (files.model_sd or {}).get("frozen_param_fragments") or {}
        for name, info in plan.frozen.items():
            if info.stage != self.snap.stage:
                continue
            fr = frs.get(name)
            if fr is None:
                raise SourceFormatError(f"{files.model_name}: no frozen_param_fragments entry for frozen parameter "
                                        f"{name!r}")
            n = numel(info.shape)
            part = math.ceil(n / plan.topo.dp)
            lo, hi = min(dp_rank * part, n), min((dp_rank + 1) * part, n)
            self.result.kinds[name] = "frozen"
            if hi > lo:
                self._shard(name, "weight", fr.reshape(-1).narrow(0, 0, hi - lo), info.shape,
                            with_placement(None, plan.placement(name)), Fragment(lo, hi, 0, hi - lo),
                            plan.position[name] * 16)

    def _write_pending(self) -> None:
        """Open every array of this rank's shards at once (``open_shards``), then write them."""
        writer, topo, hook = self.writer, self.plan.topo, self.target.on_write
        writer.open_shards([(name, state, shape, t.dtype, pattern)
                            for name, state, t, shape, pattern, _, _ in self.pending], topology=topo)
        self.target.stats["opened_s"] = time.perf_counter() - self.tp0
        for name, state, local_t, shape, pattern, frag, pos in self.pending:
            writer.write_shard(name, state, local_t.detach().cpu(), shape=shape, pattern=pattern, topology=topo,
                               rank=self.snap.rank, fragment=frag, position=pos, digest=True)
            if hook is not None:
                hook(name, state)
        self.pending.clear()

    def _check_lp(self) -> None:
        """The importer's lp_weights="auto": a low-precision weight that is not the fp32 master cast down is
        stored too. Runs while the array writes are in flight."""
        for name, fp32, start, n, lp, k in self.lp_checks:
            mine_fp32 = fp32.narrow(0, start, n).detach().cpu()
            lp_flat = lp.detach().reshape(-1).narrow(0, k, n).cpu()
            if not torch.equal(mine_fp32.to(lp_flat.dtype), lp_flat):
                self.result.lp_differs.append(name)
        self.lp_checks.clear()

    def _whole_weights(self) -> None:
        """Whole weights (frozen parameters of ZeRO-1/2, buffers) from DP rank 0 of each stage."""
        plan, snap, kinds = self.plan, self.snap, self.result.kinds
        if plan.tp is not None:  # at TP > 1 merged over the TP ranks by the importer's rules
            plan.tp.gather_weights(self.target.group, self.writer, self.files.module() if snap.dp_rank == 0 else {},
                                   snap.rank, snap.stage, plan.position, kinds)
        elif snap.dp_rank == 0:
            zero = plan.topo.zero_stage
            for name, t in self.files.module().items():
                if name in plan.seen or name in kinds or (zero >= 3 and name in plan.frozen) or t.numel() == 0:
                    continue
                kinds[name] = "buffer" if name in plan.buffers else "frozen"
                self.writer.write(name, "weight", t.detach().cpu(), pattern=with_placement(None, plan.placement(name)),
                                  position=plan.position.get(name, len(plan.position)) * 16)


# ------------------------------------------------------------------------- phase 5: agree
@dataclass
class Agreement:
    """What the agreement hands the later phases: every rank's report (on rank 0, which writes the objects
    from them; this rank's alone elsewhere) and the parameters whose low-precision weights differ on any rank."""

    reports: list[RankReport]
    lp_differs: list[str]


def _agree(target: SaveTarget, writer, share: _ShareWriter, files: StagedFiles, snap: RankSnapshot,
           error: BaseException | None, tp0: float) -> Agreement:
    """One gather of every rank's :class:`RankReport` (JSON bytes) to rank 0, and one scatter back of the outcome,
    the low-precision findings and, to each rank, the merged chunk digests of the arrays it wrote: it both
    agrees that every rank's writes returned (the barrier the origin ranks' hashing needs) and lets the origin
    ranks hash without reading back. Raises (after aborting) if any rank failed."""
    per_file = {}
    if files.model_sd is not None and files.model_name is not None:  # classify sets both or neither
        per_file[files.model_name] = _file_record(files.model_sd, files.model_name, [])
    res, tpx = share.result, share.plan.tp
    mine = RankReport(rank=snap.rank, metas=res.metas, steps=res.steps, kinds=res.kinds, lp_differs=res.lp_differs,
                      files=per_file, notes=[] if tpx is None else tpx.notes, rng=snap.rng, client=snap.client,
                      digests=writer.shard_digests(),
                      error=None if error is None else f"{type(error).__name__}: {error}")
    if target.group is None:
        reports, outcome = [mine], _outcome([mine])[0]
    else:
        try:
            reports, outcome = _agree_everywhere(target.group, mine)
        except BaseException:
            writer.abort()
            raise
        target.stats["agreed_s"] = time.perf_counter() - tp0
    if outcome["failed"]:
        writer.abort()
        raise UcpError(f"save of {target.run}@{int(snap.step)} failed on some rank ("
                       + "; ".join(f"rank {r}: {msg}" for r, msg in outcome["failed"])
                       + "); aborted (nothing listed)") from error
    for key, d in outcome["digests"].items():
        writer.set_chunk_digests(key[0], key[1], d)
    return Agreement(reports, list(outcome["lp_differs"]))


def _outcome(reports: list[RankReport]) -> list[dict]:
    """Rank 0's answer to each rank of the agreement: the failures, the low-precision findings, and every
    rank's chunk digests merged, for the arrays that rank wrote."""
    failed = [(r.rank, r.error) for r in reports if r.error is not None]
    differs = sorted({n for r in reports for n in r.lp_differs})
    merged: dict[Any, dict] = {}
    for r in reports:
        for key, d in r.digests.items():
            merged.setdefault(key, {}).update(d)
    return [{"failed": failed, "lp_differs": differs, "digests": {k: merged[k] for k in r.digests}} for r in reports]


def _agree_everywhere(group: Any, mine: RankReport) -> tuple[list[RankReport], dict]:
    """The agreement's collectives (``commit.settle``: a gather to rank 0, a scatter back; JSON bytes, never a
    pickle). Returns every rank's report on rank 0 (this rank's alone elsewhere) and this rank's outcome."""
    from ucp_store.distributed import coord
    from ucp_store.distributed.commit import settle

    reports = [mine]

    def decide(parts: list) -> list:
        reports[:] = [RankReport(**coord.from_wire(p)) for p in parts]
        return [coord.to_wire(o) for o in _outcome(reports)]

    wire = {f.name: getattr(mine, f.name) for f in dataclasses.fields(RankReport)}
    outcome = coord.from_wire(settle(coord.to_wire(wire, f"rank {mine.rank}'s save report"), decide, group))
    return reports, outcome


# ------------------------------------------------------------------------- phase 6: objects
def _write_lp_weights(writer, plan: SavePlan, snap: RankSnapshot, differs: list[str]) -> None:
    """DP rank 0 of each stage: the low-precision weights that are not the fp32 master cast down (any rank's
    check found it: ``differs``), this TP rank's slice by the parameter's pattern."""
    if snap.dp_rank != 0 or not differs:
        return
    tpx = plan.tp
    for name in differs:
        spec = plan.params[plan.seen[name]]
        if spec.stage != snap.stage:
            continue
        lp = snap.lp[name].detach()
        if tpx is not None:  # this TP rank's slice, by the parameter's pattern
            writer.write_shard(name, "weight", lp.reshape(spec.shapes[snap.tp_rank]).cpu(), shape=spec.shape,
                               pattern=with_placement(tpx.direct[name][0], plan.placement(name)), topology=plan.topo,
                               rank=snap.rank, position=plan.position[name] * 16 + 15)
        else:
            writer.write(name, "weight", lp.reshape(spec.shape).cpu(),
                         pattern=with_placement(None, plan.placement(name)), position=plan.position[name] * 16 + 15)


def _write_objects(target: SaveTarget, writer, plan: SavePlan, files: StagedFiles, reports: list[RankReport],
                   t0: float) -> None:
    """Rank 0: the file importer's objects (its own ``objects()`` over the staged dicts) and every rank's
    metadata, RNG state and client state."""
    if files.model_name is None or files.model_sd is None:
        raise SourceFormatError("save_checkpoint produced no model states file on global rank 0: the ucp "
                                "engine reads the run's configuration and step from it")
    topo = plan.topo
    all_metas, all_steps, all_kinds, per_file = {}, {}, {}, {}
    for r in reports:
        all_metas.update(r.metas)
        all_steps.update(r.steps)
        all_kinds.update(r.kinds)
        per_file.update(r.files)
    reader = _MemReader({files.model_name: files.model_sd}, files.optim_sd, zero_stage=topo.zero_stage, pp=topo.pp,
                        dp=topo.dp, prefix=files.prefix,
                        optim_files=sorted(p.optim_file for p in plan.parts),
                        layer_files=sorted({f for p in plan.parts for f in p.layer_files}),
                        params=[{"name": p.name, "stage": p.stage, "group": p.group} for p in plan.params],
                        frozen={n: {"stage": f.stage, "shape": f.shape} for n, f in plan.frozen.items()},
                        buffers=plan.buffers, tp=topo.tp,
                        notes=[n for r in sorted(reports, key=lambda r: r.rank) for n in r.notes])
    objs = reader.objects()
    for f in sorted(per_file):
        objs[f"deepspeed/model_states/{f}"] = per_file[f]
    objs["deepspeed/layout"]["model_files"] = sorted(per_file)
    objs["deepspeed/layout"]["import_seconds"] = round(time.time() - t0, 3)
    objs["deepspeed/universal_meta"] = all_metas
    objs["deepspeed/step_types"] = all_steps
    objs["deepspeed/kinds"] = all_kinds
    objs["deepspeed/rng"] = {"torch_cpu": {str(r.rank): r.rng for r in reports},
                             "encoding": "base64 of torch.get_rng_state() bytes, by global rank"}
    objs["deepspeed/direct"] = {"tag": target.tag, "world": len(plan.parts), "engine": "UcpCheckpointEngine"}
    from ucp_store.deepspeed.perrank import split_client
    from ucp_store.deepspeed.perrank import topology as rank_topology

    # every rank's client state (not only the model-states files'): per-rank keys recorded per rank
    clients = {r.rank: r.client for r in reports if r.client is not None}
    if clients:
        objs["client_state"], per_rank = split_client(clients, rank_topology(topo.tp, topo.pp, topo.dp))
        objs.update(per_rank)
    for k, v in objs.items():
        writer.write_object(k, v)


# ------------------------------------------------------------------------- phase 7: commit
@dataclass
class PendingCommit:
    """The last phase of a save, runnable later and on any thread: make it durable, then commit (a collective:
    every rank's rows and outcome to rank 0, one transaction, one broadcast of the outcome). Nothing of the
    live engine is read from here. Calling it returns the version id, or raises this or another rank's error."""

    writer: Any
    group: Any
    stats: dict[str, float]
    t0: float  # perf_counter at the start of the save (the stats are seconds since)
    syncing: Any  # the Future of the fsync pass started once the writes returned; None after a failure
    error: BaseException | None

    def __call__(self) -> str:
        from ucp_store.distributed.commit import distributed_commit

        writer, stats = self.writer, self.stats
        if self.error is None and self.syncing is not None:
            try:
                self.syncing.result()  # the fsync pass started after the writes
                writer.make_durable_async().result()  # and one over what the objects phase wrote (rare lp weights)
            except BaseException as exc:  # noqa: BLE001
                self.error = exc
        stats["durable_s"] = time.perf_counter() - self.t0
        if self.group is None:
            if self.error is not None:
                writer.abort()
                raise self.error
            cid = writer.commit().id
        else:
            # every rank's rows and outcome to rank 0 (one gather), one transaction, one broadcast of the outcome
            cid = distributed_commit(writer, group=self.group, error=self.error, synced=True, stats=stats, t0=self.t0)
        stats["commit_s"] = time.perf_counter() - self.t0
        return cid
