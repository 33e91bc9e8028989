"""Layout planner (pure): what one rank of a target topology reads from a checkpoint, and where it goes.

``plan(records, topology, rank)`` takes the catalog's tensor records (objects or dicts with ``name,
state, shape, dtype, pattern, chunk_shape``) and returns a ``Plan``: for every tensor-state the rank needs

- a *tensor* destination: the TP/EP-local tensor (``local_shape``); each ``Read`` copies logical box
  ``box`` into local box ``dst``;
- or a *flat* destination (ZeRO 1-3 optimizer state, ZeRO-3 weights): the rank's ``Fragment`` of the
  flattened TP-local tensor; each ``Read`` copies logical ``box`` (contiguous in the local tensor) into
  ``dst``, a ``FlatRange`` of the fragment's *slot* (``buffer[fragment.buffer_start + dst.start : ...]``).
  Optimizer states live in per-group flat buffers (``Plan.buffers``, DeepSpeed's
  ``single_partition_of_fp32_groups`` / ``fp32_flat_groups``); ZeRO-3 weights (``state == "weight"``) are
  per-parameter partitions (``buffer is None``, the slot is the whole buffer, DeepSpeed's ``ds_tensor``).

Everything not covered by a read is zero: ``TensorPlan.padding`` (vocab rows, ZeRO-3 clip tails) and
``BufferPlan.padding`` (ZeRO-1/2 alignment gaps and the tail). ``io.py`` zeroes those where it leaves a
destination uninitialised; the reads fill the rest. Which tensor-states a rank gets: those whose placement
includes its stage (layers of its stage, tied tensors on first and last); expert tensors give each ``ep`` rank
its experts (a fused ``expert`` tensor its slice, a separate ``expert_member`` tensor only to its owner, so
each ep rank's expert ZeRO group holds its own experts in record order: DeepSpeed's order when the records
list layer by layer, expert by expert).

Counts per tensor-state: ``bytes_needed`` (sum of read boxes), ``chunks_touched`` (distinct stored chunks
intersecting any read box, from ``chunk_shape``; ``None`` means one chunk), ``bytes_read`` (those chunks'
bytes, clipped at the array edge); ``Plan.read_amplification = bytes_read / bytes_needed``.

ZeRO groups. Parameters are grouped by ``zero_groups`` (a mapping or function name -> group; default
``"default"``, and ``"expert"`` for expert patterns, whose ZeRO world is ``sp * dp / ep``, or the stage's
``tp * sp * dp / ep`` ranks of the ep rank with ``ep_over="stage"``, where experts are whole); within a group
the flat order is the records' order. A group's members are the parameters of this stage with at least one
optimizer state among the records (the layout does not depend on the ``states`` filter); a member lacking
some state has zeros in that buffer's slot.

Chunk boundaries for writers: ``split_points`` and ``chunk_alignment``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import operator
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from ucp_store import dtype_table
from ucp_store.errors import DTypeError, PlanError
from ucp_store.geometry import Box, FlatRange, uncovered
from ucp_store.patterns import (
    ExpertMember,
    Fragment,
    LocalLayout,
    Pattern,
    ZeroGroupLayout,
    expert_held,
    flat_layout,
    is_expert,
    parse_pattern,
    stage_local_name,
    stages_of_placement,
    tp_layout,
    without_placement,
    zero_group_layout,
)
from ucp_store.records import TensorInfo
from ucp_store.topology import Topology, as_topology

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "DEFAULT_GROUP", "EXPERT_GROUP", "NOT_FLAT_STATES", "itemsize", "Read",
           "TensorPlan", "BufferPlan", "Plan", "coalesce_reads", "chunk_footprint", "default_flat_kind", "plan",
           "gc_paused", "split_points", "chunk_alignment", "MESH_ASSUMPTION", "MeshPlan", "parse_mesh", "plan_mesh"]

PLAN_FORMAT = "ucp_store.plan"
PLAN_VERSION = 1
DEFAULT_GROUP = "default"
EXPERT_GROUP = "expert"
NOT_FLAT_STATES = frozenset({"weight", "step"})

def itemsize(dtype: Any) -> int:
    """Bytes per element of a dtype name (zarr v3 / torch / numpy spelling) the store can write.

    One table with ``dtypes`` (``dtype_table``): a dtype no write can produce (float8) is refused here too."""
    try:
        return dtype_table.itemsize(dtype, what="planner")
    except DTypeError as exc:
        raise PlanError(str(exc)) from None


# ====================================================================== plan records
@dataclass(frozen=True, slots=True)
class Read:
    """Read logical ``box`` into ``dst``: a box of the local tensor, or a range of the fragment's slot."""

    box: Box
    dst: Box | FlatRange

    def to_json(self) -> dict[str, Any]:
        if isinstance(self.dst, FlatRange):
            return {"box": self.box.to_json(), "flat": self.dst.to_json()}
        return {"box": self.box.to_json(), "dst": self.dst.to_json()}


class TensorPlan(NamedTuple):
    """One tensor-state the rank needs: where its reads land, what must be zero, and what they cost.

    A named tuple, not a dataclass: a 1000-layer plan builds 100k of them, and a frozen dataclass costs
    seven times as much to construct."""

    name: str
    state: str
    local_name: str            # the name this rank's stage uses (placement.local_name / layer_names)
    dtype: str
    shape: tuple[int, ...]     # logical shape
    local_shape: tuple[int, ...]  # TP/EP-local shape (before ZeRO)
    reads: tuple[Read, ...]
    padding: tuple[Box | FlatRange, ...]  # local boxes, or slot ranges when flat, that must be zero
    bytes_needed: int
    chunks_touched: int
    bytes_read: int
    fragment: Fragment | None = None  # flat destinations only
    buffer: str | None = None         # flat: key of the group buffer; None = the tensor's own buffer

    @property
    def flat(self) -> bool:
        return self.fragment is not None

    def to_json(self) -> dict[str, Any]:
        f = self.fragment
        return {
            "name": self.name, "state": self.state, "local_name": self.local_name, "dtype": self.dtype,
            "shape": list(self.shape), "local_shape": list(self.local_shape),
            "buffer": self.buffer,
            "fragment": None if f is None else {"start": f.start, "stop": f.stop, "buffer_start": f.buffer_start,
                                                "slot": f.slot},
            "reads": [r.to_json() for r in self.reads],
            "padding": [p.to_json() for p in self.padding],
            "bytes_needed": self.bytes_needed, "chunks_touched": self.chunks_touched, "bytes_read": self.bytes_read,
        }


