"""Teach zarr-python 3.1 the zarr-extensions ``bfloat16`` data type.

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
    """Register ``bfloat16`` with zarr-python's data type registry. Returns False if zarr is absent."""
    try:
        from zarr.core.dtype import data_type_registry
        from zarr.core.dtype.npy.float import BaseFloat
    except ImportError:  # zarr-python is optional at run time: TensorStore is the fast path
        return False
    if "bfloat16" in data_type_registry.contents:
        return True

    @dataclass(frozen=True, kw_only=True)
    class BFloat16(BaseFloat):  # type: ignore[misc, type-arg]
        """bfloat16 (zarr-extensions ``bfloat16``), numpy side ``ml_dtypes.bfloat16``."""

        dtype_cls = type(_BF16)
        _zarr_v3_name: ClassVar[str] = "bfloat16"
        _zarr_v2_names: ClassVar[tuple[str, ...]] = ("bfloat16",)

        @classmethod
        def _check_native_dtype(cls, dtype: object) -> bool:  # type: ignore[override]
            return isinstance(dtype, np.dtype) and dtype == _BF16

        @classmethod
        def from_native_dtype(cls, dtype):  # type: ignore[override]
            if cls._check_native_dtype(dtype):
                return cls(endianness="little")
            from zarr.core.dtype import DataTypeValidationError

            raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected bfloat16")

        def to_native_dtype(self):  # type: ignore[override]
            return _BF16

        @property
        def item_size(self) -> int:
            return 2

    data_type_registry.register("bfloat16", BFloat16)
    return True
