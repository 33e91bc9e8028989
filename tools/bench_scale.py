"""Scale harness (issue 27 item 4): what one checkpoint of a real-size model costs the catalog, the coordinator
and each rank, at up to 8,192 ranks.

    .venv/bin/python tools/bench_scale.py synthetic                     # SQLite only (about 10 min on 2 cores)
    .venv/bin/python tools/bench_scale.py synthetic --models llama405b --repeats 1
    .venv/bin/python tools/bench_scale.py synthetic \\
        --postgres-url postgresql+psycopg2://ucp:ucp@127.0.0.1:5432/ucp_test
    .venv/bin/python tools/bench_scale.py ranks ...                      # real N-rank runs (see run_ranks)

``synthetic``: catalogs of real sizes, as catalog rows with no array data. Each model's rows (the array and
tensor rows a save records, with the layouts ``format.plan_layout`` gives the real shapes under the store's
chunk policy) are committed through the real commit path (``Store.begin`` then ``CheckpointWriter.commit(
extra_rows=...)``: what a distributed save's coordinator runs with every rank's rows) on SQLite and, with
``--postgres-url``, on PostgreSQL (under a fresh run name, deleted after). Then, per model:

- the coordinator's fetch of every row (``Checkpoint._fetch_infos``) and of one pipeline stage's rows;
- the size of those rows in a compact, non-pickle encoding a coordinator could broadcast (``encode_rows``:
  JSON with every distinct shape, pattern and codec chain sent once, then zlib level 1), and its
  encode/decode times;
- per-rank planning with cold caches (``planner.plan`` for a ``Topology``, ``planner.plan_mesh`` for a
  DTensor mesh), on all rows (what a rank plans from after one broadcast);
- files and objects per checkpoint (shard files + one ``zarr.json`` per array) and per rank (shard files
  its load reads, and the reads it issues).

Models (``MODELS``): Llama-3-405B (126 layers, hidden 16384, ffn 53248, 128 heads / 8 kv heads, vocab
128256: 1,137 tensors) and DeepSeek-V3 (61 layers, the first 3 dense, 58 MoE layers of 256 routed experts
+ 1 shared, MLA projections, hidden 7168, moe ffn 2048, dense ffn 18432, vocab 129280) with per-expert
tensors (45,395 tensors) and with fused ``[256, ...]`` expert tensors (1,091 tensors); each tensor as three
fp32 states (``fp32``, ``exp_avg``, ``exp_avg_sq``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable
from typing import Any

STATES = ("fp32", "exp_avg", "exp_avg_sq")
REP: dict[str, Any] = {"kind": "replicated"}
COL: dict[str, Any] = {"kind": "partitioned", "dim": 0}
ROW: dict[str, Any] = {"kind": "partitioned", "dim": 1}


def _at(pattern: dict, layer: int) -> dict:
    return {**pattern, "placement": {"layer": layer}}


# ---------------------------------------------------------------------- models: (name, shape, pattern)
def llama405b() -> list[tuple[str, tuple[int, ...], dict]]:
    h, ffn, heads, kv_heads, vocab, layers = 16384, 53248, 128, 8, 128256, 126
    hd = h // heads
    out: list[tuple[str, tuple[int, ...], dict]] = [
        ("model.embed_tokens.weight", (vocab, h),
         {"kind": "vocab", "original_size": vocab, "placement": {"stages": ["first"]}})]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,), _at(REP, i)),
            (p + "self_attn.q_proj.weight", (heads * hd, h), _at(COL, i)),
            (p + "self_attn.k_proj.weight", (kv_heads * hd, h), _at(COL, i)),
            (p + "self_attn.v_proj.weight", (kv_heads * hd, h), _at(COL, i)),
            (p + "self_attn.o_proj.weight", (h, heads * hd), _at(ROW, i)),
            (p + "post_attention_layernorm.weight", (h,), _at(REP, i)),
            (p + "mlp.gate_proj.weight", (ffn, h), _at(COL, i)),
            (p + "mlp.up_proj.weight", (ffn, h), _at(COL, i)),
            (p + "mlp.down_proj.weight", (h, ffn), _at(ROW, i)),
        ]
    return out + _head(h, vocab)


def _head(h: int, vocab: int) -> list[tuple[str, tuple[int, ...], dict]]:
    last = {"stages": ["last"]}
    return [("model.norm.weight", (h,), {"kind": "replicated", "placement": last}),
            ("lm_head.weight", (vocab, h), {"kind": "vocab", "original_size": vocab, "placement": last})]


def _mla(p: str, i: int, h: int) -> list[tuple[str, tuple[int, ...], dict]]:
    """DeepSeek-V3's multi-head latent attention (q_lora 1536, kv_lora 512, 128 heads of nope 128 + rope 64,
    v 128): the low-rank A projections replicated over TP, the B projections and o_proj split by heads."""
    heads, q_lora, kv_lora, nope, rope, v = 128, 1536, 512, 128, 64, 128
    return [
        (p + "input_layernorm.weight", (h,), _at(REP, i)),
        (p + "self_attn.q_a_proj.weight", (q_lora, h), _at(REP, i)),
        (p + "self_attn.q_a_layernorm.weight", (q_lora,), _at(REP, i)),
        (p + "self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora), _at(COL, i)),
        (p + "self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, h), _at(REP, i)),
        (p + "self_attn.kv_a_layernorm.weight", (kv_lora,), _at(REP, i)),
        (p + "self_attn.kv_b_proj.weight", (heads * (nope + v), kv_lora), _at(COL, i)),
        (p + "self_attn.o_proj.weight", (h, heads * v), _at(ROW, i)),
        (p + "post_attention_layernorm.weight", (h,), _at(REP, i)),
    ]


def deepseek_v3(fused: bool) -> list[tuple[str, tuple[int, ...], dict]]:
    h, moe_ffn, dense_ffn, vocab, layers, dense_layers, experts = 7168, 2048, 18432, 129280, 61, 3, 256
    out: list[tuple[str, tuple[int, ...], dict]] = [
        ("model.embed_tokens.weight", (vocab, h),
         {"kind": "vocab", "original_size": vocab, "placement": {"stages": ["first"]}})]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += _mla(p, i, h)
        if i < dense_layers:
            out += [(p + "mlp.gate_proj.weight", (dense_ffn, h), _at(COL, i)),
                    (p + "mlp.up_proj.weight", (dense_ffn, h), _at(COL, i)),
                    (p + "mlp.down_proj.weight", (h, dense_ffn), _at(ROW, i))]
            continue
        out += [(p + "mlp.gate.weight", (experts, h), _at(REP, i)),
                (p + "mlp.gate.e_score_correction_bias", (experts,), _at(REP, i)),
                (p + "mlp.shared_experts.gate_proj.weight", (moe_ffn, h), _at(COL, i)),
                (p + "mlp.shared_experts.up_proj.weight", (moe_ffn, h), _at(COL, i)),
                (p + "mlp.shared_experts.down_proj.weight", (h, moe_ffn), _at(ROW, i))]
        if fused:
            for w, shape, inner in (("gate_proj", (experts, moe_ffn, h), COL), ("up_proj", (experts, moe_ffn, h), COL),
                                    ("down_proj", (experts, h, moe_ffn), ROW)):
                out.append((p + f"mlp.experts.{w}", shape,
                            _at({"kind": "expert", "num_experts": experts, "inner": inner}, i)))
            continue
        group = p + "mlp.experts"
        for e in range(experts):
            for w, shape, inner in (("gate_proj", (moe_ffn, h), COL), ("up_proj", (moe_ffn, h), COL),
                                    ("down_proj", (h, moe_ffn), ROW)):
                out.append((p + f"mlp.experts.{e}.{w}.weight", shape,
                            _at({"kind": "expert_member", "expert": e, "num_experts": experts, "group": group,
                                 "inner": inner}, i)))
    return out + _head(h, vocab)


MODELS: dict[str, Callable[[], list[tuple[str, tuple[int, ...], dict]]]] = {
    "llama405b": llama405b,
    "deepseekv3": lambda: deepseek_v3(fused=False),
    "deepseekv3-fused": lambda: deepseek_v3(fused=True),
}
LAYERS = {"llama405b": 126, "deepseekv3": 61, "deepseekv3-fused": 61}


# ---------------------------------------------------------------------- targets
def topologies(model: str) -> list[tuple[str, Any]]:
    from ucp_store.topology import Topology

    layers = LAYERS[model]
    out = [("TP8 x PP16 x DP64, ZeRO-1 (8,192 ranks)", Topology(tp=8, pp=16, dp=64, zero_stage=1, layers=layers))]
    if model.startswith("deepseekv3"):
        out.append(("TP8 x PP16 x DP64 EP64, ZeRO-1 (8,192 ranks)",
                    Topology(tp=8, pp=16, dp=64, ep=64, zero_stage=1, layers=layers)))
    out.append(("TP8 x PP8 x DP16, ZeRO-1 (1,024 ranks)", Topology(tp=8, pp=8, dp=16, zero_stage=1, layers=layers)))
    return out


#: DTensor meshes (row-major, as init_device_mesh): FSDP2 over TP for every model, and for the fused MoE an
#: expert-parallel dim beside them (torchtitan's dp_shard x ep x tp); 8,192 ranks each
MESHES: dict[str, dict[str, Any]] = {"llama405b": {"shape": [1024, 8], "dims": ["dp", "tp"]},
          "deepseekv3": {"shape": [1024, 8], "dims": ["dp", "tp"]},
          "deepseekv3-fused": {"shape": [16, 64, 8], "dims": ["dp", "ep", "tp"]}}


def dtensor_pattern(pattern: dict, mesh: dict) -> dict:
    """The ``dtensor`` pattern ``ucp_store.distributed.save`` records for a tensor laid out like ``pattern`` on
    ``mesh``: FSDP2 shards dim 0 over ``dp`` (strided when TP shards dim 0 too), TP shards a column-parallel weight's
    dim 0 and a row-parallel one's dim 1, ``ep`` shards a fused expert tensor's expert dim."""
    kind = pattern.get("kind")
    inner = pattern.get("inner", pattern) if kind in ("expert", "expert_member") else pattern
    expert_dim = 1 if kind == "expert" else 0
    tp_dim = (inner.get("dim", 0) + expert_dim) if inner.get("kind") == "partitioned" else (
        0 if kind == "vocab" else None)
    placements = []
    for d in mesh["dims"]:
        if d == "tp":
            placements.append({"type": "replicate"} if tp_dim is None else {"type": "shard", "dim": tp_dim})
        elif d == "ep":
            placements.append({"type": "shard", "dim": 0} if kind == "expert" else {"type": "replicate"})
        else:  # dp: FSDP2 dim 0 (the dim after the expert dim of a fused expert tensor sharded by ep)
            fsdp_dim = expert_dim if "ep" in mesh["dims"] else 0
            strided = tp_dim == fsdp_dim
            placements.append({"type": "strided_shard", "dim": fsdp_dim, "split_factor": mesh["shape"][-1]}
                              if strided else {"type": "shard", "dim": fsdp_dim})
    return {"kind": "dtensor", "mesh": mesh, "placements": placements, "placement": pattern.get("placement")}


def mesh_records(infos: Iterable[Any], mesh: dict) -> list[dict]:
    """The rows of ``infos`` with the ``dtensor`` patterns a DTensor save on ``mesh`` records (planning only)."""
    memo: dict[str, dict] = {}  # equal patterns are one object, as the catalog fetch hands them out
    out = []
    for i in infos:
        pat = {k: v for k, v in dtensor_pattern(i.pattern, mesh).items() if k != "placement"}
        pat = memo.setdefault(json.dumps(pat, sort_keys=True), pat)
        out.append({"name": i.name, "state": i.state, "shape": i.shape, "dtype": i.dtype, "pattern": pat,
                    "chunk_shape": i.chunk_shape})
    return out


# ---------------------------------------------------------------------- catalog rows
def catalog_rows(params: list[tuple[str, tuple[int, ...], dict]], ck_id: str, target_bytes: int) -> list[dict]:
    """The array and tensor rows a save of ``params`` (three fp32 states each) records under checkpoint
    ``ck_id``, in ``row_to_dict`` form (what a joined rank hands its coordinator): real layouts from the
    store's chunk policy, a content hash of the real scheme's length per array (every array distinct)."""
    from ucp_store.catalog.models import new_id
    from ucp_store.io import format as fmt
    from ucp_store.io.location import array_path
    from ucp_store.save.writer import layer_of

    layouts: dict[tuple, tuple] = {}
    rows: list[dict] = []
    position = 0
    for name, shape, pattern in params:
        key = (shape, json.dumps({k: v for k, v in pattern.items() if k not in ("placement", "expert", "group")},
                                 sort_keys=True))
        lay = layouts.get(key)
        if lay is None:
            layout = fmt.plan_layout(shape, "float32", pattern=pattern, target_bytes=target_bytes)
            lay = layouts[key] = (list(layout.shape), list(layout.chunk_shape), list(layout.shard_shape),
                                  layout.codecs(), layout.nbytes)
        layer = layer_of(pattern)
        for state in STATES:
            aid = new_id(32)
            digest = "xxh3-128-units:" + new_id(32)
            rows.append({"_table": "array", "id": aid, "path": array_path(ck_id, aid), "dtype": "float32",
                         "shape": lay[0], "chunk_shape": lay[1], "shard_shape": lay[2], "codecs": lay[3],
                         "nbytes": lay[4], "content_hash": digest, "status": "ready"})
            rows.append({"_table": "tensor", "checkpoint_id": ck_id, "name": name, "state": state, "array_id": aid,
                         "shape": lay[0], "dtype": "float32", "pattern": pattern, "nbytes": lay[4],
                         "content_hash": digest, "position": position, "layer": layer})
            position += 1
    return rows


def _server_cpu(store) -> tuple[int | None, float]:
    """The PostgreSQL backend serving this store's (one pooled) connection, and its CPU seconds so far, when
    the server runs on this machine (``/proc``); ``(None, 0)`` otherwise."""
    if store.catalog.dialect != "postgresql":
        return None, 0.0
    with store.catalog.engine.connect() as conn:
        pid = int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar())
    return pid, _cpu_of(pid)


def _cpu_of(pid: int | None) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, TypeError):
        return math.nan


def commit_rows(store, run: str, params, target_bytes: int) -> dict:
    """Begin a version, build its rows, and commit them all through ``CheckpointWriter.commit(extra_rows=)``:
    the checkpoint id, row count, begin and commit wall seconds, and the commit's CPU seconds in this process
    and (a local PostgreSQL) in the server backend: on a loaded machine wall time also holds waits for a core."""
    t0 = time.perf_counter()
    w = store.begin(run, 1)
    t1 = time.perf_counter()
    rows = catalog_rows(params, w.id, target_bytes)
    gc.collect()
    pid, server0 = _server_cpu(store)
    c0, t2 = time.process_time(), time.perf_counter()
    w.commit(extra_rows=rows, reload=False)
    t3, c1 = time.perf_counter(), time.process_time()
    server = _cpu_of(pid) - server0 if pid is not None else None
    return {"id": w.id, "rows": len(rows), "begin_s": t1 - t0, "commit_s": t3 - t2, "commit_cpu_s": c1 - c0,
            "commit_server_cpu_s": server, "loadavg": os.getloadavg()[0]}


def drop_version(store, ck_id: str, run: str) -> None:
    """Delete a benchmark version's rows (a PostgreSQL catalog outlives the run; no array was written)."""
    from sqlalchemy import delete

    from ucp_store.catalog import models as m

    with store.catalog.write_session() as s:
        s.execute(delete(m.Tensor).where(m.Tensor.checkpoint_id == ck_id))
        s.execute(delete(m.StoredObject).where(m.StoredObject.checkpoint_id == ck_id))
        s.execute(delete(m.Provenance).where(m.Provenance.checkpoint_id == ck_id))
        s.execute(delete(m.Checkpoint).where(m.Checkpoint.id == ck_id))
        s.execute(delete(m.Array).where(m.Array.path.startswith(f"arrays/{ck_id}/")))
        s.execute(delete(m.Run).where(m.Run.name == run))


