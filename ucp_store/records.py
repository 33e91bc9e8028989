"""Plain records handed between the catalog, the planner and the readers (no SQL, no I/O)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TensorInfo"]


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
        }
