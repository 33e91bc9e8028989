"""The copy-distance effect the local read path works around (localread._BAD_DISTANCE), measured here.

    .venv/bin/python tools/bench_align.py

Reads 1 MiB from a cached file into a page-aligned buffer at destination offsets 0..4095 bytes after the
file offset's page position (``preadv``: the kernel's copy to user memory), and the same distances for
numpy's copy (glibc memcpy), torch's copy and localread.copy_into between two buffers; microseconds per copy,
best of 5. On AMD EPYC with FSRM (this machine) distances 1-31 bytes make preadv 20-30x slower, and numpy's
copy too at sizes where glibc picks ``rep movsb`` (64 KiB here; 1 MiB goes non-temporal); torch's copy of
1 MiB runs on an OpenMP team, which under load can take milliseconds (localread.copy_into copies in pieces).
"""
import os
import tempfile
import timeit

import numpy as np
import torch

from ucp_store.io.localread import copy_into

N = 1 << 20
DISTANCES = (0, 4, 8, 16, 24, 28, 31, 32, 48, 63, 64, 256, 2048, 4064, 4092)


def main() -> None:
    with tempfile.NamedTemporaryFile() as f:
        f.write(np.random.default_rng(0).integers(0, 255, N, np.uint8).tobytes())
        f.flush()
        fd = os.open(f.name, os.O_RDONLY)
        dst = np.empty(N + 8192, np.uint8)
        dst[:] = 1
        src = np.empty(N + 8192, np.uint8)
        src[:] = 2
        d0, s0 = -dst.ctypes.data % 4096, -src.ctypes.data % 4096
        rows = []
        for dist in DISTANCES:
            out = dst[d0 + dist:d0 + dist + N]
            inp = src[s0:s0 + N]
            tout, tin = torch.from_numpy(out), torch.from_numpy(inp)
            t_pread = min(timeit.repeat(lambda out=out: os.preadv(fd, [out.data], 0), number=5, repeat=5)) / 5
            t_np = min(timeit.repeat(lambda out=out, inp=inp: np.copyto(out, inp), number=5, repeat=5)) / 5
            t_torch = min(timeit.repeat(lambda tout=tout, tin=tin: tout.copy_(tin), number=5, repeat=5)) / 5
            t_ours = min(timeit.repeat(lambda out=out, inp=inp: copy_into(out, inp), number=5, repeat=5)) / 5
            rows.append((dist, t_pread, t_np, t_torch, t_ours))
        os.close(fd)
    print(f"{'distance (B)':>12} {'preadv us':>10} {'numpy us':>9} {'torch us':>9} {'localread.copy_into us':>19}")
    for dist, a, b, c, d in rows:
        print(f"{dist:12d} {a * 1e6:10.0f} {b * 1e6:9.0f} {c * 1e6:9.0f} {d * 1e6:19.0f}")


if __name__ == "__main__":
    main()
