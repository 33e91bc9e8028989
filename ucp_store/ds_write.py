"""One rank's share of a DeepSpeed save, written straight into the store (used by ``ds_engine``).

``write_rank_share`` turns the state dicts DeepSpeed handed to :class:`~ucp_store.ds_engine.UcpCheckpointEngine`
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

from . import safe_pickle as sp
from .adapters.deepspeed_files import LAYER_RE, MODEL_RE, OPTIM_RE, SHARDED_KEYS, UCI, ZERO3_MODEL_RE
from .adapters.deepspeed_merge import UniversalInfo
from .adapters.deepspeed_merge import with_placement as _with_placement
from .adapters.deepspeed_reader import DeepSpeedReader, _lp_dtype, _step_value
from .errors import ConfigurationError, SourceFormatError, UcpError
from .patterns import Fragment
from .topology import Topology

__all__ = ["write_rank_share"]


def _numel(shape) -> int:
    return int(math.prod(int(x) for x in shape))


class _MemReader(DeepSpeedReader):
    """The file importer's ``objects()`` over in-memory state dicts (no folder, no files)."""

    def __init__(self, model_states: dict[str, dict], optim: dict, *, zero_stage: int, pp: int, dp: int, prefix: str,
                 optim_files: list[str], layer_files: list[str], params: list[dict], frozen: dict, buffers: list):
        self.tag_dir = "<ucp engine>"
        self.lp_weights = "auto"
        self.notes = []
        self.model_states = model_states
        self._optim0 = optim
        self.zero_stage, self.tp, self.pp, self.dp, self.prefix = zero_stage, 1, pp, dp, prefix
        first = model_states[next(iter(model_states))]
        self.ds_config = first.get("ds_config") if isinstance(first.get("ds_config"), dict) else {}
        self.lp_dtype = _lp_dtype(self.ds_config)
        self.ds_version = None if first.get("ds_version") is None else str(first.get("ds_version"))
        self.global_steps = first.get("global_steps")
        self.uci = first.get(UCI) if isinstance(first.get(UCI), dict) else None
        self.info = UniversalInfo(self.uci, 1)
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

    from .distributed import distributed_begin, distributed_commit
    from .progress import track

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
    }
    parts: list[Any] = [None] * world
    if multi:
        dist.all_gather_object(parts, local, group=group)
    else:
        parts = [local]
    if any(p["uci"] for p in parts):
        raise ConfigurationError("the model carries universal_checkpoint_info patterns (Megatron-style TP layouts): "
                                 "the ucp engine does not handle them yet; save with DeepSpeed's engine and "
                                 "`ucp import deepspeed`")
    # ---------------------------------------------------------------- the global plan (the importer's _plan)
    by_stage: dict[int, dict[str, Any]] = {}
    for p in sorted(parts, key=lambda p: (p["stage"], p["dp"])):
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
            "source_topology": {"tp": 1, "pp": topo.pp, "dp": topo.dp, "zero_stage": zero},
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
        if zero < 3:
            before = [p for p in parts if p["stage"] == stage and p["dp"] < dp_rank]
            for spec in track(mine, f"save {ce.run}@{step}", enabled=show):
                name, g, shape = spec["name"], spec["group"], spec["shape"]
                maps = osd["param_slice_mappings"]
                addr = maps[g].get(name) if g < len(maps) else None
                kinds[name] = "param"
                metas[name] = {"cat_dim": 0}
                if addr is None:
                    continue
                start, n = int(addr.start), int(addr.numel)
                k = sum(q["mappings"][g].get(name, (0, 0))[1] for q in before if g < len(q["mappings"]))
                flat, st = _flat_states(osd, g, optim_name)
                frag = Fragment(k, k + n, start, n)
                pattern = _with_placement(None, placement(name))
                base = position[name] * 16
                for j, (state, t) in enumerate(flat.items()):
                    if start + n > t.numel():
                        raise SourceFormatError(f"{optim_name}: fragment of {name!r} [{start}, {start + n}) lies "
                                                f"outside the flat {state} partition ({t.numel()} elements)")
                    shard(name, state, t.narrow(0, start, n), shape, pattern, frag, base + j)
                step_t, typ = _step_value(st)
                if typ is not None:
                    steps[name] = typ
                    if k == 0:
                        writer.write(name, "step", step_t.cpu(), pattern=pattern, position=base + len(flat))
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
        if dp_rank == 0:
            if model_sd is not None and model_sd.get("module") is not None:
                entries = dict(model_sd["module"])
            else:
                entries = {}
                for li in sorted(layers):
                    for k, v in (layers[li] or {}).items():
                        if isinstance(v, torch.Tensor):
                            entries[f"{li}.{k}"] = v
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
            "rng": meta["rng"], "rank": rank, "digests": writer.shard_digests(),
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
                if spec["stage"] == stage:
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
                                frozen=frozen, buffers=buffers)
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
