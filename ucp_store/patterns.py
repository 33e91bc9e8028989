"""Pattern algebra (pure): how one logical tensor maps onto the ranks of a topology.

A *logical* tensor is the unsharded, unpadded tensor the store keeps. Its *pattern* (a JSON record,
``schemas/pattern.schema.json``, contract in ARCHITECTURE.md) says how a training job lays it out:

==============  ==============================================================================
kind            the TP-local tensor of TP rank ``r`` (out of ``tp``)
==============  ==============================================================================
replicated      the whole tensor
averaged        the whole tensor (replicas had drifted; the store holds their mean; see
                ``average_replicas``)
partitioned     slice ``r`` along ``dim``: ``widths[tp][r]`` rows if ``widths`` names this ``tp``,
                else ``size / tp`` (must divide)
vocab           rows of the vocabulary padded with zeros to ``round_up(original_size,
                vocab_multiple * tp)``, then split evenly; padding is zero in every state
fused           for each sub-parameter ``j`` (``sizes[j]`` rows along ``dim``) its slice ``r``
                (``widths[tp][j][r]`` or ``sizes[j] / tp``), concatenated in sub-parameter order:
                QKV under GQA ``[q_r; k_r; v_r]``, SwiGLU ``[gate_r; up_r]``
expert          experts ``[ep_rank * E/ep, (ep_rank+1) * E/ep)`` along ``dim``, each expert laid out
                by the ``inner`` pattern (whose dims exclude the expert dim)
==============  ==============================================================================

``placement`` (any kind) says which pipeline stages hold the tensor: ``{"layer": i}`` (the stage owning
global layer ``i``), ``{"stages": ["first", "last"]}`` (tied weights: stored once, materialised on
each listed stage) or nothing (every stage). ``placement.local_name`` optionally names the tensor as the
stage sees it: a template with ``{local}`` (stage-local layer index), ``{layer}`` (global index) and
``{stage}``, or an object ``{"first": ..., "last": ...}`` for tied tensors named differently per stage.

Coordinates. A ``Box`` is a tuple of half-open ``(start, stop)`` per dim. A ``Copy`` moves one logical box
to one box of the TP-local tensor of the same shape (no transposes ever). The TP-local tensor is what a
rank holds before ZeRO: ZeRO stages 1-3 further cut its *flattened* (row-major) form into fragments,
described by a ``Fragment`` (computed by ``ZeroGroupLayout``); ``fragment_layout`` turns a fragment into
``FlatCopy`` records (logical box -> contiguous range of the fragment), each logical box being
contiguous in the local tensor so that ``buffer[range] = logical[box].ravel()`` is exact.

Writers. Every logical element has replicas (over TP for replicated kinds, ``sp``, ``dp`` / ``edp``,
tied stages). ``is_writer`` picks exactly one: TP rank 0 for TP-replicated kinds, ``sp == 0``, ``dp == 0``
(``edp == 0`` for experts; ZeRO-flat states are disjoint over the ZeRO group, so no ``sp``/``dp``
condition), and the first stage of the placement. The reassembly tests prove the rule covers every
element exactly once.

Everything here is index arithmetic over tuples: no I/O, no tensors (``average_replicas`` excepted, which
only uses array arithmetic and works on numpy arrays and torch tensors alike).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from .errors import PatternError, TopologyError
from .topology import Topology

KINDS = ("replicated", "averaged", "partitioned", "vocab", "fused", "expert", "dtensor")
TP_REPLICATED_KINDS = ("replicated", "averaged", "dtensor")
STAGE_NAMES = ("first", "last")
SCHEMA_FILE = "pattern.schema.json"


# ====================================================================== boxes and copies
@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned box of an N-d array: half-open ``(start, stop)`` per dim (``()`` for a 0-d array)."""

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Box":
        return cls(tuple((0, int(n)) for n in shape))

    @property
    def ndim(self) -> int:
        return len(self.ranges)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.ranges)

    @property
    def start(self) -> tuple[int, ...]:
        return tuple(a for a, _ in self.ranges)

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(b for _, b in self.ranges)

    @property
    def numel(self) -> int:
        n = 1
        for a, b in self.ranges:
            n *= b - a
        return n

    @property
    def empty(self) -> bool:
        return any(b <= a for a, b in self.ranges)

    def intersect(self, other: "Box") -> "Box | None":
        """The common part, or None when it is empty."""
        out = []
        for (a, b), (c, d) in zip(self.ranges, other.ranges):
            lo, hi = (a if a > c else c), (b if b < d else d)
            if hi <= lo:
                return None
            out.append((lo, hi))
        return Box(tuple(out))

    def translate(self, delta: Sequence[int]) -> "Box":
        return Box(tuple((a + t, b + t) for (a, b), t in zip(self.ranges, delta)))

    def with_dim(self, dim: int, start: int, stop: int) -> "Box":
        r = list(self.ranges)
        r[dim] = (start, stop)
        return Box(tuple(r))

    def insert_dim(self, dim: int, start: int, stop: int) -> "Box":
        return Box(self.ranges[:dim] + ((start, stop),) + self.ranges[dim:])

    def slices(self) -> tuple[slice, ...]:
        """Index an array with ``array[box.slices()]``."""
        return tuple(slice(a, b) for a, b in self.ranges)

    def to_json(self) -> list[list[int]]:
        return [[a, b] for a, b in self.ranges]

    @classmethod
    def from_json(cls, value: Iterable[Sequence[int]]) -> "Box":
        return cls(tuple((int(a), int(b)) for a, b in value))


@dataclass(frozen=True, slots=True)
class FlatRange:
    """Half-open range ``[start, stop)`` of a flat (1-d) buffer."""

    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def shift(self, by: int) -> "FlatRange":
        return FlatRange(self.start + by, self.stop + by)

    def to_json(self) -> list[int]:
        return [self.start, self.stop]


@dataclass(frozen=True, slots=True)
class Copy:
    """Logical box <-> box of the TP-local tensor (same shape)."""

    logical: Box
    local: Box

    def to_json(self) -> dict[str, Any]:
        return {"logical": self.logical.to_json(), "local": self.local.to_json()}


@dataclass(frozen=True, slots=True)
class FlatCopy:
    """Logical box <-> contiguous range of a flat fragment: ``flat_buffer[flat] == logical[box].ravel()``."""

    logical: Box
    flat: FlatRange

    def to_json(self) -> dict[str, Any]:
        return {"logical": self.logical.to_json(), "flat": self.flat.to_json()}


