"""One rank's share of a DeepSpeed save, written straight into the store (used by ``ds_engine``).

``write_rank_share`` turns the state dicts DeepSpeed handed to :class:`~ucp_store.deepspeed.engine.UcpCheckpointEngine`
(the rank's ``*_optim_states.pt`` dict, and where DeepSpeed would write them its model-state and pipeline
layer dicts) into ``write_shard`` calls on the logical arrays, with the file importer's names, states,
patterns, positions and objects, so that the version equals ``ucp import deepspeed`` of the files.

Ranks exchange metadata only (parameter names, shapes, fragment addresses: one ``all_gather_object``),
never tensors. Order of a save: begin/join, write every fragment, agree that all succeeded, store the
low-precision weights that are not the fp32 master cast down (rare), rank 0 writes the objects, commit.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any, cast

import torch

from ucp_store import safe_pickle as sp
from ucp_store.deepspeed.files import LAYER_RE, MODEL_RE, OPTIM_RE, SHARDED_KEYS, UCI, ZERO3_MODEL_RE
from ucp_store.deepspeed.merge import UniversalInfo
from ucp_store.deepspeed.merge import with_placement as _with_placement
from ucp_store.deepspeed.reader import DeepSpeedReader, _lp_dtype, _step_value
from ucp_store.errors import ConfigurationError, SourceFormatError, UcpError
from ucp_store.patterns import Fragment
from ucp_store.topology import Topology

__all__ = ["write_rank_share"]


def _numel(shape) -> int:
    return int(math.prod(int(x) for x in shape))


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
        self.lp_dtype = _lp_dtype(self.ds_config)
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
                [n, sp._dtype_name(t.dtype), list(t.shape)] for n, t in v.items()]}
        else:
            rec[k] = sp.to_jsonable(v, notes=notes, where=f"{fname}:{k}")
    return rec


def _flat_states(osd: dict, g: int, where: str) -> tuple[dict[str, torch.Tensor], Any]:
    fp32 = osd["single_partition_of_fp32_groups"]
    bos = osd["base_optimizer_state"]
    st: dict[Any, Any]
    if isinstance(bos, dict) and "state" in bos:
        states = bos["state"]
        st = (states[g] if g in states else states.get(str(g), {})) if isinstance(states, dict) else states[g]
    elif isinstance(bos, list):
        st = bos[g] if g < len(bos) else {}
    else:
        raise SourceFormatError(f"{where}: base_optimizer_state has an unknown form")
    flat = {"fp32": fp32[g]}
    for k, v in st.items():
        if k != "step" and isinstance(v, torch.Tensor) and v.dim() == 1:
            flat[k] = v
    return flat, st.get("step", osd.get("base_optimizer_state_step"))


def _classify(staged: dict) -> tuple[str | None, dict | None, str, dict, dict[int, dict], list[str]]:
    model_name: str | None = None
    model_sd: dict | None = None
    optim_name: str | None = None
    optim_sd: dict | None = None
    layers: dict[int, dict] = {}
    for name, sd in staged.items():
        if MODEL_RE.match(name) or ZERO3_MODEL_RE.match(name):
            model_name, model_sd = name, sd
        elif OPTIM_RE.match(name):
            optim_name, optim_sd = name, sd
        elif m := LAYER_RE.match(name):
            layers[int(m.group(1))] = sd
        else:
            raise SourceFormatError(f"DeepSpeed handed the ucp engine a file {name!r} it does not know (expected "
                                    "model, optimizer or pipeline layer states); MoE saves are not supported")
    if optim_sd is None or optim_name is None:
        raise ConfigurationError("save_checkpoint produced no ZeRO optimizer state on this rank: the ucp engine "
                                 "needs a ZeRO (stage 1-3) or bf16 optimizer")
    return model_name, model_sd, optim_name, optim_sd, layers, sorted(n for n in staged if LAYER_RE.match(n))


def write_rank_share(ce, staged: dict, meta: dict, *, defer_commit: bool = False):
    """Write this rank's share of one ``save_checkpoint`` and commit it with the other ranks; returns the id.

    ``defer_commit=True``: return once every byte of the save is written (in the page cache) and the ranks
    agreed on it, with a function that makes it durable and commits it (a collective: every rank calls it,
    on any thread); the live engine state is no longer read by then."""
    import torch.distributed as dist

    from ucp_store.distributed.commit import distributed_begin, distributed_commit
    from ucp_store.progress import track

    t0 = time.time()
    tp0 = time.perf_counter()  # every phase in ce.stats is seconds since here (cumulative)
    group = ce.group
    multi = group is not None
    world = dist.get_world_size(group) if multi else 1
    topo_kw = dict(meta["topo"])
    topo = Topology(**topo_kw)
    zero = topo.zero_stage
    rank, stage, dp_rank = meta["rank"], meta["stage"], meta["dp_rank"]
    model_name, model_sd, optim_name, optim_sd, layers, layer_names = _classify(staged)
    osd = optim_sd["optimizer_state_dict"]
    # _classify only returns an optimizer file name that OPTIM_RE matched
    prefix = cast(re.Match[str], OPTIM_RE.match(optim_name)).group(1) or ""
    local = {
        "rank": rank, "stage": stage, "dp": dp_rank, "optim_file": optim_name, "layer_files": layer_names,
        "model_file": model_name,
        "param_shapes": None if model_sd is None else [[(n, tuple(int(x) for x in s)) for n, s in g.items()]
                                                      for g in (model_sd.get("param_shapes") or [])],
        "frozen_shapes": None if model_sd is None else [(n, tuple(int(x) for x in s)) for n, s in
                                                        (model_sd.get("frozen_param_shapes") or {}).items()],
        "buffers": None if model_sd is None else list(model_sd.get("buffer_names") or []),
        "uci": model_sd is not None and bool(UniversalInfo(model_sd.get(UCI) if isinstance(model_sd.get(UCI), dict)
                                                           else None, 1).has_patterns),
        "mappings": None if zero >= 3 else [{n: (int(a.start), int(a.numel)) for n, a in g.items()}
                                            for g in osd["param_slice_mappings"]],
        **_tp_local(meta, model_sd, osd, optim_name, zero),
    }
    if dp_rank == 0 and zero < 3:  # the whole weights this rank would send at TP > 1 (frozen parameters, buffers)
        owned = {n for g in (local["param_shapes"] or []) for n, _ in g}
        local["weights"] = [(n, str(t.dtype).replace("torch.", ""), tuple(int(x) for x in t.shape))
                            for n, t in _module_of(model_sd, layers).items() if n not in owned]
    parts: list[Any] = [None] * world
    if multi:
        dist.all_gather_object(parts, local, group=group)
    else:
        parts = [local]
    tp_rank = int(meta.get("tp_rank", 0))
    tpx = _TPPlan(parts, topo) if topo.tp > 1 or any(p["uci"] for p in parts) else None
    # ---------------------------------------------------------------- the global plan (the importer's _plan)
    by_stage: dict[int, dict[str, Any]] = {}
    for p in sorted(parts, key=lambda p: (p["stage"], p.get("tp", 0), p["dp"])):
        if p["param_shapes"] is not None:
            by_stage.setdefault(p["stage"], p)
    if sorted(by_stage) != list(range(topo.pp)):
        raise UcpError(f"no model states for pipeline stages {sorted(set(range(topo.pp)) - set(by_stage))}")
    params: list[dict] = []
    seen: dict[str, int] = {}
    stages_of: dict[str, list[int]] = {}
    for pp in range(topo.pp):
        for g, group_shapes in enumerate(by_stage[pp]["param_shapes"]):
            for name, shape in group_shapes:
                stages_of.setdefault(name, []).append(pp)
                if name in seen:
                    continue
                seen[name] = len(params)
                params.append({"name": name, "stage": pp, "group": g, "shape": shape})
    frozen: dict[str, dict] = {}
    buffers: list[str] = []
    for pp in range(topo.pp):
        for name, shape in by_stage[pp]["frozen_shapes"]:
            if name not in frozen and name not in seen:
                frozen[name] = {"stage": pp, "shape": shape}
        for b in by_stage[pp]["buffers"]:
            if b not in buffers:
                buffers.append(b)
    piped = bool(topo.layers) or any(p["layer_files"] for p in parts)
    if tpx is not None:
        tpx.plan(params, frozen, buffers, stages_of, piped)
    everything = list(dict.fromkeys([p["name"] for p in params] + list(frozen) + buffers))
    position = {n: i for i, n in enumerate(everything)}

    def placement(name: str) -> dict | None:
        st = sorted(set(stages_of.get(name, [])))
        if topo.pp > 1 and len(st) > 1:
            labels = (["first"] if 0 in st else []) + (["last"] if topo.pp - 1 in st else [])
            return {"stages": labels} if labels else None
        if piped:
            m = re.match(r"^(\d+)\.", name)
            if m:
                return {"layer": int(m.group(1))}
        return None

    # ---------------------------------------------------------------- begin
    ds_version = None if model_sd is None else model_sd.get("ds_version")
    prov = {"source_kind": "deepspeed", "source_path": f"ucp-engine:{ce._tag or ''}",
            "source_topology": {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "zero_stage": zero},
            "library_versions": {"deepspeed": str(ds_version or "")},
            "extra": {"zero_stage": zero, "direct": True, "ranks": world, "tag": ce._tag}}
    msg = ce.message or f"DeepSpeed save_checkpoint (tag {ce._tag}) through the ucp engine"
    step = int(meta["step"])
    stats = ce.stats
    stats["gather_s"] = time.perf_counter() - tp0
    writer = (distributed_begin(ce.store, ce.run, step, group=group, parent="auto", message=msg, provenance=prov)
              if multi else ce.store.begin(ce.run, step, parent="auto", message=msg, provenance=prov))
    # no fsync per file: every rank makes all it wrote durable in one parallel pass (flush, before agreeing)
    writer.defer_durability()
    stats["begin_s"] = time.perf_counter() - tp0
    metas: dict[str, Any] = {}
    steps: dict[str, str] = {}
    kinds: dict[str, str] = {}
    lp_differs: list[str] = []
    hook = getattr(ce, "_on_write", None)
    error: BaseException | None = None
    show = ce.progress and rank == 0

    pending: list[tuple] = []
    lp_checks: list[tuple] = []  # (name, flat fp32, start, n, low-precision weight, k): compared after submitting

    def check_lp() -> None:
        """The importer's lp_weights="auto": a low-precision weight that is not the fp32 master cast down is
        stored too. Runs while the array writes are in flight."""
        for name, fp32, start, n, lp, k in lp_checks:
            mine_fp32 = fp32.narrow(0, start, n).detach().cpu()
            lp_flat = lp.detach().reshape(-1).narrow(0, k, n).cpu()
            if not torch.equal(mine_fp32.to(lp_flat.dtype), lp_flat):
                lp_differs.append(name)
        lp_checks.clear()

    def shard(name, state, local_t, shape, pattern, frag, pos):
        pending.append((name, state, local_t, shape, pattern, frag, pos))

    def write_pending() -> None:
        """Open every array of this rank's shards at once (``open_shards``), then write them."""
        writer.open_shards([(name, state, shape, t.dtype, pattern) for name, state, t, shape, pattern, _, _ in pending],
                           topology=topo)
        stats["opened_s"] = time.perf_counter() - tp0
        for name, state, local_t, shape, pattern, frag, pos in pending:
            writer.write_shard(name, state, local_t.detach().cpu(), shape=shape, pattern=pattern, topology=topo,
                               rank=rank, fragment=frag, position=pos, digest=True)
            if hook is not None:
                hook(name, state)
        pending.clear()

    def phase1() -> None:
        mine = [p for p in params if p["stage"] == stage]
        if tpx is not None:  # TP > 1 or universal_checkpoint_info patterns: merged by the importer's rules
            tpx.gather_merge_write(ce, writer, osd, optim_name, meta, rank, stage, dp_rank, tp_rank, position,
                                   metas, steps, kinds)
            mine = [p for p in mine if p["name"] in tpx.direct]
        if zero < 3:
            before = [p for p in parts if p["stage"] == stage and p["dp"] < dp_rank and p.get("tp", 0) == tp_rank]
            for spec in track(mine, f"save {ce.run}@{step}", enabled=show):
                name, g, shape = spec["name"], spec["group"], spec["shape"]
                maps = osd["param_slice_mappings"]
                addr = maps[g].get(name) if g < len(maps) else None
                kinds[name] = "param"
                metas[name] = {"cat_dim": 0} if tpx is None else tpx.direct[name][1]
                if addr is None:
                    continue
                start, n = int(addr.start), int(addr.numel)
                k = sum(q["mappings"][g].get(name, (0, 0))[1] for q in before if g < len(q["mappings"]))
                flat, st = _flat_states(osd, g, optim_name)
                frag = Fragment(k, k + n, start, n)
                pattern = _with_placement(None if tpx is None else tpx.direct[name][0], placement(name))
                base = position[name] * 16
                for j, (state, t) in enumerate(flat.items()):
                    if start + n > t.numel():
                        raise SourceFormatError(f"{optim_name}: fragment of {name!r} [{start}, {start + n}) lies "
                                                f"outside the flat {state} partition ({t.numel()} elements)")
                    shard(name, state, t.narrow(0, start, n), shape, pattern, frag, base + j)
                step_t, typ = _step_value(st)
                if typ is not None:
                    steps[name] = typ
                    if k == 0 and tp_rank == 0:
                        writer.write(name, "step", step_t.cpu(), pattern=_with_placement(None, placement(name)),
                                     position=base + len(flat))
                lp = meta["lp"].get(name)
                if lp is not None:
                    lp_checks.append((name, flat["fp32"], start, n, lp, k))
        else:
            inner = osd["optimizer_state_dict"].get("state", {})
            sg_offsets: dict[tuple[int, str], int] = {}
            for sg, group_shapes in enumerate(by_stage[stage]["param_shapes"]):
                off = 0
                for name, shape in group_shapes:
                    sg_offsets[(sg, name)] = off
                    off += math.ceil(_numel(shape) / topo.dp)
            for spec in track(mine, f"save {ce.run}@{step}", enabled=show):
                name, sg, shape = spec["name"], spec["group"], spec["shape"]
                n = _numel(shape)
                part = math.ceil(n / topo.dp)
                off = sg_offsets[(sg, name)]
                st = inner.get(sg, inner.get(str(sg), {}))
                flat = {"fp32": osd["fp32_flat_groups"][sg]}
                for key, v in st.items():
                    if key != "step" and isinstance(v, torch.Tensor) and v.dim() == 1:
                        flat[key] = v
                lo, hi = min(dp_rank * part, n), min((dp_rank + 1) * part, n)
                frag = Fragment(lo, hi, off, part)
                pattern = _with_placement(None, placement(name))
                base = position[name] * 16
                kinds[name] = "param"
                metas[name] = {"raw": True}
                for j, (state, t) in enumerate(flat.items()):
                    if off + part > t.numel():
                        raise SourceFormatError(f"{optim_name}: {name!r} partition [{off}, {off + part}) outside "
                                                f"sub-group {sg} ({t.numel()} elements)")
                    shard(name, state, t.narrow(0, off, part), shape, pattern, frag, base + j)
                step_t, typ = _step_value(st.get("step"))
                if typ is not None:
                    steps[name] = typ
                    if lo == 0:
                        writer.write(name, "step", step_t.cpu(), pattern=pattern, position=base + len(flat))
            # frozen parameters: every rank its partition
            frs = (model_sd or {}).get("frozen_param_fragments") or {}
            for name, info in frozen.items():
                if info["stage"] != stage:
                    continue
                fr = frs.get(name)
                if fr is None:
                    raise SourceFormatError(f"{model_name}: no frozen_param_fragments entry for frozen parameter "
                                            f"{name!r}")
                n = _numel(info["shape"])
                part = math.ceil(n / topo.dp)
                lo, hi = min(dp_rank * part, n), min((dp_rank + 1) * part, n)
                kinds[name] = "frozen"
                if hi > lo:
                    shard(name, "weight", fr.reshape(-1).narrow(0, 0, hi - lo), info["shape"],
                          _with_placement(None, placement(name)), Fragment(lo, hi, 0, hi - lo), position[name] * 16)
        write_pending()
        check_lp()
        # whole weights (frozen parameters of ZeRO-1/2, buffers) from DP rank 0 of each stage
        if tpx is not None:  # at TP > 1 merged over the TP ranks by the importer's rules
            tpx.gather_weights(ce, writer, _module_of(model_sd, layers) if dp_rank == 0 else {}, rank, stage,
                               position, kinds)
        elif dp_rank == 0:
            entries = _module_of(model_sd, layers)
            for name, t in entries.items():
                if name in seen or name in kinds or (zero >= 3 and name in frozen) or t.numel() == 0:
                    continue
                kinds[name] = "buffer" if name in buffers else "frozen"
                writer.write(name, "weight", t.detach().cpu(), pattern=_with_placement(None, placement(name)),
                             position=position.get(name, len(position)) * 16)

    t_phase = tp0
    try:
        phase1()
        stats["submit_s"] = time.perf_counter() - t_phase
        writer._drain()  # every array write of this rank has returned (its bytes are in the page cache)
        stats["writes_s"] = time.perf_counter() - t_phase
    except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
        error = exc
    if error is not None and not multi:
        writer.abort()
        raise error
    # the fsync pass over all of it runs on a thread from here, beside the agreement, weights and objects
    syncing = writer.make_durable_async() if error is None else None
    # ---------------------------------------------------------------- phase 2: agree, weights, objects
    # one all_gather both agrees that every rank's writes returned (the barrier the origin ranks' hashing
    # needs) and brings every rank's metadata and chunk digests
    per_file = {}
    if model_sd is not None and model_name is not None:  # _classify sets both or neither
        per_file[model_name] = _file_record(model_sd, model_name, [])
    info = {"metas": metas, "steps": steps, "kinds": kinds, "lp_differs": lp_differs, "files": per_file,
            "notes": [] if tpx is None else tpx.notes,
            "rng": meta["rng"], "client": meta.get("client"), "rank": rank, "digests": writer.shard_digests(),
            "error": None if error is None else f"{type(error).__name__}: {error}"}
    gathered: list[Any] = [None] * world
    if multi:
        dist.all_gather_object(gathered, info, group=group)
        stats["agreed_s"] = time.perf_counter() - t_phase
        failed = [(g_["rank"], g_["error"]) for g_ in gathered if g_["error"] is not None]
        if failed:
            writer.abort()
            raise UcpError(f"save of {ce.run}@{step} failed on some rank ("
                           + "; ".join(f"rank {r}: {msg}" for r, msg in failed)
                           + "); aborted (nothing listed)") from error
    else:
        gathered = [info]
    differs = sorted({n for g_ in gathered for n in g_["lp_differs"]})
    # every rank's chunk digests (taken from memory while writing): the origin ranks hash without reading back
    merged: dict[Any, dict] = {}
    for g_ in gathered:
        for key, d in g_.pop("digests").items():
            merged.setdefault(key, {}).update(d)
    for key, d in merged.items():
        writer.set_chunk_digests(key[0], key[1], d)
    try:
        if dp_rank == 0 and differs:
            lp_all = meta["lp"]
            for name in differs:
                spec = params[seen[name]]
                if spec["stage"] != stage:
                    continue
                if tpx is not None:  # this TP rank's slice, by the parameter's pattern
                    writer.write_shard(name, "weight", lp_all[name].detach().reshape(spec["shapes"][tp_rank]).cpu(),
                                       shape=spec["shape"],
                                       pattern=_with_placement(tpx.direct[name][0], placement(name)), topology=topo,
                                       rank=rank, position=position[name] * 16 + 15)
                else:
                    writer.write(name, "weight", lp_all[name].detach().reshape(spec["shape"]).cpu(),
                                 pattern=_with_placement(None, placement(name)), position=position[name] * 16 + 15)
        if rank == 0:
            if model_name is None or model_sd is None:
                raise SourceFormatError("save_checkpoint produced no model states file on global rank 0: the ucp "
                                        "engine reads the run's configuration and step from it")
            all_metas, all_steps, all_kinds, files = {}, {}, {}, {}
            for g_ in gathered:
                all_metas.update(g_["metas"])
                all_steps.update(g_["steps"])
                all_kinds.update(g_["kinds"])
                files.update(g_["files"])
            reader = _MemReader({model_name: model_sd}, optim_sd, zero_stage=zero, pp=topo.pp, dp=topo.dp,
                                prefix=prefix,
                                optim_files=sorted(p["optim_file"] for p in parts),
                                layer_files=sorted({f for p in parts for f in p["layer_files"]}),
                                params=[{"name": p["name"], "stage": p["stage"], "group": p["group"]} for p in params],
                                frozen=frozen, buffers=buffers, tp=topo.tp,
                                notes=[n for g_ in sorted(gathered, key=lambda g_: g_["rank"]) for n in g_["notes"]])
            objs = reader.objects()
            for f in sorted(files):
                objs[f"deepspeed/model_states/{f}"] = files[f]
            objs["deepspeed/layout"]["model_files"] = sorted(files)
            objs["deepspeed/layout"]["import_seconds"] = round(time.time() - t0, 3)
            objs["deepspeed/universal_meta"] = all_metas
            objs["deepspeed/step_types"] = all_steps
            objs["deepspeed/kinds"] = all_kinds
            objs["deepspeed/rng"] = {"torch_cpu": {str(g_["rank"]): g_["rng"] for g_ in gathered},
                                     "encoding": "base64 of torch.get_rng_state() bytes, by global rank"}
            objs["deepspeed/direct"] = {"tag": ce._tag, "world": world, "engine": "UcpCheckpointEngine"}
            from ucp_store.deepspeed.perrank import split_client
            from ucp_store.deepspeed.perrank import topology as rank_topology

            # every rank's client state (not only the model-states files'): per-rank keys recorded per rank
            clients = {g_["rank"]: g_["client"] for g_ in gathered if g_.get("client") is not None}
            if clients:
                objs["client_state"], per_rank = split_client(clients, rank_topology(topo.tp, topo.pp, topo.dp))
                objs.update(per_rank)
            for k, v in objs.items():
                writer.write_object(k, v)
        writer._drain()  # the low-precision weights are live module state: written before returning
    except BaseException as exc:  # noqa: BLE001
        error = exc
    stats["objects_s"] = time.perf_counter() - t_phase

    def finish() -> str:
        """Durable, then committed: nothing of the live engine is read from here (``defer_commit``)."""
        nonlocal error
        if error is None and syncing is not None:
            try:
                syncing.result()  # the fsync pass started after the writes
                writer._make_durable()  # and what phase 2 wrote (rare low-precision weights)
            except BaseException as exc:  # noqa: BLE001
                error = exc
        stats["durable_s"] = time.perf_counter() - t_phase
        if not multi:
            if error is not None:
                writer.abort()
                raise error
            cid = writer.commit().id
        else:
            # every rank's rows and outcome to rank 0 (one gather), one transaction, one broadcast of the outcome
            cid = distributed_commit(writer, group=group, error=error, synced=True, stats=stats, t0=t_phase)
        stats["commit_s"] = time.perf_counter() - t_phase
        return cid

    if defer_commit:
        return finish
    return finish()


