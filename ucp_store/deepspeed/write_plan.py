"""The records a direct DeepSpeed save passes between its phases (``ucp_store.deepspeed.write``).

As ``torch.distributed.checkpoint`` hands a ``SavePlan`` and ``Metadata`` from one step of a save to the
next, ``write_rank_share`` runs in named phases that hand each other these small records instead of
dictionaries with implied keys:

- :class:`SaveTarget` and :class:`RankSnapshot`: what the engine hands the save (where it goes, and what was
  taken from the live engine in the training thread);
- :class:`StagedFiles`: the state dicts DeepSpeed staged on this rank, sorted by the file they stand for;
- :class:`RankPart`: what one rank tells the others (one ``all_gather_object``: metadata, never tensors);
- :class:`SavePlan`: the global plan every rank derives from all the parts (the file importer's ``_plan``);
- :class:`ShareResult`: what the write phase found out (kinds, universal metadata, step types, ...);
- :class:`RankReport`: what one rank tells the others when they agree (the second and last exchange).

Nothing here does I/O or talks to other ranks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ucp_store.deepspeed.files import LAYER_RE, MODEL_RE, OPTIM_RE, ZERO3_MODEL_RE
from ucp_store.errors import ConfigurationError, SourceFormatError
from ucp_store.topology import Topology

if TYPE_CHECKING:
    from ucp_store.deepspeed.write_tp import TPPlan

__all__ = ["FrozenSpec", "ParamSpec", "RankPart", "RankReport", "RankSnapshot", "SavePlan", "SaveTarget",
           "ShareResult", "StagedFiles", "dtype_name", "flat_states", "numel"]

Shapes = list[tuple[str, tuple[int, ...]]]  # (parameter name, shape), in the order DeepSpeed lists them


def dtype_name(dt: torch.dtype) -> str:
    """A torch dtype's name as the records and the stored objects spell it (``bfloat16``)."""
    return str(dt).replace("torch.", "")


def numel(shape) -> int:
    """The elements of a tensor of ``shape``."""
    return int(math.prod(int(x) for x in shape))


def flat_states(osd: dict, g: int, where: str) -> tuple[dict[str, torch.Tensor], Any]:
    """Group ``g``'s flat partitions of a ZeRO-1/2 ``optimizer_state_dict`` (``fp32`` and every per-element
    optimizer state, in order) and its optimizer step; ``where`` names the file in errors."""
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


# ------------------------------------------------------------------------- what the engine hands the save
@dataclass(frozen=True)
class SaveTarget:
    """Where one save goes and how it reports: the engine's settings, read when the save starts."""

    store: Any
    run: str
    group: Any  # the save's gloo process group; None in a single process
    tag: str | None
    message: str | None
    progress: bool
    stats: dict[str, float]  # the engine's: every phase adds its seconds since the save began
    on_write: Callable[[str, str], None] | None = None  # test hook: after each array write (name, state)


@dataclass(frozen=True)
class RankSnapshot:
    """What the save needs from the live engine, taken in the training thread when DeepSpeed commits."""

    rank: int
    stage: int
    dp_rank: int
    tp_rank: int
    topo: dict[str, Any]  # ``Topology`` keyword arguments (``engine_topology``)
    lp: dict[str, torch.Tensor]  # low-precision module weights by name (ZeRO-1/2: checked against the fp32 master)
    step: int
    rng: str  # base64 of ``torch.get_rng_state()``
    client: Any  # this rank's client state, JSON form


# ------------------------------------------------------------------------- what this rank staged
@dataclass(frozen=True)
class StagedFiles:
    """The state dicts DeepSpeed handed the engine on this rank, by the file each stands for."""

    optim_name: str
    optim_sd: dict
    model_name: str | None = None
    model_sd: dict | None = None
    layers: dict[int, dict] = field(default_factory=dict)  # pipeline layer index -> its layer file's dict
    layer_names: list[str] = field(default_factory=list)  # the layer files' names, sorted

    @classmethod
    def classify(cls, staged: dict[str, Any]) -> StagedFiles:
        """Sort ``staged`` (file name -> state dict) into model, optimizer and pipeline layer states."""
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
        return cls(optim_name=optim_name, optim_sd=optim_sd, model_name=model_name, model_sd=model_sd, layers=layers,
                   layer_names=sorted(n for n in staged if LAYER_RE.match(n)))

    @property
    def osd(self) -> dict:
        """The optimizer file's ``optimizer_state_dict``."""
        return self.optim_sd["optimizer_state_dict"]

    @property
    def prefix(self) -> str:
        """The optimizer file name's prefix (``bf16`` for the bf16 optimizer, else empty)."""
        m = OPTIM_RE.match(self.optim_name)
        assert m is not None  # classify keeps only an optimizer file name that OPTIM_RE matched
        return m.group(1) or ""

    def flat_states(self, g: int) -> tuple[dict[str, torch.Tensor], Any]:
        """ZeRO-1/2: group ``g``'s flat partitions and optimizer step (:func:`flat_states`)."""
        return flat_states(self.osd, g, self.optim_name)

    def module(self) -> dict[str, torch.Tensor]:
        """The module weights DeepSpeed saved on this rank: the model states' ``module``, or the pipeline layer
        files' tensors named ``<layer>.<key>``."""
        if self.model_sd is not None and self.model_sd.get("module") is not None:
            return dict(self.model_sd["module"])
        entries = {}
        for li in sorted(self.layers):
            for k, v in (self.layers[li] or {}).items():
                if isinstance(v, torch.Tensor):
                    entries[f"{li}.{k}"] = v
        return entries


