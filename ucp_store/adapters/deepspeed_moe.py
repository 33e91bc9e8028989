"""DeepSpeed mixture-of-experts checkpoints (``deepspeed.moe.layer.MoE``, ZeRO-1/2): import and resume.

What DeepSpeed 0.19 writes for an MoE model with expert parallelism ``ep`` (seen with real training on
CPU/gloo, see ``ucp_store/demo/ds_moe.py``):

- ``layer_{L}_expert_{E}_mp_rank_{MP}_model_states.pt``: the low-precision weights of expert ``E`` (its
  *global* id) of MoE layer ``L`` (MoE layers counted in module order), keyed by global names
  (``moe.0.deepspeed_moe.experts.deepspeed_experts.2.w1.weight``);
- ``mp_rank_XX_model_states.pt``: the dense module (the gate ``...deepspeed_moe.gate.wg.weight`` included) and
  ``param_shapes``, whose expert group names the experts by their *local* index on the saving rank;
- the ordinary ``*_optim_states.pt`` per DP rank: the expert optimizer state is a second parameter group
  (``name: ep_size_<ep>``, ``moe: True``) with *local* names in ``param_slice_mappings``, partitioned over
  the expert-data-parallel ranks only (``partition_count`` = dp / ep). DP rank ``d`` is ep rank ``d % ep``
  (DeepSpeed's default E+D order), so its local expert ``j`` is global expert ``(d % ep) * E/ep + j``.

``DeepSpeedMoEReader`` maps every local name to its global expert and yields one record per expert tensor
(fp32 master, ``exp_avg``, ``exp_avg_sq``, ``step`` from its ep rank's optimizer files, its weight from the
expert file when it is not the fp32 master cast down), stored either separately with an ``expert_member``
pattern (``experts="separate"``, the default: layer by layer, expert by expert, so that each ep rank's
experts are, in record order, exactly DeepSpeed's flat order of its expert group) or stacked into one
``[E, ...]`` tensor per layer and parameter with an ``expert`` pattern (``experts="fused"``).

``load_engine(engine, ref, store=)`` loads such a checkpoint into a freshly built MoE engine of any ep (and
DP) degree through ``load_shard``: each rank gets its experts and its ZeRO share of them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ConfigurationError, SourceFormatError, UcpError
from ..patterns import Expert, ExpertMember
from .deepspeed_files import EXPERT_RE
from .deepspeed_merge import ParamRecord, _numel
from .deepspeed_reader import DeepSpeedReader, release_pages

__all__ = ["UNIVERSAL_REFUSAL", "DeepSpeedMoEReader", "open_tag_reader", "global_expert_name", "local_expert_name",
           "load_engine", "engine_param_shares", "EXPERTS_RE"]

EXPERT_FILE_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
EXPERTS_RE = re.compile(r"^(?P<prefix>.*\.deepspeed_experts\.)(?P<index>\d+)(?P<suffix>\..+)$")
EP_GROUP_RE = re.compile(r"^ep_size_(\d+)$")

UNIVERSAL_REFUSAL = (
    "a DeepSpeed MoE checkpoint cannot be exported as a universal folder: DeepSpeed's load_universal looks up "
    "each expert parameter by its local name (deepspeed_experts.<j>), which on ep rank r > 0 is global expert "
    "r * E/ep + j, so every ep rank but the first would load another expert's state without an error. Resume MoE "
    "through load_shard: ucp_store.adapters.deepspeed_moe.load_engine(engine, ref, store=...)")


def global_expert_name(local_name: str, ep_rank: int, local_experts: int) -> str:
    """``...deepspeed_experts.<j>.w1.weight`` on ep rank ``r`` -> ``...deepspeed_experts.<r*E/ep + j>.w1.weight``."""
    m = EXPERTS_RE.match(local_name)
    if m is None:
        raise SourceFormatError(f"{local_name!r}: an expert parameter without '.deepspeed_experts.<index>.' in its "
                                "name")
    return f"{m['prefix']}{ep_rank * local_experts + int(m['index'])}{m['suffix']}"


def local_expert_name(global_name: str, local_experts: int) -> str:
    """The inverse of ``global_expert_name`` (the rank is implied by the global id)."""
    m = EXPERTS_RE.match(global_name)
    if m is None:
        raise SourceFormatError(f"{global_name!r}: not an expert parameter name")
    return f"{m['prefix']}{int(m['index']) % local_experts}{m['suffix']}"


def open_tag_reader(tag_dir: str | os.PathLike, *, lp_weights: str = "auto", experts: str = "separate"):
    """The reader for a DeepSpeed tag folder: ``DeepSpeedMoEReader`` when it holds expert files."""
    path = os.fspath(tag_dir)
    has_experts = os.path.isdir(path) and any(EXPERT_RE.match(f) for f in os.listdir(path))
    if experts not in ("separate", "fused"):
        raise ConfigurationError(f"experts must be 'separate' or 'fused', got {experts!r}")
    if has_experts:
        return DeepSpeedMoEReader(path, lp_weights=lp_weights, experts=experts)
    return DeepSpeedReader(path, lp_weights=lp_weights)


class DeepSpeedMoEReader(DeepSpeedReader):
    """A DeepSpeed MoE tag folder (ZeRO-1/2): the dense part as ``DeepSpeedReader`` reads it, the experts by
    global id (see the module docstring)."""

    def __init__(self, tag_dir: str | os.PathLike, *, lp_weights: str = "auto", experts: str = "separate"):
        self.experts_form = experts
        super().__init__(tag_dir, lp_weights=lp_weights)

    def _expert_file(self, fname: str) -> None:
        files = self.__dict__.setdefault("expert_files", {})
        m = EXPERT_FILE_RE.match(fname)
        if m is None:
            raise SourceFormatError(f"{self._path(fname)}: an expert file this reader does not know (expected "
                                    "'layer_<L>_expert_<E>_mp_rank_<MP>_model_states.pt'; 'expp_rank_*' files come "
                                    "from pre-ZeRO MoE saves)")
        files[(int(m[1]), int(m[2]), int(m[3]))] = fname

    # --------------------------------------------------------------------------------- plan
    def _plan(self) -> None:
        super()._plan()
        if self.zero_stage >= 3:
            raise SourceFormatError(f"{self.tag_dir}: an MoE checkpoint under ZeRO-3; only ZeRO-1/2 MoE checkpoints "
                                    "(deepspeed.moe.layer.MoE) are read")
        if self.tp != 1 or self.pp != 1:
            raise SourceFormatError(f"{self.tag_dir}: an MoE checkpoint with tp={self.tp}, pp={self.pp}; MoE import "
                                    "reads tp=1, pp=1 checkpoints")
        osd = self._optim((0, 0))["optimizer_state_dict"]
        bos = osd.get("base_optimizer_state") or {}
        groups = bos.get("param_groups") if isinstance(bos, dict) else None
        if not isinstance(groups, list):
            raise SourceFormatError(f"{self._path(self.optim_files[(0, 0)])}: no base_optimizer_state.param_groups: "
                                    "cannot tell the expert parameter group")
        self.expert_groups: dict[int, int] = {}  # param group -> ep
        for g, pg in enumerate(groups):
            if isinstance(pg, dict) and pg.get("moe"):
                m = EP_GROUP_RE.match(str(pg.get("name", "")))
                if m is None:
                    raise SourceFormatError(f"{self._path(self.optim_files[(0, 0)])}: MoE parameter group {g} is "
                                            f"named {pg.get('name')!r}, expected 'ep_size_<ep>'")
                self.expert_groups[g] = int(m[1])
        if not self.expert_groups:
            raise SourceFormatError(f"{self.tag_dir}: expert files but no MoE parameter group ('moe': True) in "
                                    f"{self.optim_files[(0, 0)]}")
        eps = set(self.expert_groups.values())
        if len(eps) != 1:
            raise SourceFormatError(f"{self.tag_dir}: MoE parameter groups with different ep sizes {sorted(eps)}")
        self.ep = eps.pop()
        if self.dp % self.ep:
            raise SourceFormatError(f"{self.tag_dir}: ep={self.ep} does not divide the {self.dp} DP ranks")
        files = getattr(self, "expert_files", {})
        # (layer, expert) -> file; the name prefix of every layer from its files' keys
        self.layer_prefix: dict[int, str] = {}
        self.num_experts: dict[int, int] = {}
        expert_names: dict[tuple[int, int], list[str]] = {}
        for (layer, e, mp), f in sorted(files.items()):
            if mp != 0:
                raise SourceFormatError(f"{self._path(f)}: expert files for model-parallel rank {mp}; only mp_rank_00")
            sd = self._load(f, "MoE expert state")
            if not isinstance(sd, dict):
                raise SourceFormatError(f"{self._path(f)}: expected a dict of expert tensors")
            names = [k for k, v in sd.items() if isinstance(v, torch.Tensor)]
            prefixes = set()
            for n in names:
                m = EXPERTS_RE.match(n)
                if m is None or int(m["index"]) != e:
                    raise SourceFormatError(f"{self._path(f)}: key {n!r} is not a parameter of global expert {e}")
                prefixes.add(m["prefix"])
            if len(prefixes) != 1:
                raise SourceFormatError(f"{self._path(f)}: keys of several expert groups {sorted(prefixes)}")
            prefix = prefixes.pop()
            if self.layer_prefix.setdefault(layer, prefix) != prefix:
                raise SourceFormatError(f"{self._path(f)}: layer {layer} has experts under {prefix!r} and "
                                        f"{self.layer_prefix[layer]!r}")
            expert_names[(layer, e)] = names
            self.num_experts[layer] = max(self.num_experts.get(layer, 0), e + 1)
        for layer, n in self.num_experts.items():
            missing = [e for e in range(n) if (layer, e) not in expert_names]
            if missing or n % self.ep:
                raise SourceFormatError(f"{self.tag_dir}: MoE layer {layer} has expert files for experts "
                                        f"{sorted(e for (lay, e) in expert_names if lay == layer)}; expected 0..E-1 "
                                        f"with E divisible by ep={self.ep}")
        by_prefix = {p: layer for layer, p in self.layer_prefix.items()}
        # the dense part stays as the base reader planned it; the expert group's local entries are replaced by
        # one entry per (layer, global expert, parameter), layer by layer, expert by expert
        dense = [p for p in self.params if p["group"] not in self.expert_groups]
        local = [p for p in self.params if p["group"] in self.expert_groups]
        local_by_layer: dict[int, list[dict]] = {}
        for spec in local:
            m = EXPERTS_RE.match(spec["name"])
            if m is None or m["prefix"] not in by_prefix:
                raise SourceFormatError(f"{self.tag_dir}: expert-group parameter {spec['name']!r} has no expert files")
            local_by_layer.setdefault(by_prefix[m["prefix"]], []).append(spec)
        self.expert_specs: list[dict] = []
        for layer in sorted(self.num_experts):
            n = self.num_experts[layer]
            per = n // self.ep
            specs = local_by_layer.get(layer, [])
            suffixes = list(dict.fromkeys(EXPERTS_RE.match(s["name"])["suffix"] for s in specs))  # type: ignore[index]
            shape_of = {EXPERTS_RE.match(s["name"])["suffix"]: s for s in specs}  # type: ignore[index]
            if len(specs) != per * len(suffixes):
                raise SourceFormatError(f"{self.tag_dir}: MoE layer {layer}: param_shapes lists {len(specs)} local "
                                        f"expert parameters, expected {per} local experts x {len(suffixes)}")
            prefix = self.layer_prefix[layer]
            for e in range(n):
                wanted = {prefix + str(e) + sfx for sfx in suffixes}
                if wanted != set(expert_names[(layer, e)]):
                    raise SourceFormatError(f"{self._path(files[(layer, e, 0)])}: holds "
                                            f"{sorted(expert_names[(layer, e)])}, the optimizer's expert group names "
                                            f"{sorted(wanted)}")
                for sfx in suffixes:
                    base = shape_of[sfx]
                    self.expert_specs.append({
                        "name": prefix + str(e) + sfx, "stage": 0, "group": base["group"], "shapes": base["shapes"],
                        "expert": {"layer": layer, "index": e, "num": n, "ep_rank": e // per,
                                   "local": prefix + str(e % per) + sfx, "prefix": prefix, "suffix": sfx,
                                   "file": files[(layer, e, 0)]}})
        self.params = dense + self.expert_specs
        self.gates = [p["name"] for p in dense if ".deepspeed_moe.gate." in p["name"]]

    # --------------------------------------------------------------------------------- metadata
    @property
    def topology(self) -> dict:
        return {**super().topology, "ep": self.ep}

    @property
    def source_files(self) -> list[str]:
        return sorted(super().source_files + list(getattr(self, "expert_files", {}).values()))

    def objects(self) -> dict[str, Any]:
        out = super().objects()
        out["deepspeed/layout"]["ep"] = self.ep
        out["deepspeed/layout"]["expert_files"] = sorted(getattr(self, "expert_files", {}).values())
        out["deepspeed/moe"] = {
            "ep": self.ep, "form": self.experts_form,
            "layers": [{"layer": layer, "group": self.layer_prefix[layer].rstrip("."),
                        "num_experts": self.num_experts[layer],
                        "gate": [g for g in self.gates if g.startswith(self.layer_prefix[layer].split(".experts.")[0])]}
                       for layer in sorted(self.num_experts)],
            "expert_param_groups": {str(g): f"ep_size_{ep}" for g, ep in self.expert_groups.items()},
        }
        return out

    # --------------------------------------------------------------------------------- records
    def records(self, *, names=None, include_weights: bool = True) -> Iterator[ParamRecord]:
        recs = super().records(names=names, include_weights=include_weights)
        if self.experts_form == "separate":
            yield from recs
            return
        pending: dict[tuple[int, str], list[ParamRecord]] = {}
        for rec in recs:
            ex = rec.meta.get("moe_expert") if isinstance(rec.meta, dict) else None
            if ex is None:
                yield rec
                continue
            key = (ex["layer"], ex["suffix"])
            pending.setdefault(key, []).append(rec)
            if len(pending[key]) == ex["num"]:
                yield self._fuse(pending.pop(key))
        if pending:
            raise SourceFormatError(f"{self.tag_dir}: experts={self.experts_form!r} needs every expert of a layer in "
                                    f"one import share; missing some of {sorted(pending)}")

    def _fuse(self, recs: list[ParamRecord]) -> ParamRecord:
        ex = recs[0].meta["moe_expert"]
        name = ex["prefix"].rstrip(".") + ex["suffix"]
        states = {}
        for k, t in recs[0].states.items():
            if t.dim() == 0:
                states[k] = t
            else:
                states[k] = torch.stack([r.states[k] for r in recs])
        pattern = Expert(dim=0, num_experts=ex["num"]).to_json()
        return ParamRecord(name=name, states=states, pattern=pattern, kind="param", shape=tuple(states["fp32"].shape),
                           group=recs[0].group, stage=0, meta={}, step_type=recs[0].step_type)

    def _zero12_param(self, spec: dict) -> ParamRecord:
        if "expert" not in spec:
            return super()._zero12_param(spec)
        ex = spec["expert"]
        name, g, local = spec["name"], spec["group"], ex["local"]
        shape = spec["shapes"][0]
        want = _numel(shape)
        steps: list = []
        used: list[tuple[torch.Tensor, int, int]] = []
        # the expert-data-parallel ranks of its ep rank
        frags, got = self._gather_fragments([(0, dp) for dp in range(ex["ep_rank"], self.dp, self.ep)], g, local,
                                            f"{local!r} (global {name!r})", steps, used)
        if got != want:
            raise SourceFormatError(f"{self.tag_dir}: the fragments of expert parameter {name!r} (local {local!r} on "
                                    f"ep rank {ex['ep_rank']}) cover {got} of its {want} elements")
        states = {k: torch.cat(fs).reshape(shape).clone() for k, fs in frags.items()}
        step_t, step_type = self._merge_steps(name, steps)
        if step_t is not None:
            states["step"] = step_t
        if self.lp_weights != "none":
            sd = self._load(ex["file"], "MoE expert state")
            lp = sd.get(name)
            if not isinstance(lp, torch.Tensor) or tuple(lp.shape) != tuple(shape):
                raise SourceFormatError(f"{self._path(ex['file'])}: no weight {name!r} of shape {list(shape)}")
            if self.lp_weights == "all" or not torch.equal(states["fp32"].to(lp.dtype), lp):
                states["weight"] = lp.clone()
        for t, s, n in used:
            release_pages(t, s, n)
        pattern = ExpertMember(expert=ex["index"], num_experts=ex["num"], group=ex["prefix"].rstrip(".")).to_json()
        meta = {"moe_expert": {k: ex[k] for k in ("layer", "index", "num", "prefix", "suffix")}}
        return ParamRecord(name=name, states=states, pattern=pattern, kind="param", shape=tuple(shape), group=g,
                           stage=0, meta=meta, step_type=step_type)


# ------------------------------------------------------------------------------------ live engines
def _ep_of(engine) -> tuple[int, int]:
    """(ep, ep_rank) of a DeepSpeed MoE engine (one ep size for all its MoE layers)."""
    from deepspeed.moe.layer import MoE

    eps = {m.ep_size for m in engine.module.modules() if isinstance(m, MoE)}
    if len(eps) != 1:
        raise ConfigurationError(f"the engine's MoE layers have ep sizes {sorted(eps)}; expected exactly one")
    ep = eps.pop()
    import deepspeed.comm as dist

    return ep, dist.get_rank() % ep


def _engine_names(engine) -> dict:
    """param -> global name: DeepSpeed's names, expert parameters renamed to their global expert."""
    from deepspeed.moe.layer import MoE

    ep, ep_rank = _ep_of(engine)
    local_experts = {}
    for m in engine.module.modules():
        if isinstance(m, MoE):
            for p in m.deepspeed_moe.experts.parameters():
                local_experts[p] = m.num_local_experts
    out = {}
    for n, p in engine.module.named_parameters():
        out[p] = global_expert_name(n, ep_rank, local_experts[p]) if p in local_experts else n
    return out


