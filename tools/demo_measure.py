"""Wall time, peak memory and CPU time of a command and every process it starts (for `ucp demo`).

`/usr/bin/time -v` sees only the processes its child waits for: the demo's ranks are forked by a fork
server, so their memory and CPU are not in its figures. This runs the command in a new session and
samples /proc every 0.1 s: the peak of the summed proportional (PSS: the forked ranks share torch's
pages) and resident memory of the session's processes, each
process's last seen CPU time (summed), and the most processes at once. Linux only.

    .venv/bin/python tools/demo_measure.py -- .venv/bin/ucp demo --dir /tmp/ucp-demo
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


def _pss(pid: str) -> int:
    """Proportional set size (pages shared by forked ranks counted once overall), 0 where unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _session(sid: int) -> dict[int, tuple[int, float, int]]:
    """{pid: (rss bytes, cpu seconds, pss bytes)} of the processes in session `sid`."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) != sid:  # fields after the comm: state ppid pgrp session ...
            continue
        cpu = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
        out[int(name)] = (int(fields[21]) * PAGE, cpu, _pss(name))
    return out


def main(argv: list[str]) -> int:
    if "--" in argv:
        argv = argv[argv.index("--") + 1:]
    if not argv:
        print(__doc__)
        return 2
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, start_new_session=True)
    peak_rss, peak_pss, peak_n, cpu = 0, 0, 0, {}
    while proc.poll() is None:
        procs = _session(proc.pid)
        peak_rss = max(peak_rss, sum(r for r, _, _ in procs.values()))
        peak_pss = max(peak_pss, sum(p for _, _, p in procs.values()))
        peak_n = max(peak_n, len(procs))
        for pid, (_, c, _) in procs.items():
            cpu[pid] = max(cpu.get(pid, 0.0), c)
        time.sleep(0.1)
    wall = time.monotonic() - t0
    print(f"\n[demo_measure] exit {proc.returncode}; wall {wall:.1f} s; peak memory of the session: summed PSS "
          f"{peak_pss / 2**20:.0f} MiB (summed RSS {peak_rss / 2**20:.0f} MiB, shared pages counted per process); "
          f"CPU {sum(cpu.values()):.1f} s in {len(cpu)} processes "
          f"(at most {peak_n} at once); load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
          f"on {os.cpu_count()} CPUs", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
