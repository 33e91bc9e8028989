"""Benchmark the planner: plan time for a 1,000-layer model and read amplification of TP changes.

    .venv/bin/python tools/bench_planner.py            # full run (about 3 minutes on 2 cores)
    .venv/bin/python tools/bench_planner.py --layers 100 --quick
    .venv/bin/python tools/bench_planner.py --postgres-url postgresql+psycopg2://ucp:ucp@127.0.0.1/ucp_bench

Part 1 plans one rank of a ~100k tensor-state model (1,000 layers x 25 parameters x 4 states: bf16
weight, fp32 master, Adam moments) for realistic topologies, as ``Checkpoint.load_shard`` does: the
rank's rows fetched from a real catalog (SQLite; also PostgreSQL with ``--postgres-url``), then planned
with cold caches. Fetch and plan are reported apart, each against the rank's load time modelled two ways:
its bytes at ``--load-gbps`` (a lower bound on the load, so the ratio errs high) and that plus the
per-read cost of ``load_shard`` measured in the same run. Part 1c writes the same model with small
dimensions (``--real-layers``, 100 by default: 10k arrays) to a real store and measures fetch, plan and
the whole load of each rank end to end.

Part 2 plans every rank of a Llama-7B-like layer (GQA 32/8 heads of 128, SwiGLU 11008, vocab 32000)
after a TP change and reports read amplification (bytes read / bytes needed, whole chunks read) for chunk
grids aligned by ``chunk_alignment`` to the source and target topologies, next to a grid aligned only to
powers of two; tp=3 uses head-granular uneven widths.
"""

from __future__ import annotations

import argparse
import math
import time

from ucp_store import patterns
from ucp_store.plan.planner import chunk_alignment, plan
from ucp_store.topology import Topology

STATES = ("weight", "fp32", "exp_avg", "exp_avg_sq")
MIB = 1 << 20


def _even_units(total_units: int, parts: int, unit: int) -> list[int]:
    """Split ``total_units`` units of ``unit`` elements over ``parts`` ranks, earlier ranks larger."""
    base, extra = divmod(total_units, parts)
    return [(base + (1 if r < extra else 0)) * unit for r in range(parts)]