@dataclass(frozen=True, slots=True)
class LocalLayout:
    """A rank's TP-local tensor: its shape, where its data comes from, and what must be zero."""

    shape: tuple[int, ...]
    copies: tuple[Copy, ...]
    padding: tuple[Box, ...]


class Fragment(NamedTuple):
    """A rank's ZeRO fragment of one parameter (a named tuple: a ZeRO-3 plan makes one per parameter).

    Elements ``[start, stop)`` of the flattened TP-local tensor land at ``buffer_start`` of the rank's
    flat buffer; ``slot`` buffer elements are reserved there (``slot > stop - start`` only for the ZeRO-3
    partition of the last ranks, whose tail is padding).

    An importer holding DeepSpeed's exact addresses builds it directly: for ZeRO-1/2
    ``param_slice_mappings[name] = (start=s, numel=n)`` on DP rank ``d`` gives
    ``Fragment(k, k + n, s, n)`` with ``k`` the elements of the parameter held by DP ranks ``< d``; for
    ZeRO-3 rank ``d`` of ``p = ceil(numel / dp)``: ``Fragment(min(d*p, numel), min((d+1)*p, numel), offset, p)``."""

    start: int
    stop: int
    buffer_start: int
    slot: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """A fragment's contents: ``copies`` and zero ``padding``, both as ranges of the fragment's slot."""

    slot: int
    copies: tuple[FlatCopy, ...]
    padding: tuple[FlatRange, ...]


# ====================================================================== pattern records
@dataclass(frozen=True, slots=True)
class Placement:
    """Pipeline placement: one global ``layer``, or named ``stages`` (tied), plus stage-local naming."""

    layer: int | None = None
    stages: tuple[str, ...] = ()
    local_name: str | None = None
    local_names: tuple[tuple[str, str], ...] = ()  # per stage name ("first"/"last") when tied

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.layer is not None:
            out["layer"] = self.layer
        if self.stages:
            out["stages"] = list(self.stages)
        if self.local_name is not None:
            out["local_name"] = self.local_name
        elif self.local_names:
            out["local_name"] = dict(self.local_names)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Pattern:
    """Base of the pattern kinds; ``kind`` names the JSON kind."""

    placement: Placement | None = None
    kind = "pattern"

    @property
    def tp_replicated(self) -> bool:
        """Identical on every TP rank (so only TP rank 0 writes it)."""
        return False

    def to_json(self) -> dict[str, Any]:
        out = {"kind": self.kind, **self._fields_json()}
        if self.placement is not None:
            out["placement"] = self.placement.to_json()
        return out

    def _fields_json(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicated(Pattern):
    kind = "replicated"

    @property
    def tp_replicated(self) -> bool:
        return True


@dataclass(frozen=True, slots=True, kw_only=True)
class Averaged(Pattern):
    max_deviation: float = 0.0
    kind = "averaged"

    @property
    def tp_replicated(self) -> bool:
        return True

    def _fields_json(self) -> dict[str, Any]:
        return {"max_deviation": self.max_deviation}


def _widths_json(widths: tuple) -> dict[str, Any]:
    def plain(w: Any) -> Any:
        return [plain(x) for x in w] if isinstance(w, tuple) else w

    return {str(tp): plain(w) for tp, w in widths}


@dataclass(frozen=True, slots=True, kw_only=True)
class Partitioned(Pattern):
    dim: int
    widths: tuple[tuple[int, tuple[int, ...]], ...] = ()  # ((tp, per-rank widths), ...) sorted by tp
    kind = "partitioned"

    def widths_for(self, tp: int) -> tuple[int, ...] | None:
        for t, w in self.widths:
            if t == tp:
                return w
        return None

    def _fields_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dim": self.dim}
        if self.widths:
            out["widths"] = _widths_json(self.widths)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Vocab(Pattern):
    dim: int = 0
    original_size: int
    kind = "vocab"

    def _fields_json(self) -> dict[str, Any]:
        return {"dim": self.dim, "original_size": self.original_size}


@dataclass(frozen=True, slots=True, kw_only=True)
class Fused(Pattern):
    dim: int
    sizes: tuple[int, ...]
    # ((tp, ((sub 0 per-rank widths), (sub 1 ...), ...)), ...) sorted by tp
    widths: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...] = ()
    kind = "fused"

    def widths_for(self, tp: int) -> tuple[tuple[int, ...], ...] | None:
        for t, w in self.widths:
            if t == tp:
                return w
        return None

    def _fields_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dim": self.dim, "sizes": list(self.sizes)}
        if self.widths:
            out["widths"] = _widths_json(self.widths)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Expert(Pattern):
    dim: int = 0
    num_experts: int
    inner: Pattern = Replicated()
    kind = "expert"

    @property
    def tp_replicated(self) -> bool:
        return self.inner.tp_replicated

    def _fields_json(self) -> dict[str, Any]:
        return {"dim": self.dim, "num_experts": self.num_experts, "inner": self.inner.to_json()}


@dataclass(frozen=True, slots=True, kw_only=True)
class DTensorSplit(Replicated):
    """How a DTensor was split when it was saved (``ucp_store.dist``): its mesh and placements.

    Informational: the logical array holds the whole tensor, so for the planner this is replicated (any
    topology reads it whole or sliced), and ``ucp_store.dist.load`` reads each target rank's boxes from
    the live DTensor, whatever mesh saved it. ``placements`` are JSON (``ucp_store/dist/layout.py``):
    ``{"type": "shard", "dim": d}``, ``{"type": "strided_shard", "dim": d, "split_factor": k}``,
    ``{"type": "replicate"}``; ``mesh_dims`` names the mesh dims (empty when unnamed)."""

    mesh_shape: tuple[int, ...] = ()
    mesh_dims: tuple[str, ...] = ()
    placements: tuple[tuple[tuple[str, Any], ...], ...] = ()
    kind = "dtensor"

    def _fields_json(self) -> dict[str, Any]:
        mesh: dict[str, Any] = {"shape": list(self.mesh_shape)}
        if self.mesh_dims:
            mesh["dims"] = list(self.mesh_dims)
        return {"mesh": mesh, "placements": [dict(pl) for pl in self.placements]}


REPLICATED = Replicated()
_KIND_CLASSES = {c.kind: c for c in (Replicated, Averaged, Partitioned, Vocab, Fused, Expert, DTensorSplit)}
_ALLOWED_KEYS = {
    "replicated": {"kind", "placement"},
    "averaged": {"kind", "placement", "max_deviation"},
    "partitioned": {"kind", "placement", "dim", "widths"},
    "vocab": {"kind", "placement", "dim", "original_size"},
    "fused": {"kind", "placement", "dim", "sizes", "widths"},
    "expert": {"kind", "placement", "dim", "num_experts", "inner"},
    "dtensor": {"kind", "placement", "mesh", "placements"},
}