def _module_of(model_sd: dict | None, layers: dict[int, dict]) -> dict[str, torch.Tensor]:
    """The module weights DeepSpeed saved on this rank: the model states' ``module``, or the pipeline layer files'
    tensors named ``<layer>.<key>``."""
    if model_sd is not None and model_sd.get("module") is not None:
        return dict(model_sd["module"])
    entries = {}
    for li in sorted(layers):
        for k, v in (layers[li] or {}).items():
            if isinstance(v, torch.Tensor):
                entries[f"{li}.{k}"] = v
    return entries


# ------------------------------------------------------------------------- tensor parallelism (TP > 1)
def _tp_local(meta: dict, model_sd: dict | None, osd: dict, optim_name: str, zero: int) -> dict:
    """What the other ranks need to know about this rank for a TP save (exchanged with the rest of the
    metadata): its TP rank, the model's ``universal_checkpoint_info``, each group's flat states (name,
    dtype) and optimizer step, and the dtype of its low-precision module weights."""
    uci = None if model_sd is None or not isinstance(model_sd.get(UCI), dict) else _standins(model_sd[UCI])
    flat: list | None = None
    gsteps: list | None = None
    if zero < 3:
        flat, gsteps = [], []
        for g in range(len(osd["param_slice_mappings"])):
            f, st = _flat_states(osd, g, optim_name)
            flat.append([(k, str(v.dtype).replace("torch.", "")) for k, v in f.items()])
            gsteps.append(st)
    lp = next(iter(meta["lp"].values()), None)
    return {"tp": int(meta.get("tp_rank", 0)), "uci_raw": uci, "flat": flat, "gsteps": gsteps,
            "lp_dtype": None if lp is None else str(lp.dtype).replace("torch.", "")}


