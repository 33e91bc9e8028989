"""Per-rank state: the saving topology, its coordinates, restore policies and the manifest records (pure).

A state dict leaf whose content differs across ranks (an RNG state, a dataloader position), or that only
some ranks hold (torchtitan's ``dataloader.dp_rank_<i>``), is *per-rank*: ``ucp_store.distributed.save`` stores
it once per distinct content, each rank's entry keyed by its rank and its coordinates in the saving
topology (``RankTopology``). On load, a rank on the same topology gets its own entry; on another
topology a declared ``Policy`` says where its state comes from. This module holds the parts that need no
torch: topologies and coordinates, policies and the choice of source ranks, and the JSON records the
catalog keeps (``PerRankManifest`` in the ``dist.state_dict`` object).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ucp_store.errors import ConfigurationError, TopologyError

__all__ = ["OBJECT_PREFIX", "Policy", "PerRankEntry", "PerRankKey", "PerRankManifest", "RankTarget", "RankTopology",
           "SavedRankState", "by_coordinate", "choose_source", "fresh", "key_order", "object_name", "parse_policy",
           "policy_for", "rank0", "reshard", "same", "unit_of"]

#: stored per-rank objects are named ``dist.state_dict/r<owner rank>/<key index>``
OBJECT_PREFIX = "dist.state_dict"


def object_name(owner: int, index: int) -> str:
    """The catalog object name of per-rank key ``index``'s content first held by rank ``owner``."""
    return f"{OBJECT_PREFIX}/r{int(owner)}/{int(index)}"


def key_order(path: Sequence[Any]) -> str:
    """The sort key of a per-rank path: every rank orders the per-rank keys the same way."""
    return json.dumps(list(path))