def engine_param_shares(engine) -> dict[str, dict[str, tuple[int, int, torch.Tensor]]]:
    """``{global name: {state: (start, stop, values)}}``: this rank's ZeRO-1/2 share of every parameter
    (``[start, stop)`` of the flattened parameter) in fp32 master, ``exp_avg`` and ``exp_avg_sq``, read
    straight from the optimizer's flat partitions (``_hp_mapping`` addresses), not through
    ``safe_get_full_optimizer_state``."""
    opt = engine.optimizer
    names = _engine_names(engine)
    out: dict[str, dict[str, tuple[int, int, torch.Tensor]]] = {}
    for g, group in enumerate(opt.bit16_groups):
        hp = opt.single_partition_of_fp32_groups[g]
        st = opt.optimizer.state.get(hp, {})
        for p in group:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                continue
            lo, n = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
            h0 = mapping.hp_fragment_address.start
            pieces = {"fp32": (lo, lo + n, hp.detach()[h0:h0 + n].clone())}
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    pieces[k] = (lo, lo + n, st[k].detach()[h0:h0 + n].clone())
            out[names[p]] = pieces
    return out


def load_engine(engine, ref: str, *, store=None) -> None:
    """Load MoE checkpoint ``ref`` into a freshly built DeepSpeed MoE engine (ZeRO-1/2) of any ep / DP degree.

    Each rank plans its topology (dp = world, ep = the engine's, ZeRO stage and alignment as the engine's)
    through ``load_shard``: the dense group and the expert group (``ep_size_<ep>``) come as DeepSpeed's flat
    partitions, the expert one holding exactly this ep rank's experts (global ids), partitioned over the
    expert-data-parallel ranks. fp32 master, ``exp_avg``, ``exp_avg_sq`` and the step go into the
    optimizer; the low-precision weights follow from the master (``update_lp_params``); then
    ``global_steps`` / ``global_samples``. The store needs the separate expert form (``expert_member``)."""
    import deepspeed.comm as dist

    from .. import open_store
    from ..io import load_shard
    from ..topology import Topology

    if store is None:
        raise ConfigurationError("load_engine: give store=")
    if isinstance(store, (str, os.PathLike)):
        store = open_store(os.fspath(store))
    ck = store.checkpoint(ref)
    objs = ck.objects()
    moe = objs.get("deepspeed/moe")
    if not isinstance(moe, dict):
        raise UcpError(f"{ref}: version {ck.id} is not an imported DeepSpeed MoE checkpoint (no deepspeed/moe object)")
    if moe.get("form") != "separate":
        raise ConfigurationError(f"{ref}: experts were imported {moe.get('form')!r}; load_engine needs the separate "
                                 "form (DeepSpeed's flat order interleaves each expert's parameters)")
    opt = engine.optimizer
    if not hasattr(opt, "single_partition_of_fp32_groups"):
        raise ConfigurationError(f"load_engine: optimizer {type(opt).__name__} is not a ZeRO-1/2 optimizer")
    ep, _ = _ep_of(engine)
    if int(getattr(engine, "mp_world_size", 1) or 1) != 1 or hasattr(engine, "num_stages"):
        raise ConfigurationError("load_engine: MoE engines with tensor or pipeline parallelism are not supported")
    # ZeRO-1/2 align each group's flat buffer to nccl_start_alignment_factor (2) x its partition count
    topo = Topology(dp=int(engine.dp_world_size), ep=ep, zero_stage=int(engine.zero_optimization_stage()),
                    zero_alignment=2)
    rank = dist.get_rank()
    names = _engine_names(engine)
    zero_groups = {names[p]: f"g{g}" for g, group in enumerate(opt.bit16_groups) for p in group}
    shard = load_shard(ck, topo, rank, states=["fp32", "exp_avg", "exp_avg_sq", "step"],
                       zero_groups=lambda n: zero_groups.get(n, "g_other"))
    by_key = {(b.group, b.state): b for b in shard.plan.buffers}
    inner = opt.optimizer
    for g, hp in enumerate(opt.single_partition_of_fp32_groups):
        for st in ("fp32", "exp_avg", "exp_avg_sq"):
            b = by_key.get((f"g{g}", st))
            if b is None:
                raise UcpError(f"{ref}: no {st} partition planned for parameter group {g}")
            buf = shard.buffers[b.key]
            if buf.numel() != hp.numel():
                raise UcpError(f"{ref}: parameter group {g} state {st}: planned {buf.numel()} elements, DeepSpeed's "
                               f"flat partition has {hp.numel()}")
            if st == "fp32":
                hp.data.copy_(buf.to(hp.dtype).view_as(hp))
            else:
                state = inner.state[hp]
                if st in state:
                    state[st].copy_(buf.to(state[st].dtype).view_as(state[st]))
                else:
                    state[st] = buf.to(hp.dtype).view_as(hp).clone()
        step = next((shard.tensors[(names[p], "step")] for p in opt.bit16_groups[g]
                     if (names[p], "step") in shard.tensors), None)
        if step is not None:
            old = inner.state[hp].get("step")
            inner.state[hp]["step"] = (step.to(dtype=old.dtype).reshape(old.shape).clone()
                                       if isinstance(old, torch.Tensor) else step.clone())
    opt.update_lp_params()
    for k in ("global_steps", "global_samples", "skipped_steps"):
        if objs.get(k) is not None:
            setattr(engine, k, int(objs[k]))
