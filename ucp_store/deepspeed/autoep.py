"""DeepSpeed AutoEP checkpoints (``expert_parallel: {"enabled": true, "autoep_size": ep}``, ZeRO-1/2 and ZeRO-3).

AutoEP (DeepSpeed 0.19, ``deepspeed/module_inject/auto_ep*.py``) swaps each MoE block of a Hugging Face model
(a preset: Mixtral, Qwen3-MoE, DeepSeek-V2/V3, ...) for an ``AutoEPMoELayer`` whose experts are *fused*
tensors ``<prefix>.w1`` / ``w2`` / ``w3`` of shape ``[E/ep, ...]``: ep rank ``r`` holds global experts
``r*E/ep .. (r+1)*E/ep - 1`` (DeepSpeed's ``expert_placement`` descriptor says so, and is checked here). The
expert parameters form a second optimizer group named ``ep_size_<ep>`` (``moe: True``) under their *local*
names, partitioned over the expert-data-parallel ranks only (``edp = dp / ep``; DP rank ``d`` is ep rank
``d % ep`` and expert-ZeRO rank ``d // ep``, DeepSpeed's default E+D order). What each save writes, as seen
with real training on CPU/gloo (``tools/ds_autoep.py``):

- every model-state file carries ``ds_autoep_layers``: per MoE layer ``expert_key_prefix``, ``num_experts``,
  ``ep_size``, the placement, the ``checkpoint_format`` (``per_expert_files`` under ZeRO-1/2,
  ``zero3_partitioned`` under ZeRO-3) and, per file, that rank's ``ep_rank`` and expert-data-parallel rank;
- ZeRO-1/2: ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt`` with expert ``E``'s low-precision slices
  keyed ``<prefix>.w1.<E>`` (global id last); the fp32 master and Adam moments in the ``ep_size_<ep>`` flat
  group of every DP rank's ``*_optim_states.pt`` (``param_slice_mappings`` by local name);
- ZeRO-3: no expert files; each DP rank's optimizer file holds the expert sub-group
  (``ds_zero_partition_groups``: family ``autoep_expert``, ``partition_count`` = edp), each parameter's
  partition ``ceil(numel / edp)`` long, in ``param_shapes`` order.

``DeepSpeedAutoEPReader`` yields one record per fused expert parameter with its *logical* shape ``[E, ...]``
(every ep rank's local block stacked in ep-rank order, which is global-expert order) and the ``expert``
pattern, with fp32 master, ``exp_avg``, ``exp_avg_sq`` and ``step`` read from the optimizer files (never
through DeepSpeed's ``safe_get_full_optimizer_state``), plus the low-precision weight from the expert files
when it is not the master cast down. The dense part (attention, router gate, shared experts) is read as
:class:`~ucp_store.deepspeed.reader.DeepSpeedReader` reads it. The experts then replan to any ``ep``
that divides ``E``: each rank's ``[E/ep, ...]`` block is one slice of the logical tensor.

``load_engine(engine, ref, store=)`` loads such a version into a freshly built AutoEP engine of any ep (and
DP) degree, ZeRO-1/2 or ZeRO-3, through ``load_shard`` (:func:`ucp_store.deepspeed.load.load` with the engine's
topology including ``ep``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from ucp_store import safe_pickle as sp
from ucp_store.deepspeed.files import MODEL_RE, ZERO3_MODEL_RE
from ucp_store.deepspeed.merge import ParamRecord, numel_of
from ucp_store.deepspeed.reader import DeepSpeedReader, release_pages
from ucp_store.errors import ConfigurationError, SourceFormatError
from ucp_store.patterns import Expert

__all__ = ["AUTOEP_KEYS", "UNIVERSAL_REFUSAL", "is_autoep_tag", "DeepSpeedAutoEPReader", "load_engine",
           "engine_topology"]

UNIVERSAL_REFUSAL = (
    "an AutoEP checkpoint is not exported as a universal folder: DeepSpeed's AutoEP load_universal reads expert "
    "files carrying its own AutoEP metadata (ep_is_expert_param, num_experts, the per-layer placement) that this "
    "exporter does not write, and no export of it has been checked against DeepSpeed's loader. Convert the "
    "DeepSpeed tag folder with ds_to_universal, or resume through load_shard: "
    "ucp_store.deepspeed.autoep.load_engine(engine, ref, store=...)")

AUTOEP_KEYS = ("ds_autoep_layers", "autoep_layers")  # DeepSpeed's AUTOEP_LAYERS_KEY and its legacy name
AUTOEP_FILE_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
EP_GROUP_RE = re.compile(r"^ep_size_(\d+)$")
FORMATS = {"per_expert_files": (1, 2), "zero3_partitioned": (3,)}


def _autoep_layers(ms: Any) -> list | None:
    if not isinstance(ms, dict):
        return None
    for k in AUTOEP_KEYS:
        if ms.get(k) is not None:
            return ms[k]
    return None


def is_autoep_tag(tag_dir: str | os.PathLike) -> bool:
    """Whether a DeepSpeed tag folder was saved by an AutoEP engine (its first model-state file names
    ``ds_autoep_layers``). Memory-mapped through the allow-list unpickler; no tensor bytes are read."""
    path = os.fspath(tag_dir)
    if not os.path.isdir(path):
        return False
    files = sorted(f for f in os.listdir(path) if MODEL_RE.match(f) or ZERO3_MODEL_RE.match(f))
    if not files:
        return False
    try:
        ms = sp.load(os.path.join(path, files[0]), what="model state")
    except Exception:  # noqa: BLE001 - the chosen reader reports an unreadable file with its own message
        return False
    return _autoep_layers(ms) is not None


class DeepSpeedAutoEPReader(DeepSpeedReader):
    """A DeepSpeed AutoEP tag folder (ZeRO-1/2 or ZeRO-3): the dense part as ``DeepSpeedReader`` reads it,
    each fused expert parameter as one ``[E, ...]`` record with the ``expert`` pattern (module docstring)."""

    reads_experts = True  # universal_checkpoint_info names the experts (expert_parameter_patterns)

    def _expert_file(self, fname: str) -> None:
        files = self.__dict__.setdefault("expert_files", {})
        m = AUTOEP_FILE_RE.match(fname)
        if m is None:
            raise SourceFormatError(f"{self._path(fname)}: an expert file AutoEP does not write (expected "
                                    "'layer_<L>_expert_<E>_mp_rank_<MP>_model_states.pt')")
        files[(int(m[1]), int(m[2]), int(m[3]))] = fname

    # --------------------------------------------------------------------------------- plan
    def _plan(self) -> None:
        super()._plan()
        if self.tp != 1 or self.pp != 1:
            raise SourceFormatError(f"{self.tag_dir}: an AutoEP checkpoint with tp={self.tp}, pp={self.pp}; AutoEP "
                                    "import reads tp=1, pp=1 checkpoints")
        first = self._model_file_name(0, 0)
        layers = _autoep_layers(self.model_states[first])
        if not isinstance(layers, list) or not layers:
            raise SourceFormatError(f"{self._path(first)}: no ds_autoep_layers list: not an AutoEP checkpoint")
        if (self.ds_config or {}).get("use_data_before_expert_parallelism"):
            raise SourceFormatError(f"{self.tag_dir}: saved with use_data_before_expert_parallelism; AutoEP import "
                                    "reads DeepSpeed's default expert-then-data rank order")
        self.layers: list[dict] = []
        eps = set()
        for i, lay in enumerate(layers):
            where = f"{self._path(first)}: ds_autoep_layers[{i}]"
            if not isinstance(lay, dict):
                raise SourceFormatError(f"{where}: not a dict")
            try:
                prefix, n, ep = str(lay["expert_key_prefix"]), int(lay["num_experts"]), int(lay["ep_size"])
                fmt = lay.get("checkpoint_format")
            except (KeyError, TypeError, ValueError) as exc:
                raise SourceFormatError(f"{where}: lacks {exc} (expert_key_prefix, num_experts, ep_size)") from None
            if fmt not in FORMATS or self.zero_stage not in FORMATS[fmt]:
                raise SourceFormatError(f"{where}: checkpoint_format {fmt!r} under ZeRO stage {self.zero_stage}; "
                                        "expected 'per_expert_files' (ZeRO-1/2) or 'zero3_partitioned' (ZeRO-3)")
            if ep < 1 or n % ep or self.dp % ep:
                raise SourceFormatError(f"{where}: {n} experts at ep_size={ep} over {self.dp} DP ranks; expected ep "
                                        "dividing both")
            self._check_placement(lay.get("expert_placement"), n, ep, where)
            eps.add(ep)
            self.layers.append({"layer": int(lay.get("moe_layer_id", i)), "prefix": prefix, "num_experts": n,
                                "ep": ep, "module": lay.get("module_path"), "format": fmt})
        if len(eps) != 1:
            raise SourceFormatError(f"{self.tag_dir}: AutoEP layers with different ep sizes {sorted(eps)}")
        self.ep = eps.pop()
        self.edp = self.dp // self.ep
        if self.zero_stage >= 3:
            self._check_zero3_ranks()
        self.expert_groups = self._find_expert_groups()
        by_prefix = {lay["prefix"] + ".": lay for lay in self.layers}
        self.expert_specs: list[dict] = []
        for spec in self.params:
            if spec["group"] not in self.expert_groups:
                continue
            lay = next((v for k, v in by_prefix.items() if spec["name"].startswith(k)), None)
            if lay is None:
                raise SourceFormatError(f"{self.tag_dir}: parameter {spec['name']!r} of the expert group ep_size_"
                                        f"{self.ep} is under no AutoEP layer's expert_key_prefix")
            local = tuple(spec["shapes"][0])
            per = lay["num_experts"] // self.ep
            if not local or local[0] != per:
                raise SourceFormatError(f"{self.tag_dir}: expert parameter {spec['name']!r} has local shape "
                                        f"{list(local)}; expected [{per}, ...] ({lay['num_experts']} experts at "
                                        f"ep={self.ep})")
            spec["autoep"] = {**lay, "local_shape": local, "suffix": spec["name"][len(lay["prefix"]) + 1:]}
            spec["shapes"] = [(lay["num_experts"], *local[1:])]
            self.expert_specs.append(spec)
        for lay in self.layers:
            if not any(s["autoep"]["prefix"] == lay["prefix"] for s in self.expert_specs):
                raise SourceFormatError(f"{self.tag_dir}: AutoEP layer {lay['prefix']!r} has no parameter in the "
                                        f"expert optimizer group ep_size_{self.ep}")
        if self.zero_stage < 3:
            self._check_expert_files()

    @staticmethod
    def _check_placement(placement: Any, n: int, ep: int, where: str) -> None:
        """The placement must be DeepSpeed's contiguous one (ep rank r: experts r*E/ep ... (r+1)*E/ep - 1)."""
        if placement is None:
            return
        per = n // ep
        try:
            ranks = {int(r["rank"]): [int(e) for e in r["experts"]] for r in placement["ranks"]}
        except (KeyError, TypeError, ValueError):
            raise SourceFormatError(f"{where}: expert_placement without ranks[].rank/experts") from None
        want = {r: list(range(r * per, (r + 1) * per)) for r in range(ep)}
        if ranks != want:
            raise SourceFormatError(f"{where}: expert_placement {ranks} is not the contiguous placement {want}; "
                                    "only contiguous AutoEP placements are read")

    def _check_zero3_ranks(self) -> None:
        """Each ZeRO-3 model file names its ep rank and expert-data-parallel rank: they must be d % ep, d // ep."""
        for dp in range(self.dp):
            f = self._model_file_name(0, dp)
            for lay in _autoep_layers(self.model_states[f]) or []:
                er, edr = lay.get("ep_rank"), lay.get("expert_data_parallel_rank")
                edw = lay.get("expert_data_parallel_world_size")
                if (er, edr, edw) != (dp % self.ep, dp // self.ep, self.edp):
                    raise SourceFormatError(
                        f"{self._path(f)}: AutoEP layer {lay.get('expert_key_prefix')!r} says ep_rank={er}, expert "
                        f"data-parallel rank {edr} of {edw}; DP rank {dp} at ep={self.ep} is ep rank {dp % self.ep}, "
                        f"expert data-parallel rank {dp // self.ep} of {self.edp}")

    def _find_expert_groups(self) -> list[int]:
        """The optimizer group indices of the experts: ZeRO-1/2 the one param group named ep_size_<ep> with moe,
        ZeRO-3 every sub-group of family autoep_expert (``sub_group_size`` may cut the experts into several),
        each partitioned over edp ranks."""
        fname = self.optim_files[(0, 0)]
        osd = self._optim((0, 0))["optimizer_state_dict"]
        found = []
        if self.zero_stage >= 3:
            for pg in osd.get("ds_zero_partition_groups") or []:
                if isinstance(pg, dict) and "autoep_expert" in (pg.get("families") or []):
                    if int(pg.get("partition_count", -1)) != self.edp:
                        raise SourceFormatError(f"{self._path(fname)}: AutoEP expert sub-group partitioned over "
                                                f"{pg.get('partition_count')} ranks; expected edp = {self.edp}")
                    found.append(int(pg["sub_group"]))
        else:
            bos = osd.get("base_optimizer_state") or {}
            for g, pg in enumerate(bos.get("param_groups") or [] if isinstance(bos, dict) else []):
                if isinstance(pg, dict) and pg.get("moe"):
                    m = EP_GROUP_RE.match(str(pg.get("name", "")))
                    if m is None or int(m[1]) != self.ep:
                        raise SourceFormatError(f"{self._path(fname)}: MoE parameter group {g} is named "
                                                f"{pg.get('name')!r}, expected 'ep_size_{self.ep}'")
                    found.append(g)
        if not found or (self.zero_stage < 3 and len(found) != 1):
            what = ("ds_zero_partition_groups family autoep_expert" if self.zero_stage >= 3
                    else f"one param group ep_size_{self.ep}")
            raise SourceFormatError(f"{self._path(fname)}: {len(found)} AutoEP expert optimizer groups; expected "
                                    f"{what}")
        return sorted(found)

    def _check_expert_files(self) -> None:
        files = getattr(self, "expert_files", {})
        if not files and self.lp_weights != "none":
            self.notes.append("no AutoEP expert files: expert low-precision weights not stored")
            self.lp_weights_experts = False
            return
        self.lp_weights_experts = True
        by_layer = {lay["layer"]: lay for lay in self.layers}
        for (layer, e, mp), f in files.items():
            lay = by_layer.get(layer)
            if lay is None or mp != 0 or e >= lay["num_experts"]:
                raise SourceFormatError(f"{self._path(f)}: no AutoEP layer {layer} with expert {e} (mp rank {mp}) in "
                                        "ds_autoep_layers")
        for lay in self.layers:
            missing = [e for e in range(lay["num_experts"]) if (lay["layer"], e, 0) not in files]
            if missing:
                raise SourceFormatError(f"{self.tag_dir}: AutoEP layer {lay['layer']} ({lay['prefix']}) lacks the "
                                        f"expert files of experts {missing}")

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
        out["deepspeed/autoep"] = {
            "ep": self.ep, "edp": self.edp, "form": "fused", "expert_groups": self.expert_groups,
            "layers": [{"layer": lay["layer"], "group": lay["prefix"], "module": lay["module"],
                        "num_experts": lay["num_experts"], "format": lay["format"],
                        "tensors": [s["name"] for s in self.expert_specs if s["autoep"]["prefix"] == lay["prefix"]]}
                       for lay in self.layers],
        }
        return out

    # --------------------------------------------------------------------------------- records
    def _edp_ranks(self, ep_rank: int) -> list[int]:
        """The DP ranks of ep rank ``ep_rank``'s expert ZeRO group, in partition order."""
        return list(range(ep_rank, self.dp, self.ep))

    def _records_zero3(self, wanted) -> Iterator[ParamRecord]:
        experts = {s["name"] for s in self.expert_specs}
        dense = {p["name"] for p in self.params if p["name"] not in experts}
        yield from super()._records_zero3(dense if wanted is None else dense & set(wanted))
        for spec in self.expert_specs:
            if wanted is None or spec["name"] in wanted:
                yield self._expert_record(spec)
        self._drop_optim(list(self.optim_files))

    def _zero12_param(self, spec: dict) -> ParamRecord:
        if "autoep" not in spec:
            return super()._zero12_param(spec)
        return self._expert_record(spec)

    def _zero3_offsets(self) -> dict[str, int]:
        """Offset of each expert parameter's partition in its expert sub-group's flat buffer."""
        offs = self.__dict__.get("_z3_offsets")
        if offs is None:
            offs = {}
            shapes = self._ms(0, 0).get("param_shapes") or []
            for sg in self.expert_groups:
                off = 0
                for name, shape in shapes[sg].items():
                    offs[name] = off
                    off += math.ceil(numel_of(shape) / self.edp)
            self.__dict__["_z3_offsets"] = offs
        return offs

    def _expert_record(self, spec: dict) -> ParamRecord:
        ax = spec["autoep"]
        name, g, local = spec["name"], spec["group"], ax["local_shape"]
        n = numel_of(local)
        blocks: dict[str, list[torch.Tensor]] = {}
        steps: list = []
        used: list[tuple[torch.Tensor, int, int]] = []
        for r in range(self.ep):
            keys = [(0, d) for d in self._edp_ranks(r)]
            if self.zero_stage >= 3:
                frags, got = self._zero3_fragments(keys, g, name, n, steps, used)
            else:
                frags, got = self._gather_fragments(keys, g, name, f"{name!r} (ep rank {r})", steps, used)
            if got != n:
                raise SourceFormatError(f"{self.tag_dir}: the fragments of AutoEP expert parameter {name!r} on ep rank "
                                        f"{r} (DP ranks {self._edp_ranks(r)}) cover {got} of its {n} elements")
            for k, fs in frags.items():
                blocks.setdefault(k, []).append(torch.cat(fs).reshape(local))
        states = {k: torch.cat(bs, dim=0).clone() for k, bs in blocks.items() if len(bs) == self.ep}
        if "fp32" not in states:
            raise SourceFormatError(f"{self.tag_dir}: no fp32 master for AutoEP expert parameter {name!r}")
        step_t, step_type = self._merge_steps(name, steps)
        if step_t is not None:
            states["step"] = step_t
        if self.zero_stage < 3 and self.lp_weights != "none" and getattr(self, "lp_weights_experts", False):
            lp = self._expert_lp_weight(spec)
            if self.lp_weights == "all" or not torch.equal(states["fp32"].to(lp.dtype), lp):
                states["weight"] = lp
        for t, s, k in used:
            release_pages(t, s, k)
        pattern = Expert(dim=0, num_experts=ax["num_experts"]).to_json()
        meta = {"autoep": {"group": ax["prefix"], "layer": ax["layer"], "num_experts": ax["num_experts"],
                           "local_shape": list(local)}}
        return ParamRecord(name=name, states=states, pattern=pattern, kind="param", shape=tuple(states["fp32"].shape),
                           group=g, stage=0, meta=meta, step_type=step_type)

    def _zero3_fragments(self, keys, sg: int, name: str, n: int, steps: list, used: list):
        part = math.ceil(n / self.edp)
        off = self._zero3_offsets()[name]
        frags: dict[str, list[torch.Tensor]] = {}
        got = 0
        for i, key in enumerate(keys):
            osd = self._optim(key)["optimizer_state_dict"]
            inner = osd["optimizer_state_dict"].get("state", {})
            st = inner.get(sg, inner.get(str(sg), {}))
            flat = {"fp32": osd["fp32_flat_groups"][sg]}
            for k, v in st.items():
                if k != "step" and isinstance(v, torch.Tensor) and v.dim() == 1:
                    flat[k] = v
            real = max(0, min(part, n - i * part))
            for k, t in flat.items():
                if off + real > t.numel():
                    raise SourceFormatError(f"{self._path(self.optim_files[key])}: AutoEP expert {name!r} fragment "
                                            f"[{off}, {off + real}) outside sub-group {sg} "
                                            f"({t.numel()} elements)")
                frags.setdefault(k, []).append(t.narrow(0, off, real))
                used.append((t, off, real))
            steps.append((st.get("step"), key))
            got += real
        return frags, got

    def _expert_lp_weight(self, spec: dict) -> torch.Tensor:
        """The low-precision ``[E, ...]`` weight stacked from the per-expert files (keys ``<name>.<e>``)."""
        ax = spec["autoep"]
        name, per_expert = spec["name"], tuple(ax["local_shape"][1:])
        out = []
        for e in range(ax["num_experts"]):
            f = self.__dict__["expert_files"][(ax["layer"], e, 0)]
            sd = self._load(f, "AutoEP expert state")
            t = sd.get(f"{name}.{e}") if isinstance(sd, dict) else None
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != per_expert:
                raise SourceFormatError(f"{self._path(f)}: no weight {name + '.' + str(e)!r} of shape "
                                        f"{list(per_expert)}")
            out.append(t)
        return torch.stack(out).clone()


# ------------------------------------------------------------------------------------ live engines
def _autoep_layers_of(engine) -> list:
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return [m for m in engine.module.modules() if isinstance(m, AutoEPMoELayer)]


def engine_topology(engine):
    """The :class:`~ucp_store.topology.Topology` of an AutoEP engine: dp, ``ep`` (its ``ep_size``), its ZeRO
    stage, ZeRO-1/2 alignment 2 (DeepSpeed's ``nccl_start_alignment_factor``)."""
    from ucp_store.topology import Topology

    layers = _autoep_layers_of(engine)
    if not layers:
        raise ConfigurationError("load_engine: the engine has no AutoEP MoE layer (expert_parallel.enabled?)")
    eps = {int(m.ep_size) for m in layers}
    if len(eps) != 1:
        raise ConfigurationError(f"load_engine: the engine's AutoEP layers have ep sizes {sorted(eps)}; expected one")
    if int(getattr(engine, "mp_world_size", 1) or 1) != 1 or hasattr(engine, "num_stages"):
        raise ConfigurationError("load_engine: AutoEP engines with tensor or pipeline parallelism are not supported")
    if getattr(engine._config, "use_data_before_expert_parallel_", False):
        raise ConfigurationError("load_engine: use_data_before_expert_parallelism is not supported (expert-then-data "
                                 "rank order only)")
    zero = int(engine.zero_optimization_stage())
    if zero not in (1, 2, 3):
        raise ConfigurationError(f"load_engine: ZeRO stage {zero}; AutoEP load needs ZeRO stage 1, 2 or 3")
    return Topology(dp=int(engine.dp_world_size), ep=eps.pop(), zero_stage=zero, zero_alignment=2)


def load_engine(engine, ref: str, *, store=None, load_optimizer_states: bool = True) -> dict:
    """Load AutoEP version ``ref`` into a freshly built AutoEP engine (ZeRO-1/2 or ZeRO-3) of any ep / DP degree.

    Every rank plans ``engine_topology(engine)`` through ``load_shard``: its ``[E/ep, ...]`` block of each
    fused expert parameter, ZeRO-partitioned over its expert-data-parallel ranks, and its share of the dense
    part, straight into the optimizer's flat buffers (:func:`ucp_store.deepspeed.load.load`). Returns the client
    state."""
    from ucp_store.deepspeed.load import load

    if store is None:
        raise ConfigurationError("load_engine: give store=")
    return load(engine, ref, store=store, load_optimizer_states=load_optimizer_states,
                topology=engine_topology(engine))