# ---------------------------------------------------------------------- the broadcast encoding
def encode_rows(infos: list[Any]) -> bytes:
    """A compact, non-pickle encoding of a version's tensor rows, as a coordinator could broadcast them:
    JSON with every distinct value of the repetitive columns (shape, dtype, pattern, chunk and shard shapes,
    codec chain, array folder) sent once in a table and rows holding indices, then zlib level 1."""
    tables: dict[str, dict[str, int]] = {k: {} for k in ("shape", "dtype", "pattern", "codecs", "folder")}

    def index(kind: str, value: Any) -> int:
        table = tables[kind]
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), sort_keys=True)
        found = table.get(text)
        if found is None:
            found = table[text] = len(table)
        return found

    memo: dict[int, int] = {}  # patterns and tuples are shared objects across rows: index each once

    def shared(kind: str, value: Any) -> int:
        found = memo.get(id(value))
        if found is None:
            found = memo[id(value)] = index(kind, value)
        return found

    rows = []
    for i in infos:
        folder, _, leaf = i.array.rpartition("/")
        rows.append([i.name, i.state, shared("shape", i.shape), index("dtype", i.dtype), shared("pattern", i.pattern),
                     shared("shape", i.chunk_shape), shared("shape", i.shard_shape), index("folder", folder), leaf,
                     i.array_id, shared("codecs", i.codecs), i.nbytes, i.content_hash, i.position])
    doc = {k: list(v) for k, v in tables.items()}
    doc["rows"] = rows  # type: ignore[assignment]
    return zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 1)


