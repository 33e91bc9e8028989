"""crc32c libraries on this machine: numcodecs CRC32C vs google_crc32c vs crc32c (ucp_store/io/crc.py uses the
last where it is hardware-based: the fastest out of cache here, and it releases the GIL).

    python tools/bench_crc32c.py
"""

import time
from concurrent.futures import ThreadPoolExecutor

import crc32c
import google_crc32c
import numpy as np
from numcodecs import CRC32C


def best_seconds(fn, size: int) -> float:
    """The best per-call time of ``fn`` over 5 rounds of about 32 MiB of calls."""
    n = max(3, (32 << 20) // size)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best


def single_buffers() -> None:
    codec = CRC32C()
    for size in (32 << 10, 128 << 10, 256 << 10, 1 << 20, 16 << 20):
        buf = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        enc = np.frombuffer(codec.encode(buf), np.uint8)
        assert google_crc32c.value(buf) == crc32c.crc32c(buf)
        cases = {"google_crc32c.value(ndarray)": lambda b=buf: google_crc32c.value(b),
                 "crc32c.crc32c(ndarray)": lambda b=buf: crc32c.crc32c(b),
                 "numcodecs CRC32C.decode": lambda e=enc: codec.decode(e)}
        res = {name: best_seconds(fn, size) for name, fn in cases.items()}
        print(f"{size >> 10:6d} KiB  " + "  ".join(f"{k}: {v * 1e6:8.1f} us {size / v / 1e9:5.1f} GB/s"
                                                   for k, v in res.items()))


def threads() -> None:
    bufs = [np.ones(64 << 20, np.uint8) for _ in range(2)]
    for name, fn in [("google_crc32c", google_crc32c.value), ("crc32c", crc32c.crc32c)]:
        t1 = t2 = 1e9
        with ThreadPoolExecutor(2) as ex:
            for _ in range(5):
                t = time.perf_counter()
                for b in bufs * 4:
                    fn(b)
                t1 = min(t1, time.perf_counter() - t)
                t = time.perf_counter()
                list(ex.map(fn, bufs * 4))
                t2 = min(t2, time.perf_counter() - t)
        print(f"{name}: 512 MiB 1 thread {t1:.3f} s, 2 threads {t2:.3f} s (GIL released if ~2x)")


if __name__ == "__main__":
    single_buffers()
    threads()
