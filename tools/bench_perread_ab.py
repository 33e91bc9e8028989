"""A/B per-read cost of load_shard, source trees alternated process by process: a ZeRO-3 rank of dp=4 over
1000 arrays of 128x128 fp32 (64 KiB each, 16 KiB read per array, as bench_planner.per_read_seconds), best of
N loads per process; also fetch (plan_records) and plan separately, so exec = total - fetch - plan.

Each tree reads the store its own writer made (the chunk policy is part of a tree), and beside them:
``after@before-store`` (this tree reading the before tree's store: the read path alone) and, with ``TS=1``,
``tensorstore`` (the before tree on its own store with ``UCP_LOCAL_READ=0``: every read through
TensorStore, the path issue 10 measured at 270-470 us per read). Two floors of the same job: ``raw
syscalls`` (per array only the system calls of a checked read, no catalog) and ``python floor`` (this
tree's catalog query plus those reads, with the least per-row Python a load needs; ``PYFLOOR=0`` leaves
it out): how far a load written in Python could go at best.

    git archive 2d4a9d7 | tar -x -C /tmp/before          # the tree to compare against
    BEFORE=/tmp/before TS=1 .venv/bin/python tools/bench_perread_ab.py 3   # rounds (processes per tree)

``BEFORE`` may also be a0bb242, the tree issue 10 was filed against (TensorStore only, nothing held
across loads): its "before" row is then the per-read cost the issue set out to cut to a tenth.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE = os.environ["BEFORE"]
# name -> (tree, store built by, UCP_LOCAL_READ: "0" sends every read through TensorStore; the child sets
# config.local_read from it on trees that have ucp_store.config)
runs = {"before": (BEFORE, "before", "1"), "after": (HERE, "after", "1"),
        "after@before-store": (HERE, "before", "1"), "raw syscalls, before store": ("raw", "before", "1"),
        "raw syscalls, after store": ("raw", "after", "1")}
if os.environ.get("PYFLOOR", "1") != "0":
    runs["python floor, after store"] = ("pyfloor", "after", "1")
if os.environ.get("TS") == "1":
    runs["tensorstore"] = (BEFORE, "before", "0")
py = sys.executable
child = r'''
import sys, os, time, json
sys.path.insert(0, os.environ["T"])
os.environ["UCP_PROGRESS"] = "0"
import ucp_store
try:  # trees with ucp_store.config pick the read path there; older ones read UCP_LOCAL_READ themselves
    from ucp_store import config
    config.set(local_read=os.environ.get("UCP_LOCAL_READ", "1") != "0")
except ImportError:
    pass
from ucp_store.topology import Topology
from ucp_store import io
from ucp_store.plan.planner import plan as make_plan
store = ucp_store.open_store(os.environ["S"])
topo = Topology(dp=4, zero_stage=3, layers=1000)
best = {}
for i in range(int(os.environ["N"])):
    if os.environ["F"] == "1":
        getattr(io, "_held", {}).clear()   # trees before the local read path hold nothing across loads
    ck = store.checkpoint("r@1")
    t0 = time.perf_counter(); recs = ck.plan_records(topo, 1)
    t1 = time.perf_counter(); p = make_plan(recs, topo, 1)
    t2 = time.perf_counter(); c2 = time.process_time(); io.execute(ck, p, infos=recs)
    t3 = time.perf_counter(); c3 = time.process_time()
    if os.environ["F"] == "1":
        getattr(io, "_held", {}).clear()
    ck2 = store.checkpoint("r@1")
    t4 = time.perf_counter(); sh = ck2.load_shard(topo, 1); t5 = time.perf_counter()
    n = p.num_reads
    for k, v in (("fetch", t1 - t0), ("plan", t2 - t1), ("exec", t3 - t2), ("exec_cpu", c3 - c2),
                 ("load_shard", t5 - t4)):
        best[k] = min(best.get(k, 1e9), v / n)
print(json.dumps(best))
'''
# The machine's ceiling for the same job, in the same run: per array only the system calls a checked read
# needs (open, fstat, one preadv of the rows' chunk with the rows into a fresh destination buffer, crc32c
# over the chunk, close), chunk offsets taken from the shard index beforehand (a held reader's state); no
# catalog, no plan, no Python beyond the loop.
raw_child = r'''
import os, sys, time, json, glob
import numpy as np, google_crc32c
try:
    import crc32c                   # the store's CRC32C library (ucp_store/io/crc.py) where installed
    crcv = crc32c.crc32c
    crce = lambda c, d: crc32c.crc32c(d, c)
except ImportError:
    crcv, crce = google_crc32c.value, google_crc32c.extend
S = os.environ["S"]
files = sorted(glob.glob(S + "/arrays/*/*.zarr"), key=lambda p: p)
plan = []
for f in files:
    meta = json.load(open(f + "/zarr.json"))
    codec = meta["codecs"][0]
    chunk = codec["configuration"]["chunk_shape"][0] if codec["name"] == "sharding_indexed" else meta["shape"][0]
    per = 128 // chunk
    k = 32 // chunk                      # the chunk holding rows 32..63 (its first one, when chunk < 32)
    n = max(1, 32 // chunk)              # chunks the 32 rows span
    raw = open(f + "/c/0/0", "rb").read()
    idx = np.frombuffer(raw[len(raw) - 16 * per - 4:len(raw) - 4], "<u8").reshape(-1, 2)
    plan.append((f + "/c/0/0", int(idx[k][0]), chunk, n))
best = 1e9
for _ in range(int(os.environ["N"])):
    out = np.empty(4096 * len(plan), np.float32).view(np.uint8)   # fresh memory, as load_shard's buffer
    scratch = np.empty(1 << 20, np.uint8)
    t = time.perf_counter()
    for j, (path, off, chunk, n) in enumerate(plan):
        fd = os.open(path, os.O_RDONLY)
        os.fstat(fd)
        dst = out[j * 16384:(j + 1) * 16384]
        cb = chunk * 512
        if chunk >= 32:                   # rows 32..63 inside one chunk: before, rows, after + crc
            a = (32 % chunk) * 512
            pre, post = scratch[:a], scratch[a:a + cb - a - 16384 + 4]
            os.preadv(fd, [pre, dst, post] if a else [dst, post], off)
            c = crce(crcv(pre), dst) if a else crcv(dst)
            crce(c, post[:-4])
        else:                             # whole chunks: each one's bytes then its crc
            crcs = scratch[:4 * n]
            iov = []
            for i in range(n):
                iov += [dst[i * cb:(i + 1) * cb], crcs[4 * i:4 * i + 4]]
            os.preadv(fd, iov, off)
            for i in range(n):
                crcv(dst[i * cb:(i + 1) * cb])
        os.close(fd)
    best = min(best, (time.perf_counter() - t) / len(plan))
print(json.dumps({"fetch": 0.0, "plan": 0.0, "exec": best, "exec_cpu": best, "load_shard": best}))
'''
# The same job with everything but the catalog query and the checked reads taken out, in Python: this tree's
# catalog query (the columns Checkpoint._fetch_infos selects, through SQLAlchemy Core, one fetchall), per
# row its shape and pattern decoded (each layer's pattern is its own text) and the rows' flat range of a
# ZeRO-3 rank worked out, then open, fstat and the file's identity compared with the held index's, one
# preadv of the rows' chunk(s) into a fresh destination buffer, crc32c, close. No records, no plan, no
# io layer: what a per-row Python loop costs at least for this load, where the raw row above has no catalog.
# Its "first load" reads and checks each shard's index as well (open, fstat, pread of the file's tail,
# crc32c, parse, in the same open), where the held one takes it from memory and compares the identity.
pyfloor_child = r'''
import os, sys, time, json
sys.path.insert(0, os.environ["T"])
os.environ["UCP_PROGRESS"] = "0"
import numpy as np
from sqlalchemy import Text, cast, select
import ucp_store
from ucp_store.io.crc import value as crc
from ucp_store.catalog import models as m
store = ucp_store.open_store(os.environ["S"])
ck = store.checkpoint("r@1")
root = store.location.root
held = {}  # array path -> (shard file, identity, chunk entries, rows per chunk): a held reader's state
for info in ck.tensors():
    f = os.path.join(root, info.array, "c", "0", "0")
    st = os.stat(f)
    raw = open(f, "rb").read()
    per = info.shape[0] // info.chunk_shape[0]
    idx = np.frombuffer(raw[len(raw) - 16 * per - 4:len(raw) - 4], "<u8").reshape(-1, 2).tolist()
    held[info.array] = (f, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns), idx, info.chunk_shape[0])
t, a = m.Tensor, m.Array
q = (select(t.name, t.state, cast(t.shape, Text), t.dtype, cast(t.pattern, Text), cast(a.chunk_shape, Text),
            cast(a.shard_shape, Text), a.path, a.id, cast(a.codecs, Text), t.nbytes, t.content_hash, t.position)
     .join(a, t.array_id == a.id).where(t.checkpoint_id == ck.id).order_by(t.position))
scan = json.scanner.make_scanner(json.JSONDecoder())
engine = store.catalog.engine
rank, world = 1, 4
first = os.environ["F"] == "1"
best = 1e9
for _ in range(int(os.environ["N"])):
    scratch = np.empty(1 << 20, np.uint8)
    t0 = time.perf_counter()
    with engine.connect() as conn:
        rows = conn.execute(q).fetchall()
    out = np.empty(sum(4096 for _ in rows), np.float32).view(np.uint8)   # fresh memory, as load_shard's buffer
    shapes = {}
    pos = 0
    for (name, state, shape, dtype, pattern, chunk, shard, path, aid, codecs, nbytes, chash, position) in rows:
        s = shapes.get(shape)
        if s is None:
            s = shapes[shape] = tuple(json.loads(shape))
        scan(pattern, 0)
        f, ident, idx, c0 = held[path]
        rb = 4 * s[1]
        part = s[0] * s[1] // world
        lo, hi = rank * part // s[1], (rank + 1) * part // s[1]   # rows of the rank's flat range
        fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        st = os.fstat(fd)
        if first:           # a first load holds no index: read it from the file's tail and check its crc32c
            want = 16 * (s[0] // c0) + 4
            raw = os.pread(fd, want, st.st_size - want)
            if crc(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
                raise SystemExit(f"{f}: index crc32c mismatch")
            idx = np.frombuffer(raw, "<u8", 2 * (s[0] // c0)).reshape(-1, 2).tolist()
        elif (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) != ident:
            raise SystemExit(f"{f} changed")
        n = (hi - lo) * rb
        dst = out[pos:pos + n]
        pos += n
        i, cb = lo // c0, c0 * rb
        if hi - lo <= c0:   # inside one chunk: before, rows, after + crc
            off, nb = idx[i]
            a0 = (lo - i * c0) * rb
            pre, post = scratch[:a0], scratch[a0:a0 + nb - a0 - n]
            os.preadv(fd, [pre, dst, post] if a0 else [dst, post], off)
            c = crc(dst, crc(pre)) if a0 else crc(dst)
            ok = crc(post[:-4], c) == int.from_bytes(post[-4:], "little")
        else:               # whole chunks: each one's bytes then its crc
            k = (hi - lo) // c0
            crcs = scratch[:4 * k]
            iov = []
            for j in range(k):
                iov += [dst[j * cb:(j + 1) * cb], crcs[4 * j:4 * j + 4]]
            os.preadv(fd, iov, idx[i][0])
            ok = all(crc(dst[j * cb:(j + 1) * cb]) == int.from_bytes(crcs[4 * j:4 * j + 4], "little") for j in range(k))
        os.close(fd)
        if not ok:
            raise SystemExit(f"{f}: crc32c mismatch")
    best = min(best, (time.perf_counter() - t0) / len(rows))
print(json.dumps({"fetch": 0.0, "plan": 0.0, "exec": best, "exec_cpu": best, "load_shard": best}))
'''
tmp = tempfile.mkdtemp()
mk = r'''
import sys, os, torch
sys.path.insert(0, os.environ["T"]); os.environ["UCP_PROGRESS"] = "0"
import ucp_store
store = ucp_store.open_store(sys.argv[1], create=True)
with store.begin("r", 1) as w:
    for i in range(1000):
        w.write(f"layers.{i}.w", "fp32", torch.randn(128, 128),
                pattern={"kind": "partitioned", "dim": 0, "placement": {"layer": i}})
print(list(store.checkpoint("r@1").info("layers.0.w", "fp32").chunk_shape))
'''
for who, tree in (("before", BEFORE), ("after", HERE)):
    out = subprocess.run([py, "-c", mk, f"{tmp}/{who}"], check=True, env={**os.environ, "T": tree},
                         capture_output=True, text=True)
    print(f"store of {who}: chunk shape {out.stdout.strip()}")
res = {}
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
keys = ["fetch", "plan", "exec", "exec_cpu", "load_shard"]
for r in range(rounds):
    for fresh in ("0", "1"):
        for name, (tree, built, local) in runs.items():
            code = {"raw": raw_child, "pyfloor": pyfloor_child}.get(tree, child)
            out = subprocess.run([py, "-c", code], env={"T": HERE if tree == "pyfloor" else tree, "F": fresh,
                                 "S": f"{tmp}/{built}",
                                 "N": os.environ.get("N", "8"), "PATH": "/usr/bin:/bin", "UCP_LOCAL_READ": local},
                                 capture_output=True, text=True)
            if out.returncode:
                print(out.stderr)
                sys.exit(1)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            mode = "first load" if fresh == "1" else "held"
            for k in keys:
                res[(name, mode, k)] = min(res.get((name, mode, k), 1e9), got[k])
            print(r, name, mode, {k: round(got[k] * 1e6, 1) for k in keys}, flush=True)
print(f"\nus per read, best over {rounds} rounds x {os.environ.get('N', '8')} loads ({os.cpu_count()} cores)")
print(f"{'':32}" + "".join(f"{k:>11}" for k in keys))
for mode in ("held", "first load"):
    for name in runs:
        print(f"{name + ' ' + mode:32}" + "".join(f"{res[(name, mode, k)] * 1e6:11.1f}" for k in keys))
    for ref in [n for n in runs if n != "after"]:
        print(f"{ref + '/after ' + mode:32}" + "".join(f"{res[(ref, mode, k)] / res[('after', mode, k)]:11.2f}"
                                                    for k in keys))
shutil.rmtree(tmp, ignore_errors=True)
