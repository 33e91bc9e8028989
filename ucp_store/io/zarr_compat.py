"""Teach zarr-python 3.1 the zarr-extensions ``bfloat16``, ``float8_e4m3fn`` and ``float8_e5m2`` data types.

TensorStore reads and writes ``"data_type": "bfloat16"`` natively; zarr-python 3.1 refuses it
("No Zarr data type found that matches 'bfloat16'"). We register a ZDType backed by
``ml_dtypes.bfloat16`` so that every array the store writes also opens with zarr-python, bit-exact,
without disguising bf16 as uint16 or upcasting it. Registration is idempotent and happens on
``import ucp_store``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np

__all__ = ["register_bfloat16"]

_BF16 = np.dtype(ml_dtypes.bfloat16)


def register_bfloat16() -> bool:
    """Register ``bfloat16`` (and the float8 types the store writes, ``float8_e4m3fn`` and ``float8_e5m2``)
    with zarr-python's data type registry. Returns False if zarr is absent."""
    try:
        from zarr.core.dtype import data_type_registry
        from zarr.core.dtype.npy.float import BaseFloat
    except ImportError:  # zarr-python is optional at run time: TensorStore is the fast path
        return False
    for name, native in _EXTENSIONS.items():
        if name not in data_type_registry.contents:
            data_type_registry.register(name, _ztype(BaseFloat, name, native))
    return True


_EXTENSIONS = {"bfloat16": _BF16, "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
               "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}


def _ztype(base: type, name: str, native: np.dtype) -> type:
    """A zarr-python ZDType for the zarr-extensions float ``name`` backed by the ``ml_dtypes`` type ``native``."""

    @dataclass(frozen=True, kw_only=True)
    class ExtensionFloat(base):  # type: ignore[misc, valid-type]
        dtype_cls = type(native)
        _zarr_v3_name: ClassVar[str] = name
        _zarr_v2_names: ClassVar[tuple[str, ...]] = (name,)

        @classmethod
        def _check_native_dtype(cls, dtype: object) -> bool:  # type: ignore[override]
            return isinstance(dtype, np.dtype) and dtype == native

        @classmethod
        def from_native_dtype(cls, dtype):  # type: ignore[override]
            if cls._check_native_dtype(dtype):
                return cls(endianness="little")
            from zarr.core.dtype import DataTypeValidationError

            raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {name}")

        def to_native_dtype(self):  # type: ignore[override]
            return native

        @property
        def item_size(self) -> int:
            return native.itemsize

    ExtensionFloat.__name__ = ExtensionFloat.__qualname__ = "".join(p.capitalize() for p in name.split("_"))
    return ExtensionFloat
