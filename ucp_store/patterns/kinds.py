"""The pattern kinds (pure): frozen dataclasses for each JSON ``kind`` and for ``placement``.

The vocabulary the rest of the store speaks about layouts: parsing (``parse``) builds these, layouts
(``layout``, ``zero``) and the planner read them, adapters construct them and call ``to_json()``. Each
kind answers the questions other modules used to ask of raw dicts: ``tp_replicated``, ``layer`` (the
pipeline layer of its placement) and ``split_dims`` / ``split_edges`` (the dims it splits across ranks
and the boundaries it fixes on them, which the chunk policy aligns to).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

__all__ = ["KINDS", "TP_REPLICATED_KINDS", "STAGE_NAMES", "SCHEMA_FILE", "Placement", "Pattern", "Replicated",
           "Averaged", "Partitioned", "Vocab", "Fused", "Expert", "ExpertMember", "DTensorSplit", "REPLICATED",
           "is_expert"]

KINDS = ("replicated", "averaged", "partitioned", "vocab", "fused", "expert", "expert_member", "dtensor")
TP_REPLICATED_KINDS = ("replicated", "averaged", "dtensor")
STAGE_NAMES = ("first", "last")
SCHEMA_FILE = "pattern.schema.json"


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

    @property
    def layer(self) -> int | None:
        """The global pipeline layer of ``placement`` (the catalog's ``tensors.layer``), or None."""
        return None if self.placement is None else self.placement.layer

    @property
    def split_dims(self) -> tuple[int, ...]:
        """The logical dims this pattern splits across ranks (TP or EP), ascending; () when none."""
        return tuple(sorted(self.split_edges()))

    def split_edges(self) -> dict[int, frozenset[int]]:
        """Each split dim with the interior boundaries the pattern fixes on it (fused sub-parameter edges)."""
        return {}

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


def _widths_json(widths: tuple[tuple[int, Any], ...]) -> dict[str, Any]:
    def plain(w: Any) -> Any:
        return [plain(x) for x in w] if isinstance(w, tuple) else w

    return {str(tp): plain(w) for tp, w in widths}


@dataclass(frozen=True, slots=True, kw_only=True)
class Partitioned(Pattern):
    dim: int
    widths: tuple[tuple[int, tuple[int, ...]], ...] = ()  # ((tp, per-rank widths), ...) sorted by tp
    kind = "partitioned"

    def split_edges(self) -> dict[int, frozenset[int]]:
        return {self.dim: frozenset()}

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

    def split_edges(self) -> dict[int, frozenset[int]]:
        return {self.dim: frozenset()}

    def _fields_json(self) -> dict[str, Any]:
        return {"dim": self.dim, "original_size": self.original_size}


@dataclass(frozen=True, slots=True, kw_only=True)
class Fused(Pattern):
    dim: int
    sizes: tuple[int, ...]
    # ((tp, ((sub 0 per-rank widths), (sub 1 ...), ...)), ...) sorted by tp
    widths: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...] = ()
    kind = "fused"

    def split_edges(self) -> dict[int, frozenset[int]]:
        return {self.dim: frozenset(itertools.accumulate(self.sizes[:-1]))}

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

    def split_edges(self) -> dict[int, frozenset[int]]:
        # the inner pattern's dims exclude the expert dim: shift those at or past it by one
        out: dict[int, frozenset[int]] = {self.dim: frozenset()}
        for d, edges in self.inner.split_edges().items():
            out[d + 1 if d >= self.dim else d] = edges
        return out

    def _fields_json(self) -> dict[str, Any]:
        return {"dim": self.dim, "num_experts": self.num_experts, "inner": self.inner.to_json()}


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertMember(Pattern):
    """One expert's tensor stored on its own (``...experts.<e>.w1``), a member of a layer's expert group.

    The tensors of one MoE layer with the same ``group`` (e.g. ``moe.0.deepspeed_moe.experts``) form the
    expert group; ``expert`` (global id, out of ``num_experts``) maps onto ep rank ``expert // (E/ep)``,
    which alone holds the tensor (local expert index ``expert % (E/ep)``); ``inner`` lays the tensor out
    over TP (its dims are the tensor's). Its optimizer states are ZeRO-partitioned over ``sp x edp``."""

    expert: int
    num_experts: int
    group: str | None = None
    inner: Pattern = Replicated()
    kind = "expert_member"

    @property
    def tp_replicated(self) -> bool:
        return self.inner.tp_replicated

    def split_edges(self) -> dict[int, frozenset[int]]:
        return self.inner.split_edges()

    def owner(self, ep: int) -> int:
        """The ep rank holding this expert at expert-parallel degree ``ep`` (``num_experts % ep == 0``)."""
        return self.expert // (self.num_experts // ep)

    def local_index(self, ep: int) -> int:
        """The expert's index among its ep rank's local experts."""
        return self.expert % (self.num_experts // ep)

    def _fields_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"expert": self.expert, "num_experts": self.num_experts}
        if self.group is not None:
            out["group"] = self.group
        out["inner"] = self.inner.to_json()
        return out


def is_expert(p: Pattern) -> bool:
    """An expert tensor (fused ``expert`` or a separate ``expert_member``): split over ``ep``, ZeRO over edp."""
    return isinstance(p, (Expert, ExpertMember))


@dataclass(frozen=True, slots=True, kw_only=True)
class DTensorSplit(Replicated):
    """How a DTensor was split when it was saved (``ucp_store.distributed``): its mesh and placements.

    Informational: the logical array holds the whole tensor, so for the planner this is replicated (any
    topology reads it whole or sliced), and ``ucp_store.distributed.load`` reads each target rank's boxes from
    the live DTensor, whatever mesh saved it. ``placements`` are JSON (``ucp_store/distributed/layout.py``):
    ``{"type": "shard", "dim": d}``, ``{"type": "strided_shard", "dim": d, "split_factor": k}``,
    ``{"type": "replicate"}``; ``mesh_dims`` names the mesh dims (empty when unnamed)."""

    mesh_shape: tuple[int, ...] = ()
    mesh_dims: tuple[str, ...] = ()
    placements: tuple[tuple[tuple[str, Any], ...], ...] = ()
    kind = "dtensor"

    def split_edges(self) -> dict[int, frozenset[int]]:
        # a later mesh may shard any dim (colwise TP dim 0, rowwise dim 1, FSDP dim 0), so rows and columns
        # both follow the power-of-two splits, and so does every dim the source sharded (the chunk policy
        # drops dims the tensor does not have)
        dims = {0, 1} | {int(dict(pl)["dim"]) for pl in self.placements if "dim" in dict(pl)}
        return {d: frozenset() for d in sorted(dims)}

    def _fields_json(self) -> dict[str, Any]:
        mesh: dict[str, Any] = {"shape": list(self.mesh_shape)}
        if self.mesh_dims:
            mesh["dims"] = list(self.mesh_dims)
        return {"mesh": mesh, "placements": [dict(pl) for pl in self.placements]}


REPLICATED = Replicated()