# ------------------------------------------------------------------------- what the ranks exchange
@dataclass(frozen=True)
class RankPart:
    """What one rank tells the others before anything is written (one ``all_gather_object``): which files it
    holds, the parameter names and shapes its model states list, its fragment addresses, and for a TP save its
    TP rank, ``universal_checkpoint_info``, flat states and steps, and the whole weights it would send."""

    rank: int
    stage: int
    dp: int
    tp: int
    optim_file: str
    layer_files: list[str]
    model_file: str | None
    param_shapes: list[Shapes] | None  # per optimizer group; None without model states on this rank
    frozen_shapes: Shapes | None
    buffers: list[str] | None
    uci: bool  # its model states carry universal_checkpoint_info patterns
    mappings: list[dict[str, tuple[int, int]]] | None  # ZeRO-1/2: per group, name -> (start, numel) in the flat
    uci_raw: Any  # the model's universal_checkpoint_info (stand-ins for live objects), or None
    flat: list[list[tuple[str, str]]] | None  # ZeRO-1/2: per group, the flat states' (name, dtype)
    gsteps: list | None  # ZeRO-1/2: per group, the optimizer step
    lp_dtype: str | None  # the dtype of its low-precision module weights (None: none to check)
    weights: list[tuple[str, str, tuple[int, ...]]] | None = None  # DP rank 0, ZeRO-1/2: (name, dtype, shape)

    def mapping(self, g: int, name: str) -> tuple[int, int] | None:
        """(start, numel) of ``name``'s fragment in this rank's flat group ``g``, or None if it holds none."""
        maps = self.mappings or []
        return maps[g].get(name) if g < len(maps) else None


@dataclass(frozen=True)
class RankReport:
    """What one rank tells the others once its writes returned (the agreement's ``all_gather_object``)."""

    rank: int
    metas: dict[str, dict]
    steps: dict[str, str]
    kinds: dict[str, str]
    lp_differs: list[str]
    files: dict[str, dict]  # the model-states file's JSON record, by file name
    notes: list[str]
    rng: str
    client: Any
    digests: dict  # the writer's ``shard_digests``
    error: str | None  # "<type>: <message>" of this rank's failure


# ------------------------------------------------------------------------- the global plan
@dataclass
class ParamSpec:
    """One optimizer-owned parameter of the plan, stored once (at its first pipeline stage). The TP plan
    completes it (``shapes``, and the logical ``shape`` of a parameter written in place)."""

    name: str
    stage: int
    group: int
    shape: tuple[int, ...]  # its logical shape (at TP > 1 set by the TP plan for the direct ones)
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # TP plan: its shape on every TP rank


@dataclass(frozen=True)
class FrozenSpec:
    """A frozen parameter: the stage that stores it, and its shape."""

    stage: int
    shape: tuple[int, ...]


@dataclass
class SavePlan:
    """What every rank derives alike from all ranks' parts (the file importer's ``_plan``): the parameters in
    checkpoint order, frozen parameters, buffers, every tensor's position, and at TP > 1 the TP plan."""

    topo: Topology
    parts: list[RankPart]
    by_stage: dict[int, RankPart]  # each stage's first rank with model states (lowest tp, then dp)
    params: list[ParamSpec]
    seen: dict[str, int]  # name -> index in params
    stages_of: dict[str, list[int]]  # name -> every pipeline stage that lists it (tied parameters: several)
    frozen: dict[str, FrozenSpec]
    buffers: list[str]
    piped: bool  # a pipeline engine (layer files or layers in the topology)
    position: dict[str, int]
    tp: TPPlan | None = None

    def placement(self, name: str) -> dict | None:
        """The pipeline placement the importer gives ``name``: the first/last stages of a tied parameter, else
        its layer in a pipeline engine."""
        st = sorted(set(self.stages_of.get(name, [])))
        if self.topo.pp > 1 and len(st) > 1:
            labels = (["first"] if 0 in st else []) + (["last"] if self.topo.pp - 1 in st else [])
            return {"stages": labels} if labels else None
        if self.piped:
            m = re.match(r"^(\d+)\.", name)
            if m:
                return {"layer": int(m.group(1))}
        return None


# ------------------------------------------------------------------------- what the write phase found
@dataclass
class ShareResult:
    """What this rank's write phase records for the objects (merged over all ranks by rank 0)."""

    metas: dict[str, dict] = field(default_factory=dict)  # deepspeed/universal_meta
    steps: dict[str, str] = field(default_factory=dict)  # deepspeed/step_types
    kinds: dict[str, str] = field(default_factory=dict)  # deepspeed/kinds
    lp_differs: list[str] = field(default_factory=list)  # low-precision weights that are not the master cast down