def _text(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


# ----------------------------------------------------------------------------------------- topology
@dataclass(frozen=True)
class RankTopology:
    """The ranks of one save or load: ``world`` ranks (group order), their global ranks, and the device mesh
    they form (``dims`` names, ``shape``, ``mesh``: global ranks in row-major mesh order), if one is known."""

    world: int
    global_ranks: tuple[int, ...]
    dims: tuple[str, ...] = ()
    shape: tuple[int, ...] = ()
    mesh: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.world < 1 or len(self.global_ranks) != self.world or len(set(self.global_ranks)) != self.world:
            raise TopologyError(f"rank topology: {self.world} ranks need {self.world} distinct global ranks, got "
                                f"{list(self.global_ranks)}")
        if len(self.dims) != len(self.shape) or len(set(self.dims)) != len(self.dims):
            raise TopologyError(f"rank topology: mesh dims {list(self.dims)} must be distinct, one per size in "
                                f"{list(self.shape)}")
        if self.mesh is not None:
            n = 1
            for s in self.shape:
                n *= s
            if n != self.world or sorted(self.mesh) != sorted(self.global_ranks):
                raise TopologyError(f"rank topology: mesh {list(self.dims)}={list(self.shape)} over global ranks "
                                    f"{list(self.mesh)} does not cover the {self.world} ranks "
                                    f"{list(self.global_ranks)}")
        elif self.dims:
            raise TopologyError("rank topology: mesh dims without the mesh's ranks")

    @classmethod
    def flat(cls, world: int, global_ranks: Iterable[int] | None = None) -> RankTopology:
        """Ranks with no known mesh (coordinates: the rank only)."""
        return cls(world, tuple(range(world)) if global_ranks is None else tuple(int(g) for g in global_ranks))

    @classmethod
    def from_mesh(cls, dims: Sequence[str], shape: Sequence[int], mesh: Sequence[int],
                  global_ranks: Sequence[int] | None = None) -> RankTopology:
        """A mesh topology; ``global_ranks`` defaults to the mesh's ranks in ascending order."""
        ranks = tuple(sorted(int(g) for g in mesh)) if global_ranks is None else tuple(int(g) for g in global_ranks)
        return cls(len(ranks), ranks, tuple(str(d) for d in dims), tuple(int(s) for s in shape),
                   tuple(int(g) for g in mesh))

    def coords(self, rank: int) -> dict[str, int]:
        """Group rank ``rank``'s mesh coordinates by dim name ({} without a mesh)."""
        if not 0 <= rank < self.world:
            raise TopologyError(f"rank {rank} is not in a topology of {self.world} rank(s)")
        if self.mesh is None:
            return {}
        flat = self.mesh.index(self.global_ranks[rank])
        out: dict[str, int] = {}
        for dim, size in zip(reversed(self.dims), reversed(self.shape)):
            out[dim] = flat % size
            flat //= size
        return {d: out[d] for d in self.dims}

    def rank_at(self, coords: Mapping[str, int]) -> int:
        """The group rank at full mesh coordinates ``coords`` (the inverse of ``coords``)."""
        if self.mesh is None:
            raise TopologyError("rank topology without a mesh has no coordinates")
        flat = 0
        for dim, size in zip(self.dims, self.shape):
            c = int(coords[dim])
            if not 0 <= c < size:
                raise TopologyError(f"coordinate {dim}={c} outside 0..{size - 1}")
            flat = flat * size + c
        return self.global_ranks.index(self.mesh[flat])

    def same_as(self, other: RankTopology) -> bool:
        return self == other

    def describe(self) -> str:
        """``4 ranks, mesh dp=2 x tp=2`` / ``2 ranks, no mesh``."""
        ranks = f"{self.world} rank{'s' if self.world != 1 else ''}"
        if self.mesh is None:
            return f"{ranks}, no mesh"
        mesh = " x ".join(f"{d}={s}" for d, s in zip(self.dims, self.shape))
        order = "" if list(self.mesh) == sorted(self.global_ranks) else f" (global ranks {list(self.mesh)})"
        return f"{ranks}, mesh {mesh}{order}"

    def to_json(self) -> dict[str, Any]:
        return {"world": self.world, "global_ranks": list(self.global_ranks), "dims": list(self.dims),
                "shape": list(self.shape), "mesh": None if self.mesh is None else list(self.mesh)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RankTopology:
        try:
            mesh = d.get("mesh")
            return cls(int(d["world"]), tuple(int(g) for g in d["global_ranks"]), tuple(str(x) for x in d["dims"]),
                       tuple(int(s) for s in d["shape"]), None if mesh is None else tuple(int(g) for g in mesh))
        except (KeyError, TypeError, ValueError) as exc:
            raise TopologyError(f"rank topology record {d!r} is malformed ({exc})") from None


# ----------------------------------------------------------------------------------------- manifest
@dataclass(frozen=True)
class PerRankEntry:
    """Rank ``rank``'s content of a per-rank key: stored object ``object`` (shared by equal contents)."""

    rank: int
    kind: str  # "tensor" or "value"
    object: str

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "kind": self.kind, "object": self.object}


@dataclass(frozen=True)
class PerRankKey:
    """One per-rank key (a state dict path) and the entry of every rank that held it at save."""

    path: tuple[Any, ...]
    entries: tuple[PerRankEntry, ...]

    @property
    def text(self) -> str:
        return _text(self.path)

    def entry(self, rank: int) -> PerRankEntry | None:
        return next((e for e in self.entries if e.rank == rank), None)

    def to_json(self) -> dict[str, Any]:
        return {"path": list(self.path), "text": self.text, "entries": [e.to_json() for e in self.entries]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PerRankKey:
        return cls(tuple(d["path"]), tuple(PerRankEntry(int(e["rank"]), str(e["kind"]), str(e["object"]))
                                           for e in d["entries"]))


@dataclass(frozen=True)
class PerRankManifest:
    """What the catalog records of a version's per-rank state: the saving topology and every per-rank key."""

    topology: RankTopology
    keys: tuple[PerRankKey, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"topology": self.topology.to_json(), "keys": [k.to_json() for k in self.keys]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PerRankManifest:
        try:
            return cls(RankTopology.from_json(d["topology"]), tuple(PerRankKey.from_json(k) for k in d["keys"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TopologyError(f"per-rank manifest is malformed ({exc})") from None

    def by_path(self) -> dict[tuple[Any, ...], int]:
        return {k.path: i for i, k in enumerate(self.keys)}


# ----------------------------------------------------------------------------------------- policies
@dataclass(frozen=True)
class SavedRankState:
    """One saving rank's state of a per-rank unit, as a ``reshard`` callback receives it."""

    rank: int
    coords: dict[str, int]
    path: tuple[Any, ...]
    value: Any


@dataclass(frozen=True)
class RankTarget:
    """The loading rank a ``reshard`` callback computes the state for."""

    rank: int
    coords: dict[str, int]
    path: tuple[Any, ...]
    world: int
    topology: RankTopology
    saved_topology: RankTopology


@dataclass(frozen=True)
class Policy:
    """How a per-rank unit is restored; build with ``same()``, ``by_coordinate(...)``, ``rank0()``,
    ``reshard(fn)`` or ``fresh()`` (or the strings ``parse_policy`` takes)."""

    kind: str
    dims: tuple[str, ...] = ()
    fn: Callable[[list[SavedRankState], RankTarget], Any] | None = field(default=None, compare=False)

    def describe(self) -> str:
        if self.kind == "by-coordinate":
            return f"by-coordinate({', '.join(self.dims)})"
        if self.kind == "reshard":
            return f"reshard({getattr(self.fn, '__name__', 'fn')})"
        return self.kind


def same() -> Policy:
    """Each rank gets its own saved state; only valid on the saving topology (the default)."""
    return Policy("same")


def by_coordinate(*dims: str) -> Policy:
    """Ranks whose coordinates on ``dims`` (mesh dim names, e.g. ``"dp"``) equal a saved rank's get its state."""
    if not dims or not all(isinstance(d, str) and d for d in dims):
        raise ConfigurationError(f"by_coordinate: name one or more mesh dims (e.g. 'dp'), got {list(dims)!r}")
    return Policy("by-coordinate", tuple(dims))


def rank0() -> Policy:
    """Every rank gets saved rank 0's state."""
    return Policy("rank0")


def fresh() -> Policy:
    """Left as the caller built it (the saved per-rank state is deliberately not restored)."""
    return Policy("fresh")


def reshard(fn: Callable[[list[SavedRankState], RankTarget], Any]) -> Policy:
    """``fn(saved, target)`` computes this rank's state from every saved rank's state (``SavedRankState``:
    rank, coords, path, value) and the loading rank (``RankTarget``: rank, coords, path, world, topologies)."""
    if not callable(fn):
        raise ConfigurationError(f"reshard: expected a callable (saved, target) -> state, got {type(fn).__name__}")
    return Policy("reshard", fn=fn)


def parse_policy(value: Any, *, what: str = "per_rank policy") -> Policy:
    """A ``Policy`` from a ``Policy``, a callable (``reshard``) or a string: ``same``, ``rank0``, ``fresh``,
    ``by-coordinate:dp`` / ``by-coordinate:dp,pp``."""
    if isinstance(value, Policy):
        return value
    if isinstance(value, str):
        name, _, rest = value.partition(":")
        name = name.strip().replace("_", "-")
        if name == "by-coordinate":
            dims = tuple(d.strip() for d in rest.split(",") if d.strip())
            if not dims:
                raise ConfigurationError(f"{what} {value!r}: name the mesh dims to match, e.g. 'by-coordinate:dp'")
            return by_coordinate(*dims)
        if not rest and name in ("same", "rank0", "fresh"):
            return Policy(name)
        raise ConfigurationError(f"{what} {value!r}: expected 'same', 'rank0', 'fresh', 'by-coordinate:<dims>', a "
                                 "Policy or a reshard callable")
    if callable(value):
        return reshard(value)
    raise ConfigurationError(f"{what}: expected a Policy, a string or a callable, got {type(value).__name__}")


def unit_of(path: Sequence[Any], patterns: Sequence[str]) -> tuple[int, tuple[Any, ...]] | None:
    """The first pattern (index) matching ``path`` or one of its ancestors, and the highest matching node
    (the unit the policy restores as a whole); None when no pattern matches."""
    for i, pattern in enumerate(patterns):
        for n in range(1, len(path) + 1):
            if fnmatch.fnmatchcase(_text(path[:n]), pattern):
                return i, tuple(path[:n])
    return None


def policy_for(path: Sequence[Any], policies: Mapping[str, Policy]) -> tuple[str, Policy, tuple[Any, ...]] | None:
    """(pattern, policy, unit path) for a per-rank leaf at ``path``, or None when no pattern matches."""
    patterns = list(policies)
    found = unit_of(path, patterns)
    if found is None:
        return None
    i, unit = found
    return patterns[i], policies[patterns[i]], unit


def _candidates(key: PerRankKey, saved: RankTopology, live: RankTopology, rank: int, dims: Sequence[str]) -> list[int]:
    mine = live.coords(rank)
    return [e.rank for e in key.entries if all(saved.coords(e.rank)[d] == mine[d] for d in dims)]


def choose_source(policy: Policy, key: PerRankKey, saved: RankTopology, live: RankTopology, rank: int) -> int:
    """The saved rank whose entry of ``key`` loading rank ``rank`` takes under ``policy`` (``same``,
    ``rank0``, ``by-coordinate``). Raises ``ConfigurationError`` saying why none fits."""
    what = f"per-rank key {key.text!r}"
    if policy.kind == "same":
        if not saved.same_as(live):
            raise ConfigurationError(f"{what}: saved on {saved.describe()}, loading on {live.describe()}; declare a "
                                     "policy (by-coordinate, rank0, reshard or fresh)")
        if key.entry(rank) is None:
            raise ConfigurationError(f"{what}: rank {rank} did not hold it at save (held by ranks "
                                     f"{[e.rank for e in key.entries]})")
        return rank
    if policy.kind == "rank0":
        if key.entry(0) is None:
            raise ConfigurationError(f"{what}: policy rank0, but saved rank 0 did not hold it (held by ranks "
                                     f"{[e.rank for e in key.entries]})")
        return 0
    if policy.kind != "by-coordinate":
        raise ConfigurationError(f"{what}: policy {policy.describe()} does not pick one saved rank")
    missing = [d for d in policy.dims if d not in saved.dims or d not in live.dims]
    if missing:
        raise ConfigurationError(f"{what}: by-coordinate({', '.join(policy.dims)}): dim(s) {missing} not in both the "
                                 f"saving topology ({saved.describe()}) and this one ({live.describe()})")
    found = _candidates(key, saved, live, rank, policy.dims)
    if not found:
        raise ConfigurationError(f"{what}: by-coordinate({', '.join(policy.dims)}): no saved rank has rank {rank}'s "
                                 f"coordinates {live.coords(rank)} on those dims (saved on {saved.describe()}, "
                                 f"loading on {live.describe()}); use reshard")
    objects = {key.entry(r).object for r in found}  # type: ignore[union-attr]
    if len(objects) > 1:  # refine by the dims both topologies share with the same size (an unchanged TP)
        shared = [d for d in live.dims if d not in policy.dims and d in saved.dims
                  and saved.shape[saved.dims.index(d)] == live.shape[live.dims.index(d)]]
        found = _candidates(key, saved, live, rank, tuple(policy.dims) + tuple(shared))
        objects = {key.entry(r).object for r in found}  # type: ignore[union-attr]
        if len(objects) != 1:
            raise ConfigurationError(f"{what}: by-coordinate({', '.join(policy.dims)}): the saved ranks with rank "
                                     f"{rank}'s coordinates {live.coords(rank)} hold different states; name more "
                                     f"dims or use reshard (saved on {saved.describe()}, loading on {live.describe()})")
    return min(found)
