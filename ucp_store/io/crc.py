"""CRC32C (Castagnoli), the checksum of every inner chunk and shard index: the one home of the library
that computes it for the local read and write paths (TensorStore computes its own).

``crc32c`` (the ICRAR package, numcodecs' own CRC32C backend) where it runs on the CPU's CRC instructions:
it keeps its speed on buffers larger than the cache and releases the GIL, so the crc of a held row read and
of the read path's chunks runs on several threads (figures: docs/perf.md, tools/bench_crc32c.py).
``google_crc32c`` (zarr's dependency) otherwise: a CPU without CRC instructions, or no ``crc32c`` wheel.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import google_crc32c

__all__ = ["LIBRARY", "value"]

_crc32c: ModuleType | None
try:
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - a platform without a crc32c wheel
    _crc32c = None

_g_value, _g_extend = google_crc32c.value, google_crc32c.extend


def google_value(data: Any, crc: int = 0) -> int:
    """``value`` through ``google_crc32c`` (the fallback; also what tests compare against)."""
    return _g_extend(crc, data) if crc else _g_value(data)


value: Callable[..., int]  # value(data, crc=0): the CRC32C of data (bytes, numpy array...), continuing crc
if _crc32c is not None and getattr(_crc32c, "hardware_based", False):
    LIBRARY = "crc32c"
    value = _crc32c.crc32c
else:  # pragma: no cover - where crc32c is missing or software-only
    LIBRARY = "google_crc32c"
    value = google_value
