"""DeepSpeed mixture-of-experts checkpoints (``deepspeed.moe.layer.MoE``, ZeRO-1/2): import and resume.

What DeepSpeed 0.19 writes for an MoE model with expert parallelism ``ep`` (seen with real training on
CPU/gloo, see ``tools/ds_moe.py``):

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

import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ucp_store.deepspeed.files import EXPERT_RE
from ucp_store.deepspeed.merge import ParamRecord
from ucp_store.deepspeed.reader import DeepSpeedReader, release_pages
from ucp_store.errors import ConfigurationError, SourceFormatError, UcpError
from ucp_store.patterns import Expert, ExpertMember
from ucp_store.topology import Topology

__all__ = ["UNIVERSAL_REFUSAL", "DeepSpeedMoEReader", "open_tag_reader", "global_expert_name", "local_expert_name",
           "load_engine", "engine_param_shares", "ep_of", "EXPERTS_RE", "ExpertSpec"]

EXPERT_FILE_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
EXPERTS_RE = re.compile(r"^(?P<prefix>.*\.deepspeed_experts\.)(?P<index>\d+)(?P<suffix>\..+)$")
EP_GROUP_RE = re.compile(r"^ep_size_(\d+)$")

UNIVERSAL_REFUSAL = (
    "a DeepSpeed MoE checkpoint cannot be exported as a universal folder: DeepSpeed's load_universal looks up "
    "each expert parameter by its local name (deepspeed_experts.<j>), which on ep rank r > 0 is global expert "
    "r * E/ep + j, so every ep rank but the first would load another expert's state without an error. Resume MoE "
    "through load_shard: ucp_store.deepspeed.moe.load_engine(engine, ref, store=...)")


# ------------------------------------------------------------------------------------ plan records
@dataclass
class EpPlacement:
    """DeepSpeed's default expert groups over a source's tp x dp ranks, per ep rank: the model-parallel rank
    of the rank that writes its expert files, and the (mp, dp) optimizer files of its expert-data-parallel
    ranks in ZeRO order."""

    writer_mp: list[int]
    keys: list[list[tuple[int, int]]]


@dataclass
class ExpertFiles:
    """The expert files of a tag folder by (MoE layer, global expert): the file, the model-parallel rank that
    wrote it and the names of its tensors."""

    file: dict[tuple[int, int], str]
    mp: dict[tuple[int, int], int]
    names: dict[tuple[int, int], list[str]]


@dataclass
class ExpertSpec:
    """Where one global expert parameter's state comes from: the ``"expert"`` entry of its reader spec."""

    layer: int  #: the MoE layer (counted in module order)
    index: int  #: the global expert id
    num: int  #: the layer's number of experts
    ep_rank: int  #: the ep rank holding the expert
    local: str  #: its name on that ep rank (local expert index), as the optimizer files name it
    prefix: str  #: ``...deepspeed_experts.``
    suffix: str  #: ``.w1.weight``
    file: str  #: its expert file (the low-precision weight)
    keys: list[tuple[int, int]]  #: the (mp, dp) optimizer files of its ep rank's expert-data-parallel ranks

    def meta(self) -> dict[str, Any]:
        """The record's ``moe_expert`` metadata (stored with the record; the fused form groups by it)."""
        return {"layer": self.layer, "index": self.index, "num": self.num, "prefix": self.prefix,
                "suffix": self.suffix}


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
        """The base reader's plan, its expert group's local entries replaced by one spec per (layer, global
        expert, parameter): find the expert group and ep, place the ep ranks, scan and check the expert files,
        then build the specs."""
        super()._plan()
        if self.zero_stage >= 3:
            raise SourceFormatError(f"{self.tag_dir}: an MoE checkpoint under ZeRO-3; only ZeRO-1/2 MoE checkpoints "
                                    "(deepspeed.moe.layer.MoE) are read")
        if self.pp != 1:
            raise SourceFormatError(f"{self.tag_dir}: an MoE checkpoint with pp={self.pp}; MoE import reads "
                                    "checkpoints without pipeline parallelism (tp x dp)")
        self.expert_groups = self._expert_param_groups()
        eps = set(self.expert_groups.values())
        if len(eps) != 1:
            raise SourceFormatError(f"{self.tag_dir}: MoE parameter groups with different ep sizes {sorted(eps)}")
        self.ep = eps.pop()
        placement = self._ep_placement()
        found = self._scan_expert_files()
        self._check_expert_writers(found, placement)
        # the dense part stays as the base reader planned it; the expert group's local entries are replaced by
        # one entry per (layer, global expert, parameter), layer by layer, expert by expert
        dense = [p for p in self.params if p["group"] not in self.expert_groups]
        self.expert_specs = self._expert_specs(found, placement)
        self.params = dense + self.expert_specs
        self.gates = [p["name"] for p in dense if ".deepspeed_moe.gate." in p["name"]]

    def _expert_param_groups(self) -> dict[int, int]:
        """param group -> ep of the MoE parameter groups (``moe: True``, named ``ep_size_<ep>``) in the first
        optimizer file."""
        osd = self._optim((0, 0))["optimizer_state_dict"]
        bos = osd.get("base_optimizer_state") or {}
        groups = bos.get("param_groups") if isinstance(bos, dict) else None
        if not isinstance(groups, list):
            raise SourceFormatError(f"{self._path(self.optim_files[(0, 0)])}: no base_optimizer_state.param_groups: "
                                    "cannot tell the expert parameter group")
        out: dict[int, int] = {}
        for g, pg in enumerate(groups):
            if isinstance(pg, dict) and pg.get("moe"):
                m = EP_GROUP_RE.match(str(pg.get("name", "")))
                if m is None:
                    raise SourceFormatError(f"{self._path(self.optim_files[(0, 0)])}: MoE parameter group {g} is "
                                            f"named {pg.get('name')!r}, expected 'ep_size_<ep>'")
                out[g] = int(m[1])
        if not out:
            raise SourceFormatError(f"{self.tag_dir}: expert files but no MoE parameter group ('moe': True) in "
                                    f"{self.optim_files[(0, 0)]}")
        return out

    def _ep_placement(self) -> EpPlacement:
        """Where DeepSpeed's default (E+D) expert groups put each ep rank.

        They span the whole tp x dp world of a stage, tp fastest (Megatron's and PipeModelDataParallelTopology's
        order): Topology(ep_over="stage") (topology.py, the one home of the rule): global rank r = tp + TP * dp
        is ep rank r % ep, and the ranks of one ep rank (r, r + ep, ...) form its expert-data-parallel group,
        which ZeRO partitions the expert group over. Experts are not tensor-parallel there: each expert file is
        written once, by the rank of its ep rank whose expert-data-parallel rank is 0 (global rank ep_rank, so
        mp_rank ep_rank % tp)."""
        world = self.tp * self.dp
        if world % self.ep:
            raise SourceFormatError(f"{self.tag_dir}: ep={self.ep} does not divide the {world} ranks (tp={self.tp} x "
                                    f"dp={self.dp})")
        groups_topo = Topology(tp=self.tp, dp=self.dp, ep=self.ep, ep_over="stage")
        writer_mp = [groups_topo.coords(groups_topo.rank({"ep": er, "edp": 0}))["tp"] for er in range(self.ep)]
        keys = [[(c["tp"], c["dp"]) for c in sorted((groups_topo.coords(r) for r in range(world)),
                                                     key=lambda c: c["edp"]) if c["ep"] == er]
                for er in range(self.ep)]
        return EpPlacement(writer_mp, keys)

    def _scan_expert_files(self) -> ExpertFiles:
        """Open every expert file: one per (layer, global expert), each holding the parameters of exactly that
        expert under one prefix per layer. Sets ``layer_prefix`` and ``num_experts``."""
        by_expert: dict[tuple[int, int], dict[int, str]] = {}
        for (layer, e, mp), f in getattr(self, "expert_files", {}).items():
            by_expert.setdefault((layer, e), {})[mp] = f
        self.layer_prefix: dict[int, str] = {}
        self.num_experts: dict[int, int] = {}
        found = ExpertFiles(file={}, mp={}, names={})
        for (layer, e), per_mp in sorted(by_expert.items()):
            if len(per_mp) > 1:
                raise SourceFormatError(
                    f"{self.tag_dir}: expert {e} of MoE layer {layer} has files for model-parallel ranks "
                    f"{sorted(per_mp)} ({', '.join(sorted(per_mp.values()))}): tensor-parallel experts "
                    "(MoE(enable_expert_tensor_parallelism=True)) are not read; experts must be whole on one rank")
            (mp, f), = per_mp.items()
            found.file[(layer, e)], found.mp[(layer, e)] = f, mp
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
            found.names[(layer, e)] = names
            self.num_experts[layer] = max(self.num_experts.get(layer, 0), e + 1)
        return found

    def _check_expert_writers(self, found: ExpertFiles, placement: EpPlacement) -> None:
        """Every layer has experts 0..E-1 (E divisible by ep), each written by its ep rank's writer."""
        for layer, n in self.num_experts.items():
            missing = [e for e in range(n) if (layer, e) not in found.names]
            if missing or n % self.ep:
                raise SourceFormatError(f"{self.tag_dir}: MoE layer {layer} has expert files for experts "
                                        f"{sorted(e for (lay, e) in found.names if lay == layer)}; expected 0..E-1 "
                                        f"with E divisible by ep={self.ep}")
            per = n // self.ep
            for e in range(n):
                mp = found.mp[(layer, e)]
                if mp != placement.writer_mp[e // per]:
                    raise SourceFormatError(
                        f"{self._path(found.file[(layer, e)])}: expert {e} is on ep rank {e // per}, whose writer "
                        f"(global rank {e // per}) is model-parallel rank {placement.writer_mp[e // per]}, not {mp}: "
                        f"not DeepSpeed's default expert groups over tp={self.tp} x dp={self.dp} ranks (tp fastest, "
                        "ep rank = rank % ep); use_data_before_expert_parallelism layouts are not read")

    def _expert_specs(self, found: ExpertFiles, placement: EpPlacement) -> list[dict]:
        """One reader spec per (layer, global expert, parameter), layer by layer, expert by expert: each ep
        rank's experts are then, in record order, exactly DeepSpeed's flat order of its expert group."""
        by_prefix = {p: layer for layer, p in self.layer_prefix.items()}
        local_by_layer: dict[int, list[dict]] = {}
        for spec in (p for p in self.params if p["group"] in self.expert_groups):
            m = EXPERTS_RE.match(spec["name"])
            if m is None or m["prefix"] not in by_prefix:
                raise SourceFormatError(f"{self.tag_dir}: expert-group parameter {spec['name']!r} has no expert files")
            local_by_layer.setdefault(by_prefix[m["prefix"]], []).append(spec)
        out: list[dict] = []
        for layer in sorted(self.num_experts):
            out += self._layer_specs(layer, local_by_layer.get(layer, []), found, placement)
        return out

    def _layer_specs(self, layer: int, specs: list[dict], found: ExpertFiles, placement: EpPlacement) -> list[dict]:
        """The specs of MoE layer ``layer`` from its local expert-group specs (``specs``, the saving ranks'
        names), checked against its expert files' names."""
        n = self.num_experts[layer]
        per = n // self.ep
        suffixes = list(dict.fromkeys(EXPERTS_RE.match(s["name"])["suffix"] for s in specs))  # type: ignore[index]
        shape_of = {EXPERTS_RE.match(s["name"])["suffix"]: s for s in specs}  # type: ignore[index]
        if len(specs) != per * len(suffixes):
            raise SourceFormatError(f"{self.tag_dir}: MoE layer {layer}: param_shapes lists {len(specs)} local "
                                    f"expert parameters, expected {per} local experts x {len(suffixes)}")
        prefix = self.layer_prefix[layer]
        out: list[dict] = []
        for e in range(n):
            wanted = {prefix + str(e) + sfx for sfx in suffixes}
            if wanted != set(found.names[(layer, e)]):
                raise SourceFormatError(f"{self._path(found.file[(layer, e)])}: holds "
                                        f"{sorted(found.names[(layer, e)])}, the optimizer's expert group names "
                                        f"{sorted(wanted)}")
            er = e // per
            for sfx in suffixes:
                base = shape_of[sfx]
                shapes = base["shapes"]
                if any(tuple(s) != tuple(shapes[0]) for s in shapes[1:]):
                    raise SourceFormatError(f"{self.tag_dir}: expert parameter {base['name']!r} has shapes "
                                            f"{[list(x) for x in shapes]} on the TP ranks; experts must be whole")
                ex = ExpertSpec(layer=layer, index=e, num=n, ep_rank=er, local=prefix + str(e % per) + sfx,
                                prefix=prefix, suffix=sfx, file=found.file[(layer, e)], keys=placement.keys[er])
                out.append({"name": prefix + str(e) + sfx, "stage": 0, "group": base["group"], "shapes": shapes,
                            "expert": ex})
        return out

    # --------------------------------------------------------------------------------- metadata
    @property
    def topology(self) -> dict:
        # ep_over: DeepSpeed's expert groups of whole experts span a stage's ranks (global rank % ep), which
        # differs from ep carved out of dp as soon as tp > 1; recorded so that plans default to it
        return {**super().topology, "ep": self.ep, "ep_over": "stage"}

    @property
    def source_files(self) -> list[str]:
        return sorted(super().source_files + list(getattr(self, "expert_files", {}).values()))

    def objects(self) -> dict[str, Any]:
        out = super().objects()
        out["deepspeed/layout"]["ep"] = self.ep
        out["deepspeed/layout"]["expert_files"] = sorted(getattr(self, "expert_files", {}).values())
        out["deepspeed/moe"] = {
            "ep": self.ep, "form": self.experts_form, "tp": self.tp,
            # DeepSpeed's default expert groups: ep rank = global rank % ep over the tp x dp ranks (tp fastest);
            # experts whole (not tensor-parallel), ZeRO-partitioned over the tp x dp / ep ranks of their ep rank
            "expert_groups": "rank % ep",
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
        ex: ExpertSpec = spec["expert"]
        name, g, local = spec["name"], spec["group"], ex.local
        shape = spec["shapes"][0]
        want = int(math.prod(int(x) for x in shape))
        steps: list = []
        used: list[tuple[torch.Tensor, int, int]] = []
        # the expert-data-parallel ranks of its ep rank
        frags, got = self._gather_fragments(ex.keys, g, local, f"{local!r} (global {name!r})", steps, used)
        if got != want:
            raise SourceFormatError(f"{self.tag_dir}: the fragments of expert parameter {name!r} (local {local!r} on "
                                    f"ep rank {ex.ep_rank}) cover {got} of its {want} elements")
        states = {k: torch.cat(fs).reshape(shape).clone() for k, fs in frags.items()}
        step_t, step_type = self._merge_steps(name, steps)
        if step_t is not None:
            states["step"] = step_t
        if self.lp_weights != "none":
            sd = self._load(ex.file, "MoE expert state")
            lp = sd.get(name)
            if not isinstance(lp, torch.Tensor) or tuple(lp.shape) != tuple(shape):
                raise SourceFormatError(f"{self._path(ex.file)}: no weight {name!r} of shape {list(shape)}")
            if self.lp_weights == "all" or not torch.equal(states["fp32"].to(lp.dtype), lp):
                states["weight"] = lp.clone()
        for t, s, n in used:
            release_pages(t, s, n)
        pattern = ExpertMember(expert=ex.index, num_experts=ex.num, group=ex.prefix.rstrip(".")).to_json()
        meta = {"moe_expert": ex.meta()}
        return ParamRecord(name=name, states=states, pattern=pattern, kind="param", shape=tuple(shape), group=g,
                           stage=0, meta=meta, step_type=step_type)


# ------------------------------------------------------------------------------------ live engines
def ep_of(engine) -> tuple[int, int]:
    """(ep, ep_rank) of a DeepSpeed MoE engine (one ep size for all its MoE layers)."""
    from deepspeed.moe.layer import MoE

    eps = {m.ep_size for m in engine.module.modules() if isinstance(m, MoE)}
    if len(eps) != 1:
        raise ConfigurationError(f"the engine's MoE layers have ep sizes {sorted(eps)}; expected exactly one")
    ep = eps.pop()
    from deepspeed.utils import groups

    return ep, int(groups._get_expert_parallel_rank(f"ep_size_{ep}"))


def _engine_names(engine) -> dict:
    """param -> global name: DeepSpeed's names, expert parameters renamed to their global expert."""
    from deepspeed.moe.layer import MoE

    ep, ep_rank = ep_of(engine)
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


def _engine_tp(engine) -> tuple[int, int]:
    """(tp, tp_rank) of an engine's mpu (1, 0 without one)."""
    mpu = getattr(engine, "mpu", None)
    if mpu is None:
        return 1, 0
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank, bwc_tensor_model_parallel_world_size

    return int(bwc_tensor_model_parallel_world_size(mpu)), int(bwc_tensor_model_parallel_rank(mpu))


@dataclass
class MoEEngineTarget:
    """A live DeepSpeed MoE engine (ZeRO-1/2) as :func:`load_engine` fills it."""

    topo: Topology  #: ``Topology(tp, dp, ep, ep_over="stage")`` with the engine's ZeRO stage and alignment
    rank: int
    names: dict  #: param -> global name (expert parameters by their global expert)
    zero_groups: dict[str, str]  #: global name -> its flat group ``g<i>``


def load_engine(engine, ref: str, *, store=None) -> None:
    """Load MoE checkpoint ``ref`` into a freshly built DeepSpeed MoE engine (ZeRO-1/2) of any tp / ep / DP
    degree.

    Each rank plans its share once, through the planner and ``io.execute``, at
    ``Topology(tp, dp, ep, ep_over="stage")`` (``ucp plan --ep`` plans the same): the dense part at ``tp`` x
    ``dp`` (the engine's mpu; TP slices by their patterns, ZeRO over the data-parallel group), and the experts
    as DeepSpeed's default expert groups place them: over all ``tp x dp`` ranks of the world (experts are
    whole, not tensor-parallel), ep rank = rank % ep, ZeRO-partitioned over the ranks of that ep rank. Both
    come as DeepSpeed's flat partitions: the expert group (``ep_size_<ep>``) holds exactly this ep rank's
    experts (global ids). fp32 master, ``exp_avg``, ``exp_avg_sq`` and the step go into the optimizer; the
    low-precision weights follow from the master (``update_lp_params``); then ``global_steps`` /
    ``global_samples``. The store needs the separate expert
    form (``expert_member``)."""
    from ucp_store.io.read import execute
    from ucp_store.plan.planner import plan as make_plan

    ck, objs = _open_moe_version(ref, store)
    target = _moe_engine_target(engine)
    records = ck.tensors()
    p = make_plan(records, target.topo, target.rank, states=["fp32", "exp_avg", "exp_avg_sq", "step"],
                  zero_groups=lambda n: target.zero_groups.get(n, "g_other"))
    shard = execute(ck, p, infos=records)
    buffers = {(b.group, b.state): shard.buffers[b.key] for b in p.buffers}
    steps = {n: t for (n, st), t in shard.tensors.items() if st == "step"}
    _fill_optimizer(engine.optimizer, ref, buffers, steps, target.names)
    engine.optimizer.update_lp_params()
    for k in ("global_steps", "global_samples", "skipped_steps"):
        if objs.get(k) is not None:
            setattr(engine, k, int(objs[k]))


def _open_moe_version(ref: str, store) -> tuple[Any, dict[str, Any]]:
    """(checkpoint, objects) of ``ref``, refusing a version that is not an MoE import of the separate form.
    Over several ranks only rank 0 opens the store and reads the catalog (``load.open_version_everywhere``)."""
    from ucp_store.deepspeed.load import open_version_everywhere

    if store is None:
        raise ConfigurationError("load_engine: give store=")
    ck, objs = open_version_everywhere(store, ref, f"load_engine of {ref}")
    moe = objs.get("deepspeed/moe")
    if not isinstance(moe, dict):
        raise UcpError(f"{ref}: version {ck.id} is not an imported DeepSpeed MoE checkpoint (no deepspeed/moe object)")
    if moe.get("form") != "separate":
        raise ConfigurationError(f"{ref}: experts were imported {moe.get('form')!r}; load_engine needs the separate "
                                 "form (DeepSpeed's flat order interleaves each expert's parameters)")
    return ck, objs


def _moe_engine_target(engine) -> MoEEngineTarget:
    """The engine's topology and rank, checked to be DeepSpeed's default expert groups (tp fastest, ep rank =
    rank % ep) under a ZeRO-1/2 optimizer without pipeline parallelism."""
    import deepspeed.comm as dist

    opt = engine.optimizer
    if not hasattr(opt, "single_partition_of_fp32_groups"):
        raise ConfigurationError(f"load_engine: optimizer {type(opt).__name__} is not a ZeRO-1/2 optimizer")
    ep, ep_rank = ep_of(engine)
    if hasattr(engine, "num_stages"):
        raise ConfigurationError("load_engine: MoE engines with pipeline parallelism are not supported")
    tp, tp_rank = _engine_tp(engine)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = int(engine.dp_world_size)
    if tp * dp != world or rank % tp != tp_rank:
        raise ConfigurationError(f"load_engine: rank {rank} of {world} is tp rank {tp_rank} of tp={tp} with dp={dp}; "
                                 "expected tp x dp = world with tp fastest (rank = tp_rank + tp * dp_rank)")
    if world % ep:
        raise ConfigurationError(f"load_engine: ep={ep} does not divide the {world} ranks")
    stage = int(engine.zero_optimization_stage())
    # ZeRO-1/2 align each group's flat buffer to nccl_start_alignment_factor (2) x its partition count
    topo = Topology(tp=tp, dp=dp, ep=ep, ep_over="stage", zero_stage=stage, zero_alignment=2)
    if topo.coords(rank)["ep"] != ep_rank:
        raise ConfigurationError(f"load_engine: rank {rank} is ep rank {ep_rank} of ep={ep}; expected DeepSpeed's "
                                 f"default expert groups (ep rank {topo.coords(rank)['ep']} = rank % ep over the "
                                 "whole world)")
    names = _engine_names(engine)
    zero_groups = {names[p]: f"g{g}" for g, group in enumerate(opt.bit16_groups) for p in group}
    return MoEEngineTarget(topo, rank, names, zero_groups)


def _fill_optimizer(opt, ref: str, buffers: dict[tuple[str, str], torch.Tensor], steps: dict[str, torch.Tensor],
                    names: dict) -> None:
    """Copy the read flat partitions (``buffers``: (group, state) -> flat tensor) into the ZeRO-1/2 optimizer's
    fp32 groups and moments, and each group's step (the first of its parameters' stored steps)."""
    inner = opt.optimizer
    for g, hp in enumerate(opt.single_partition_of_fp32_groups):
        for st in ("fp32", "exp_avg", "exp_avg_sq"):
            buf = buffers.get((f"g{g}", st))
            if buf is None:
                raise UcpError(f"{ref}: no {st} partition planned for parameter group {g}")
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
                    state[st] = buf.to(device=hp.device, dtype=hp.dtype).view_as(hp).clone()
        step = next((steps[names[p]] for p in opt.bit16_groups[g] if names[p] in steps), None)
        if step is not None:
            old = inner.state[hp].get("step")
            inner.state[hp]["step"] = (step.to(device=old.device, dtype=old.dtype).reshape(old.shape).clone()
                                       if isinstance(old, torch.Tensor) else step.clone())