class _Merger(DeepSpeedReader):
    """The file importer's per-parameter merge (``DeepSpeedReader._finish``: the TP rule from
    ``universal_checkpoint_info`` or inferred, ``merge_tp_slices``, the pattern, ``averaged`` deviations, the
    step check, the low-precision weight check) over TP slices gathered from the ranks, not read from files:
    the same code, so the same arithmetic and the same bytes."""

    def __init__(self, info: UniversalInfo, tp: int, pp: int, zero_stage: int, stages_of: dict, layered: bool,
                 optim_files: dict):
        self.tag_dir = "<ucp engine>"
        self.lp_weights = "auto"
        self.notes = []
        self.info, self.tp, self.pp, self.zero_stage = info, tp, pp, zero_stage
        self.stages_of = stages_of
        self.layer_files = {(0, 0): "layers"} if layered else {}
        self.optim_files = optim_files
        self.lp: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def _module_entries(self, pp: int, tp: int) -> dict[str, torch.Tensor]:
        return self.lp.get((pp, tp), {})


class _TPPlan:
    """A save at TP > 1 (or of a model with ``universal_checkpoint_info`` patterns), ZeRO-1/2.

    Every parameter gets the file importer's rule (``UniversalInfo.rule``). A parameter the rule concatenates
    along one dimension in equal widths (column- and row-parallel weights) is *direct*: each rank writes its
    ZeRO fragments of its TP slice through ``write_shard`` with the ``partitioned`` pattern. Every other one
    (TP-replicated norms and biases, averaged, fused sub-parameters, vocabularies, affine maps, and every
    parameter of a TP model without patterns, whose rule depends on the data) is *gathered*: its fragments
    travel (bytes over the save's gloo group, point to point, bounded by its timeout) to the stage's first rank
    (tp 0, dp 0), which runs the importer's own merge (:class:`_Merger`) and writes the result whole. Only the
    gathered parameters move, and in Megatron models they are the small ones. Frozen parameters and buffers
    travel the same way (``gather_weights``) and are merged by the importer's ``_weight_records``."""

    def __init__(self, parts: list[dict], topo: Topology):
        self.topo = topo
        self.parts = {int(p["rank"]): p for p in parts}
        if topo.zero_stage >= 3:
            raise ConfigurationError("the ucp engine saves ZeRO-3 only at TP=1 and without universal_checkpoint_info "
                                     "patterns; save with DeepSpeed's engine and `ucp import deepspeed`")
        uci = next((self.parts[r]["uci_raw"] for r in sorted(self.parts) if self.parts[r].get("uci_raw")), None)
        self.info = UniversalInfo(uci, topo.tp)
        self.notes: list[str] = []
        self.direct: dict[str, tuple[dict | None, dict]] = {}
        self.gather: list[dict] = []
        self._stages_of: dict = {}
        self._layered = False

    def _rank(self, stage: int, dp: int, tp: int) -> int:
        return tp + self.topo.tp * (dp + self.topo.dp * stage)

    def plan(self, params: list[dict], frozen: dict, buffers: list, stages_of: dict, layered: bool) -> None:
        """Split ``params`` into direct and gathered ones; give each spec its per-TP ``shapes`` and, if direct,
        its logical ``shape``."""
        from ucp_store.deepspeed.merge import pattern_for

        topo = self.topo
        self._stages_of, self._layered = stages_of, layered
        self._buffers = list(buffers)
        for spec in params:
            shapes = []
            for t in range(topo.tp):
                holder = next((p for r, p in sorted(self.parts.items()) if p["stage"] == spec["stage"]
                               and p.get("tp", 0) == t and p["param_shapes"] is not None), None)
                if holder is None:
                    raise UcpError(f"no model states for pipeline stage {spec['stage']} TP rank {t}")
                grp = holder["param_shapes"][spec["group"]] if spec["group"] < len(holder["param_shapes"]) else []
                found = dict(grp).get(spec["name"])
                if found is None:
                    raise SourceFormatError(f"{holder['model_file']}: param_shapes lacks {spec['name']!r} which TP "
                                            "rank 0 has")
                shapes.append(tuple(found))
            spec["shapes"] = shapes
            rule = self.info.rule(spec["name"])
            if self.info.has_patterns and rule.kind == "cat" and not rule.vocab:
                d = rule.cat_dim
                pat = pattern_for(spec["name"], rule, self.info, [torch.empty(s, device="meta") for s in shapes],
                                  topo.tp)
                same = all(len(s) == len(shapes[0]) and all(a == b for i, (a, b) in enumerate(zip(s, shapes[0]))
                                                            if i != d) for s in shapes)
                if same and ((pat is None and topo.tp == 1) or
                             (pat is not None and pat.get("kind") == "partitioned" and "widths" not in pat
                              and pat.get("dim") == d)):
                    logical = list(shapes[0])
                    if topo.tp > 1:
                        logical[d] = sum(s[d] for s in shapes)
                    spec["shape"] = tuple(logical)
                    self.direct[spec["name"]] = (pat, {"cat_dim": d})
                    continue
            self.gather.append(spec)

    def _merger(self) -> _Merger:
        topo = self.topo
        optim_files = {(p["stage"] * topo.tp + p.get("tp", 0), p["dp"]): p["optim_file"] for p in self.parts.values()}
        return _Merger(self.info, topo.tp, topo.pp, topo.zero_stage, self._stages_of, self._layered, optim_files)

    def gather_weights(self, ce, writer, entries: dict[str, torch.Tensor], rank: int, stage: int, position: dict,
                       kinds: dict) -> None:
        """Frozen parameters and buffers (whole module tensors, from DP rank 0 of every TP rank of a stage): sent to
        the stage's first rank, which merges their TP copies as the importer's ``_weight_records`` does (the
        same code) and writes them."""
        import torch.distributed as dist

        topo = self.topo
        dst = self._rank(stage, 0, 0)
        mine = self.parts[rank].get("weights") or []
        if rank != dst:
            if mine:
                payload = torch.cat([entries[n].detach().cpu().contiguous().view(torch.uint8).reshape(-1)
                                     for n, _, _ in mine])
                if payload.numel():
                    dist.send(payload, dst=dst, group=ce.group)
            return
        merger = self._merger()
        merger.params, merger.buffers = [], self._buffers
        for t in range(topo.tp):
            r = self._rank(stage, 0, t)
            ents = self.parts[r].get("weights") or []
            if r == rank:
                merger.lp[(stage, t)] = {n: entries[n].detach().cpu() for n, _, _ in ents}
                continue
            sizes = [_numel(shape) * torch.empty(0, dtype=getattr(torch, dt)).element_size() for _, dt, shape in ents]
            buf = torch.empty(sum(sizes), dtype=torch.uint8)
            if buf.numel():
                dist.recv(buf, src=r, group=ce.group)
            got, off = {}, 0
            for (n, dt, shape), nb in zip(ents, sizes):
                got[n] = buf[off:off + nb].clone().view(getattr(torch, dt)).reshape(shape)
                off += nb
            merger.lp[(stage, t)] = got
        for rec in merger._weight_records(None):
            writer.write(rec.name, "weight", rec.states["weight"], pattern=rec.pattern_for("weight"),
                         position=position.get(rec.name, len(position)) * 16)
            kinds[rec.name] = rec.kind
        self.notes.extend(merger.notes)

    def _entries(self, part: dict, specs: list[dict]) -> list[tuple[str, str, str, int]]:
        """What ``part``'s rank sends for the gathered parameters ``specs``, in order: (name, state, dtype,
        elements); state ``__lp__`` is its low-precision module weight (from DP rank 0 only)."""
        out = []
        for spec in specs:
            g = spec["group"]
            maps = part["mappings"]
            m = maps[g].get(spec["name"]) if g < len(maps) else None
            if m is not None:
                for st, dt in part["flat"][g]:
                    out.append((spec["name"], st, dt, int(m[1])))
        if part["dp"] == 0 and part["lp_dtype"] is not None:
            for spec in specs:
                out.append((spec["name"], "__lp__", part["lp_dtype"], _numel(spec["shapes"][part.get("tp", 0)])))
        return out

    def gather_merge_write(self, ce, writer, osd, optim_name, meta, rank, stage, dp_rank, tp_rank, position,
                           metas, steps, kinds) -> None:
        """Send this rank's fragments of the gathered parameters of its stage to the stage's first rank; there,
        merge each with the importer's rules and write it."""
        import torch.distributed as dist

        topo = self.topo
        specs = [s for s in self.gather if s["stage"] == stage]
        if not specs:
            return
        dst = self._rank(stage, 0, 0)
        mine = self.parts[rank]
        pieces = []
        for name, st, _dt, n in self._entries(mine, specs):
            spec = next(s for s in specs if s["name"] == name)
            if st == "__lp__":
                lp = meta["lp"].get(name)
                if lp is None:
                    raise UcpError(f"rank {rank}: no module weight {name!r} to compare with its fp32 master")
                t = lp.detach().reshape(-1)
            else:
                g = spec["group"]
                start = int(osd["param_slice_mappings"][g][name].start)
                t = _flat_states(osd, g, optim_name)[0][st].narrow(0, start, n)
            pieces.append(t.detach().cpu().contiguous().view(torch.uint8).reshape(-1))
        payload = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
        if rank != dst:
            if payload.numel():
                dist.send(payload, dst=dst, group=ce.group)
            return
        data: dict[int, dict[tuple[str, str], torch.Tensor]] = {}
        for r in sorted(self.parts):
            part = self.parts[r]
            if part["stage"] != stage:
                continue
            ents = self._entries(part, specs)
            size = sum(n * torch.empty(0, dtype=getattr(torch, dt)).element_size() for _, _, dt, n in ents)
            if r == rank:
                buf = payload
            else:
                buf = torch.empty(size, dtype=torch.uint8)
                if size:
                    dist.recv(buf, src=r, group=ce.group)
            if buf.numel() != size:
                raise UcpError(f"rank {r} sent {buf.numel()} bytes of TP fragments, expected {size}")
            off = 0
            got: dict[tuple[str, str], torch.Tensor] = {}
            for name, st, dt, n in ents:
                dtype = getattr(torch, dt)
                nb = n * torch.empty(0, dtype=dtype).element_size()
                got[(name, st)] = buf[off:off + nb].clone().view(dtype)
                off += nb
            data[r] = got
        merger = self._merger()
        for t in range(topo.tp):
            r0 = self._rank(stage, 0, t)
            merger.lp[(stage, t)] = {n: v.reshape(spec["shapes"][t]) for spec in specs
                                     for (n, st), v in data.get(r0, {}).items() if st == "__lp__" and n == spec["name"]}
        for spec in specs:
            name, g = spec["name"], spec["group"]
            per_state: dict[str, list[torch.Tensor]] = {}
            step_list: list = []
            for t in range(topo.tp):
                frags: dict[str, list[torch.Tensor]] = {}
                count = 0
                for d in range(topo.dp):
                    r = self._rank(stage, d, t)
                    part = self.parts[r]
                    maps = part["mappings"]
                    m = maps[g].get(name) if g < len(maps) else None
                    if m is None:
                        continue
                    for st, _dt in part["flat"][g]:
                        frags.setdefault(st, []).append(data[r][(name, st)])
                    count += int(m[1])
                    step_list.append((part["gsteps"][g], (stage * topo.tp + t, d)))
                if count == 0:
                    per_state = {}
                    break
                if count != _numel(spec["shapes"][t]):
                    raise SourceFormatError(f"the fragments of {name!r} on TP rank {t} cover {count} of its "
                                            f"{_numel(spec['shapes'][t])} elements")
                for k, fs in frags.items():
                    per_state.setdefault(k, []).append(torch.cat(fs).reshape(spec["shapes"][t]))
            rec = merger._finish(name, {"name": name, "stage": stage, "group": g, "shapes": spec["shapes"]},
                                 per_state, step_list, [])
            base = position[name] * 16
            for j, (state, value) in enumerate(rec.states.items()):
                writer.write(name, state, value, pattern=rec.pattern_for(state), position=base + j)
            if "fp32" in rec.states:
                metas[name] = rec.meta
            if rec.step_type:
                steps[name] = rec.step_type
            kinds[name] = rec.kind
        self.notes.extend(merger.notes)
