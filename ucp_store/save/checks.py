"""Checks on what a writer is handed, before a byte is hashed or written: extents, patterns, placement layers."""

from __future__ import annotations

import json
import math
from typing import Any

from ucp_store.errors import ValidationError

__all__ = ["MAX_ELEMENTS", "check_extent", "layer_of", "validate_pattern"]

#: the most elements one tensor-state may have (256 Ti: 1 PiB of fp32). A larger shape is a bad input
#: (a corrupt header, a stride-0 view of 2^62 elements), refused before a byte is hashed or allocated.
MAX_ELEMENTS = 1 << 48

#: pattern JSON texts that passed the schema (the schema check is the slow half of pattern validation)
_SCHEMA_CHECKED: set[str] = set()


def check_extent(shape: Any, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints of at most :data:`MAX_ELEMENTS` elements, or a ValidationError."""
    try:
        dims = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise ValidationError(f"{what}: shape {shape!r} is not a sequence of integers") from None
    if any(d < 0 for d in dims):
        raise ValidationError(f"{what}: shape {list(dims)} has a negative dimension")
    n = math.prod(dims)
    if n > MAX_ELEMENTS:
        raise ValidationError(f"{what}: shape {list(dims)} has {n} elements (~2^{n.bit_length() - 1}); a "
                              f"tensor-state holds at most 2^48 ({MAX_ELEMENTS})")
    return dims


def layer_of(pattern: dict | None) -> int | None:
    """The catalog's ``tensors.layer``: the pattern's placement layer, or None."""
    if pattern is None:
        return None
    from ucp_store.patterns import parse_pattern

    return parse_pattern(pattern).layer


def validate_pattern(name: str, pattern: dict, shape: Any) -> None:
    """Schema first (clear field paths), then the algebra's own checks against the shape."""
    from ucp_store import patterns as pat
    from ucp_store.schema import validate

    text = json.dumps(pattern, sort_keys=True)
    if text not in _SCHEMA_CHECKED:  # many tensors share one pattern (all of a mesh's Shard(0) DTensors)
        validate("pattern", pattern)
        if len(_SCHEMA_CHECKED) > 4096:
            _SCHEMA_CHECKED.clear()
        _SCHEMA_CHECKED.add(text)
    pat.check_pattern(pattern, tuple(shape), name=name)