@dataclass(frozen=True, slots=True)
class BufferPlan:
    """One ZeRO flat buffer of the rank: a parameter group's partition of one optimizer state."""

    key: str
    group: str
    state: str
    dtype: str
    numel: int
    members: tuple[str, ...]          # parameters with a slot in this buffer, in flat order
    padding: tuple[FlatRange, ...]    # ranges outside every planned slot: must be zero

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "group": self.group, "state": self.state, "dtype": self.dtype, "numel": self.numel,
                "members": list(self.members), "padding": [p.to_json() for p in self.padding]}


class _PlanTotals:
    """Totals over a rank's tensor plans, shared by :class:`Plan` (topology) and :class:`MeshPlan` (DTensor mesh)."""

    __slots__ = ()
    rank: int
    tensors: tuple[TensorPlan, ...]
    _WHAT = "plan"

    @property
    def bytes_needed(self) -> int:
        return sum(t.bytes_needed for t in self.tensors)

    @property
    def bytes_read(self) -> int:
        return sum(t.bytes_read for t in self.tensors)

    @property
    def chunks_touched(self) -> int:
        return sum(t.chunks_touched for t in self.tensors)

    @property
    def num_reads(self) -> int:
        return sum(len(t.reads) for t in self.tensors)

    @property
    def read_amplification(self) -> float:
        needed = self.bytes_needed
        return self.bytes_read / needed if needed else 1.0

    def tensor(self, name: str, state: str) -> TensorPlan:
        for t in self.tensors:
            if t.name == name and t.state == state:
                return t
        raise PlanError(f"{self._WHAT} for rank {self.rank} has no tensor-state ({name!r}, {state!r})")

    def totals_json(self) -> dict[str, Any]:
        return {"tensor_states": len(self.tensors), "reads": self.num_reads,
                "bytes_needed": self.bytes_needed, "chunks_touched": self.chunks_touched,
                "bytes_read": self.bytes_read, "read_amplification": self.read_amplification}


@dataclass(frozen=True, slots=True)
class Plan(_PlanTotals):
    topology: Topology
    rank: int
    coords: Mapping[str, int]
    tensors: tuple[TensorPlan, ...]
    buffers: tuple[BufferPlan, ...]


    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT, "version": PLAN_VERSION,
            "topology": self.topology.to_json(), "rank": self.rank, "coords": dict(self.coords),
            "tensors": [t.to_json() for t in self.tensors],
            "buffers": [b.to_json() for b in self.buffers],
            "totals": self.totals_json(),
        }

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))


# ====================================================================== coalescing and chunk counts
def coalesce_reads(reads: Sequence[Read]) -> tuple[Read, ...]:
    """Merge reads whose boxes and destinations are adjacent and contiguous along one dim.

    Tensor reads merge when box and dst differ in the same single dim and abut there; flat reads also
    need the merged box to stay contiguous in row-major order (every dim before the merge dim of extent 1)
    and the two flat ranges to abut."""
    if len(reads) < 2:
        return tuple(reads)
    flat = isinstance(reads[0].dst, FlatRange)
    if flat:
        items = sorted(reads, key=lambda r: cast(FlatRange, r.dst).start)
    else:
        items = sorted(reads, key=lambda r: cast(Box, r.dst).ranges)
    out = [items[0]]
    for cur in items[1:]:
        merged = _merge(out[-1], cur, flat)
        if merged is None:
            out.append(cur)
        else:
            out[-1] = merged
    if not flat and len(out) > 1 and len(out) < len(items):
        # a merge can make two earlier-separated reads adjacent in another dim; run again until stable
        again = coalesce_reads(out)
        return again if len(again) < len(out) else tuple(out)
    return tuple(out)


def _merge_dim(a: Box, b: Box) -> int | None:
    dim = None
    for d, (ra, rb) in enumerate(zip(a.ranges, b.ranges)):
        if ra != rb:
            if dim is not None or ra[1] != rb[0]:
                return None
            dim = d
    return dim


def _merge(a: Read, b: Read, flat: bool) -> Read | None:
    d = _merge_dim(a.box, b.box)
    if d is None:
        return None
    box = a.box.with_dim(d, a.box.ranges[d][0], b.box.ranges[d][1])
    adst: Any = a.dst  # a FlatRange when ``flat``, else a Box (as is ``b.dst``)
    bdst: Any = b.dst
    if flat:
        if adst.stop != bdst.start or any(hi - lo != 1 for lo, hi in a.box.ranges[:d]):
            return None
        return Read(box, FlatRange(adst.start, bdst.stop))
    if _merge_dim(adst, bdst) != d:
        return None
    return Read(box, adst.with_dim(d, adst.ranges[d][0], bdst.ranges[d][1]))


