"""Topology of a training job: parallel degrees, rank order, pipeline layer assignment (pure).

A ``Topology`` says how a job's ``world_size`` ranks are arranged. Four *axes* make up a rank:

- ``tp``: tensor parallel (Megatron column/row splits, vocab splits).
- ``sp``: sequence/context parallel (DeepSpeed-Ulysses, Megatron context parallel). Parameters are
  replicated over ``sp``; ZeRO shards over ``sp x dp`` (DeepSpeed's sequence-data-parallel group,
  Megatron's data-parallel-with-context-parallel group).
- ``dp``: data parallel, the axis ZeRO partitions over.
- ``pp``: pipeline parallel; stage ``s`` owns the transformer layers ``layers_of_stage(s)``.

Expert parallelism is not a fifth axis: ``ep`` ranks are carved out of ``dp`` (``dp % ep == 0``), as in
DeepSpeed (``groups._create_expert_and_data_parallel``, default E+D ordering) and Megatron (``ep`` inside
the data-parallel dimension). Within a pipeline stage and TP rank, the data-parallel rank ``d`` splits into

    ep_rank  = d % ep          (consecutive dp ranks form an expert-parallel group)
    edp_rank = d // ep         (ranks with the same ep_rank form an expert-data-parallel group)

so experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` live on ``ep_rank``, and expert parameters are
replicated (and ZeRO-partitioned) over ``edp`` x ``sp``. That is ``ep_over="dp"`` (the default).

``ep_over="stage"`` is DeepSpeed's rule for whole (not tensor-parallel) experts in a job with an mpu
(``groups._create_expert_and_data_parallel``, default E+D order, which ``MoE`` uses unless
``enable_expert_tensor_parallelism``): the expert groups span every rank of a pipeline stage, ``tp`` and
``sp`` included. With ``s`` the rank's index within its stage (global-rank order; ``rank % (world / pp)``
when ``pp`` is slowest)

    ep_rank  = s % ep          (``tp x sp x dp`` must be a multiple of ep)
    edp_rank = s // ep         (the expert-data-parallel group: the stage's ranks of one ep_rank)

so at ``tp=2, dp=2, ep=2`` global rank ``g`` is ep rank ``g % 2``: TP rank 0 holds experts 0-1 and TP rank 1
experts 2-3. Experts are whole there (their inner TP pattern is not applied: ``tp_for(expert=True) == 1``),
and their ZeRO group is the ``tp x sp x dp / ep`` ranks of the ep rank (``zero_world(expert=True)``). Both
rules live here (``coords``, ``rank``, ``zero_world``, ``zero_rank``, ``tp_for``) and nowhere else: the
planner, the writer rule, ``ucp plan --ep`` / ``ucp show`` and ``deepspeed_moe.load_engine`` follow them.

Rank order
----------
``order`` lists the axes fastest-varying first. The default is Megatron's order
``("tp", "sp", "dp", "pp")``: TP neighbours are adjacent ranks (same node), then sequence parallel,
then data parallel, and the pipeline stage varies slowest::

    rank = tp_rank + tp * (sp_rank + sp * (dp_rank + dp * pp_rank))

Another order, e.g. ``["tp", "dp", "pp"]`` (fastest first), may omit axes of size 1; an axis of size > 1
must be listed. The ZeRO partition index of a rank is its position, in global-rank order, within its
ZeRO group (the ranks sharing its ``tp`` and ``pp`` coordinates, and for expert parameters its
``ep_rank``), which is what ``torch.distributed.new_group(sorted ranks)`` gives.

Pipeline layers
---------------
``layers`` is the number of transformer layers (global indices ``0 .. layers-1``). ``layer_stages``,
when given, lists the stage of every layer; it must start at stage 0, end at stage ``pp-1``, never
decrease and never skip a stage. By default layers are split evenly, the first ``layers % pp`` stages
taking one extra layer (DeepSpeed's ``partition_uniform``). Parameters outside the layers (embeddings,
final norm, LM head) are placed by their pattern's ``placement`` (``patterns.py``).

Stage-local names
-----------------
Canonical tensor names use global layer indices. A job whose model names layers stage-locally
(Megatron-core: ``decoder.layers.<local>.``) states ``layer_names = {"canonical": "layers.{layer}.",
"local": "layers.{local}."}``: both templates hold one placeholder and the rest is matched literally.
``local_name`` rewrites the first occurrence of the canonical template; ``canonical_name`` does the
reverse for a given stage. A pattern's ``placement.local_name`` (per tensor) takes precedence.

ZeRO partition arithmetic (the flat buffers themselves are computed in ``patterns.py``) needs two
constants recorded here: ``zero_alignment`` (DeepSpeed's ``nccl_start_alignment_factor``, 2: every
partition's size is a multiple of it, so the flat group is padded to a multiple of
``zero_alignment * zero_world``) and ``zero_param_alignment`` (1 unless DeepSpeed's
``zero_optimization.parameter_alignment`` is on, then 16 bytes / element size: each parameter but the
last starts on a multiple of it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, cast

from ucp_store.errors import TopologyError

__all__ = ["AXES", "DEFAULT_ORDER", "EP_OVER", "MAX_WORLD_SIZE", "SCHEMA_FILE", "LayerNameRule", "Topology",
           "load_schema", "schema_errors", "validate_topology_record", "as_topology"]

AXES = ("tp", "sp", "dp", "pp")
DEFAULT_ORDER = ("tp", "sp", "dp", "pp")
# what expert parallelism is carved out of (see the module docstring)
EP_OVER = ("dp", "stage")
SCHEMA_FILE = "topology.schema.json"
#: the most ranks a topology (or a DTensor mesh, ``planner.plan_mesh`` through ``ucp plan --mesh``) may have:
#: twice and more the largest jobs run; a larger one is a typo, and planning or listing its ranks would
#: exhaust memory before it said anything
MAX_WORLD_SIZE = 1 << 20

_INT_FIELDS = ("tp", "pp", "dp", "sp", "ep", "vocab_multiple", "zero_alignment", "zero_param_alignment")


@lru_cache(maxsize=256)
def _template_regex(template: str, placeholder: str, what: str) -> tuple[re.Pattern[str], str, str]:
    """A regex matching ``template`` with its one ``{placeholder}`` as a run of digits."""
    token = "{" + placeholder + "}"
    if template.count(token) != 1 or re.search(r"\{(?!" + placeholder + r"\})", template):
        raise TopologyError(
            f"layer_names.{what} template {template!r} must contain {token} exactly once and no other '{{'"
        )
    head, tail = template.split(token)
    return re.compile(re.escape(head) + r"(\d+)" + re.escape(tail)), head, tail


@dataclass(frozen=True)
class LayerNameRule:
    """How a job names layers: ``canonical`` (global ``{layer}``) <-> ``local`` (stage-local ``{local}``)."""

    canonical: str
    local: str

    def __post_init__(self) -> None:
        _template_regex(self.canonical, "layer", "canonical")
        _template_regex(self.local, "local", "local")

    def to_json(self) -> dict[str, str]:
        return {"canonical": self.canonical, "local": self.local}


@dataclass(frozen=True)
class Topology:
    """A training job's layout. Immutable and hashable; see the module docstring for the conventions."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero_stage: int = 0
    sp: int = 1
    ep: int = 1
    vocab_multiple: int = 1
    layers: int = 0
    layer_stages: tuple[int, ...] | None = None
    order: tuple[str, ...] = DEFAULT_ORDER
    zero_alignment: int = 2
    zero_param_alignment: int = 1
    layer_names: LayerNameRule | None = None
    ep_over: str = "dp"

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        for f in _INT_FIELDS:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise TopologyError(f"topology field {f!r} must be an integer >= 1, got {v!r}")
        if not isinstance(self.zero_stage, int) or isinstance(self.zero_stage, bool) or not 0 <= self.zero_stage <= 3:
            raise TopologyError(f"topology field 'zero_stage' must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if not isinstance(self.layers, int) or isinstance(self.layers, bool) or self.layers < 0:
            raise TopologyError(f"topology field 'layers' must be an integer >= 0, got {self.layers!r}")
        if self.ep_over not in EP_OVER:
            raise TopologyError(f"topology field 'ep_over' must be one of {list(EP_OVER)}, got {self.ep_over!r}")
        if self.ep_over == "dp" and self.dp % self.ep:
            raise TopologyError(
                f"ep={self.ep} must divide dp={self.dp}: expert-parallel ranks are carved out of the "
                f"data-parallel dimension; use ep in {_divisors(self.dp)}"
            )
        if self.world_size > MAX_WORLD_SIZE:
            raise TopologyError(f"topology tp={self.tp} x sp={self.sp} x dp={self.dp} x pp={self.pp} has "
                                f"{self.world_size} ranks; at most {MAX_WORLD_SIZE} (2^20) are supported")
        stage_world = self.tp * self.sp * self.dp
        if self.ep_over == "stage" and stage_world % self.ep:
            raise TopologyError(
                f"ep={self.ep} must divide the {stage_world} ranks of a pipeline stage (tp={self.tp} x sp={self.sp} x "
                f"dp={self.dp}) with ep_over='stage'; use ep in {_divisors(stage_world)}"
            )
        object.__setattr__(self, "order", tuple(self.order))
        self._check_order()
        if self.layer_stages is not None:
            object.__setattr__(self, "layer_stages", tuple(self.layer_stages))
        if isinstance(self.layer_names, Mapping):
            object.__setattr__(self, "layer_names", _layer_name_rule(self.layer_names))
        self._check_layer_stages()

    def _check_order(self) -> None:
        seen = set()
        for axis in self.order:
            if axis == "ep":
                raise TopologyError(
                    "order may not list 'ep': expert-parallel ranks are carved out of 'dp' (ep_rank = dp_rank % ep)"
                )
            if axis not in AXES:
                raise TopologyError(f"order lists unknown axis {axis!r}; axes are {list(AXES)} (fastest first)")
            if axis in seen:
                raise TopologyError(f"order lists axis {axis!r} twice: {list(self.order)}")
            seen.add(axis)
        missing = [a for a in AXES if a not in seen and getattr(self, a) > 1]
        if missing:
            raise TopologyError(
                f"order {list(self.order)} omits axis {missing} of size > 1; list every axis of size > 1, fastest first"
            )

    def _check_layer_stages(self) -> None:
        pp, layers = self.pp, self.layers
        if self.layer_stages is None:
            if pp > 1 and layers < pp:
                raise TopologyError(
                    f"pp={pp} stages need at least {pp} layers (every stage owns >= 1 layer), got layers={layers}"
                )
            return
        stages = self.layer_stages
        if len(stages) != layers:
            raise TopologyError(
                f"layer_stages has {len(stages)} entries but layers={layers}: give the stage of every layer"
            )
        if layers == 0:
            if pp > 1:
                raise TopologyError(f"pp={pp} stages need at least {pp} layers, got layers=0")
            return
        for i, s in enumerate(stages):
            if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < pp:
                raise TopologyError(f"layer_stages[{i}]={s!r} is not a stage in 0..{pp - 1}")
        if stages[0] != 0:
            raise TopologyError(f"layer_stages must start at stage 0 (layer 0 is on stage {stages[0]})")
        for i in range(1, layers):
            step = stages[i] - stages[i - 1]
            if step < 0:
                raise TopologyError(
                    f"layer_stages is not monotonic: layer {i} is on stage {stages[i]} after layer {i - 1} on "
                    f"stage {stages[i - 1]}"
                )
            if step > 1:
                raise TopologyError(
                    f"layer_stages skips stage(s) {list(range(stages[i - 1] + 1, stages[i]))} between layers "
                    f"{i - 1} and {i}: every stage must own at least one layer"
                )
        if stages[-1] != pp - 1:
            raise TopologyError(
                f"layer_stages ends at stage {stages[-1]} but pp={pp}: stages {list(range(stages[-1] + 1, pp))} "
                f"own no layer"
            )

    # ------------------------------------------------------------------ sizes and rank order
    @property
    def world_size(self) -> int:
        return self.tp * self.sp * self.dp * self.pp

    def size(self, axis: str) -> int:
        if axis not in AXES:
            raise TopologyError(f"unknown axis {axis!r}; axes are {list(AXES)}")
        value: int = getattr(self, axis)
        return value

    @cached_property
    def _full_order(self) -> tuple[str, ...]:
        # axes omitted from ``order`` have size 1, so where they go does not change any rank
        return self.order + tuple(a for a in AXES if a not in self.order)

    @cached_property
    def strides(self) -> dict[str, int]:
        """Global-rank stride of each axis (``rank = sum(coord[a] * strides[a])``)."""
        out, stride = {}, 1
        for axis in self._full_order:
            out[axis] = stride
            stride *= getattr(self, axis)
        return out

    @cached_property
    def _stage_axes(self) -> tuple[str, ...]:
        """The axes inside a pipeline stage, fastest first (what ``ep_over="stage"`` counts ranks by)."""
        return tuple(a for a in self._full_order if a != "pp")

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of ``rank``: ``tp, sp, dp, pp`` plus the derived ``ep`` and ``edp``."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank!r} is outside 0..{self.world_size - 1} (world_size={self.world_size})")
        out = {}
        rest = rank
        for axis in self._full_order:
            n = getattr(self, axis)
            out[axis] = rest % n
            rest //= n
        if self.ep_over == "dp":
            carved = out["dp"]
        else:  # the rank's index within its stage, in global-rank order
            carved, stride = 0, 1
            for axis in self._stage_axes:
                carved += out[axis] * stride
                stride *= getattr(self, axis)
        out["ep"] = carved % self.ep
        out["edp"] = carved // self.ep
        return {k: out[k] for k in ("tp", "sp", "dp", "pp", "ep", "edp")}

    @property
    def edp(self) -> int:
        """Ranks per expert-data-parallel group (``dp / ep``, or ``tp x sp x dp / ep`` with ``ep_over="stage"``)."""
        return (self.dp if self.ep_over == "dp" else self.tp * self.sp * self.dp) // self.ep

    def tp_for(self, expert: bool) -> int:
        """The TP degree a tensor is laid out over: 1 for experts with ``ep_over="stage"`` (whole experts)."""
        return 1 if expert and self.ep_over == "stage" else self.tp

    def rank(self, coords: Mapping[str, int]) -> int:
        """The global rank at ``coords`` (``tp, sp, dp, pp``; an axis of size 1 may be left out).

        ``dp`` (with ``ep_over="stage"``: ``tp``, ``sp`` and ``dp``) may instead be given as ``ep`` and ``edp``
        (``dp = ep + ep_size * edp``, or the stage index ``ep + ep_size * edp``)."""
        c = dict(coords)
        unknown = set(c) - set(AXES) - {"ep", "edp"}
        if unknown:
            raise TopologyError(f"unknown coordinate(s) {sorted(unknown)}; use {list(AXES)} (+ 'ep', 'edp')")
        if "ep" in c or "edp" in c:
            ep_rank, edp_rank = c.pop("ep", 0), c.pop("edp", 0)
            if not 0 <= ep_rank < self.ep or not 0 <= edp_rank < self.edp:
                raise TopologyError(f"ep={ep_rank}, edp={edp_rank} outside ep<{self.ep}, edp<{self.edp}")
            carved = ep_rank + self.ep * edp_rank
            derived: dict[str, int] = {}
            if self.ep_over == "dp":
                derived["dp"] = carved
            else:
                for axis in self._stage_axes:
                    n = getattr(self, axis)
                    derived[axis] = carved % n
                    carved //= n
            for axis, v in derived.items():
                if axis in c and c[axis] != v:
                    raise TopologyError(f"coordinates disagree: {axis}={c[axis]} but ep={ep_rank}, edp={edp_rank} "
                                        f"give {axis}={v}" + (" (ep_over='stage')" if self.ep_over == "stage" else ""))
                c[axis] = v
        rank = 0
        for axis in AXES:
            n = getattr(self, axis)
            if axis not in c:
                if n > 1:
                    raise TopologyError(f"coordinates {dict(coords)} lack axis {axis!r} (size {n})")
                continue
            v = c[axis]
            if not isinstance(v, int) or not 0 <= v < n:
                raise TopologyError(f"coordinate {axis}={v!r} outside 0..{n - 1}")
            rank += v * self.strides[axis]
        return rank

    def ranks_where(self, **fixed: int) -> list[int]:
        """Every global rank whose coordinates match ``fixed`` (e.g. ``tp=0, pp=1``), ascending."""
        return [r for r in range(self.world_size) if all(self.coords(r)[k] == v for k, v in fixed.items())]

    # ------------------------------------------------------------------ ZeRO groups
    def zero_world(self, expert: bool = False) -> int:
        """Number of ranks one tensor's ZeRO state is partitioned over (1 when zero_stage == 0)."""
        if self.zero_stage == 0:
            return 1
        if expert and self.ep_over == "stage":
            return self.edp
        return self.sp * (self.dp // self.ep if expert else self.dp)

    def zero_rank(self, rank: int, expert: bool = False) -> int:
        """Index of ``rank`` within its ZeRO group, in global-rank order."""
        if self.zero_stage == 0:
            return 0
        c = self.coords(rank)
        if expert and self.ep_over == "stage":
            return c["edp"]  # the stage index ep + ep * edp grows with the global rank
        dp_name, dp_val, dp_n = ("edp", c["edp"], self.dp // self.ep) if expert else ("dp", c["dp"], self.dp)
        # the group is the product of the sp and (e)dp axes; whichever is faster in the global order
        # is the faster one inside the group
        if self.strides["sp"] < self.strides["dp"]:
            return c["sp"] + self.sp * dp_val
        return dp_val + dp_n * c["sp"]

    # ------------------------------------------------------------------ pipeline stages
    @cached_property
    def stage_starts(self) -> tuple[int, ...]:
        """``stage_starts[s]`` is the first global layer of stage ``s``; ``stage_starts[pp] == layers``."""
        if self.layer_stages is not None:
            starts = [0] * (self.pp + 1)
            starts[self.pp] = self.layers
            for i in range(self.layers - 1, -1, -1):
                starts[self.layer_stages[i]] = i
            return tuple(starts)
        base, extra = divmod(self.layers, self.pp)
        starts, at = [0], 0
        for s in range(self.pp):
            at += base + (1 if s < extra else 0)
            starts.append(at)
        return tuple(starts)

    def stage_of_layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not 0 <= layer < self.layers:
            raise TopologyError(f"layer {layer!r} is outside 0..{self.layers - 1} (topology has layers={self.layers})")
        if self.layer_stages is not None:
            return self.layer_stages[layer]
        base, extra = divmod(self.layers, self.pp)
        big = extra * (base + 1)  # layers held by the stages with one extra layer
        if layer < big:
            return layer // (base + 1)
        return extra + (layer - big) // base

    def layers_of_stage(self, stage: int) -> range:
        if not isinstance(stage, int) or not 0 <= stage < self.pp:
            raise TopologyError(f"stage {stage!r} is outside 0..{self.pp - 1} (pp={self.pp})")
        return range(self.stage_starts[stage], self.stage_starts[stage + 1])

    # ------------------------------------------------------------------ stage-local names
    def local_name(self, name: str) -> str:
        """``name`` as a job with ``layer_names`` calls it on the stage owning its layer (unchanged if no rule)."""
        rule = self.layer_names
        if rule is None:
            return name
        rx, _, _ = _template_regex(rule.canonical, "layer", "canonical")
        m = rx.search(name)
        if m is None:
            return name
        layer = int(m.group(1))
        stage = self.stage_of_layer(layer)
        local = layer - self.stage_starts[stage]
        return name[: m.start()] + rule.local.replace("{local}", str(local)) + name[m.end():]

    def canonical_name(self, local_name: str, stage: int) -> str:
        """Inverse of ``local_name`` for a name seen on ``stage``."""
        rule = self.layer_names
        if rule is None:
            return local_name
        rx, _, _ = _template_regex(rule.local, "local", "local")
        m = rx.search(local_name)
        if m is None:
            return local_name
        local = int(m.group(1))
        span = self.layers_of_stage(stage)
        if local >= len(span):
            raise TopologyError(
                f"name {local_name!r}: local layer {local} does not exist on stage {stage}, "
                f"which has {len(span)} layers"
            )
        canonical = rule.canonical.replace("{layer}", str(span.start + local))
        return local_name[: m.start()] + canonical + local_name[m.end():]

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tp": self.tp, "pp": self.pp, "dp": self.dp, "zero_stage": self.zero_stage, "sp": self.sp,
            "ep": self.ep, "vocab_multiple": self.vocab_multiple, "layers": self.layers,
            "layer_stages": list(self.layer_stages) if self.layer_stages is not None else None,
            "order": list(self.order),
        }
        if self.zero_alignment != 2:
            out["zero_alignment"] = self.zero_alignment
        if self.zero_param_alignment != 1:
            out["zero_param_alignment"] = self.zero_param_alignment
        if self.layer_names is not None:
            out["layer_names"] = self.layer_names.to_json()
        if self.ep_over != "dp":
            out["ep_over"] = self.ep_over
        return out

    @classmethod
    def from_json(cls, record: Mapping[str, Any] | str) -> "Topology":
        """Build from a topology record (dict or JSON text), validated against the schema first."""
        if isinstance(record, str):
            try:
                record = json.loads(record)
            except json.JSONDecodeError as e:
                raise TopologyError(f"topology record is not valid JSON: {e}") from None
        validate_topology_record(record)
        kw = dict(cast(Mapping[str, Any], record))
        if kw.get("layer_stages") is not None:
            kw["layer_stages"] = tuple(kw["layer_stages"])
        if "order" in kw:
            kw["order"] = tuple(kw["order"])
        if kw.get("layer_names") is not None:
            kw["layer_names"] = _layer_name_rule(kw["layer_names"])
        return cls(**kw)

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        if self.zero_stage:
            parts.append(f"zero={self.zero_stage}")
        if self.sp > 1:
            parts.append(f"sp={self.sp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}" + (f" (over the stage's {self.tp * self.sp * self.dp} ranks)"
                                            if self.ep_over == "stage" else ""))
        return " ".join(parts)


def _layer_name_rule(value: Any) -> LayerNameRule:
    if isinstance(value, LayerNameRule):
        return value
    try:
        return LayerNameRule(canonical=value["canonical"], local=value["local"])
    except (KeyError, TypeError):
        raise TopologyError(f"layer_names must be {{'canonical': ..., 'local': ...}}, got {value!r}") from None


def _divisors(n: int, limit: int = 12) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return "{" + ", ".join(map(str, ds[:limit])) + (", ...}" if len(ds) > limit else "}")


# ---------------------------------------------------------------------- JSON Schema
_SCHEMA_CACHE: dict[str, Any] = {}


def load_schema(filename: str) -> dict[str, Any]:
    """A JSON Schema from ``schemas/`` (the repository folder, or ``ucp_store._schemas`` when installed)."""
    if filename in _SCHEMA_CACHE:
        cached: dict[str, Any] = _SCHEMA_CACHE[filename]
        return cached
    candidates = [Path(__file__).resolve().parent.parent / "schemas" / filename]
    try:
        from importlib import resources

        candidates.append(Path(str(resources.files("ucp_store._schemas").joinpath(filename))))
    except (ModuleNotFoundError, ImportError, TypeError):
        pass
    for path in candidates:
        if path.is_file():
            schema: dict[str, Any] = json.loads(path.read_text())
            _SCHEMA_CACHE[filename] = schema
            return schema
    raise FileNotFoundError(f"JSON Schema {filename} not found (looked in {[str(p) for p in candidates]})")


def schema_errors(record: Any, filename: str) -> list[str]:
    """Human-readable JSON Schema violations of ``record`` (empty when valid)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(load_schema(filename))
    out = []
    for err in sorted(validator.iter_errors(record), key=lambda e: list(e.absolute_path)):
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        out.append(f"{where}: {err.message}")
    return out


def validate_topology_record(record: Any) -> None:
    """Raise ``TopologyError`` if ``record`` does not match ``schemas/topology.schema.json``."""
    errors = schema_errors(record, SCHEMA_FILE)
    if errors:
        raise TopologyError("topology record does not match topology.schema.json: " + "; ".join(errors))


def as_topology(value: "Topology | Mapping[str, Any]") -> Topology:
    """Accept a ``Topology`` or its JSON record."""
    if isinstance(value, Topology):
        return value
    return Topology.from_json(value)
