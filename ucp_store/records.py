"""Plain records handed between the catalog, the planner and the readers (no SQL, no I/O)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TensorInfo", "main_state", "merge_orders", "model_order"]


@dataclass(frozen=True)
class ArrayRef:
    """A base array of a delta (issue 39): where it is, its codec chain and its own encoding. A base has its
    delta's shape, dtype, chunk and shard grid (the writer makes deltas only so)."""

    array: str  # location relative to the store root
    array_id: str
    codecs: Any
    encoding: str = "plain"

    def to_json(self) -> list[Any]:
        return [self.array, self.array_id, self.codecs, self.encoding]

    @classmethod
    def from_json(cls, row: list[Any]) -> "ArrayRef":
        return cls(row[0], row[1], row[2], row[3])


@dataclass(frozen=True)
class TensorInfo:
    """One tensor-state of a checkpoint as the catalog records it."""

    name: str
    state: str
    shape: tuple[int, ...]
    dtype: str
    pattern: dict[str, Any] | None
    chunk_shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    array: str  # location relative to the store root
    array_id: str
    codecs: list[Any] = field(default_factory=list, compare=False, repr=False)
    nbytes: int = 0
    content_hash: str = ""
    position: int = 0
    #: ``plain`` or ``xor`` (the array holds the bits XOR its base's; issue 39)
    encoding: str = "plain"
    #: an ``xor`` array's bases, nearest first, down to a plain one (the keyframe); empty for ``plain``
    bases: tuple[ArrayRef, ...] = ()

    @property
    def depth(self) -> int:
        """The chain depth: 0 for a plain array, else how many xor arrays are read over the keyframe."""
        return 0 if self.encoding == "plain" else 1 + sum(1 for b in self.bases if b.encoding != "plain")

    @classmethod
    def from_catalog(cls, name: str, state: str, shape: tuple[int, ...], dtype: str, pattern: dict[str, Any] | None,
                     chunk_shape: tuple[int, ...], shard_shape: tuple[int, ...], array: str, array_id: str,
                     codecs: list[Any], nbytes: int, content_hash: str, position: int,
                     encoding: str = "plain", bases: tuple[ArrayRef, ...] = ()) -> "TensorInfo":
        """Build from catalog columns, bypassing the dataclass ``__init__``: a frozen dataclass sets each
        field through ``object.__setattr__``, which was a third of fetching 100k rows (docs/perf.md). The
        instance is as frozen as any other."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "__dict__", {
            "name": name, "state": state, "shape": shape, "dtype": dtype, "pattern": pattern,
            "chunk_shape": chunk_shape, "shard_shape": shard_shape, "array": array, "array_id": array_id,
            "codecs": codecs, "nbytes": nbytes, "content_hash": content_hash, "position": position,
            "encoding": encoding, "bases": bases})
        return obj

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self, array_url: str | None = None) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "pattern": self.pattern,
            "nbytes": self.nbytes,
            "array": array_url or self.array,
            "chunk_shape": list(self.chunk_shape),
            "content_hash": self.content_hash,
            "encoding": self.encoding,
            "depth": self.depth,
            "base": self.bases[0].array if self.bases else None,
        }


def main_state(infos: Iterable[TensorInfo]) -> TensorInfo:
    """"The" state of one tensor among its tensor-states, the one rule every listing and picture uses
    (``Checkpoint.info``, ``read``'s default, ``ucp plan --plot``, the demo): ``fp32``, else ``weight``, else
    the largest (bytes, then elements; the first by position on a tie); never a 0-d state (an optimizer's
    ``step``) when a state with dimensions exists."""
    rows = list(infos)
    if not rows:
        raise ValueError("main_state: no tensor-states given")
    cands = [i for i in rows if i.shape != ()] or rows
    for preferred in ("fp32", "weight"):
        for i in cands:
            if i.state == preferred:
                return i
    return max(cands, key=lambda i: (i.nbytes, i.numel, -i.position))


def model_order(keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """``(name, state)`` -> position (1, 2, ...): tensors in the order the caller gave them (first appearance
    of each name: a state dict's or a source file's order) with each tensor's states together, in their own
    order of appearance. A training state dict lists every weight, then every optimizer state; the catalog
    then lists ``a [weight], a [exp_avg], a [exp_avg_sq], a [step], b [weight], ...``."""
    states: dict[str, list[str]] = {}
    for name, state in keys:
        got = states.setdefault(name, [])
        if state not in got:
            got.append(state)
    out: dict[tuple[str, str], int] = {}
    for name, ss in states.items():
        for s in ss:
            out[(name, s)] = len(out) + 1
    return out


def merge_orders(orders: Sequence[Sequence[tuple[str, str]]]) -> list[tuple[str, str]]:
    """One order of the keys of several ranks' orders (each its state dict's): the first rank's, then each key
    only a later rank holds placed right after the key before it in that rank's order (at the end when it is
    that rank's first). Ranks with one state dict layout (FSDP, TP) give the first rank's order unchanged;
    pipeline stages' disjoint keys follow one another."""
    merged: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for order in orders:
        if not seen:
            for k in order:
                if k not in seen:
                    seen.add(k)
                    merged.append(k)
            continue
        inserts: dict[int, list[tuple[str, str]]] = {}  # index in merged after which new keys go
        at = len(merged) - 1
        index = {k: j for j, k in enumerate(merged)}
        for k in order:
            if k in index:
                at = index[k]
            elif k not in seen:
                seen.add(k)
                inserts.setdefault(at, []).append(k)
        if inserts:
            out: list[tuple[str, str]] = list(inserts.get(-1, []))
            for j, k in enumerate(merged):
                out.append(k)
                out.extend(inserts.get(j, []))
            merged = out
    return merged
