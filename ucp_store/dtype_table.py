"""The store's data types as names and sizes (pure, torch-free): one table for the planner and ``dtypes``.

The store keeps exactly the dtypes it can write bit-exactly as zarr v3 arrays: these names, and nothing
else. ``float8_e4m3fn`` and ``float8_e5m2`` (FP8 models, issue 39) are the zarr-extensions names TensorStore
writes natively; the other float8 variants have no zarr v3 name the store writes, so a checkpoint never holds
one. ``dtypes``
maps the same names onto torch and numpy; the planner only needs the item size, and must not import
torch to get it. Keeping both on this one table is what stops them drifting apart (the planner once
accepted ``float8_e4m3fn``, which no write could have produced).
"""

from __future__ import annotations

import difflib
from typing import Any

from ucp_store.errors import DTypeError

__all__ = ["ITEMSIZE", "SUPPORTED", "ALIASES", "UNSTORABLE", "canonical_name", "itemsize", "unsupported_message"]

#: zarr v3 data type name -> bytes per element; the dtypes the store can write
ITEMSIZE: dict[str, int] = {
    "bool": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
SUPPORTED: tuple[str, ...] = tuple(ITEMSIZE)

#: other spellings (torch's short names, DeepSpeed config names) -> the zarr v3 name
ALIASES: dict[str, str] = {"half": "float16", "float": "float32", "double": "float64", "bf16": "bfloat16",
                           "fp16": "float16", "fp32": "float32", "long": "int64", "int": "int32", "bool_": "bool"}

#: known dtypes the store refuses, with the reason (named in the error instead of "unknown")
UNSTORABLE: dict[str, str] = {
    name: "float8 has no zarr v3 data type the store writes bit-exactly"
    for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
}

_CANONICAL: dict[str, str] = {}


def canonical_name(dtype: Any) -> str | None:
    """The zarr v3 name of a dtype spelled as torch (``torch.float32``), numpy or a name; None if unknown."""
    key = dtype if type(dtype) is str else str(dtype)
    hit = _CANONICAL.get(key)
    if hit is not None:
        return hit
    name = key.removeprefix("torch.").removeprefix("<class 'numpy.").rstrip("'>")
    name = ALIASES.get(name, name)
    if name not in ITEMSIZE:
        return None
    _CANONICAL[key] = name
    return name


def itemsize(dtype: Any, *, what: str = "tensor") -> int:
    """Bytes per element of a storable dtype; ``DTypeError`` naming ``what`` (and a near match) otherwise."""
    name = canonical_name(dtype)
    if name is not None:
        return ITEMSIZE[name]
    raise DTypeError(unsupported_message(dtype, what))


def unsupported_message(dtype: Any, what: str) -> str:
    """Why ``dtype`` is refused: a known but unstorable dtype says so; an unknown one gets a near match."""
    raw = str(dtype).removeprefix("torch.")
    if raw in UNSTORABLE:
        return (f"{what}: dtype {raw} cannot be stored ({UNSTORABLE[raw]}); "
                f"supported: {', '.join(SUPPORTED)}")
    near = difflib.get_close_matches(raw, list(ITEMSIZE) + list(ALIASES), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return f"{what}: unknown dtype {dtype!r}{hint}; supported: {', '.join(SUPPORTED)}"
