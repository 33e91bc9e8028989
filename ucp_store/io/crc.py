"""CRC32C (Castagnoli), the checksum of every inner chunk and shard index: the one home of the library
that computes it for the local read and write paths (TensorStore computes its own).

``crc32c`` (the ICRAR package, numcodecs' own CRC32C backend) where it runs on the CPU's CRC instructions:
tools/bench_crc32c.py measured it at about 28 GB/s on buffers larger than the cache, where
``google_crc32c`` fell to about 6 GB/s (4 MiB: 148 vs 682 us), and it releases the GIL (two threads, twice
the rate; ``google_crc32c`` held it). A held row read of a 1 MiB chunk, which is mostly that chunk's crc,
went from 133 to 50 us (tools/bench_row_ab.py). Small buffers cost the same in both. ``google_crc32c``
(zarr's dependency) otherwise: a CPU without CRC instructions, or no ``crc32c`` wheel.
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