# ---------------------------------------------------------------------- the model
def layer_params(i: int, h: int, heads: int, kv_heads: int, head_dim: int, ffn: int, experts: int, expert_ffn: int,
                 uneven_tp: int | None = None):
    """25 parameters of one layer: attention (GQA), dense SwiGLU MLP, a small MoE block, norms and biases."""
    q, kv = heads * head_dim, kv_heads * head_dim

    def at(pattern):
        return {**pattern, "placement": {"layer": i}}

    qkv_widths = ffn_widths = down_widths = None
    if uneven_tp:
        t = uneven_tp
        kv_w = _even_units(kv_heads, t, head_dim)
        q_w = [w * (heads // kv_heads) for w in kv_w]  # query groups follow their kv head
        qkv_widths = {str(t): [q_w, kv_w, kv_w]}
        ffn_widths = {str(t): [_even_units(ffn // 128, t, 128)] * 2}
        down_widths = {str(t): _even_units(ffn // 128, t, 128)}
    fused_qkv = {"kind": "fused", "dim": 0, "sizes": [q, kv, kv]}
    if qkv_widths:
        fused_qkv["widths"] = qkv_widths
    gate_up = {"kind": "fused", "dim": 0, "sizes": [ffn, ffn]}
    if ffn_widths:
        gate_up["widths"] = ffn_widths
    down = {"kind": "partitioned", "dim": 1}
    if down_widths:
        down["widths"] = down_widths
    o_proj = {"kind": "partitioned", "dim": 1}
    if qkv_widths:
        o_proj["widths"] = {k: v[0] for k, v in qkv_widths.items()}
    rep = {"kind": "replicated"}
    p = f"layers.{i}."
    out = [
        (p + "input_norm.weight", at(rep), (h,)),
        (p + "input_norm.bias", at(rep), (h,)),
        (p + "attn.qkv.weight", at(fused_qkv), (q + 2 * kv, h)),
        (p + "attn.qkv.bias", at(fused_qkv), (q + 2 * kv,)),
        (p + "attn.q_norm.weight", at(rep), (head_dim,)),
        (p + "attn.k_norm.weight", at(rep), (head_dim,)),
        (p + "attn.o.weight", at(o_proj), (h, q)),
        (p + "attn.o.bias", at(rep), (h,)),
        (p + "post_norm.weight", at(rep), (h,)),
        (p + "post_norm.bias", at(rep), (h,)),
        (p + "mlp.gate_up.weight", at(gate_up), (2 * ffn, h)),
        (p + "mlp.gate_up.bias", at({**gate_up, "dim": 0}), (2 * ffn,)),
        (p + "mlp.down.weight", at(down), (h, ffn)),
        (p + "mlp.down.bias", at(rep), (h,)),
        (p + "moe.router.weight", at(rep), (experts, h)),
        (p + "moe.router.bias", at(rep), (experts,)),
        (p + "moe.experts.w13", at({"kind": "expert", "num_experts": experts,
                                    "inner": {"kind": "fused", "dim": 0, "sizes": [expert_ffn, expert_ffn]}}),
         (experts, 2 * expert_ffn, h)),
        (p + "moe.experts.w2", at({"kind": "expert", "num_experts": experts,
                                   "inner": {"kind": "partitioned", "dim": 1}}), (experts, h, expert_ffn)),
        (p + "moe.experts.b2", at({"kind": "expert", "num_experts": experts, "inner": rep}), (experts, h)),
        (p + "moe.shared.gate_up.weight", at({"kind": "fused", "dim": 0, "sizes": [expert_ffn, expert_ffn]}),
         (2 * expert_ffn, h)),
        (p + "moe.shared.down.weight", at({"kind": "partitioned", "dim": 1}), (h, expert_ffn)),
        (p + "moe.shared.gate.weight", at(rep), (1, h)),
        (p + "moe.norm.weight", at(rep), (h,)),
        (p + "layer_scale.attn", at(rep), (h,)),
        (p + "layer_scale.mlp", at(rep), (h,)),
    ]
    return out


def model_records(layers: int, h=1024, heads=16, kv_heads=8, head_dim=64, ffn=4096, experts=8, expert_ffn=512,
                  vocab=32000):
    params = [("embedding.weight", {"kind": "vocab", "original_size": vocab,
                                    "placement": {"stages": ["first", "last"]}}, (vocab, h))]
    for i in range(layers):
        params += layer_params(i, h, heads, kv_heads, head_dim, ffn, experts, expert_ffn)
    params.append(("final_norm.weight", {"kind": "replicated", "placement": {"stages": ["last"]}}, (h,)))
    recs = []
    for name, pj, shape in params:
        chunk = (min(shape[0], 256),) + tuple(shape[1:])  # chunk shapes only feed the counts here
        for state in STATES:
            recs.append({"name": name, "state": state, "shape": shape, "pattern": pj, "chunk_shape": chunk,
                         "dtype": "bfloat16" if state == "weight" else "float32"})
    return recs


# ---------------------------------------------------------------------- part 1: plan time
def _topologies(layers: int) -> list[tuple[str, Topology]]:
    return [
        ("tp8 pp8 dp16 zero1 ep8 (1024 ranks)", Topology(tp=8, pp=8, dp=16, zero_stage=1, ep=8, layers=layers)),
        ("tp4 pp1 dp8 zero3 (32 ranks)", Topology(tp=4, dp=8, zero_stage=3, layers=layers)),
        ("tp1 pp1 dp1 zero0 (1 rank)", Topology(layers=layers)),
        # targets of the TP changes 1 -> 8 and 8 -> 2 (this model's 16 heads do not split over
        # tp=3; uneven TP=3 plans are timed end to end in bench_reshard.py)
        ("tp8 (8 ranks)", Topology(tp=8, layers=layers)),
        ("tp2 (2 ranks)", Topology(tp=2, layers=layers)),
        ("tp8 pp16 dp4 zero2 sp2 (1024 ranks)", Topology(tp=8, pp=16, dp=4, sp=2, zero_stage=2, layers=layers)),
    ]


def catalog_store(root: str, recs: list[dict], catalog: str | None = None):
    """``(store, ref, drop)``: a store whose catalog lists ``recs`` as one committed checkpoint ``ref``, as
    catalog rows only, and a function deleting those rows again (a PostgreSQL catalog outlives the run).

    Planning reads no array, so none is written (100k real arrays would take hours to write here); the
    rows are what a save commits (``tensors.layer`` included), inserted in one transaction."""
    import datetime as dt

    from sqlalchemy import delete, insert

    import ucp_store
    from ucp_store.catalog import models as m
    from ucp_store.save.writer import layer_of as _layer_of

    store = ucp_store.open_store(root, create=True, catalog=catalog)
    now = dt.datetime.now(dt.UTC)
    cid = m.new_id()  # fresh ids and run name: the catalog may hold an earlier run's rows
    run_name = f"bench-{cid}"
    arrays, tensors = [], []
    for pos, r in enumerate(recs):
        aid = f"{cid}{pos:016x}"
        arrays.append(dict(id=aid, path=f"arrays/bench/{aid}", dtype=r["dtype"], shape=list(r["shape"]),
                           chunk_shape=list(r["chunk_shape"]), shard_shape=list(r["shape"]),
                           codecs=[{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                           nbytes=0, content_hash=None, created_at=now, status="ready"))
        tensors.append(dict(checkpoint_id=cid, name=r["name"], state=r["state"], array_id=aid,
                            shape=list(r["shape"]), dtype=r["dtype"], pattern=r["pattern"], nbytes=0,
                            content_hash="none", position=pos, layer=_layer_of(r["pattern"])))
    with store.catalog.write_session() as s:
        run = m.Run(name=run_name)
        s.add(run)
        s.flush()
        s.add(m.Checkpoint(id=cid, run_id=run.id, step=1, status="committed", committed_at=now,
                           format_version=1))
        s.flush()
        s.execute(insert(m.Array), arrays)
        s.execute(insert(m.Tensor), tensors)

    def drop() -> None:
        with store.catalog.write_session() as s:
            s.execute(delete(m.Tensor).where(m.Tensor.checkpoint_id == cid))
            s.execute(delete(m.Checkpoint).where(m.Checkpoint.id == cid))
            s.execute(delete(m.Array).where(m.Array.id.startswith(cid)))
            s.execute(delete(m.Run).where(m.Run.name == run_name))
        store.catalog.close()

    return store, f"{run_name}@1", drop


def per_read_seconds(arrays: int = 1000, fresh: bool = False) -> float:
    """Seconds per read of ``load_shard`` here, from a real store of ``arrays`` small arrays (64 KiB) loaded
    by a ZeRO-3 rank: one read per array, so the figure holds TensorStore's open and read overhead,
    which a rank holding many small fragments pays on top of the bytes. ``fresh``: drop the per-process
    held local readers before each load (a process's first load of these arrays)."""
    import tempfile

    import torch

    import ucp_store

    with tempfile.TemporaryDirectory() as tmp:
        store = ucp_store.open_store(f"{tmp}/s", create=True)
        with store.begin("r", 1) as w:
            for i in range(arrays):
                w.write(f"layers.{i}.w", "fp32", torch.randn(128, 128),
                        pattern={"kind": "partitioned", "dim": 0, "placement": {"layer": i}})
        topo = Topology(dp=4, zero_stage=3, layers=arrays)
        best = math.inf
        for _ in range(3):
            ck = store.checkpoint("r@1")
            if fresh:
                from ucp_store.io import read as io
                io._held.clear()
            t0 = time.perf_counter()
            shard = ck.load_shard(topo, 1)
            best = min(best, (time.perf_counter() - t0) / shard.plan.num_reads)
        store.catalog.close()
    return best


def bench_plan_time(layers: int, repeats: int, load_gbps: float, catalog: str | None, label: str,
                    read_s: float) -> None:
    """What ``Checkpoint.load_shard`` pays before its first read, per rank: fetch the rank's rows from the
    catalog (a fresh ``Checkpoint``, nothing cached) and plan them with cold caches (every parse and layout
    afresh). Each includes the young-generation collection its allocations leave due (both pause the
    collector while building, so that collection comes after they return). Loads are modelled, not run
    (the model's arrays would hold 400 GB): ``bw`` is the rank's bytes at ``load_gbps``, a lower bound;
    ``bw+reads`` adds ``read_s`` per read, measured in this run on a real store (each tensor-state is its
    own array, so a rank opens and reads one array per read)."""
    import gc
    import tempfile

    recs = model_records(layers)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        store, ref, drop = catalog_store(f"{tmp}/store", recs, catalog)
        print(f"\nPlan time ({label} catalog): {layers} layers, {len(recs):,} tensor rows (inserted in "
              f"{time.perf_counter() - t0:.1f} s); best of {repeats}; load at {load_gbps} GB/s, "
              f"+{read_s * 1e6:.0f} us per read for bw+reads")
        del recs
        header = (f"{'topology':38} {'rank':>4} {'rows':>7} {'planned':>7} {'reads':>7} {'fetch s':>7} "
                  f"{'plan s':>6} {'us/row':>6} {'GB need':>7} | {'plan/load bw':>12} {'all/load bw':>11} | "
                  f"{'plan/load bw+reads':>18} {'all/load bw+reads':>17}")
        print(header)
        print("-" * len(header))
        for name, t in _topologies(layers):
            for rank in sorted({0, t.world_size - 1}):
                best = (math.inf, math.inf)
                p = rows = None
                for _ in range(repeats):
                    p = rows = None  # the previous result is freed outside the timed region
                    patterns.clear_caches()
                    gc.collect()
                    ck = store.checkpoint(ref)
                    t0 = time.perf_counter()
                    rows = ck.plan_records(t, rank)
                    gc.collect(1)  # the collection the fetched rows leave due: charged to the fetch
                    t1 = time.perf_counter()
                    p = plan(rows, t, rank)
                    gc.collect(1)  # and the one the plan's allocations leave due
                    t2 = time.perf_counter()
                    if t2 - t0 < sum(best):
                        best = (t1 - t0, t2 - t1)
                fetch, plan_s = best
                bw = p.bytes_needed / (load_gbps * 1e9)
                model = bw + p.num_reads * read_s
                print(f"{name:38} {rank:>4} {len(rows):>7,} {len(p.tensors):>7,} {p.num_reads:>7,} {fetch:>7.3f} "
                      f"{plan_s:>6.3f} {plan_s / len(rows) * 1e6:>6.1f} {p.bytes_needed / 1e9:>7.2f} | "
                      f"{plan_s / bw:>12.2%} {(fetch + plan_s) / bw:>11.2%} | "
                      f"{plan_s / model:>18.2%} {(fetch + plan_s) / model:>17.2%}")
        drop()


def bench_real_load(layers: int, repeats: int) -> None:
    """End to end on a real store: the same model shape with small dimensions (every tensor-state its own
    array, ``layers * 100`` of them), written for real, then each rank loaded by ``load_shard``'s steps
    (catalog fetch, plan, execute) and the plan's share of the whole measured."""
    import gc
    import tempfile

    import torch

    import ucp_store
    from ucp_store.io.read import execute

    dims = dict(h=64, heads=8, kv_heads=8, head_dim=8, ffn=256, experts=8, expert_ffn=32, vocab=4096)
    recs = model_records(layers, **dims)
    with tempfile.TemporaryDirectory() as tmp:
        store = ucp_store.open_store(f"{tmp}/store", create=True)
        g = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        with store.begin("real", 1) as w:
            for r in recs:
                x = torch.randn(*r["shape"], generator=g)
                w.write(r["name"], r["state"], x.bfloat16() if r["state"] == "weight" else x, pattern=r["pattern"])
        print(f"\nEnd to end on a real store: {layers} layers with h={dims['h']}, {len(recs):,} arrays written in "
              f"{time.perf_counter() - t0:.0f} s; each rank: fetch, plan, execute (best of {repeats})")
        header = (f"{'topology':38} {'rank':>4} {'rows':>6} {'reads':>6} {'MB':>6} {'fetch s':>7} {'plan s':>6} "
                  f"{'load s':>6} {'plan/load':>9} {'fetch+plan/load':>15}")
        print(header)
        print("-" * len(header))
        for name, t in _topologies(layers):
            rank = t.world_size - 1
            best = None
            for _ in range(repeats):
                patterns.clear_caches()
                gc.collect()
                ck = store.checkpoint("real@1")
                t0 = time.perf_counter()
                rows = ck.plan_records(t, rank)
                t1 = time.perf_counter()
                p = plan(rows, t, rank)
                t2 = time.perf_counter()
                shard = execute(ck, p, infos=rows)
                t3 = time.perf_counter()
                if best is None or t3 - t0 < best[3] - best[0]:
                    best = (t0, t1, t2, t3, p)
                del shard
            t0, t1, t2, t3, p = best
            print(f"{name:38} {rank:>4} {len(rows):>6,} {p.num_reads:>6,} {p.bytes_needed / 1e6:>6.1f} {t1 - t0:>7.3f} "
                  f"{t2 - t1:>6.3f} {t3 - t0:>6.3f} {(t2 - t1) / (t3 - t0):>9.2%} {(t2 - t0) / (t3 - t0):>15.2%}")
        store.catalog.close()


# ---------------------------------------------------------------------- part 2: read amplification
def llama_layer(uneven_tp: int | None):
    return layer_params(0, 4096, 32, 8, 128, 11008, 8, 1792, uneven_tp=uneven_tp)[:14] + [
        ("embedding.weight", {"kind": "vocab", "original_size": 32000}, (32000, 4096))]


def byte_target_chunk(shape, align, itemsize, target=1 * MIB):
    """Chunk extents from per-dim alignment units: split dims keep a divisor of their unit (so every
    aligned boundary stays a chunk edge), and the leading dim is thinned first, because ZeRO fragments
    cut the row-major flattening inside rows and a thin chunk bounds what a partial row over-reads."""
    chunk = [max(1, min(a, n)) for a, n in zip(align, shape)]

    def too_big():
        return math.prod(chunk) * itemsize > target

    # ZeRO fragments are row ranges of the TP-local tensor: keep a chunk under 1/16 of the rows when the
    # alignment allows, so that a fragment over-reads at most a thin slab at each end
    if shape and shape[0] >= 64:
        while chunk[0] > shape[0] // 16 and chunk[0] % 2 == 0:
            chunk[0] //= 2
    for d in range(len(shape)):
        while too_big() and chunk[d] > 1:
            p = next(q for q in range(2, chunk[d] + 1) if chunk[d] % q == 0)  # smallest prime factor
            if p == chunk[d] and p > 64:  # a large prime extent: plain ceil-division (loses alignment)
                chunk[d] = -(-chunk[d] // -(-math.prod(chunk) * itemsize // target))
            else:
                chunk[d] //= p
    return tuple(chunk)


def pow2_align(pattern, shape):
    """A chunking that ignores the topologies: every power-of-two split <= 64 of the split dims."""
    out = []
    for d, n in enumerate(shape):
        unit = n
        for _ in range(6):
            if unit % 2:
                break
            unit //= 2
        out.append(unit if d == 0 or (pattern or {}).get("dim") == d else n)
    return tuple(out)


def amplification(src: Topology, tgt: Topology, aligned: bool) -> tuple[float, float, int]:
    uneven = next((t.tp for t in (src, tgt) if t.tp not in (1, 2, 4, 8)), None)
    params = llama_layer(uneven)
    recs = []
    for name, pj, shape in params:
        align = chunk_alignment(pj, shape, [src, tgt], itemsize=4) if aligned else pow2_align(pj, shape)
        recs.append({"name": name, "state": "fp32", "shape": shape, "pattern": pj, "dtype": "float32",
                     "chunk_shape": byte_target_chunk(shape, align, 4)})
    needed = read = chunks = 0
    for rank in range(tgt.world_size):
        p = plan(recs, tgt, rank)
        needed += p.bytes_needed
        read += p.bytes_read
        chunks += p.chunks_touched
    return read / needed, read / 1e9, chunks


def bench_amplification() -> None:
    cases = [
        ("TP 1 -> 8", Topology(tp=1), Topology(tp=8)),
        ("TP 8 -> 2", Topology(tp=8), Topology(tp=2)),
        ("TP 4 -> 3 (uneven)", Topology(tp=4), Topology(tp=3)),
        ("TP 2 -> 8, ZeRO-1 dp=4", Topology(tp=2), Topology(tp=8, dp=4, zero_stage=1)),
        ("TP 4 -> 3, ZeRO-3 dp=2", Topology(tp=4), Topology(tp=3, dp=2, zero_stage=3)),
    ]
    print("\nRead amplification (bytes read / bytes needed, all target ranks), one Llama-7B-like layer + "
          "embedding, fp32, ~1 MiB chunks")
    header = (f"{'change':26} {'aligned':>9} {'GB read':>8} {'chunks':>7}   "
              f"{'pow2 only':>9} {'GB read':>8} {'chunks':>7}")
    print(header)
    print("-" * len(header))
    for label, src, tgt in cases:
        a, ga, ca = amplification(src, tgt, True)
        b, gb, cb = amplification(src, tgt, False)
        print(f"{label:26} {a:>9.3f} {ga:>8.2f} {ca:>7}   {b:>9.3f} {gb:>8.2f} {cb:>7}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one repeat")
    ap.add_argument("--load-gbps", type=float, default=1.0,
                    help="load rate for plan/load (default 1.0: above the 0.4-0.65 GB/s bench_reshard.py "
                         "measures here, so the ratio errs high)")
    ap.add_argument("--postgres-url", default=None,
                    help="also fetch from this PostgreSQL catalog (rows go in under a fresh run name and are "
                         "deleted after)")
    ap.add_argument("--real-layers", type=int, default=100,
                    help="layers of the small-dimension model written to a real store and loaded end to end "
                         "(0: skip; 100 layers = 10k arrays, about a minute to write)")
    args = ap.parse_args()
    deepest = max(t.pp for _, t in _topologies(10**6))
    if args.layers < deepest or 0 < args.real_layers < deepest:
        ap.error(f"--layers and --real-layers (unless 0) must be >= {deepest}: the deepest topology has pp={deepest}")
    t0 = time.perf_counter()
    repeats = 1 if args.quick else args.repeats
    read_s = per_read_seconds()
    bench_plan_time(args.layers, repeats, args.load_gbps, None, "SQLite", read_s)
    if args.postgres_url:
        bench_plan_time(args.layers, repeats, args.load_gbps, args.postgres_url, "PostgreSQL", read_s)
    if args.real_layers:
        bench_real_load(args.real_layers, repeats)
    bench_amplification()
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