def _who(name: str | None) -> str:
    return f"tensor {name!r}" if name else "pattern"


def _int(value: Any, what: str, name: str | None, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PatternError(f"{_who(name)}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def _int_list(value: Any, what: str, name: str | None) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise PatternError(f"{_who(name)}: {what} must be a list of integers, got {value!r}")
    return tuple(_int(v, what, name) for v in value)


def _parse_placement(rec: Any, name: str | None) -> Placement | None:
    if rec is None:
        return None
    if isinstance(rec, Placement):
        return rec
    if not isinstance(rec, Mapping):
        raise PatternError(f"{_who(name)}: placement must be an object, got {rec!r}")
    unknown = set(rec) - {"layer", "stages", "local_name"}
    if unknown:
        raise PatternError(f"{_who(name)}: placement has unknown field(s) {sorted(unknown)}; "
                           f"fields are 'layer', 'stages', 'local_name'")
    has_layer, has_stages = "layer" in rec, "stages" in rec
    if has_layer == has_stages:
        raise PatternError(f"{_who(name)}: placement needs exactly one of 'layer' or 'stages', got {dict(rec)!r}")
    layer = _int(rec["layer"], "placement.layer", name) if has_layer else None
    stages: tuple[str, ...] = ()
    if has_stages:
        raw = rec["stages"]
        if not isinstance(raw, (list, tuple)) or not raw or any(s not in STAGE_NAMES for s in raw) \
                or len(set(raw)) != len(raw):
            raise PatternError(f"{_who(name)}: placement.stages must be a non-empty list of distinct 'first'/'last', "
                               f"got {raw!r}")
        stages = tuple(s for s in STAGE_NAMES if s in raw)  # canonical order: first, last
    local_name, local_names = None, ()
    ln = rec.get("local_name")
    if isinstance(ln, str):
        local_name = ln
    elif isinstance(ln, Mapping):
        if not has_stages or set(ln) - set(stages):
            raise PatternError(f"{_who(name)}: placement.local_name as an object maps the listed stages "
                               f"{list(stages)} to names, got {dict(ln)!r}")
        if any(not isinstance(v, str) for v in ln.values()):
            raise PatternError(f"{_who(name)}: placement.local_name values must be strings, got {dict(ln)!r}")
        local_names = tuple((s, ln[s]) for s in STAGE_NAMES if s in ln)
    elif ln is not None:
        raise PatternError(f"{_who(name)}: placement.local_name must be a string or an object, got {ln!r}")
    return Placement(layer=layer, stages=stages, local_name=local_name, local_names=local_names)


def _parse_widths(raw: Any, nested: bool, name: str | None) -> tuple:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise PatternError(f"{_who(name)}: widths must be an object {{'<tp>': [...]}}, got {raw!r}")
    out = []
    for key, value in raw.items():
        try:
            tp = int(key)
        except (TypeError, ValueError):
            raise PatternError(f"{_who(name)}: widths key {key!r} is not a TP degree") from None
        if tp < 1:
            raise PatternError(f"{_who(name)}: widths key {key!r} is not a TP degree >= 1")
        if nested:
            if not isinstance(value, (list, tuple)):
                raise PatternError(f"{_who(name)}: widths[{key!r}] must list, per sub-parameter, the per-rank widths")
            w = tuple(_int_list(v, f"widths[{key!r}] entry", name) for v in value)
            if any(len(x) != tp for x in w):
                raise PatternError(f"{_who(name)}: widths[{key!r}] must give {tp} per-rank widths for every "
                                   f"sub-parameter, got {value!r}")
        else:
            w = _int_list(value, f"widths[{key!r}]", name)
            if len(w) != tp:
                raise PatternError(f"{_who(name)}: widths[{key!r}] must give {tp} per-rank widths, got {list(w)}")
        out.append((tp, w))
    return tuple(sorted(out))


_PARSE_CACHE: dict[str, Pattern] = {}
_PLACEMENT_CACHE: dict[str, Placement] = {}
_BARE_BY_ID: dict[int, tuple] = {}  # id(parsed pattern) -> (pattern, its placement-less twin)
_PARSE_CACHE_MAX = 200_000


def parse_pattern(record: Any, *, name: str | None = None) -> Pattern:
    """A ``Pattern`` from its JSON record (a dict), ``None`` (replicated everywhere) or a ``Pattern``.

    Raises ``PatternError`` naming the tensor for an unknown kind, a missing or malformed field."""
    if record is None:
        return REPLICATED
    if type(record) is not dict:
        if isinstance(record, Pattern):
            return record
        if not isinstance(record, Mapping):
            raise PatternError(f"{_who(name)}: a pattern is an object with a 'kind', got {record!r}")
        record = dict(record)
    # memoised on the record's repr: a catalog holds one pattern per tensor, but few distinct ones, and
    # repr is the cheapest faithful key of a JSON value (a different key order only costs a miss)
    key = repr(record)
    hit = _PARSE_CACHE.get(key)
    if hit is not None:
        return hit
    placement_rec = record.get("placement")
    if placement_rec is None:
        pattern = _parse(record, name, inner=False)
    else:
        # Records of a 1000-layer model differ per layer only in their placement: parse the rest once
        # (memoised like any record) and the placement on its own, instead of every layer's record whole.
        bare = parse_pattern({k: v for k, v in record.items() if k != "placement"}, name=name)
        pkey = repr(placement_rec)
        placement = _PLACEMENT_CACHE.get(pkey)
        if placement is None:
            placement = _PLACEMENT_CACHE[pkey] = _parse_placement(placement_rec, name)
            if len(_PLACEMENT_CACHE) >= _PARSE_CACHE_MAX:
                _PLACEMENT_CACHE.clear()
        pattern = replace(bare, placement=placement)
        # without_placement(pattern) is then this very object, so per-layer patterns share their layouts
        _BARE_BY_ID[id(pattern)] = (pattern, bare)
    if len(_PARSE_CACHE) >= _PARSE_CACHE_MAX:
        _PARSE_CACHE.clear()
        _BARE_BY_ID.clear()
    _PARSE_CACHE[key] = pattern
    return pattern


def _parse(rec: Mapping[str, Any], name: str | None, inner: bool) -> Pattern:
    kind = rec.get("kind")
    if kind not in _KIND_CLASSES:
        raise PatternError(f"{_who(name)}: unknown pattern kind {kind!r}; kinds are {', '.join(KINDS)}")
    unknown = set(rec) - _ALLOWED_KEYS[kind]
    if unknown:
        raise PatternError(f"{_who(name)}: {kind} pattern has unknown field(s) {sorted(unknown)}; "
                           f"allowed: {sorted(_ALLOWED_KEYS[kind])}")
    placement = _parse_placement(rec.get("placement"), name)
    if inner and placement is not None:
        raise PatternError(f"{_who(name)}: the inner pattern of an expert pattern cannot have a placement "
                           f"(place the expert pattern itself)")
    if kind == "replicated":
        return Replicated(placement=placement)
    if kind == "dtensor":
        return _parse_dtensor(rec, name, placement)
    if kind == "averaged":
        dev = rec.get("max_deviation", 0.0)
        if not isinstance(dev, (int, float)) or isinstance(dev, bool) or not dev >= 0:
            raise PatternError(f"{_who(name)}: averaged.max_deviation must be a number >= 0, got {dev!r}")
        return Averaged(max_deviation=float(dev), placement=placement)
    if kind == "partitioned":
        if "dim" not in rec:
            raise PatternError(f"{_who(name)}: partitioned pattern needs 'dim'")
        return Partitioned(dim=_int(rec["dim"], "dim", name), widths=_parse_widths(rec.get("widths"), False, name),
                           placement=placement)
    if kind == "vocab":
        if "original_size" not in rec:
            raise PatternError(f"{_who(name)}: vocab pattern needs 'original_size' (rows kept after stripping padding)")
        return Vocab(dim=_int(rec.get("dim", 0), "dim", name),
                     original_size=_int(rec["original_size"], "original_size", name), placement=placement)
    if kind == "fused":
        if "dim" not in rec or "sizes" not in rec:
            raise PatternError(f"{_who(name)}: fused pattern needs 'dim' and 'sizes'")
        sizes = _int_list(rec["sizes"], "sizes", name)
        if not sizes:
            raise PatternError(f"{_who(name)}: fused pattern needs at least one sub-parameter size")
        widths = _parse_widths(rec.get("widths"), True, name)
        for tp, w in widths:
            if len(w) != len(sizes):
                raise PatternError(f"{_who(name)}: widths[{str(tp)!r}] lists {len(w)} sub-parameters but sizes "
                                   f"lists {len(sizes)}")
        return Fused(dim=_int(rec["dim"], "dim", name), sizes=sizes, widths=widths, placement=placement)
    # expert
    if inner:
        raise PatternError(f"{_who(name)}: expert patterns cannot nest")
    if "num_experts" not in rec:
        raise PatternError(f"{_who(name)}: expert pattern needs 'num_experts'")
    inner_rec = rec.get("inner")
    inner_pattern = REPLICATED if inner_rec is None else None
    if inner_rec is not None:
        if not isinstance(inner_rec, Mapping):
            raise PatternError(f"{_who(name)}: expert.inner must be a pattern object, got {inner_rec!r}")
        inner_pattern = _parse(inner_rec, name, inner=True)
    return Expert(dim=_int(rec.get("dim", 0), "dim", name),
                  num_experts=_int(rec["num_experts"], "num_experts", name, minimum=1),
                  inner=inner_pattern, placement=placement)


def pattern_to_json(pattern: Pattern | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The JSON record of a pattern (``None`` stays ``None``)."""
    if pattern is None:
        return None
    return parse_pattern(pattern).to_json()


def validate_pattern_record(record: Any, *, name: str | None = None) -> Pattern:
    """Check ``record`` against ``schemas/pattern.schema.json`` and parse it; ``PatternError`` otherwise."""
    from .topology import schema_errors

    errors = schema_errors(record, SCHEMA_FILE)
    if errors:
        raise PatternError(f"{_who(name)}: pattern record does not match pattern.schema.json: " + "; ".join(errors))
    return parse_pattern(record, name=name)


_DTENSOR_PLACEMENT_KEYS = {"replicate": {"type"}, "shard": {"type", "dim"},
                           "strided_shard": {"type", "dim", "split_factor"}}


def _parse_dtensor(rec: Mapping[str, Any], name: str | None, placement: Placement | None) -> DTensorSplit:
    mesh = rec.get("mesh")
    if not isinstance(mesh, Mapping) or set(mesh) - {"shape", "dims"} or "shape" not in mesh:
        raise PatternError(f"{_who(name)}: dtensor pattern needs 'mesh': {{'shape': [...], 'dims': [...]}}, "
                           f"got {mesh!r}")
    shape = _int_list(mesh["shape"], "mesh.shape", name)
    if not shape or any(n < 1 for n in shape):
        raise PatternError(f"{_who(name)}: dtensor mesh.shape must list sizes >= 1, got {list(shape)}")
    dims = mesh.get("dims") or ()
    if not isinstance(dims, (list, tuple)) or any(not isinstance(d, str) for d in dims) or (
            dims and len(dims) != len(shape)):
        raise PatternError(f"{_who(name)}: dtensor mesh.dims must name each of the {len(shape)} mesh dims, "
                           f"got {dims!r}")
    pls = rec.get("placements")
    if not isinstance(pls, (list, tuple)) or len(pls) != len(shape):
        raise PatternError(f"{_who(name)}: dtensor pattern needs one placement per mesh dim ({len(shape)}), "
                           f"got {pls!r}")
    parsed = []
    for pl in pls:
        kind = pl.get("type") if isinstance(pl, Mapping) else None
        if kind not in _DTENSOR_PLACEMENT_KEYS or set(pl) != _DTENSOR_PLACEMENT_KEYS[kind]:
            raise PatternError(f"{_who(name)}: dtensor placement {pl!r} is not one of {{'type': 'replicate'}}, "
                               "{'type': 'shard', 'dim': d}, {'type': 'strided_shard', 'dim': d, 'split_factor': k}")
        if "dim" in pl:
            _int(pl["dim"], "placement dim", name)
        if "split_factor" in pl:
            _int(pl["split_factor"], "placement split_factor", name, minimum=1)
        parsed.append(tuple((k, pl[k]) for k in ("type", "dim", "split_factor") if k in pl))
    return DTensorSplit(mesh_shape=shape, mesh_dims=tuple(dims), placements=tuple(parsed), placement=placement)


def check_pattern(pattern: Any, shape: Sequence[int], *, name: str | None = None) -> Pattern:
    """Check that a pattern fits a logical ``shape`` (topology-independent checks); returns the parsed pattern."""
    p = parse_pattern(pattern, name=name)
    _check_shape(p, tuple(int(s) for s in shape), name)
    return p


def _check_shape(p: Pattern, shape: tuple[int, ...], name: str | None) -> None:
    ndim = len(shape)
    dim = getattr(p, "dim", None)
    if dim is not None and not 0 <= dim < ndim:
        raise PatternError(f"{_who(name)}: {p.kind} pattern splits dim {dim} but the tensor has shape "
                           f"{list(shape)} ({ndim} dims)")
    if isinstance(p, Partitioned):
        for tp, w in p.widths:
            if sum(w) != shape[dim]:
                raise PatternError(f"{_who(name)}: widths for tp={tp} are {list(w)} (sum {sum(w)}) but dim {dim} "
                                   f"has size {shape[dim]}")
    elif isinstance(p, Vocab):
        if shape[dim] != p.original_size:
            raise PatternError(f"{_who(name)}: vocab dim {dim} has size {shape[dim]} but original_size is "
                               f"{p.original_size}; the logical tensor holds exactly the unpadded rows")
    elif isinstance(p, Fused):
        if sum(p.sizes) != shape[dim]:
            raise PatternError(f"{_who(name)}: fused sub-parameter sizes {list(p.sizes)} add up to {sum(p.sizes)} "
                               f"but dim {dim} has size {shape[dim]}")
        for tp, w in p.widths:
            for j, (s, wj) in enumerate(zip(p.sizes, w)):
                if sum(wj) != s:
                    raise PatternError(f"{_who(name)}: widths for tp={tp} of sub-parameter {j} are {list(wj)} "
                                       f"(sum {sum(wj)}) but its size is {s}")
    elif isinstance(p, DTensorSplit):
        for pl in p.placements:
            d = dict(pl).get("dim")
            if d is not None and d >= ndim:
                raise PatternError(f"{_who(name)}: dtensor placement {dict(pl)} shards dim {d} but the tensor has "
                                   f"shape {list(shape)} ({ndim} dims)")
    elif isinstance(p, Expert):
        if shape[dim] != p.num_experts:
            raise PatternError(f"{_who(name)}: expert dim {dim} has size {shape[dim]} but num_experts is "
                               f"{p.num_experts}")
        _check_shape(p.inner, shape[:dim] + shape[dim + 1:], name)


# ====================================================================== placement and names
def placement_stages(pattern: Any, topology: Topology, *, name: str | None = None) -> tuple[int, ...]:
    """The pipeline stages holding the tensor, ascending (tied tensors: first and last; pp=1: (0,))."""
    p = parse_pattern(pattern, name=name)
    return stages_of_placement(p.placement, topology, name)


def stages_of_placement(pl: Placement | None, topology: Topology, name: str | None = None) -> tuple[int, ...]:
    """The stages a ``Placement`` (or ``None``: every stage) resolves to in ``topology``, ascending."""
    if pl is None:
        return tuple(range(topology.pp))
    if pl.layer is not None:
        if topology.pp == 1:
            return (0,)  # one stage holds every layer, whatever ``layers`` says
        if pl.layer >= topology.layers:
            raise TopologyError(f"{_who(name)} is placed on layer {pl.layer} but the topology has "
                                f"layers={topology.layers}; set 'layers' to the model's number of layers")
        return (topology.stage_of_layer(pl.layer),)
    return tuple(sorted({0 if s == "first" else topology.pp - 1 for s in pl.stages}))


def holds(pattern: Any, topology: Topology, rank: int, *, name: str | None = None) -> bool:
    """Does ``rank``'s pipeline stage hold the tensor?"""
    return topology.coords(rank)["pp"] in placement_stages(pattern, topology, name=name)


def stage_local_name(name: str, pattern: Any, topology: Topology, stage: int | None = None) -> str:
    """The name stage ``stage`` uses for canonical tensor ``name``.

    ``placement.local_name`` wins (``{local}``, ``{layer}``, ``{stage}`` filled in); otherwise the
    topology's ``layer_names`` rule; otherwise the canonical name (global layer indices, as in
    Megatron-DeepSpeed pipe models)."""
    p = parse_pattern(pattern, name=name)
    pl = p.placement
    stages = stages_of_placement(pl, topology, name)
    if stage is None:
        stage = stages[0]
    elif stage not in stages:
        raise TopologyError(f"{_who(name)} is not held by stage {stage} (held by {list(stages)})")
    template = None
    if pl is not None:
        template = pl.local_name
        if template is None and pl.local_names:
            wanted = {"first": 0, "last": topology.pp - 1}
            for stage_name, t in pl.local_names:
                if wanted[stage_name] == stage:
                    template = t
                    break
    if template is None:
        return topology.local_name(name)
    layer = pl.layer if pl is not None and pl.layer is not None else None
    local = layer - topology.stage_starts[stage] if layer is not None else ""
    try:
        return template.format(local=local, layer=layer if layer is not None else "", stage=stage)
    except (KeyError, IndexError, ValueError) as e:
        raise PatternError(f"{_who(name)}: placement.local_name {template!r} is not a valid template "
                           f"(fields: {{local}}, {{layer}}, {{stage}}): {e}") from None


def canonical_names(tensors: Iterable[tuple[str, Any]], topology: Topology, stage: int) -> dict[str, str]:
    """Map stage-local names to canonical names for every ``(name, pattern)`` held by ``stage``.

    The inverse of ``stage_local_name``; raises ``PatternError`` if two tensors share a local name."""
    out: dict[str, str] = {}
    for name, pattern in tensors:
        p = parse_pattern(pattern, name=name)
        if stage not in stages_of_placement(p.placement, topology, name):
            continue
        local = stage_local_name(name, p, topology, stage)
        if out.get(local, name) != name:
            raise PatternError(f"tensors {out[local]!r} and {name!r} both have the local name {local!r} "
                               f"on stage {stage}")
        out[local] = name
    return out


# ====================================================================== TP / EP layouts
def _divisors(n: int, limit: int = 8) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return "{" + ", ".join(map(str, ds[:limit])) + (", ...}" if len(ds) > limit else "}")


def _even_widths(n: int, tp: int, name: str | None, what: str) -> tuple[int, ...]:
    if n % tp:
        raise TopologyError(f"{_who(name)} {what} of size {n} cannot be split {tp} ways: give widths for tp={tp} "
                            f"or use tp in {_divisors(n)}")
    return (n // tp,) * tp


def _full_copy(shape: tuple[int, ...]) -> LocalLayout:
    box = Box.full(shape)
    return LocalLayout(shape, () if box.empty else (Copy(box, box),), ())


def without_placement(p: Pattern) -> Pattern:
    """The pattern with its placement removed (what layouts depend on)."""
    # layouts do not depend on the placement: strip it so every layer shares one cache entry
    if p.placement is None:
        return p
    hit = _BARE_BY_ID.get(id(p))
    if hit is not None and hit[0] is p:  # the identity check makes a recycled id harmless
        return hit[1]
    return _strip_placement(p)


@lru_cache(maxsize=1 << 16)
def _strip_placement(p: Pattern) -> Pattern:
    return replace(p, placement=None)


_LAYOUT_CACHE: dict[tuple, LocalLayout] = {}
_LAYOUT_CACHE_MAX = 200_000


def tp_layout(pattern: Any, shape: Sequence[int], tp: int, tp_rank: int, *, ep: int = 1, ep_rank: int = 0,
              vocab_multiple: int = 1, name: str | None = None) -> LocalLayout:
    """The TP/EP-local layout of ``rank`` given its coordinates directly (see ``local_layout``)."""
    p = without_placement(parse_pattern(pattern, name=name))
    shape = tuple(shape)
    key = (p, shape, tp, tp_rank, ep, ep_rank, vocab_multiple)
    hit = _LAYOUT_CACHE.get(key)
    if hit is not None:
        return hit
    _check_shape(p, shape, name)
    out = _layout(p, shape, tp, tp_rank, ep, ep_rank, vocab_multiple, name)
    if len(_LAYOUT_CACHE) >= _LAYOUT_CACHE_MAX:
        _LAYOUT_CACHE.clear()
    _LAYOUT_CACHE[key] = out
    return out


def local_layout(pattern: Any, shape: Sequence[int], topology: Topology, rank: int, *,
                 name: str | None = None) -> LocalLayout:
    """Forward map: the TP-local tensor of ``rank`` (before ZeRO) as shape, copies and zero padding.

    Pipeline placement is not checked here (see ``holds``): the layout is the one the rank would hold."""
    c = topology.coords(rank)
    return tp_layout(pattern, shape, topology.tp, c["tp"], ep=topology.ep, ep_rank=c["ep"],
                     vocab_multiple=topology.vocab_multiple, name=name)


def _layout(p: Pattern, shape: tuple[int, ...], tp: int, r: int, ep: int, ep_rank: int, vmult: int,
            name: str | None) -> LocalLayout:
    if isinstance(p, (Replicated, Averaged)):
        return _full_copy(shape)
    if isinstance(p, Partitioned):
        d = p.dim
        widths = p.widths_for(tp) or _even_widths(shape[d], tp, name, f"dim {d}")
        off, w = sum(widths[:r]), widths[r]
        local_shape = shape[:d] + (w,) + shape[d + 1:]
        local = Box.full(local_shape)
        if local.empty:
            return LocalLayout(local_shape, (), ())
        return LocalLayout(local_shape, (Copy(local.with_dim(d, off, off + w), local),), ())
    if isinstance(p, Vocab):
        d, n = p.dim, p.original_size
        multiple = vmult * tp
        per = -(-n // multiple) * multiple // tp  # padded rows per rank
        lo, hi = min(r * per, n), min((r + 1) * per, n)
        local_shape = shape[:d] + (per,) + shape[d + 1:]
        full = Box.full(local_shape)
        if full.empty:
            return LocalLayout(local_shape, (), ())
        copies, padding = (), ()
        if hi > lo:
            copies = (Copy(full.with_dim(d, lo, hi), full.with_dim(d, 0, hi - lo)),)
        if per > hi - lo:
            padding = (full.with_dim(d, hi - lo, per),)
        return LocalLayout(local_shape, copies, padding)
    if isinstance(p, Fused):
        d = p.dim
        widths = p.widths_for(tp)
        if widths is None:
            widths = []
            for j, s in enumerate(p.sizes):
                if s % tp:
                    common = math.gcd(*p.sizes)
                    raise TopologyError(
                        f"{_who(name)} dim {d}: fused sub-parameter {j} of size {s} (sizes {list(p.sizes)}) cannot "
                        f"be split {tp} ways: give widths for tp={tp} or use tp in {_divisors(common)}")
                widths.append((s // tp,) * tp)
        extent = sum(wj[r] for wj in widths)
        local_shape = shape[:d] + (extent,) + shape[d + 1:]
        full = Box.full(local_shape)
        copies = []
        sub_start = local_at = 0
        for s, wj in zip(p.sizes, widths):
            w = wj[r]
            if w:
                src = sub_start + sum(wj[:r])
                copies.append(Copy(full.with_dim(d, src, src + w), full.with_dim(d, local_at, local_at + w)))
            sub_start += s
            local_at += w
        if full.empty:
            copies = []
        return LocalLayout(local_shape, tuple(copies), ())
    if isinstance(p, Expert):
        e, n = p.dim, p.num_experts
        if n % ep:
            raise TopologyError(f"{_who(name)}: {n} experts cannot be split over ep={ep}; use ep in {_divisors(n)}")
        per = n // ep
        e0 = ep_rank * per
        inner = _layout(p.inner, shape[:e] + shape[e + 1:], tp, r, 1, 0, vmult, name)
        local_shape = inner.shape[:e] + (per,) + inner.shape[e:]
        copies = tuple(Copy(c.logical.insert_dim(e, e0, e0 + per), c.local.insert_dim(e, 0, per))
                       for c in inner.copies)
        padding = tuple(b.insert_dim(e, 0, per) for b in inner.padding)
        return LocalLayout(local_shape, copies, padding)
    raise PatternError(f"{_who(name)}: unknown pattern kind {p.kind!r}")


# ====================================================================== writers (the inverse map)
def is_writer(pattern: Any, topology: Topology, rank: int, *, flat: bool = False, name: str | None = None) -> bool:
    """Is ``rank`` the one rank that writes its copy of the tensor (see the module docstring)?

    ``flat``: the state is a ZeRO flat fragment (``zero_stage >= 1``), whose fragments are already disjoint
    across the ZeRO group (``sp`` x ``dp``, or ``sp`` x ``edp`` for experts)."""
    p = parse_pattern(pattern, name=name)
    c = topology.coords(rank)
    stages = stages_of_placement(p.placement, topology, name)
    if c["pp"] != stages[0]:
        return False
    if p.tp_replicated and c["tp"] != 0:
        return False
    if flat and topology.zero_stage > 0:
        return True
    if c["sp"] != 0:
        return False
    return (c["edp"] if isinstance(p, Expert) else c["dp"]) == 0


def shard_copies(pattern: Any, shape: Sequence[int], topology: Topology, rank: int, *,
                 name: str | None = None) -> tuple[Copy, ...]:
    """Inverse map: where ``rank``'s TP-local tensor lands in the logical tensor (every copy, writer or not).

    ``logical[c.logical.slices()] = local[c.local.slices()]`` for each copy rebuilds the logical tensor."""
    return local_layout(pattern, shape, topology, rank, name=name).copies


def writer_copies(pattern: Any, shape: Sequence[int], topology: Topology, rank: int, *,
                  name: str | None = None) -> tuple[Copy, ...]:
    """The copies ``rank`` must write when saving: ``shard_copies`` if it is the writer, else nothing."""
    if not holds(pattern, topology, rank, name=name) or not is_writer(pattern, topology, rank, name=name):
        return ()
    return shard_copies(pattern, shape, topology, rank, name=name)


def fragment_writer_copies(pattern: Any, shape: Sequence[int], topology: Topology, rank: int,
                           fragment: Fragment, *, name: str | None = None) -> tuple[FlatCopy, ...]:
    """The flat copies a ZeRO rank must write from its fragment (ranges relative to the fragment's slot)."""
    if not holds(pattern, topology, rank, name=name) or not is_writer(pattern, topology, rank, flat=True, name=name):
        return ()
    return fragment_layout(pattern, shape, topology, rank, fragment, name=name).copies


# ====================================================================== flat ranges
def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Decompose ``[start, stop)`` of the row-major flattening of ``shape`` into boxes, in flat order.

    Each box is contiguous in the flattening (fixed leading indices, a range on one dim, full trailing
    dims); there are at most ``2 * ndim - 1``."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise PatternError(f"flat range [{start}, {stop}) is outside a tensor of shape {list(shape)} "
                           f"({numel} elements)")
    if start == stop:
        return []
    if not shape:
        return [Box(())]
    out: list[Box] = []
    _decompose(shape, start, stop, (), out)
    return out


def _decompose(shape: tuple[int, ...], a: int, b: int, prefix: tuple[tuple[int, int], ...], out: list[Box]) -> None:
    # [a, b) is non-empty and lies within one block of shape ``shape`` whose leading indices are ``prefix``
    rest = shape[1:]
    inner = math.prod(rest)
    full_rest = tuple((0, n) for n in rest)
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(b, inner)
    if not rest or (r0 == 0 and r1 == 0):
        out.append(Box(prefix + ((i0, i1),) + full_rest))
        return
    if i0 == i1:
        _decompose(rest, r0, r1, prefix + ((i0, i0 + 1),), out)
        return
    if r0:
        _decompose(rest, r0, inner, prefix + ((i0, i0 + 1),), out)
        i0 += 1
    if i1 > i0:
        out.append(Box(prefix + ((i0, i1),) + full_rest))
    if r1:
        _decompose(rest, 0, r1, prefix + ((i1, i1 + 1),), out)


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def split_contiguous(box: Box, shape: Sequence[int]) -> list[Box]:
    """Split ``box`` of an array of ``shape`` into the fewest boxes each contiguous in row-major order."""
    ranges = box.ranges
    j = len(ranges) - 1
    while j >= 0 and ranges[j] == (0, shape[j]):
        j -= 1
    if j <= 0 or all(b - a == 1 for a, b in ranges[:j]):
        return [box]
    # every index combination of the dims before the last partial one is its own contiguous run
    heads = itertools.product(*(range(a, b) for a, b in ranges[:j]))
    return [Box(tuple((i, i + 1) for i in head) + ranges[j:]) for head in heads]


def fragment_layout(pattern: Any, shape: Sequence[int], topology: Topology, rank: int, fragment: Fragment, *,
                    name: str | None = None) -> FlatLayout:
    """Forward map for a ZeRO fragment: logical boxes -> ranges of the fragment's slot, and zero padding.

    Ranges are relative to the slot (``buffer[fragment.buffer_start + r.start : ...]``)."""
    layout = local_layout(pattern, shape, topology, rank, name=name)
    return flat_layout(layout, fragment)


_FLAT_CACHE: dict[tuple, FlatLayout] = {}


def flat_layout(layout: LocalLayout, fragment: Fragment) -> FlatLayout:
    """``fragment_layout`` from an already computed ``LocalLayout`` (cached on the fragment's extent)."""
    key = (layout, fragment.start, fragment.stop, fragment.slot)
    hit = _FLAT_CACHE.get(key)
    if hit is not None:
        return hit
    shape = layout.shape
    strides = row_major_strides(shape)
    copies: list[FlatCopy] = []
    for piece in flat_range_to_boxes(shape, fragment.start, fragment.stop):
        for c in layout.copies:
            inter = piece.intersect(c.local)
            if inter is None:
                continue
            delta = tuple(lg - lc for (lg, _), (lc, _) in zip(c.logical.ranges, c.local.ranges))
            for run in split_contiguous(inter, shape):
                at = sum(a * s for (a, _), s in zip(run.ranges, strides)) - fragment.start
                copies.append(FlatCopy(run.translate(delta), FlatRange(at, at + run.numel)))
    copies.sort(key=lambda fc: fc.flat.start)
    padding, at = [], 0
    for fc in copies:
        if fc.flat.start > at:
            padding.append(FlatRange(at, fc.flat.start))
        at = fc.flat.stop
    if fragment.slot > at:
        padding.append(FlatRange(at, fragment.slot))
    out = FlatLayout(fragment.slot, tuple(copies), tuple(padding))
    if len(_FLAT_CACHE) >= _LAYOUT_CACHE_MAX:
        _FLAT_CACHE.clear()
    _FLAT_CACHE[key] = out
    return out


# ====================================================================== ZeRO partitions
@dataclass(frozen=True, slots=True)
class ZeroGroupLayout:
    """How one parameter group's flat buffer is partitioned over a ZeRO group of ``world`` ranks.

    Stage 1/2 (DeepSpeed ``stage_1_and_2.py``): the TP-local parameters are flattened and concatenated
    in order, each but the last followed by padding to a multiple of ``param_alignment``; the whole is
    padded to a multiple of ``alignment * world``, and rank ``z`` owns ``[z * P, (z+1) * P)`` with
    ``P = total / world``. A parameter may straddle ranks. ``offsets[i]`` is parameter ``i``'s start in
    the unpartitioned flat group.

    Stage 3 (``partition_parameters.py``): every parameter is split on its own into
    ``p_i = ceil(numel_i / world)`` pieces, the last rank(s) clipped and padded; a rank's buffer holds
    its piece of every parameter back to back, ``offsets[i]`` being where piece ``i`` starts in it."""

    zero_stage: int
    world: int
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    partition_numel: int  # each rank's buffer length
    total_numel: int      # stage 1/2: the padded flat group; stage 3: world * partition_numel

    def fragment(self, index: int, zero_rank: int) -> Fragment | None:
        """Rank ``zero_rank``'s part of parameter ``index``, or None if it holds none of it (stage 1/2)."""
        n, off = self.numels[index], self.offsets[index]
        if self.zero_stage == 3:
            piece = -(-n // self.world)
            start = min(zero_rank * piece, n)
            return Fragment(start, min(start + piece, n), off, piece)
        lo = zero_rank * self.partition_numel
        a, b = max(off, lo), min(off + n, lo + self.partition_numel)
        if b <= a:
            return None
        return Fragment(a - off, b - off, a - lo, b - a)

    def fragments(self, zero_rank: int) -> list[tuple[int, Fragment]]:
        """``(parameter index, fragment)`` for every parameter rank ``zero_rank`` holds a slot of.

        The arithmetic of ``fragment`` inlined (a ZeRO-3 group of a 1000-layer model has 25k members),
        and for stage 1/2 only over the members overlapping the rank; a property test holds the two equal."""
        numels, offsets = self.numels, self.offsets
        if self.zero_stage == 3:  # every parameter has a piece on every rank (empty for tiny ones)
            world = self.world
            out = []
            for i, n in enumerate(numels):
                piece = -(-n // world)
                if piece:
                    start = min(zero_rank * piece, n)
                    out.append((i, Fragment(start, min(start + piece, n), offsets[i], piece)))
            return out
        # stage 1/2: only the parameters overlapping [lo, hi) of the flat group; offsets ascend
        lo = zero_rank * self.partition_numel
        hi = lo + self.partition_numel
        first = max(bisect.bisect_right(offsets, lo) - 1, 0)
        out = []
        for i in range(first, len(numels)):
            off = offsets[i]
            if off >= hi:
                break
            a, b = max(off, lo), min(off + numels[i], hi)
            if b > a:
                out.append((i, Fragment(a - off, b - off, a - lo, b - a)))
        return out

    def gaps(self, zero_rank: int) -> tuple[FlatRange, ...]:
        """Buffer ranges of ``zero_rank`` outside every parameter's slot (alignment and tail padding)."""
        slots = sorted((f.buffer_start, f.buffer_start + f.slot) for _, f in self.fragments(zero_rank))
        out, at = [], 0
        for a, b in slots:
            if a > at:
                out.append(FlatRange(at, a))
            at = max(at, b)
        if self.partition_numel > at:
            out.append(FlatRange(at, self.partition_numel))
        return tuple(out)


def zero_group_layout(numels: Sequence[int], world: int, zero_stage: int, *, alignment: int = 2,
                      param_alignment: int = 1) -> ZeroGroupLayout:
    """Partition a parameter group (TP-local numels in group order) over ``world`` ZeRO ranks.

    ``alignment`` is DeepSpeed's ``nccl_start_alignment_factor`` (2); ``param_alignment`` is 1 unless
    ``zero_optimization.parameter_alignment`` is on (then ``16 // element_size``). Both are ignored by
    stage 3, which partitions each parameter separately."""
    if zero_stage not in (1, 2, 3):
        raise TopologyError(f"ZeRO partitions exist for zero_stage 1, 2 or 3, not {zero_stage!r}")
    if world < 1 or alignment < 1 or param_alignment < 1:
        raise TopologyError(f"ZeRO world {world}, alignment {alignment} and param_alignment {param_alignment} "
                            f"must be >= 1")
    numels = tuple(int(n) for n in numels)
    offsets = []
    if zero_stage == 3:
        at = 0
        for n in numels:
            offsets.append(at)
            at += -(-n // world)
        return ZeroGroupLayout(3, world, numels, tuple(offsets), at, at * world)
    at = 0
    for i, n in enumerate(numels):
        offsets.append(at)
        at += n
        if i < len(numels) - 1:
            at += (-at) % param_alignment
    unit = alignment * world
    total = -(-at // unit) * unit
    return ZeroGroupLayout(zero_stage, world, numels, tuple(offsets), total // world, total)


# ====================================================================== averaged replicas
def average_replicas(replicas: Sequence[Any]) -> tuple[Any, float]:
    """Mean of drifted replicas and the largest absolute deviation of any replica from it.

    Works on numpy arrays and torch tensors (computed in float64, returned in the replicas' dtype);
    ``max_deviation`` is measured against the returned (rounded) mean, i.e. the error a rank loading
    the averaged tensor sees relative to its own replica."""
    if not replicas:
        raise PatternError("average_replicas needs at least one replica")
    first = replicas[0]
    shapes = {tuple(r.shape) for r in replicas}
    if len(shapes) != 1:
        raise PatternError(f"replicas to average have different shapes {sorted(shapes)}")
    if hasattr(first, "double") and hasattr(first, "to"):  # torch
        wide = [r.double() for r in replicas]
        mean = (sum(wide[1:], wide[0].clone()) / len(wide)).to(first.dtype)
        mean_wide = mean.double()
        dev = max(float((w - mean_wide).abs().max()) if w.numel() else 0.0 for w in wide)
        return mean, dev
    import numpy as np

    arrays = [np.asarray(r) for r in replicas]
    wide = [a.astype(np.float64) for a in arrays]
    mean = (sum(wide[1:], wide[0].copy()) / len(wide)).astype(arrays[0].dtype)
    mean_wide = mean.astype(np.float64)
    dev = max(float(np.abs(w - mean_wide).max()) if w.size else 0.0 for w in wide)
    return mean, dev


def clear_caches() -> None:
    """Forget memoised parses and layouts (for benchmarks; results never depend on the caches)."""
    _PARSE_CACHE.clear()
    _PLACEMENT_CACHE.clear()
    _BARE_BY_ID.clear()
    _LAYOUT_CACHE.clear()
    _FLAT_CACHE.clear()
    _strip_placement.cache_clear()