def chunk_footprint(boxes: Iterable[Box], shape: Sequence[int], chunk_shape: Sequence[int] | None,
                    itemsize: int) -> tuple[int, int]:
    """``(chunks, bytes)``: distinct chunks of the stored array touched by any box, and their bytes
    (edge chunks clipped to the array)."""
    shape = tuple(shape)
    chunk = tuple(shape) if chunk_shape is None else tuple(chunk_shape)
    chunk = tuple(max(1, c) for c in chunk)
    if len(chunk) != len(shape):
        raise PlanError(f"chunk_shape {list(chunk)} does not match shape {list(shape)}")
    cboxes = set()
    for box in boxes:
        if box.empty:
            continue
        cboxes.add(tuple((a // c, -(-b // c)) for (a, b), c in zip(box.ranges, chunk)))
    if not cboxes:
        return 0, 0
    count, extent = _union(list(cboxes), 0, shape, chunk)
    return count, extent * itemsize


def _extent(lo: int, hi: int, size: int, c: int) -> int:
    # elements along one dim of chunks lo..hi-1, the last one clipped at the array edge
    return min(hi * c, size) - lo * c


def _union(cboxes: list[tuple[tuple[int, int], ...]], dim: int, shape: tuple[int, ...],
           chunk: tuple[int, ...]) -> tuple[int, int]:
    """Chunk count and element count of the union of chunk-index boxes (exact, by sweeping dims)."""
    if dim == len(shape):
        return 1, 1
    if len(cboxes) == 1:
        count = elems = 1
        for d in range(dim, len(shape)):
            lo, hi = cboxes[0][d]
            count *= hi - lo
            elems *= _extent(lo, hi, shape[d], chunk[d])
        return count, elems
    points = sorted({p for b in cboxes for p in b[dim]})
    count = elems = 0
    prev_active: list[tuple[tuple[int, int], ...]] | None = None
    prev_result = (0, 0)
    for lo, hi in zip(points, points[1:]):
        active = [b for b in cboxes if b[dim][0] <= lo and b[dim][1] >= hi]
        if not active:
            continue
        if active != prev_active:
            prev_active, prev_result = active, _union(active, dim + 1, shape, chunk)
        c, e = prev_result
        count += (hi - lo) * c
        elems += _extent(lo, hi, shape[dim], chunk[dim]) * e
    return count, elems


# ====================================================================== the planner
_RECORD_FIELDS = ("name", "state", "shape", "dtype", "pattern", "chunk_shape")
_INFO_FIELDS = operator.attrgetter(*_RECORD_FIELDS)
_OPTIONAL = frozenset({"pattern", "chunk_shape"})


def _fields(rec: Any) -> tuple[Any, ...]:
    """``(name, state, shape, dtype, pattern, chunk_shape)`` of a dict or an object record (the planner
    reads ``TensorInfo`` records itself, through ``_INFO_FIELDS``)."""
    if type(rec) is dict:  # the other common case
        try:
            return rec["name"], rec["state"], rec["shape"], rec["dtype"], rec.get("pattern"), rec.get("chunk_shape")
        except KeyError:
            pass
    out = []
    for f in _RECORD_FIELDS:
        if isinstance(rec, Mapping):
            present, value = f in rec, rec.get(f)
        else:
            present, value = hasattr(rec, f), getattr(rec, f, None)
        if not present and f not in _OPTIONAL:
            raise PlanError(f"tensor record {rec!r} lacks field {f!r}")
        out.append(value)
    return tuple(out)


def _shape(value: Any, name: str, what: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if type(value) is not tuple:
        if isinstance(value, str):
            value = json.loads(value)
        try:
            value = tuple(value)
        except TypeError:
            raise PlanError(f"tensor {name!r}: {what} {value!r} is not a list of integers") from None
    for v in value:
        if type(v) is not int or v < 0:
            try:
                value = tuple(int(x) for x in value)
            except (TypeError, ValueError):
                raise PlanError(f"tensor {name!r}: {what} {list(value)!r} is not a list of integers") from None
            if any(x < 0 for x in value):
                raise PlanError(f"tensor {name!r}: {what} {list(value)} has a negative extent")
            break
    out: tuple[int, ...] = value
    return out


def default_flat_kind(topology: Topology, state: str, flat_states: Collection[str] | None = None) -> str | None:
    """How a state is held under ZeRO: ``None`` (TP-local tensor), ``"group"`` (flat group buffer) or
    ``"own"`` (a per-parameter flat partition: ZeRO-3 weights)."""
    if topology.zero_stage == 0:
        return None
    if state == "weight":
        return "own" if topology.zero_stage == 3 else None
    if flat_states is not None:
        return "group" if state in flat_states else None
    return None if state in NOT_FLAT_STATES else "group"


_UNSET = object()


def plan(records: Iterable[Any], topology: Topology | Mapping[str, Any], rank: int, *,
         states: Collection[str] | None = None,
         flat_states: Collection[str] | None = None,
         zero_groups: Mapping[str, str] | Callable[[str], str] | None = None,
         coalesce: bool = True) -> Plan:
    """Plan every read ``rank`` of ``topology`` needs (see the module docstring).

    ``states``: only plan these states (ZeRO layouts still account for every optimizer state).
    ``flat_states``: the optimizer states ZeRO partitions (default: every state but ``weight``/``step``).
    ``zero_groups``: parameter name -> ZeRO parameter group (default ``"default"`` / ``"expert"``).

    ``records`` may hold only this stage's tensors (``Checkpoint.plan_records`` asks the catalog for
    them) or every tensor. Patterns of tensors placed on another stage's layer are not parsed (so not
    validated) here."""
    with gc_paused():
        return _plan(records, topology, rank, states, flat_states, zero_groups, coalesce)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a large acyclic result is built.

    A 1000-layer plan allocates a few hundred thousand tuples; each allocation burst triggers collections
    that rescan every live container (the caller's records too), which cost 40% of the plan here. Nothing
    planned forms a cycle, so reference counting frees all of it; the collector is restored after."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _plan(records: Iterable[Any], topology: Topology | Mapping[str, Any], rank: int,
          states: Collection[str] | None, flat_states: Collection[str] | None,
          zero_groups: Mapping[str, str] | Callable[[str], str] | None, coalesce: bool) -> Plan:
    """The phases of a plan, in order: select the stage's records (pass 1), check the ``states`` filter,
    lay out the ZeRO groups, build one ``TensorPlan`` per wanted tensor-state (pass 2), then the buffers."""
    topo = as_topology(topology)
    coords = topo.coords(rank)
    wanted = None if states is None else frozenset(states)
    sel = _select(records, topo, coords, flat_states, zero_groups)
    _check_wanted(wanted, sel.stored_states)
    zero = _zero_fragments(sel, topo, rank)
    tensors, buffer_slots, buffer_dtypes = _tensor_plans(sel, zero, topo, rank, coords["pp"], wanted, coalesce)
    buffers = _buffer_plans(sel, zero, buffer_slots, buffer_dtypes, wanted)
    return Plan(topo, rank, coords, tuple(tensors), tuple(buffers))


# An entry of pass 1: (name, state, dtype, shape, chunk, pattern, layout, flat kind, renamed). A plain
# tuple: a 1000-layer plan holds 100k of them.
_Entry = tuple[str, str, str, tuple[int, ...], "tuple[int, ...] | None", Pattern, LocalLayout, "str | None", bool]


@dataclass(slots=True)
class _Selection:
    """What pass 1 found: the stage's entries in record order and the ZeRO group members among them."""

    entries: list[_Entry]
    stored_states: set[str]
    group_members: dict[str, list[str]]  # group -> parameters with a flat optimizer state, in record order
    group_states: dict[str, set[str]]    # group -> its flat states
    member_numel: dict[str, int]         # parameter -> TP-local numel
    member_expert: dict[str, bool]


@dataclass(slots=True)
class _ZeroFragments:
    """This rank's share of every ZeRO group: its fragments, and each group's layout."""

    fragments: dict[str, tuple[str, Fragment, tuple[int, int, int], tuple[int, int]]]  # name -> (group, fragment,
    #                                                     its extent, its buffer slot)
    group_layouts: dict[str, ZeroGroupLayout]


@dataclass(frozen=True, slots=True)
class _StageView:
    """What pass 1 reads of the topology and of the rank's coordinates, looked up once per plan."""

    topo: Topology
    stage: int
    tp: int
    tp_rank: int
    ep: int
    ep_rank: int
    vocab_multiple: int
    whole_experts: bool            # ep_over="stage": experts are not TP-split
    layer_stage: list[int] | None  # stage of every layer, so other stages' layers are skipped before parsing
    default_names: bool            # no layer_names rule: only placements can rename a tensor


def _stage_view(topo: Topology, coords: Mapping[str, int]) -> _StageView:
    starts = topo.stage_starts
    layer_stage = ([s for s in range(topo.pp) for _ in range(starts[s], starts[s + 1])] if topo.pp > 1
                   else None)
    return _StageView(topo, coords["pp"], topo.tp, coords["tp"], topo.ep, coords["ep"], topo.vocab_multiple,
                      topo.tp_for(True) != topo.tp, layer_stage, topo.layer_names is None)


@dataclass(slots=True)
class _Memos:
    """Per-plan memos of pass 1, keyed by object identity.

    A catalog hands the four states of a parameter one shared pattern record and shape, and hashing a
    nested JSON value costs more than the lookup it guards. Each memo value holds its key object, so no id
    is recycled while the plan is built."""

    by_pattern: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # id(record) -> _pattern_entry(...)
    by_shape: dict[int, tuple[Any, ...]] = field(default_factory=dict)    # id(shape value) -> (value, tuple)
    by_chunk: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    chunk_values: dict[tuple[int, ...] | None, tuple[int, ...] | None] = field(default_factory=dict)
    on_stage: dict[Any, bool] = field(default_factory=dict)
    flat_kind: dict[str, str | None] = field(default_factory=dict)
    layouts: dict[tuple[Any, ...], LocalLayout] = field(default_factory=dict)


@dataclass(slots=True)
class _GroupMembers:
    """ZeRO group membership as pass 1 finds it, in record order."""

    members: dict[str, list[str]] = field(default_factory=dict)  # group -> parameters with a flat state
    states: dict[str, set[str]] = field(default_factory=dict)    # group -> its flat states
    group_of: dict[str, str] = field(default_factory=dict)       # parameter -> its group
    numel: dict[str, int] = field(default_factory=dict)          # parameter -> TP-local numel
    expert: dict[str, bool] = field(default_factory=dict)

    def join(self, name: str, pattern: Pattern, layout: LocalLayout,
             zero_groups: Mapping[str, str] | Callable[[str], str] | None) -> str:
        """Add parameter ``name`` (not yet a member) to its group; refuse a group mixing expert and
        non-expert parameters."""
        group = self.group_of[name] = _group_of(name, pattern, zero_groups)
        expert = is_expert(pattern)
        members = self.members.get(group)
        if members is None:
            members = self.members[group] = []
            self.states[group] = set()
        elif self.expert[members[0]] != expert:
            raise PlanError(f"ZeRO group {group!r} mixes expert ({members[0]!r} or {name!r}) and "
                            f"non-expert parameters, which are partitioned over different ranks; put them "
                            f"in separate groups")
        members.append(name)
        self.numel[name] = math.prod(layout.shape)
        self.expert[name] = expert
        return group


def _pattern_of(view: _StageView, memos: _Memos, pattern_rec: Any, name: str) -> tuple[Any, ...]:
    """``_pattern_entry`` of a pattern record, once per record object."""
    hit = memos.by_pattern.get(id(pattern_rec))
    if hit is None:
        hit = memos.by_pattern[id(pattern_rec)] = _pattern_entry(pattern_rec, name, view.topo, view.stage,
                                                                 view.layer_stage, memos.on_stage,
                                                                 view.default_names, view.ep_rank)
    return hit


def _shape_of(memos: _Memos, shape_rec: Any, name: str) -> tuple[int, ...] | None:
    """The validated shape of a record's shape value, once per value object."""
    sh = memos.by_shape.get(id(shape_rec))
    if sh is None:
        sh = memos.by_shape[id(shape_rec)] = (shape_rec, _shape(shape_rec, name, "shape"))
    out: tuple[int, ...] | None = sh[1]
    return out


def _chunk_of(memos: _Memos, chunk_rec: Any, name: str) -> tuple[int, ...] | None:
    """The validated chunk shape of a record, once per value object; equal chunk shapes are one object,
    since pass 2 keys by id."""
    if chunk_rec is None:
        return None
    ch = memos.by_chunk.get(id(chunk_rec))
    if ch is None:
        value = _shape(chunk_rec, name, "chunk_shape")
        value = memos.chunk_values.setdefault(value, value)
        ch = memos.by_chunk[id(chunk_rec)] = (chunk_rec, value)
    out: tuple[int, ...] | None = ch[1]
    return out


def _layout_of(view: _StageView, memos: _Memos, bare: Pattern, shape: tuple[int, ...],
               chunk: tuple[int, ...] | None, name: str, state: str) -> LocalLayout:
    """The TP/EP-local layout of a (placement-less pattern, shape), after checking the chunk shape's rank."""
    if chunk is not None and len(chunk) != len(shape):
        raise PlanError(f"tensor {name!r} state {state!r}: chunk_shape {list(chunk)} does not match shape "
                        f"{list(shape)}")
    lkey = (id(bare), shape)  # the placement-less twin is shared by every layer's pattern
    layout = memos.layouts.get(lkey)
    if layout is None:
        if view.whole_experts and is_expert(bare):  # ep_over="stage": experts are not TP-split
            tp, tp_rank = 1, 0
        else:
            tp, tp_rank = view.tp, view.tp_rank
        layout = tp_layout(bare, shape, tp, tp_rank, ep=view.ep, ep_rank=view.ep_rank,
                           vocab_multiple=view.vocab_multiple, name=name)
        memos.layouts[lkey] = layout
    return layout


def _select(records: Iterable[Any], topo: Topology, coords: Mapping[str, int], flat_states: Collection[str] | None,
            zero_groups: Mapping[str, str] | Callable[[str], str] | None) -> _Selection:
    """Pass 1: the records this stage holds, with their TP/EP-local layouts and ZeRO group membership.

    Consecutive records usually share their pattern, shape and chunk objects (the states of one
    parameter): an identity check then skips every lookup, so the loop below only calls out (``_pattern_of``,
    ``_shape_of``, ``_chunk_of``, ``_layout_of``, ``_GroupMembers.join``) when one of them changes."""
    view = _stage_view(topo, coords)
    memos = _Memos()
    groups = _GroupMembers()
    flat_kind, group_of, group_states = memos.flat_kind, groups.group_of, groups.states
    entries: list[_Entry] = []
    add_entry = entries.append
    seen: dict[str, set[str]] = {}
    stored_states: set[str] = set()
    add_state = stored_states.add
    prev_pattern: Any = _UNSET
    prev_shape: Any = _UNSET
    prev_chunk: Any = _UNSET
    p: Any = None
    bare: Any = None
    shape: Any = None
    chunk: Any = None
    layout: Any = None
    held = renamed = False
    info_fields = _INFO_FIELDS
    for rec in records:
        if type(rec) is TensorInfo:  # what Checkpoint.load_shard passes: one C-level getter
            name, state, shape_rec, dtype, pattern_rec, chunk_rec = info_fields(rec)
        else:
            name, state, shape_rec, dtype, pattern_rec, chunk_rec = _fields(rec)
        add_state(state)
        if pattern_rec is not prev_pattern:
            _, p, held, bare, renamed = _pattern_of(view, memos, pattern_rec, name)
            prev_pattern, layout = pattern_rec, None
        if not held:
            continue
        names_seen = seen.get(state)  # per state, a set of names: no (name, state) tuple per record
        if names_seen is None:
            names_seen = seen[state] = set()
        n_seen = len(names_seen)
        names_seen.add(name)
        if len(names_seen) == n_seen:
            raise PlanError(f"tensor-state ({name!r}, {state!r}) is listed twice")
        if shape_rec is not prev_shape:
            shape, prev_shape, layout = _shape_of(memos, shape_rec, name), shape_rec, None
        if chunk_rec is not prev_chunk:
            chunk, prev_chunk, layout = _chunk_of(memos, chunk_rec, name), chunk_rec, None
        if layout is None:  # something changed since the previous record
            layout = _layout_of(view, memos, bare, shape, chunk, name, state)
        if type(dtype) is not str:
            dtype = str(dtype)
        fk: Any = flat_kind.get(state, _UNSET)
        if fk is _UNSET:
            fk = flat_kind[state] = default_flat_kind(topo, state, flat_states)
        if fk == "group":  # ZeRO group membership, in record order
            group = group_of.get(name)
            if group is None:
                group = groups.join(name, p, layout, zero_groups)
            group_states[group].add(state)
        add_entry((name, state, dtype, shape, chunk, p, layout, fk, renamed))
    return _Selection(entries, stored_states, groups.members, groups.states, groups.numel, groups.expert)


def _check_wanted(wanted: frozenset[str] | None, stored_states: set[str]) -> None:
    """Refuse a ``states`` filter naming a state no tensor has: an empty plan would look like success."""
    if wanted is not None and not wanted <= stored_states:
        unknown = ", ".join(repr(x) for x in sorted(wanted - stored_states))
        raise PlanError(f"no state {unknown} in any tensor; the states are "
                        f"{', '.join(sorted(stored_states)) or '(none)'}")


def _zero_fragments(sel: _Selection, topo: Topology, rank: int) -> _ZeroFragments:
    """ZeRO groups: one layout per group, shared by all its optimizer states, and this rank's fragments."""
    fragments: dict[str, tuple[str, Fragment, tuple[int, int, int], tuple[int, int]]] = {}
    extents: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    group_layouts: dict[str, ZeroGroupLayout] = {}
    if topo.zero_stage > 0:
        for group, members in sel.group_members.items():
            expert = sel.member_expert[members[0]]
            layout = zero_group_layout([sel.member_numel[m] for m in members], topo.zero_world(expert),
                                       topo.zero_stage, alignment=topo.zero_alignment,
                                       param_alignment=topo.zero_param_alignment)
            group_layouts[group] = layout
            zrank = topo.zero_rank(rank, expert)
            for index, frag in layout.fragments(zrank):
                extent = (frag.start, frag.stop, frag.slot)
                extent = extents.setdefault(extent, extent)  # one object per extent: pass 2 keys by id
                fragments[members[index]] = (group, frag, extent, (frag.buffer_start, frag.buffer_start + frag.slot))
    return _ZeroFragments(fragments, group_layouts)


def _tensor_plans(sel: _Selection, zero: _ZeroFragments, topo: Topology, rank: int, stage: int,
                  wanted: frozenset[str] | None, coalesce: bool,
                  ) -> tuple[list[TensorPlan], dict[str, list[tuple[int, int]]], dict[str, str]]:
    """Pass 2: one ``TensorPlan`` per wanted tensor-state, plus each flat buffer's slots and dtype."""
    fragments = zero.fragments
    tensors: list[TensorPlan] = []
    add_tensor = tensors.append
    new_tuple = tuple.__new__
    memo: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    sizes: dict[str, int] = {}
    own_fragments: dict[tuple[int, bool], Fragment | None] = {}
    buffer_dtypes: dict[str, str] = {}
    buffer_slots: dict[str, list[tuple[int, int]]] = {}
    for name, state, dtype, shape, chunk, p, layout, fk, renamed in sel.entries:
        if wanted is not None and state not in wanted:
            continue
        size = sizes.get(dtype)
        if size is None:
            size = sizes[dtype] = _itemsize_of(dtype, name, state)
        fragment: Fragment | None = None
        buffer: str | None = None
        frag_key: Any = None
        if fk == "group":
            hit = fragments.get(name)
            if hit is None:
                continue  # this rank holds no part of the parameter
            group, fragment, frag_key, slot = hit
            buffer = f"{group}/{state}"
            slots = buffer_slots.get(buffer)
            if slots is None:
                slots = buffer_slots[buffer] = []
                buffer_dtypes[buffer] = dtype
            elif buffer_dtypes[buffer] != dtype:
                raise PlanError(f"ZeRO buffer {buffer!r} mixes dtypes {buffer_dtypes[buffer]} and {dtype} "
                                f"(tensor {name!r})")
            slots.append(slot)
        elif fk == "own":
            expert = is_expert(p)
            numel = math.prod(layout.shape)
            if (numel, expert) not in own_fragments:
                own = zero_group_layout([numel], topo.zero_world(expert), 3)
                own_fragments[(numel, expert)] = own.fragment(0, topo.zero_rank(rank, expert))
            fragment = own_fragments[(numel, expert)]
            frag_key = fragment  # one object per (numel, expert), kept alive by own_fragments
        # by identity: the layout object stands for (pattern, shape), and chunk shapes and fragment
        # extents are one object per value (interned above), so no nested tuple is hashed per record
        key = (id(layout), id(chunk), size, id(frag_key))
        cached = memo.get(key)
        if cached is None:
            cached = memo[key] = _reads_for(layout, fragment, shape, chunk, size, coalesce)
        reads, padding, needed, chunks, read_bytes = cached
        local_name = stage_local_name(name, p, topo, stage) if renamed else name
        # tuple.__new__ skips the named tuple's Python-level __new__ (a third of building 100k of them)
        add_tensor(new_tuple(TensorPlan, (name, state, local_name, dtype, shape, layout.shape, reads, padding,
                                          needed, chunks, read_bytes, fragment, buffer)))
    return tensors, buffer_slots, buffer_dtypes


def _buffer_plans(sel: _Selection, zero: _ZeroFragments, buffer_slots: Mapping[str, list[tuple[int, int]]],
                  buffer_dtypes: Mapping[str, str], wanted: frozenset[str] | None) -> list[BufferPlan]:
    """One ``BufferPlan`` per (ZeRO group, wanted flat state): its planned members and its zero ranges.

    The zero ranges are the buffer outside the slots actually planned for this state, so a member that
    lacks the state leaves its slot zero too (``ZeroGroupLayout.gaps`` over the planned slots)."""
    buffers = []
    for group, members in sel.group_members.items():
        layout = zero.group_layouts[group]
        member_set = set(members)
        holders = tuple(m for m in members if m in zero.fragments)
        for state in sorted(sel.group_states[group]):
            if wanted is not None and state not in wanted:
                continue
            key = f"{group}/{state}"
            padding = uncovered(buffer_slots.get(key, ()), layout.partition_numel)
            dtype = buffer_dtypes.get(key) or next(e[2] for e in sel.entries if e[1] == state and e[0] in member_set)
            buffers.append(BufferPlan(key, group, state, dtype, layout.partition_numel, holders, padding))
    return buffers


def _itemsize_of(dtype: str, name: str, state: str) -> int:
    """Bytes per element of a record's dtype: only dtypes the store can write (``dtype_table``)."""
    try:
        return dtype_table.itemsize(dtype, what=f"tensor {name!r} state {state!r}")
    except DTypeError as exc:
        raise PlanError(str(exc)) from None


def _pattern_entry(pattern_rec: Any, name: str, topo: Topology, stage: int, layer_stage: list[int] | None,
                   on_stage: dict[Any, bool], default_names: bool, ep_rank: int = 0) -> tuple[Any, ...]:
    """``(record, pattern, held by this stage, placement-less twin, may be renamed)`` for a pattern record."""
    if type(pattern_rec) is dict:
        pl_raw = pattern_rec.get("placement")
        if layer_stage is not None and type(pl_raw) is dict:
            layer = pl_raw.get("layer")
            if type(layer) is int and 0 <= layer < len(layer_stage) and layer_stage[layer] != stage:
                return pattern_rec, None, False, None, False  # another stage's layer: not parsed
        p = parse_pattern(pattern_rec, name=name)
    elif isinstance(pattern_rec, str):  # JSON text, as some catalogs hand it over
        p = parse_pattern(json.loads(pattern_rec), name=name)
    else:
        p = parse_pattern(pattern_rec, name=name)
    if type(p) is ExpertMember and not expert_held(p, topo.ep, ep_rank, name):
        return pattern_rec, None, False, None, False  # another ep rank's expert
    pl = p.placement
    if pl is not None:
        held = on_stage.get(pl)
        if held is None:
            held = on_stage[pl] = stage in stages_of_placement(pl, topo, name)
        if not held:
            return pattern_rec, None, False, None, False
    renamed = not default_names or (pl is not None and (pl.local_name is not None or bool(pl.local_names)))
    return pattern_rec, p, True, without_placement(p), renamed


def _group_of(name: str, pattern: Pattern, zero_groups: Mapping[str, str] | Callable[[str], str] | None) -> str:
    if zero_groups is None:
        return EXPERT_GROUP if is_expert(pattern) else DEFAULT_GROUP
    if callable(zero_groups):
        return str(zero_groups(name))
    if name in zero_groups:
        return str(zero_groups[name])
    return EXPERT_GROUP if is_expert(pattern) else DEFAULT_GROUP


def _reads_for(layout: LocalLayout, fragment: Fragment | None, shape: tuple[int, ...],
               chunk: tuple[int, ...] | None, size: int, coalesce: bool) -> tuple[Any, ...]:
    """``(reads, padding, bytes needed, chunks touched, bytes read)`` of one layout (and fragment)."""
    listed: list[Read]
    padding: tuple[Box, ...] | tuple[FlatRange, ...]
    if fragment is None:
        listed = [Read(c.logical, c.local) for c in layout.copies]
        padding = layout.padding
    else:
        fl = flat_layout(layout, fragment)
        listed = [Read(c.logical, c.flat) for c in fl.copies]
        padding = fl.padding
    reads = coalesce_reads(listed) if coalesce else tuple(listed)
    needed = sum(r.box.numel for r in reads) * size
    chunks, read_bytes = chunk_footprint((r.box for r in reads), shape, chunk, size)
    return reads, padding, needed, chunks, read_bytes


# ====================================================================== chunk boundaries for writers
def split_points(pattern: Any, shape: Sequence[int], topologies: Iterable[Topology | Mapping[str, Any]], *,
                 name: str | None = None) -> tuple[tuple[int, ...], ...]:
    """Per dim, the sorted logical coordinates (strictly inside the dim) where some rank of some listed
    topology starts or stops its slice. Chunks whose edges include these serve each of those topologies
    without reading data it does not need (ZeRO flat cuts excepted: they fall inside rows)."""
    shape = tuple(int(s) for s in shape)
    p = parse_pattern(pattern, name=name)
    points: list[set[int]] = [set() for _ in shape]
    for t in topologies:
        topo = as_topology(t)
        tp = topo.tp_for(is_expert(p))
        for tp_rank in range(tp):
            for ep_rank in range(topo.ep if is_expert(p) else 1):
                layout = tp_layout(p, shape, tp, tp_rank, ep=topo.ep, ep_rank=ep_rank,
                                   vocab_multiple=topo.vocab_multiple, name=name)
                for c in layout.copies:
                    for d, (a, b) in enumerate(c.logical.ranges):
                        points[d].add(a)
                        points[d].add(b)
    return tuple(tuple(sorted(x for x in pts if 0 < x < n)) for pts, n in zip(points, shape))


def chunk_alignment(pattern: Any, shape: Sequence[int], topologies: Iterable[Topology | Mapping[str, Any]], *,
                    itemsize: int = 4, min_chunk_bytes: int = 64 << 10, name: str | None = None) -> tuple[int, ...]:
    """Suggested chunk extent per dim so that chunk edges fall on ``split_points``.

    Along a split dim: the gcd of all its split points, so that every boundary is a chunk edge (any
    divisor of it keeps that property, so a writer may cut further). When the gcd would make chunks
    thinner than ``min_chunk_bytes`` (counting the other dims at full extent), as for 1024 rows over 3
    ranks, the fallback is the smallest extent at or above that floor (below twice it) putting the most
    boundaries on chunk edges: each remaining boundary costs at most one partly used chunk per reader.
    The default floor stays above the chunk policy's 16 KiB (``chunking.MIN_CHUNK_BYTES``): aligned to
    uneven splits at 16 KiB, bench_reshard's TP 4 -> 3 loads ran 1.9x slower. A dim too small for the floor
    is one chunk. Dims nobody splits get their full extent (no constraint: the writer cuts them to its byte
    target)."""
    shape = tuple(int(s) for s in shape)
    points = split_points(pattern, shape, topologies, name=name)
    out = []
    for d, (n, pts) in enumerate(zip(shape, points)):
        if not pts:
            out.append(max(n, 1))
            continue
        others = math.prod(shape[:d] + shape[d + 1:]) * itemsize
        floor = max(1, -(-min_chunk_bytes // max(others, 1)))
        g = math.gcd(*pts)
        if g >= floor:
            out.append(g)
        elif floor >= n:
            out.append(n)
        else:
            # most boundaries aligned; ties to the most power-of-two-like extent, then the smallest
            best = max(range(floor, min(2 * floor, n + 1)),
                       key=lambda c: (sum(1 for b in pts if b % c == 0), c & -c, -c))
            out.append(best)
    return tuple(out)


# ====================================================================== DTensor mesh targets
#: what a mesh plan assumes, printed with it (``ucp plan --mesh``)
MESH_ASSUMPTION = ("each dtensor tensor-state keeps its saved placements per mesh dim name on the target mesh "
                   "(strided-shard split factors follow the target sizes); plain tensors and other patterns are "
                   "read whole by every rank")


@dataclass(frozen=True, slots=True)
class MeshPlan(_PlanTotals):
    """What one rank of a DTensor ``DeviceMesh`` reads (``plan_mesh``): per tensor-state, its local boxes."""

    mesh_shape: tuple[int, ...]
    mesh_dims: tuple[str, ...]
    rank: int
    coords: Mapping[str, int]
    tensors: tuple[TensorPlan, ...]
    _WHAT = "mesh plan"


    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT, "version": PLAN_VERSION,
            "mesh": {"shape": list(self.mesh_shape), "dims": list(self.mesh_dims)}, "assumes": MESH_ASSUMPTION,
            "rank": self.rank, "coords": dict(self.coords), "tensors": [t.to_json() for t in self.tensors],
            "totals": self.totals_json(),
        }


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``"dp=2,tp=2"`` -> ((2, 2), ("dp", "tp")); ``"2,2"`` -> unnamed dims."""
    shape, dims = [], []
    for part in [p.strip() for p in str(text).split(",") if p.strip()]:
        name, _, size = part.rpartition("=")
        try:
            n = int(size)
        except ValueError:
            n = 0
        if n < 1 or (name and not name.replace("_", "").isalnum()):
            raise PlanError(f"mesh {text!r}: expected comma-separated NAME=SIZE (or SIZE) with sizes >= 1, "
                            f"e.g. 'dp=2,tp=2'; got {part!r}")
        shape.append(n)
        dims.append(name)
    if not shape:
        raise PlanError(f"mesh {text!r}: expected comma-separated NAME=SIZE, e.g. 'dp=2,tp=2'")
    if any(dims) and not all(dims) or len(set(dims)) != len(dims) and all(dims):
        raise PlanError(f"mesh {text!r}: name every dim once (e.g. 'dp=2,tp=2') or none ('2,2')")
    return tuple(shape), tuple(dims) if all(dims) else ()


def plan_mesh(records: Iterable[Any], mesh: Mapping[str, Any] | str, rank: int, *,
              states: Iterable[str] | None = None) -> MeshPlan:
    """What rank ``rank`` of a DTensor mesh reads of a checkpoint (pure), as ``ucp_store.distributed.load`` does:
    each tensor-state's boxes on the target mesh (``patterns.mesh.target_placements``: the saved placements
    by mesh dim name), and the stored chunks those boxes touch. ``mesh`` is ``{"shape": [...], "dims":
    [...]}`` or ``"dp=2,tp=2"``; ranks are laid out row-major, as ``init_device_mesh`` does."""
    from ucp_store.patterns import mesh as pm

    if isinstance(mesh, str):
        shape_m, dims_m = parse_mesh(mesh)
    else:
        shape_m = tuple(int(n) for n in mesh.get("shape", ()))
        dims_m = tuple(mesh.get("dims") or ())
    world = math.prod(shape_m)
    if not shape_m or any(n < 1 for n in shape_m) or (dims_m and len(dims_m) != len(shape_m)):
        raise PlanError(f"mesh {dict(mesh) if not isinstance(mesh, str) else mesh!r}: shape must list sizes >= 1 "
                        "and dims (if given) name each of them")
    if not 0 <= rank < world:
        raise PlanError(f"rank {rank} is outside the mesh's {world} ranks ({list(shape_m)})")
    coord = pm.coord_of(rank, shape_m)
    wanted = None if states is None else frozenset(states)
    out = []
    # Tensors of one layout (same pattern object, shape, chunks, dtype: a model's experts and layers) plan
    # alike: each layout is planned once (a 136k-row mixture-of-experts catalog has a few dozen). The memo
    # holds each pattern object, so the id in its key is not reused while the memo lives.
    memo: dict[tuple[Any, ...], _MeshLayout] = {}
    with gc_paused():
        for rec in records:
            name, state, shape_v, dtype, pattern, chunk_shape = _fields(rec)
            if wanted is not None and state not in wanted:
                continue
            shape = tuple(int(s) for s in shape_v)
            chunk = None if chunk_shape is None else tuple(chunk_shape)
            key = (pattern if pattern is None or isinstance(pattern, str) else id(pattern), shape, chunk, dtype)
            hit = memo.get(key)
            if hit is None:
                hit = memo[key] = _mesh_layout(name, state, shape, dtype, pattern, chunk, shape_m, dims_m, coord)
            local_shape, reads, needed, chunks, nbytes, _held = hit
            out.append(TensorPlan(name, state, name, dtype, shape, local_shape, reads, (), needed, chunks, nbytes))
    coords = {(d or f"dim{i}"): c for i, (d, c) in enumerate(zip(dims_m or ("",) * len(shape_m), coord))}
    return MeshPlan(shape_m, dims_m, rank, coords, tuple(out))


# what one layout of a mesh plan shares: local shape, reads, bytes needed, chunks touched, bytes read, pattern
_MeshLayout = tuple[tuple[int, ...], tuple[Read, ...], int, int, int, Any]


def _mesh_layout(name: str, state: str, shape: tuple[int, ...], dtype: str, pattern: Any,
                 chunk: tuple[int, ...] | None, shape_m: tuple[int, ...], dims_m: tuple[str, ...],
                 coord: tuple[int, ...]) -> _MeshLayout:
    """One layout's share of a mesh plan: (local shape, reads, bytes needed, chunks, bytes read, the pattern)."""
    from ucp_store.patterns import mesh as pm

    held = pattern
    if isinstance(pattern, str):
        pattern = json.loads(pattern)
    elif pattern is not None and not isinstance(pattern, Mapping):
        pattern = pattern.to_json()
    what = f"tensor {name!r} state {state!r}"
    placements = pm.target_placements(pattern, shape_m, dims_m, what=what)
    regions = pm.local_regions(shape, shape_m, placements, coord, what=what)
    isz = _itemsize_of(dtype, name, state)
    reads = tuple(Read(Box(r.global_box), Box(r.local_box)) for r in regions)
    chunks, nbytes = chunk_footprint([r.box for r in reads], shape, chunk, isz)
    needed = sum(r.box.numel for r in reads) * isz
    return pm.local_shape(shape, shape_m, placements, coord), reads, needed, chunks, nbytes, held
