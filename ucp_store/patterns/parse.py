"""Pattern records: parsing, validation against the schema and the logical shape, memoised.

``parse_pattern`` turns a JSON record (or ``None``, or a ``Pattern``) into the typed kinds of ``kinds``
and raises ``PatternError`` naming the tensor, the field and the expectation. Parses are memoised on the
record's repr, the placement apart from the rest (a 1000-layer model's records differ per layer only
in their placement), so that ``without_placement`` maps every layer's pattern to one shared object and
the layout caches hit across layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any

from ucp_store.errors import PatternError
from ucp_store.patterns.kinds import (
    KINDS,
    REPLICATED,
    SCHEMA_FILE,
    STAGE_NAMES,
    Averaged,
    DTensorSplit,
    Expert,
    ExpertMember,
    Fused,
    Partitioned,
    Pattern,
    Placement,
    Replicated,
    Vocab,
)

__all__ = ["parse_pattern", "pattern_to_json", "validate_pattern_record", "check_pattern", "without_placement",
           "clear_parse_caches"]

_KIND_CLASSES = {c.kind: c for c in (Replicated, Averaged, Partitioned, Vocab, Fused, Expert, ExpertMember,
                                            DTensorSplit)}
_ALLOWED_KEYS = {
    "replicated": {"kind", "placement"},
    "averaged": {"kind", "placement", "max_deviation"},
    "partitioned": {"kind", "placement", "dim", "widths"},
    "vocab": {"kind", "placement", "dim", "original_size"},
    "fused": {"kind", "placement", "dim", "sizes", "widths"},
    "expert": {"kind", "placement", "dim", "num_experts", "inner"},
    "expert_member": {"kind", "placement", "expert", "num_experts", "group", "inner"},
    "dtensor": {"kind", "placement", "mesh", "placements"},
}


def who(name: str | None) -> str:
    return f"tensor {name!r}" if name else "pattern"


def _int(value: Any, what: str, name: str | None, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PatternError(f"{who(name)}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def _int_list(value: Any, what: str, name: str | None) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise PatternError(f"{who(name)}: {what} must be a list of integers, got {value!r}")
    return tuple(_int(v, what, name) for v in value)


def _parse_placement(rec: Any, name: str | None) -> Placement | None:
    if rec is None:
        return None
    if isinstance(rec, Placement):
        return rec
    if not isinstance(rec, Mapping):
        raise PatternError(f"{who(name)}: placement must be an object, got {rec!r}")
    unknown = set(rec) - {"layer", "stages", "local_name"}
    if unknown:
        raise PatternError(f"{who(name)}: placement has unknown field(s) {sorted(unknown)}; "
                           f"fields are 'layer', 'stages', 'local_name'")
    has_layer, has_stages = "layer" in rec, "stages" in rec
    if has_layer == has_stages:
        raise PatternError(f"{who(name)}: placement needs exactly one of 'layer' or 'stages', got {dict(rec)!r}")
    layer = _int(rec["layer"], "placement.layer", name) if has_layer else None
    stages: tuple[str, ...] = ()
    if has_stages:
        raw = rec["stages"]
        if not isinstance(raw, (list, tuple)) or not raw or any(s not in STAGE_NAMES for s in raw) \
                or len(set(raw)) != len(raw):
            raise PatternError(f"{who(name)}: placement.stages must be a non-empty list of distinct 'first'/'last', "
                               f"got {raw!r}")
        stages = tuple(s for s in STAGE_NAMES if s in raw)  # canonical order: first, last
    local_name: str | None = None
    local_names: tuple[tuple[str, str], ...] = ()
    ln = rec.get("local_name")
    if isinstance(ln, str):
        local_name = ln
    elif isinstance(ln, Mapping):
        if not has_stages or set(ln) - set(stages):
            raise PatternError(f"{who(name)}: placement.local_name as an object maps the listed stages "
                               f"{list(stages)} to names, got {dict(ln)!r}")
        if any(not isinstance(v, str) for v in ln.values()):
            raise PatternError(f"{who(name)}: placement.local_name values must be strings, got {dict(ln)!r}")
        local_names = tuple((s, ln[s]) for s in STAGE_NAMES if s in ln)
    elif ln is not None:
        raise PatternError(f"{who(name)}: placement.local_name must be a string or an object, got {ln!r}")
    return Placement(layer=layer, stages=stages, local_name=local_name, local_names=local_names)


def _parse_widths(raw: Any, nested: bool, name: str | None) -> tuple[Any, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise PatternError(f"{who(name)}: widths must be an object {{'<tp>': [...]}}, got {raw!r}")
    out = []
    for key, value in raw.items():
        try:
            tp = int(key)
        except (TypeError, ValueError):
            raise PatternError(f"{who(name)}: widths key {key!r} is not a TP degree") from None
        if tp < 1:
            raise PatternError(f"{who(name)}: widths key {key!r} is not a TP degree >= 1")
        if nested:
            if not isinstance(value, (list, tuple)):
                raise PatternError(f"{who(name)}: widths[{key!r}] must list, per sub-parameter, the per-rank widths")
            w: Any = tuple(_int_list(v, f"widths[{key!r}] entry", name) for v in value)
            if any(len(x) != tp for x in w):
                raise PatternError(f"{who(name)}: widths[{key!r}] must give {tp} per-rank widths for every "
                                   f"sub-parameter, got {value!r}")
        else:
            w = _int_list(value, f"widths[{key!r}]", name)
            if len(w) != tp:
                raise PatternError(f"{who(name)}: widths[{key!r}] must give {tp} per-rank widths, got {list(w)}")
        out.append((tp, w))
    return tuple(sorted(out))


_PARSE_CACHE: dict[str, Pattern] = {}
_PLACEMENT_CACHE: dict[str, Placement] = {}
_BARE_BY_ID: dict[int, tuple[Pattern, Pattern]] = {}  # id(parsed pattern) -> (pattern, its placement-less twin)
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
            raise PatternError(f"{who(name)}: a pattern is an object with a 'kind', got {record!r}")
        record = dict(record)
    # memoised on the record's repr: a catalog holds one pattern per tensor, but few distinct ones, and
    # repr is the cheapest faithful key of a JSON value (a different key order only costs a miss)
    key = repr(record)
    hit = _PARSE_CACHE.get(key)
    if hit is not None:
        return hit
    placement_rec = record.get("placement")
    if placement_rec is None:
        pattern = parse_record(record, name, inner=False)
    else:
        # Records of a 1000-layer model differ per layer only in their placement: parse the rest once
        # (memoised like any record) and the placement on its own, instead of every layer's record whole.
        bare = parse_pattern({k: v for k, v in record.items() if k != "placement"}, name=name)
        pkey = repr(placement_rec)
        placement = _PLACEMENT_CACHE.get(pkey)
        if placement is None:
            parsed = _parse_placement(placement_rec, name)
            assert parsed is not None  # the record is not None here
            placement = _PLACEMENT_CACHE[pkey] = parsed
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


def parse_record(rec: Mapping[str, Any], name: str | None, inner: bool) -> Pattern:
    kind = rec.get("kind")
    if kind not in _KIND_CLASSES:
        raise PatternError(f"{who(name)}: unknown pattern kind {kind!r}; kinds are {', '.join(KINDS)}")
    unknown = set(rec) - _ALLOWED_KEYS[kind]
    if unknown:
        raise PatternError(f"{who(name)}: {kind} pattern has unknown field(s) {sorted(unknown)}; "
                           f"allowed: {sorted(_ALLOWED_KEYS[kind])}")
    placement = _parse_placement(rec.get("placement"), name)
    if inner and placement is not None:
        raise PatternError(f"{who(name)}: the inner pattern of an expert pattern cannot have a placement "
                           f"(place the expert pattern itself)")
    if kind == "replicated":
        return Replicated(placement=placement)
    if kind == "dtensor":
        return _parse_dtensor(rec, name, placement)
    if kind == "averaged":
        dev = rec.get("max_deviation", 0.0)
        if not isinstance(dev, (int, float)) or isinstance(dev, bool) or not dev >= 0:
            raise PatternError(f"{who(name)}: averaged.max_deviation must be a number >= 0, got {dev!r}")
        return Averaged(max_deviation=float(dev), placement=placement)
    if kind == "partitioned":
        if "dim" not in rec:
            raise PatternError(f"{who(name)}: partitioned pattern needs 'dim'")
        return Partitioned(dim=_int(rec["dim"], "dim", name), widths=_parse_widths(rec.get("widths"), False, name),
                           placement=placement)
    if kind == "vocab":
        if "original_size" not in rec:
            raise PatternError(f"{who(name)}: vocab pattern needs 'original_size' (rows kept after stripping padding)")
        return Vocab(dim=_int(rec.get("dim", 0), "dim", name),
                     original_size=_int(rec["original_size"], "original_size", name), placement=placement)
    if kind == "fused":
        if "dim" not in rec or "sizes" not in rec:
            raise PatternError(f"{who(name)}: fused pattern needs 'dim' and 'sizes'")
        sizes = _int_list(rec["sizes"], "sizes", name)
        if not sizes:
            raise PatternError(f"{who(name)}: fused pattern needs at least one sub-parameter size")
        widths = _parse_widths(rec.get("widths"), True, name)
        for tp, w in widths:
            if len(w) != len(sizes):
                raise PatternError(f"{who(name)}: widths[{str(tp)!r}] lists {len(w)} sub-parameters but sizes "
                                   f"lists {len(sizes)}")
        return Fused(dim=_int(rec["dim"], "dim", name), sizes=sizes, widths=widths, placement=placement)
    # expert, expert_member
    if inner:
        raise PatternError(f"{who(name)}: expert patterns cannot nest")
    if "num_experts" not in rec:
        raise PatternError(f"{who(name)}: {kind} pattern needs 'num_experts'")
    inner_rec = rec.get("inner")
    inner_pattern: Pattern = REPLICATED
    if inner_rec is not None:
        if not isinstance(inner_rec, Mapping):
            raise PatternError(f"{who(name)}: {kind}.inner must be a pattern object, got {inner_rec!r}")
        inner_pattern = parse_record(inner_rec, name, inner=True)
    if kind == "expert_member":
        if "expert" not in rec:
            raise PatternError(f"{who(name)}: expert_member pattern needs 'expert' (the global expert id)")
        num = _int(rec["num_experts"], "num_experts", name, minimum=1)
        expert = _int(rec["expert"], "expert", name)
        if expert >= num:
            raise PatternError(f"{who(name)}: expert_member expert {expert} is not below num_experts {num}")
        group = rec.get("group")
        if group is not None and (not isinstance(group, str) or not group):
            raise PatternError(f"{who(name)}: expert_member.group must be a non-empty string, got {group!r}")
        return ExpertMember(expert=expert, num_experts=num, group=group, inner=inner_pattern, placement=placement)
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
    from ucp_store.topology import schema_errors

    errors = schema_errors(record, SCHEMA_FILE)
    if errors:
        raise PatternError(f"{who(name)}: pattern record does not match pattern.schema.json: " + "; ".join(errors))
    return parse_pattern(record, name=name)


_DTENSOR_PLACEMENT_KEYS = {"replicate": {"type"}, "shard": {"type", "dim"},
                           "strided_shard": {"type", "dim", "split_factor"}}


def _parse_dtensor(rec: Mapping[str, Any], name: str | None, placement: Placement | None) -> DTensorSplit:
    mesh = rec.get("mesh")
    if not isinstance(mesh, Mapping) or set(mesh) - {"shape", "dims"} or "shape" not in mesh:
        raise PatternError(f"{who(name)}: dtensor pattern needs 'mesh': {{'shape': [...], 'dims': [...]}}, "
                           f"got {mesh!r}")
    shape = _int_list(mesh["shape"], "mesh.shape", name)
    if not shape or any(n < 1 for n in shape):
        raise PatternError(f"{who(name)}: dtensor mesh.shape must list sizes >= 1, got {list(shape)}")
    dims = mesh.get("dims") or ()
    if not isinstance(dims, (list, tuple)) or any(not isinstance(d, str) for d in dims) or (
            dims and len(dims) != len(shape)):
        raise PatternError(f"{who(name)}: dtensor mesh.dims must name each of the {len(shape)} mesh dims, "
                           f"got {dims!r}")
    pls = rec.get("placements")
    if not isinstance(pls, (list, tuple)) or len(pls) != len(shape):
        raise PatternError(f"{who(name)}: dtensor pattern needs one placement per mesh dim ({len(shape)}), "
                           f"got {pls!r}")
    parsed = []
    for pl in pls:
        kind = pl.get("type") if isinstance(pl, Mapping) else None
        if kind not in _DTENSOR_PLACEMENT_KEYS or set(pl) != _DTENSOR_PLACEMENT_KEYS[kind]:
            raise PatternError(f"{who(name)}: dtensor placement {pl!r} is not one of {{'type': 'replicate'}}, "
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
    check_shape(p, tuple(int(s) for s in shape), name)
    return p


def check_shape(p: Pattern, shape: tuple[int, ...], name: str | None) -> None:
    ndim = len(shape)
    dim: Any = getattr(p, "dim", None)
    if dim is not None and not 0 <= dim < ndim:
        raise PatternError(f"{who(name)}: {p.kind} pattern splits dim {dim} but the tensor has shape "
                           f"{list(shape)} ({ndim} dims)")
    if isinstance(p, Partitioned):
        for tp, w in p.widths:
            if sum(w) != shape[dim]:
                raise PatternError(f"{who(name)}: widths for tp={tp} are {list(w)} (sum {sum(w)}) but dim {dim} "
                                   f"has size {shape[dim]}")
    elif isinstance(p, Vocab):
        if shape[dim] != p.original_size:
            raise PatternError(f"{who(name)}: vocab dim {dim} has size {shape[dim]} but original_size is "
                               f"{p.original_size}; the logical tensor holds exactly the unpadded rows")
    elif isinstance(p, Fused):
        if sum(p.sizes) != shape[dim]:
            raise PatternError(f"{who(name)}: fused sub-parameter sizes {list(p.sizes)} add up to {sum(p.sizes)} "
                               f"but dim {dim} has size {shape[dim]}")
        for tp, sub_widths in p.widths:
            for j, (s, wj) in enumerate(zip(p.sizes, sub_widths)):
                if sum(wj) != s:
                    raise PatternError(f"{who(name)}: widths for tp={tp} of sub-parameter {j} are {list(wj)} "
                                       f"(sum {sum(wj)}) but its size is {s}")
    elif isinstance(p, DTensorSplit):
        for pl in p.placements:
            d = dict(pl).get("dim")
            if d is not None and d >= ndim:
                raise PatternError(f"{who(name)}: dtensor placement {dict(pl)} shards dim {d} but the tensor has "
                                   f"shape {list(shape)} ({ndim} dims)")
    elif isinstance(p, Expert):
        if shape[dim] != p.num_experts:
            raise PatternError(f"{who(name)}: expert dim {dim} has size {shape[dim]} but num_experts is "
                               f"{p.num_experts}")
        check_shape(p.inner, shape[:dim] + shape[dim + 1:], name)
    elif isinstance(p, ExpertMember):
        check_shape(p.inner, shape, name)


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


def clear_parse_caches() -> None:
    """Forget memoised parses (results never depend on the caches)."""
    _PARSE_CACHE.clear()
    _PLACEMENT_CACHE.clear()
    _BARE_BY_ID.clear()
    _strip_placement.cache_clear()