def decode_rows(blob: bytes) -> list[Any]:
    """The ``TensorInfo`` rows of :func:`encode_rows` (equal values decoded once, shared as the fetch shares them)."""
    from ucp_store.records import TensorInfo

    doc = json.loads(zlib.decompress(blob))
    shapes = [tuple(json.loads(s)) for s in doc["shape"]]
    patterns = [json.loads(p) for p in doc["pattern"]]
    codecs = [json.loads(c) for c in doc["codecs"]]
    dtypes, folders = doc["dtype"], doc["folder"]
    make = TensorInfo.from_catalog
    return [make(n, st, shapes[sh], dtypes[dt], patterns[pa], shapes[ch], shapes[sd], f"{folders[fo]}/{leaf}", aid,
                 codecs[co], nb, h, pos)
            for n, st, sh, dt, pa, ch, sd, fo, leaf, aid, co, nb, h, pos in doc["rows"]]


# ---------------------------------------------------------------------- files and objects
def shard_files(shape: tuple[int, ...], shard: tuple[int, ...]) -> int:
    return math.prod(-(-n // s) for n, s in zip(shape, shard)) if shape else 1


def plan_files(p, infos_by_key: dict) -> int:
    """Distinct shard files the reads of plan ``p`` touch."""
    files: set = set()
    for t in p.tensors:
        info = infos_by_key[(t.name, t.state)]
        shard = info.shard_shape
        for r in t.reads:
            ranges = [range(a // s, -(-b // s)) for (a, b), s in zip(r.box.ranges, shard)]
            for idx in _product(ranges):
                files.add((info.array_id, idx))
    return len(files)


def _product(ranges: list[range]):
    import itertools

    return itertools.product(*ranges)


# ---------------------------------------------------------------------- measurements
#: CPU seconds of the fastest run of the last best_of call: on a shared machine, wall time also counts waits
#: for a core, and single-threaded work's CPU time is what it takes on a core of its own
LAST_CPU: list[float] = [math.nan]


def best_of(repeats: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """The fastest of ``repeats`` cold runs of ``fn`` (pattern caches cleared, garbage collected before each);
    its CPU seconds go to ``LAST_CPU``."""
    from ucp_store import patterns

    best, out = math.inf, None
    for _ in range(repeats):
        out = None
        patterns.clear_caches()
        gc.collect()
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if wall < best:
            best, LAST_CPU[0] = wall, cpu
    return best, out


def measure_catalog(model: str, params, root: str, catalog: str | None, label: str, repeats: int,
                    sqlalchemy_insert: bool = False) -> dict:
    """Commit the model's rows on one catalog, then time the coordinator's fetches; returns the figures and
    (under ``infos``) the fetched rows."""
    import ucp_store
    import ucp_store.save.writer
    from ucp_store.catalog.models import new_id

    store = ucp_store.open_store(root, create=True, catalog=catalog)
    if sqlalchemy_insert:  # the insert path before catalog/bulk.py, for comparison
        from sqlalchemy import event

        from ucp_store.catalog import bulk

        for factory in (store.catalog.session, store.catalog._write_session, store.catalog._lazy_write_session):
            event.remove(factory, "do_orm_execute", bulk._on_execute)
    run = f"bench-scale-{new_id()}"
    c = commit_rows(store, run, params, int(store.settings["chunk_target_bytes"]))
    ck_id = c.pop("id")
    ref = f"{run}@1"
    fetch_s, infos = best_of(repeats, lambda: store.checkpoint(ref)._fetch_infos())
    fetch_cpu = LAST_CPU[0]
    topo = topologies(model)[0][1]
    stage_s, stage_rows = best_of(repeats, lambda: store.checkpoint(ref).plan_records(topo, topo.world_size - 1))
    out = {"catalog": label, **c, "tensor_rows": len(infos), "fetch_all_s": fetch_s, "fetch_all_cpu_s": fetch_cpu,
           "fetch_stage_s": stage_s,
           "stage_rows": len(stage_rows), "infos": infos}
    if catalog is not None:
        drop_version(store, ck_id, run)
    store.catalog.close()
    return out


def measure_encoding(infos: list[Any], repeats: int) -> dict:
    plain = json.dumps([i.to_json() for i in infos], separators=(",", ":")).encode()
    enc_s, blob = best_of(repeats, lambda: encode_rows(infos))
    enc_cpu = LAST_CPU[0]
    dec_s, back = best_of(repeats, lambda: decode_rows(blob))
    dec_cpu = LAST_CPU[0]
    assert [(b.name, b.state, b.shape, b.pattern, b.array, b.codecs) for b in back] == \
        [(i.name, i.state, i.shape, i.pattern, i.array, i.codecs) for i in infos], "encoding does not round-trip"
    raw = len(zlib.decompress(blob))
    return {"json_per_row_bytes": len(plain), "interned_json_bytes": raw, "broadcast_bytes": len(blob),
            "encode_s": enc_s, "decode_s": dec_s, "encode_cpu_s": enc_cpu, "decode_cpu_s": dec_cpu}


def _sample_ranks(world: int) -> list[int]:
    return sorted({0, world // 2 + 3, world - 1})


def measure_planning(model: str, infos: list[Any], repeats: int) -> list[dict]:
    """Per-rank planning from every row (what a rank holds after one broadcast), with cold caches."""
    from ucp_store.plan.planner import plan, plan_mesh

    by_key = {(i.name, i.state): i for i in infos}
    out = []
    for label, topo in topologies(model):
        for rank in _sample_ranks(topo.world_size):
            s, p = best_of(repeats, lambda t=topo, r=rank: plan(infos, t, r))
            out.append({"target": label, "rank": rank, "plan_s": s, "plan_cpu_s": LAST_CPU[0],
                        "tensors": len(p.tensors), "reads": p.num_reads,
                        "files": plan_files(p, by_key), "gb_needed": p.bytes_needed / 1e9})
    mesh = MESHES[model]
    rows = mesh_records(infos, mesh)
    label = "DTensor mesh " + " x ".join(f"{d}={n}" for d, n in zip(mesh["dims"], mesh["shape"])) + \
        f" ({math.prod(mesh['shape']):,} ranks)"
    for rank in _sample_ranks(math.prod(mesh["shape"])):
        s, p = best_of(repeats, lambda r=rank: plan_mesh(rows, mesh, r))
        out.append({"target": label, "rank": rank, "plan_s": s, "plan_cpu_s": LAST_CPU[0],
                    "tensors": len(p.tensors), "reads": p.num_reads,
                    "files": plan_files(p, by_key), "gb_needed": p.bytes_needed / 1e9})
    return out


def checkpoint_files(infos: list[Any]) -> dict:
    shards = sum(shard_files(i.shape, i.shard_shape) for i in infos)
    return {"arrays": len(infos), "shard_files": shards, "objects": shards + len(infos),
            "tb": sum(i.nbytes for i in infos) / 1e12}


# ---------------------------------------------------------------------- report
def _machine() -> str:
    return f"{platform.node()}: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, " \
           f"Python {platform.python_version()}"


def run_synthetic(args: argparse.Namespace) -> dict:
    results: dict[str, Any] = {"machine": _machine(), "models": {}}
    for model in args.models:
        params = MODELS[model]()[:args.tensors]
        print(f"\n## {model}: {len(params):,} tensors x {len(STATES)} states", flush=True)
        figures: dict[str, Any] = {"tensors": len(params), "catalogs": []}
        infos = None
        with tempfile.TemporaryDirectory() as tmp:
            catalogs = [(None, "SQLite")] + ([(args.postgres_url, "PostgreSQL")] if args.postgres_url else [])
            for url, label in catalogs:
                c = measure_catalog(model, params, f"{tmp}/{label}", url, label, args.repeats, args.sqlalchemy_insert)
                fetched = c.pop("infos")
                infos = fetched if infos is None else infos
                figures["catalogs"].append(c)
                server = "" if c["commit_server_cpu_s"] is None else f" + server {c['commit_server_cpu_s']:.2f}"
                print(f"{label:10} rows {c['rows']:>8,}  begin {c['begin_s']:.3f} s  commit {c['commit_s']:7.2f} s "
                      f"(cpu {c['commit_cpu_s']:.2f}{server} s, load {c['loadavg']:.0f})  "
                      f"fetch all {c['tensor_rows']:,} rows {c['fetch_all_s']:.2f} s (cpu {c['fetch_all_cpu_s']:.2f})  "
                      f"fetch one stage ({c['stage_rows']:,} rows) {c['fetch_stage_s']:.3f} s", flush=True)
        assert infos is not None
        del params
        figures["files"] = checkpoint_files(infos)
        f = figures["files"]
        print(f"files: {f['arrays']:,} arrays, {f['shard_files']:,} shard files, {f['objects']:,} objects "
              f"(+ zarr.json each), {f['tb']:.2f} TB", flush=True)
        figures["encoding"] = e = measure_encoding(infos, args.repeats)
        print(f"broadcast: {e['broadcast_bytes'] / 1e6:.2f} MB (interned JSON {e['interned_json_bytes'] / 1e6:.1f} MB, "
              f"JSON per row {e['json_per_row_bytes'] / 1e6:.1f} MB); encode {e['encode_s']:.2f} s "
              f"(cpu {e['encode_cpu_s']:.2f}), decode {e['decode_s']:.2f} s (cpu {e['decode_cpu_s']:.2f})", flush=True)
        figures["maxrss_mb_after_fetch"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{'target':46} {'rank':>5} {'plan s':>7} {'cpu s':>6} {'tensors':>8} {'reads':>8} {'files':>7} "
              f"{'GB':>7}")
        figures["planning"] = []
        for r in measure_planning(model, infos, args.repeats):
            figures["planning"].append(r)
            print(f"{r['target']:46} {r['rank']:>5} {r['plan_s']:>7.3f} {r['plan_cpu_s']:>6.3f} {r['tensors']:>8,} "
                  f"{r['reads']:>8,} "
                  f"{r['files']:>7,} {r['gb_needed']:>7.2f}", flush=True)
        results["models"][model] = figures
        del infos
        gc.collect()
    return results


def _tree(n: int, nbytes: float, latency_s: float, gbps: float) -> float:
    """Seconds for a binomial-tree broadcast (or gather) of ``nbytes`` over ``n`` ranks, not pipelined: every
    one of the ceil(log2 n) rounds pays the latency and the whole payload at the link's rate."""
    return math.ceil(math.log2(max(n, 2))) * (latency_s + nbytes / (gbps * 1e9))


def model_rows(figures: dict, ranks: int, latency_s: float, gbps: float, wall: bool = False) -> dict:
    """The control path of one load and one save at ``ranks`` ranks, from one model's measured figures (see
    docs/scale.md): coordinator fetch + encode + one broadcast + per-rank decode + per-rank plan; per-rank
    plan + one gather of every rank's rows + one commit of every row + one broadcast of the outcome."""
    pg = next((c for c in figures["catalogs"] if c["catalog"] == "PostgreSQL"), figures["catalogs"][0])
    enc = figures["encoding"]
    cpu = "_s" if wall else "_cpu_s"  # CPU seconds: what the work takes on a core of its own
    world = 1024 if ranks <= 1024 else 8192
    plan_s = max(r["plan" + cpu] for r in figures["planning"] if f"({world:,} ranks)" in r["target"])
    fetch, encode, decode = pg["fetch_all" + cpu], enc["encode" + cpu], enc["decode" + cpu]
    # the commit's CPU in this process and in the server backend, run one after the other: an upper bound
    # on a machine where they overlap; the fsync at commit is not in it
    commit = pg["commit_s"] if wall else pg["commit_cpu_s"] + (pg["commit_server_cpu_s"] or 0.0)
    bcast = _tree(ranks, enc["broadcast_bytes"], latency_s, gbps)
    gather = _tree(ranks, 0, latency_s, gbps) + enc["json_per_row_bytes"] * 2 / (gbps * 1e9)
    load = fetch + encode + bcast + decode + plan_s
    save = plan_s + gather + commit + _tree(ranks, 64, latency_s, gbps)
    return {"ranks": ranks, "catalog": pg["catalog"], "fetch_s": fetch, "encode_s": encode, "broadcast_s": bcast,
            "decode_s": decode, "plan_s": plan_s, "load_s": load, "gather_s": gather, "commit_s": commit,
            "save_s": save}


def run_model(args: argparse.Namespace) -> dict:
    with open(args.figures) as f:
        measured = json.load(f)
    out: dict[str, Any] = {"machine": measured["machine"], "from": measured.get("command"), "rows": []}
    print(f"model from {args.figures} ({measured.get('command')}); {'wall' if args.wall else 'CPU'} seconds; "
          f"links: {args.latency_us:g} us, {args.gbps:g} GB/s per round of a binomial tree")
    print(f"{'model':18} {'ranks':>6} {'fetch':>6} {'encode':>6} {'bcast':>6} {'decode':>6} {'plan':>6} {'LOAD':>6} | "
          f"{'gather':>6} {'commit':>6} {'SAVE':>6}   (seconds)")
    for name, figures in measured["models"].items():
        for ranks in args.ranks:
            r = {"model": name, **model_rows(figures, ranks, args.latency_us * 1e-6, args.gbps, args.wall)}
            out["rows"].append(r)
            print(f"{name:18} {ranks:>6,} {r['fetch_s']:>6.2f} {r['encode_s']:>6.2f} {r['broadcast_s']:>6.2f} "
                  f"{r['decode_s']:>6.2f} {r['plan_s']:>6.2f} {r['load_s']:>6.2f} | {r['gather_s']:>6.2f} "
                  f"{r['commit_s']:>6.2f} {r['save_s']:>6.2f}")
    return out


def run_ranks(args: argparse.Namespace) -> dict:
    """Real N-rank runs: N processes saving and loading one store (PostgreSQL with max_connections lowered,
    and SQLite), per save and load: wall time, catalog connections, round trips, collectives, bytes
    broadcast. Lands with the one-catalog-client work of issue 27 (items 1, 2, 5)."""
    raise SystemExit("ucp: error: bench_scale.py ranks: not implemented yet (issue 27 items 1, 2, 5: the real N-rank "
                     "runs come with the one-catalog-client save and load)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    syn = sub.add_parser("synthetic", help="synthetic catalogs of real model sizes: commit, fetch, broadcast size, "
                                           "per-rank planning, files")
    syn.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    syn.add_argument("--repeats", type=int, default=3, help="timed repeats; the best is reported (default 3)")
    syn.add_argument("--postgres-url", default=None,
                     help="also commit and fetch on this PostgreSQL catalog (rows deleted after)")
    syn.add_argument("--tensors", type=int, default=None,
                     help="keep only each model's first N tensors (e.g. 25000 of DeepSeek-V3: 150k catalog rows)")
    syn.add_argument("--sqlalchemy-insert", action="store_true",
                     help="commit through SQLAlchemy's own insert (without catalog/bulk.py), for comparison")
    syn.add_argument("--json-out", default=None, help="also write every figure to this JSON file")
    mod = sub.add_parser("model", help="the control path of a load and a save at N ranks from synthetic's figures")
    mod.add_argument("figures", help="the --json-out file of a synthetic run")
    mod.add_argument("--ranks", type=int, nargs="+", default=[1000, 8192])
    mod.add_argument("--latency-us", type=float, default=100.0, help="per-round latency (default 100 us)")
    mod.add_argument("--gbps", type=float, default=1.0, help="per-link rate, GB/s (default 1: gloo over TCP)")
    mod.add_argument("--wall", action="store_true", help="use the measured wall seconds instead of CPU seconds")
    mod.add_argument("--json-out", default=None)
    ranks = sub.add_parser("ranks", help="real N-rank save and load runs (issue 27 items 1, 2, 5)")
    ranks.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    args = ap.parse_args(argv)
    if args.command == "synthetic" and args.repeats < 1:
        ap.error("--repeats must be >= 1")
    t0 = time.perf_counter()
    run = {"synthetic": run_synthetic, "model": run_model, "ranks": run_ranks}[args.command]
    results = run(args)
    results.setdefault("machine", _machine())
    results["command"] = "tools/bench_scale.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results["total_s"] = time.perf_counter() - t0
    if getattr(args, "json_out", None):
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\ntotal {results['total_s']:.0f} s on {results['machine']}")


if __name__ == "__main__":
    main()
