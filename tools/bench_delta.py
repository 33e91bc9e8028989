"""Publish and pull on a real update sequence (issue 39): versions stored as deltas of their parent, and a TP=2
puller moving M -> M+1 and M -> M+5 by reading only the changed chunks of its boxes.

    python tools/bench_delta.py                 # Llama ~125M parameters (transformers, from a config), 20 steps
    python tools/bench_delta.py --small         # a few million parameters, 6 steps: a quick check

A ``LlamaForCausalLM`` built from a config (no hub), fp32 master weights, trained with AdamW on generated text
(a seeded Zipf-Markov token stream) at lr 1e-6 (RL-like) and 1e-5 (SFT-like). After every step:

- ``rl`` / ``sft``: the bf16 weights (``p.to(bfloat16)``, as an inference engine holds them) published with
  ``delta="auto"`` (a delta of the previous version where it is small enough, a keyframe every K versions);
- ``pre``: the fp32 master weights and both AdamW moments (a pretraining-like save), also ``delta="auto"``,
  for ``--opt-steps`` steps (each full version is 12 bytes per parameter on disk).

Per sequence and version: the fraction of elements that changed (the floor is that fraction x bytes per element,
the least any encoding of "which elements, what new bits" could approach), the bytes the version stored (its
array files on disk) against the full size and against ``save_pretrained``'s safetensors, and the publish time.
A TP=2 puller (column-parallel weights split on dim 0, row-parallel on dim 1, norms replicated; each rank's
boxes pulled in turn) moves M -> M+1 and M -> M+5: bytes read (counted by the pull's reader) against the delta
bytes of its boxes and the full bytes of its boxes, and time against a full load of the version's boxes
(``Checkpoint`` reads, which reconstruct keyframe XOR deltas), with the page cache warm and dropped for the
store's files (``posix_fadvise(DONTNEED)``, no root needed). Every pulled box is compared bit for bit with the
full load, and the last version of each sequence runs ``verify`` (content hashes of the reconstruction).

Figures are ratios for the closing note; record ``uptime``'s load beside them (a busy machine slows everything).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import ucp_store  # noqa: E402
from ucp_store.puller import pull  # noqa: E402

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def build_model(small: bool, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if small:
        cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                          num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg)
    model.train()
    return model, cfg


def text_batches(vocab: int, batch: int, seq: int, seed: int = 1):
    """Generated text: a seeded Markov chain over a Zipf vocabulary (each token's successors drawn from a few
    favourites), so the loss falls and gradients have the structure of language, not of noise."""
    rng = np.random.default_rng(seed)
    favourites = rng.zipf(1.3, size=(vocab, 8)) % vocab
    while True:
        toks = np.empty((batch, seq), np.int64)
        toks[:, 0] = rng.zipf(1.3, size=batch) % vocab
        for j in range(1, seq):
            pick = rng.integers(0, 8, size=batch)
            toks[:, j] = favourites[toks[:, j - 1], pick]
        yield torch.from_numpy(toks)


def tp_box(name: str, shape: tuple[int, ...], rank: int, tp: int = 2) -> tuple[tuple[int, int], ...]:
    full = [(0, n) for n in shape]
    if len(shape) == 2:
        dim = 0 if any(k in name for k in COLUMN) else 1 if any(k in name for k in ROW) else None
        if dim is not None and shape[dim] % tp == 0:
            w = shape[dim] // tp
            full[dim] = (rank * w, (rank + 1) * w)
    return tuple(full)


def drop_cache(root: str) -> None:
    for folder, _dirs, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(folder, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def version_bytes(store, ck_id: str) -> int:
    """Bytes of the array files this version wrote (its own folder under arrays/)."""
    root = os.path.join(store.location.root, "arrays", ck_id)
    total = 0
    for folder, _dirs, files in os.walk(root):
        total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    return total


def changed_elements(prev: dict, cur: dict) -> tuple[int, int]:
    diff = total = 0
    for k, v in cur.items():
        a = prev[k].contiguous().view(torch.uint8).view(-1, v.element_size())
        b = v.contiguous().view(torch.uint8).view(-1, v.element_size())
        diff += int((a != b).any(dim=1).sum())
        total += v.numel()
    return diff, total


def state_figures(store, ck_id: str, prev: dict, cur: dict) -> dict:
    """Per state: the fraction of elements changed, how many tensor-states auto stored as deltas, and the size a
    delta of the largest tensor-state would take without the policy's bound (why auto stores it full or not)."""
    from ucp_store.io import delta as dl
    from ucp_store.io import deltaio
    from ucp_store.io import format as fmt

    ck = store.checkpoint(ck_id)
    out: dict[str, dict] = {}
    for info in ck.tensors():
        f = out.setdefault(info.state, {"changed": 0, "numel": 0, "xor": 0, "tensors": 0, "largest": None})
        key = f"{info.name}|{info.state}"
        a, b = prev[key], cur[key]
        size = b.element_size()
        f["changed"] += int((a.contiguous().view(torch.uint8).view(-1, size)
                             != b.contiguous().view(torch.uint8).view(-1, size)).any(dim=1).sum())
        f["numel"] += b.numel()
        f["xor"] += info.encoding == "xor"
        f["tensors"] += 1
        # the largest tensor-state stored full (or the largest at all): its unbounded delta says why
        rank = (info.encoding != "xor", b.numel())
        if f["largest"] is None or rank > f["largest"][0]:
            f["largest"] = (rank, key, info)
    for f in out.values():
        _rank, key, info = f.pop("largest")
        layout = deltaio.delta_layout(fmt.ArrayLayout.from_catalog(info.dtype, info.shape, info.chunk_shape,
                                                                   info.shard_shape, []), "zstd")
        bits = dl.xor(dtypes_numpy(cur[key]), dtypes_numpy(prev[key]))
        enc = deltaio.encode_delta(layout, bits, None)
        f["changed_frac"] = f.pop("changed") / f.pop("numel")
        f["largest_delta_over_full"] = (enc.nbytes / layout.nbytes) if enc is not None else None
    return out


def dtypes_numpy(t: torch.Tensor) -> np.ndarray:
    from ucp_store import dtypes

    return dtypes.to_numpy(t.contiguous(), what="bench")


def safetensors_bytes(model, tmp: str) -> int:
    folder = os.path.join(tmp, "hf")
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    model.to(torch.float32)
    n = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    shutil.rmtree(folder)
    return n


def publish(store, run: str, step: int, tensors: dict, delta: str, how: str = "store") -> tuple[str, float]:
    """One version: ``Store.save`` (its delta base read back from the store), or with ``how="dist"`` the trainer
    path ``ucp_store.distributed.save`` (one process here; its base is what it published last, in memory)."""
    t0 = time.perf_counter()
    if how == "dist" and not any(isinstance(v, dict) for v in tensors.values()):
        import ucp_store.distributed as ucpd

        ck_id = ucpd.save({"model": tensors}, store=store, run=run, step=step, delta=delta, progress=False)
        return ck_id, time.perf_counter() - t0
    ck = store.save(run, step, tensors, delta=delta)
    return ck.id, time.perf_counter() - t0


def train(args, lr: float, store, runs: dict[str, str], tmp: str) -> dict[str, list[dict]]:
    """``args.steps`` AdamW steps at ``lr``; publishes per step into ``runs`` ({"weights": run, "opt": run})."""
    model, cfg = build_model(args.small)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    batches = text_batches(cfg.vocab_size, args.batch, args.seq)
    out: dict[str, list[dict]] = {k: [] for k in runs}
    prev: dict[str, dict] = {}
    for step in range(args.steps + 1):
        if step:
            ids = next(batches)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        params = dict(model.named_parameters())
        sets = {"weights": {n: p.detach().to(torch.bfloat16) for n, p in params.items()}}
        if "opt" in runs and step <= args.opt_steps:
            sets["opt"] = {}
            for n, p in params.items():
                st = opt.state.get(p, {})
                sets["opt"][n] = {"fp32": p.detach().clone(),
                                  "exp_avg": st.get("exp_avg", torch.zeros_like(p)).detach().clone(),
                                  "exp_avg_sq": st.get("exp_avg_sq", torch.zeros_like(p)).detach().clone()}
        for kind, tensors in sets.items():
            flat = {f"{n}|{s}": t for n, d in tensors.items() for s, t in (d.items() if isinstance(d, dict) else
                                                                             [("weight", d)])}
            ck, secs = publish(store, runs[kind], step, tensors, "auto", args.publisher)
            row = {"step": step, "id": ck, "publish_s": secs, "stored": version_bytes(store, ck),
                   "full": sum(t.numel() * t.element_size() for t in flat.values())}
            if kind in prev:
                d, n = changed_elements(prev[kind], flat)
                row["changed_frac"] = d / n
                row["floor"] = row["changed_frac"] * row["full"]
                row["states"] = state_figures(store, ck, prev[kind], flat)
            prev[kind] = flat
            out[kind].append(row)
        if step:
            print(f"  lr {lr:g} step {step}: loss {float(loss.detach()):.3f}", file=sys.stderr)
    return out


def _full_load(ck, names: list[str], rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for n in names:
        info = ck.info(n, "weight")
        box = tp_box(n, info.shape, rank)
        out[n] = ck.tensor(n, "weight").read(tuple(slice(a, b) for a, b in box))
    return out


def pull_figures(store, run: str, steps: list[int], hops: int) -> list[dict]:
    """A TP=2 puller at M (each rank's boxes loaded) moving to M+hops; per rank: bytes and times."""
    rows = []
    if steps:  # one untimed pull first: imports and the catalog's first queries are not a pull's cost
        ck = store.checkpoint(f"{run}@{steps[0] + hops}")
        names = [i.name for i in ck.tensors(state="weight")]
        pull(store, f"{run}@{steps[0]}", f"{run}@{steps[0] + hops}", _full_load(store.checkpoint(f"{run}@{steps[0]}"),
                                                                                names, 0),
             boxes={n: tp_box(n, ck.info(n, "weight").shape, 0) for n in names})
    for m_step in steps:
        n_step = m_step + hops
        ck_m, ck_n = store.checkpoint(f"{run}@{m_step}"), store.checkpoint(f"{run}@{n_step}")
        names = [i.name for i in ck_n.tensors(state="weight")]
        for rank in range(2):
            held = _full_load(ck_m, names, rank)
            boxes = {n: tp_box(n, ck_n.info(n, "weight").shape, rank) for n in names}
            box_bytes = sum(t.numel() * t.element_size() for t in held.values())
            rec: dict[str, Any] = {"from": m_step, "to": n_step, "rank": rank, "box_bytes": box_bytes}
            for cache in ("warm", "cold"):
                held_c = {n: t.clone() for n, t in held.items()}
                if cache == "cold":
                    drop_cache(store.location.root)
                t0 = time.perf_counter()
                res = pull(store, f"{run}@{m_step}", f"{run}@{n_step}", held_c, boxes=boxes)
                rec[f"pull_{cache}_s"] = time.perf_counter() - t0
                if cache == "cold":
                    drop_cache(store.location.root)
                t0 = time.perf_counter()
                full = _full_load(ck_n, names, rank)
                rec[f"full_{cache}_s"] = time.perf_counter() - t0
                exact = all(torch.equal(held_c[n].view(torch.int16), full[n].view(torch.int16)) for n in names)
                if not exact:
                    raise SystemExit(f"pull {run}@{m_step} -> {n_step} rank {rank}: not bit-exact against a full load")
                rec.update(bytes_read=res.bytes_read, delta_bytes=res.delta_bytes,
                           routes={k: sum(t.kind == k for t in res.tensors) for k in ("same", "delta", "full")})
            rows.append(rec)
    return rows


def _boxes(ck, names: list[str], rank: int) -> dict[str, tuple]:
    return {n: tp_box(n, ck.info(n, "weight").shape, rank) for n in names}


def _empty(ck, boxes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    from ucp_store import dtypes

    return {n: torch.empty([b - a for a, b in box], dtype=dtypes.torch_dtype(ck.info(n, "weight").dtype))
            for n, box in boxes.items()}


def _stored_chunks(store, routes: dict, boxes: dict[str, tuple], arrays_of) -> list[tuple]:
    """The stored chunks of the arrays ``arrays_of(route)`` (in order) that each box intersects, read into memory
    beforehand: ``[(name, reader's decode or None, chunk shape, numpy dtype, raw bytes, src box, dst box,
    mode)]`` (mode ``copy`` for a route's first full array, else ``xor``)."""
    from ucp_store.geometry import Box
    from ucp_store.io.chunkread import ChunkReader
    from ucp_store.plan.pull import chunk_cuts

    out = []
    for (name, _state), tr in routes.items():
        box = Box(tuple(boxes[name]))
        for i, a in enumerate(arrays_of(tr)):
            mode = "copy" if a.encoding != "xor" and i == 0 else "xor"
            r = ChunkReader(store.location, a.path, shape=a.shape, dtype=a.dtype, shard_shape=a.shard_shape,
                            codecs=a.codecs)
            for c in chunk_cuts(r.shape, r.chunk_shape, r.shard_shape, box):
                raw = r.raw(c.shard, c.slot)
                if raw is not None:
                    out.append((name, r.decode, r.chunk_shape, r.np_dtype, raw, c.src, c.dst, mode))
    return out


def _apply_in_memory(chunks: list[tuple], dest: dict[str, np.ndarray], threads: int) -> tuple[float, float]:
    """The least work of a pull or a load given its stored chunks already in memory: each decoded (a plain
    array's bytes used as they are) and XORed or copied into ``dest``; no I/O, no plan, no crc check. Runs on
    ``threads`` threads (the pull's pool size), chunks of one tensor in order. Wall and process CPU seconds."""
    from concurrent.futures import ThreadPoolExecutor

    from ucp_store.io import delta as dl

    by_name: dict[str, list[tuple]] = {}
    for c in chunks:
        by_name.setdefault(c[0], []).append(c)

    def work(items: list[tuple]) -> None:
        for name, decode, shape, dtype, raw, src, dst, mode in items:
            body = memoryview(raw)[:-4]
            data = decode(body, int(np.prod(shape)) * dtype.itemsize) if decode is not None else body
            part = np.frombuffer(data, dtype).reshape(shape)[src.slices()]
            if mode == "copy":
                dest[name][dst.slices()] = part
            else:
                dl.xor_into(dest[name][dst.slices()], part)

    # a tensor's chunks are disjoint except between levels (copy, then xor): one task per tensor and level
    tasks = []
    for items in by_name.values():
        level: list[tuple] = []
        for c in items:
            if level and c[7] == "copy" and level[-1][7] != "copy":
                tasks.append(level)
                level = []
            level.append(c)
        tasks.append(level)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(len, [()] * threads))  # the threads started before the clock
        t0, c0 = time.perf_counter(), time.process_time()
        list(pool.map(work, tasks))
        return time.perf_counter() - t0, time.process_time() - c0


def _best(fn, repeats: int) -> tuple[float, Any]:
    best, got = math.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        if dt < best:
            best, got = dt, out
    return best, got


def phase_figures(store, run: str, m_step: int, hops: int, rank: int, keyframe_step: int, repeats: int = 3) -> dict:
    """One rank's pull M -> M+hops against full loads of the same boxes, phase by phase (best of ``repeats``,
    page cache warm), beside the ceilings: the same stored chunks already in memory, decoded and XORed (the
    pull) or copied (a version stored full) with nothing else. The loads: ``full_chain`` (N as stored: its
    keyframe, then every delta above it, through the pull's reader), ``full_stored`` (a version stored full,
    the keyframe ``keyframe_step``: what a registry without deltas reads per version) and ``checkpoint``
    (``Checkpoint`` reads of N, the library's ordinary read path)."""
    from ucp_store import dtypes
    from ucp_store.io.pools import LazyPool
    from ucp_store.registry.pull import plan_pull

    have, want, key = f"{run}@{m_step}", f"{run}@{m_step + hops}", f"{run}@{keyframe_step}"
    ck_m, ck_n, ck_k = store.checkpoint(have), store.checkpoint(want), store.checkpoint(key)
    names = [i.name for i in ck_n.tensors(state="weight")]
    boxes = _boxes(ck_n, names, rank)
    held = _full_load(ck_m, names, rank)
    rec: dict[str, Any] = {"run": run, "from": m_step, "to": m_step + hops, "rank": rank, "keyframe": keyframe_step,
                           "box_bytes": sum(t.numel() * t.element_size() for t in held.values())}

    def run_pull(h, w, start):
        tensors = {n: t.clone() for n, t in start.items()}
        t0, c0 = time.perf_counter(), time.process_time()
        res = pull(store, h, w, tensors, boxes=boxes)
        return time.perf_counter() - t0, res, tensors, time.process_time() - c0

    cases = {"pull": (have, want, held), "full_chain": (None, want, _empty(ck_n, boxes)),
             "full_stored": (None, key, _empty(ck_k, boxes))}
    results = {}
    for case, (h, w, start) in cases.items():
        runs = [run_pull(h, w, start) for _ in range(repeats)]
        secs, res, tensors, cpu = min(runs, key=lambda x: x[0])
        results[case] = tensors
        rec[case] = {"s": secs, "cpu_s": cpu, "bytes_read": res.bytes_read, "delta_bytes": res.delta_bytes,
                     "requests": res.requests,
                     "phases": dict(res.phases),
                     "routes": {k: sum(t.kind == k for t in res.tensors) for k in ("same", "delta", "full")}}
    c0 = time.process_time()
    rec["checkpoint"] = {"s": _best(lambda: _full_load(ck_n, names, rank), repeats)[0],
                         "cpu_s": (time.process_time() - c0) / repeats}
    full = _full_load(ck_n, names, rank)
    for case in ("pull", "full_chain"):
        if not all(torch.equal(results[case][n].view(torch.int16), full[n].view(torch.int16)) for n in names):
            raise SystemExit(f"{case} {have} -> {want} rank {rank}: not bit-exact against a Checkpoint read")

    # ceilings: the stored chunks already in memory (bytes read beforehand), decoded and applied, nothing else
    threads = LazyPool("bench", "read_threads", lambda cpus: max(4, min(32, 2 * cpus))).size()
    routes_pull = plan_pull(store, have, want, [(n, "weight") for n in names])
    routes_key = plan_pull(store, None, key, [(n, "weight") for n in names])
    for case, routes, arrays_of, start in (("pull", routes_pull, lambda tr: tr.deltas, held),
                                           ("full_stored", routes_key, lambda tr: tr.full, None)):
        chunks = _stored_chunks(store, routes, boxes, arrays_of)
        secs = (math.inf, math.inf)
        for _ in range(repeats):  # a fresh destination each time (an XOR applied twice undoes itself)
            dest_t = {n: t.clone() for n, t in start.items()} if start is not None else _empty(ck_k, boxes)
            secs = min(secs, _apply_in_memory(chunks, {n: dtypes.numpy_view(t) for n, t in dest_t.items()},
                                              threads))
        if not all(torch.equal(dest_t[n].view(torch.int16), results[case][n].view(torch.int16)) for n in names):
            raise SystemExit(f"ceiling of {case} {have} -> {want} rank {rank}: differs from the pull's result")
        rec[case]["ceiling_s"], rec[case]["ceiling_cpu_s"] = secs
        rec[case]["ceiling_bytes"] = sum(len(c[4]) for c in chunks)
        rec[case]["ceiling_threads"] = threads
    return rec


def s3_figures(store, run: str, m_step: int, rank: int, keyframe_step: int, tmp: str, repeats: int = 2) -> dict:
    """The pull M -> M+1 and the full loads of ``phase_figures`` against a bucket: versions ``keyframe_step`` ..
    M+1 of ``run`` published again (the same values, ``delta="auto"``) into a store on moto's S3 server over
    real HTTP on this host (``tests/ucp_test_helpers.moto_s3``), then read back through the kvstore's
    byte-range reads. Localhost HTTP to a Python server: it shows what the bytes cost where requests carry them,
    not a real bucket's bandwidth."""
    import logging

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from ucp_test_helpers import moto_s3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise

    have, want, key = f"{run}@{m_step}", f"{run}@{m_step + 1}", f"{run}@{keyframe_step}"
    with moto_s3("bench") as endpoint:
        s3 = ucp_store.open_store(f"s3://bench/store?endpoint={endpoint}&region=us-east-1", create=True,
                                  catalog=f"sqlite:///{os.path.join(tmp, 's3-catalog.db')}")
        t0 = time.perf_counter()
        for step in range(keyframe_step, m_step + 2):
            ck = store.checkpoint(f"{run}@{step}")
            s3.save(run, step, {i.name: ck.tensor(i.name, "weight").read() for i in ck.tensors(state="weight")},
                    delta="auto")
        rec: dict[str, Any] = {"run": run, "from": m_step, "to": m_step + 1, "rank": rank, "endpoint": "moto",
                               "publish_s": time.perf_counter() - t0}
        ck_m, ck_n = store.checkpoint(have), s3.checkpoint(want)
        names = [i.name for i in ck_n.tensors(state="weight")]
        boxes = _boxes(ck_n, names, rank)
        held = _full_load(ck_m, names, rank)
        expect = _full_load(store.checkpoint(want), names, rank)
        for case, (h, w, start) in {"pull": (have, want, held), "full_chain": (None, want, _empty(ck_n, boxes)),
                                    "full_stored": (None, key, _empty(ck_n, boxes))}.items():
            best: dict[str, Any] = {"s": math.inf}
            for _ in range(repeats):
                tensors = {n: t.clone() for n, t in start.items()}
                t0, c0 = time.perf_counter(), time.process_time()
                res = pull(s3, h, w, tensors, boxes=boxes)
                secs, cpu = time.perf_counter() - t0, time.process_time() - c0
                if secs < best["s"]:
                    best = {"s": secs, "cpu_s": cpu, "bytes_read": res.bytes_read, "requests": res.requests,
                            "phases": dict(res.phases)}
            if case != "full_stored" and not all(torch.equal(tensors[n].view(torch.int16), expect[n].view(torch.int16))
                                                 for n in names):
                raise SystemExit(f"S3 {case} {have} -> {want} rank {rank}: not bit-exact")
            rec[case] = best
    return rec


def summarize(name: str, rows: list[dict], hf_bytes: int | None) -> dict:
    later = rows[1:]
    s: dict[str, Any] = {"sequence": name, "versions": len(rows), "full_bytes": rows[0]["full"]}
    if later:
        s["changed_frac_mean"] = float(np.mean([r["changed_frac"] for r in later]))
        s["stored_over_full_mean"] = float(np.mean([r["stored"] / r["full"] for r in later]))
        s["stored_over_full_max"] = float(max(r["stored"] / r["full"] for r in later))
        s["floor_over_full_mean"] = float(np.mean([r["floor"] / r["full"] for r in later]))
        s["publish_s_mean"] = float(np.mean([r["publish_s"] for r in later]))
        # the versions stored as deltas apart from the keyframes (every K-th version is stored full, by design)
        deltas = [r for r in later if any(f["xor"] for f in (r.get("states") or {}).values())]
        s["keyframes"] = [r["step"] for r in later if r not in deltas]
        if deltas:
            s["delta_stored_over_full_mean"] = float(np.mean([r["stored"] / r["full"] for r in deltas]))
            s["delta_stored_over_full_max"] = float(max(r["stored"] / r["full"] for r in deltas))
            s["delta_changed_frac_mean"] = float(np.mean([r["changed_frac"] for r in deltas]))
    s["first_publish_s"] = rows[0]["publish_s"]
    if hf_bytes:
        s["stored_over_safetensors_mean"] = float(np.mean([r["stored"] / hf_bytes for r in later])) if later else None
    return s


def pull_summary(rows: list[dict]) -> dict:
    if not rows:
        return {}

    def mean(k):
        return float(np.mean([r[k] for r in rows])) if rows else None

    # a pull across a keyframe reads N's own chain (route "full"): no delta bytes to compare its reads with
    via_deltas = [r for r in rows if not r.get("routes", {}).get("full")]
    return {"bytes_read_over_delta": float(np.mean([r["bytes_read"] / max(1, r["delta_bytes"]) for r in via_deltas]))
            if via_deltas else math.nan, "across_keyframe": len(rows) - len(via_deltas),
            "bytes_read_over_box": float(np.mean([r["bytes_read"] / r["box_bytes"] for r in rows])),
            "pull_warm_s": mean("pull_warm_s"), "full_warm_s": mean("full_warm_s"),
            "pull_cold_s": mean("pull_cold_s"), "full_cold_s": mean("full_cold_s"),
            "speedup_warm": float(np.mean([r["full_warm_s"] / r["pull_warm_s"] for r in rows])),
            "speedup_cold": float(np.mean([r["full_cold_s"] / r["pull_cold_s"] for r in rows]))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a few million parameters, 6 steps")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--opt-steps", type=int, default=None, help="steps whose fp32 master and moments are saved")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--publisher", choices=("store", "dist"), default="store",
                    help="store: Store.save (base read back from the store); dist: ucp_store.distributed.save "
                         "(base kept in memory from the last publish); the fp32 sequence always uses Store.save")
    ap.add_argument("--store", default=None, help="store folder (default: a temporary one, removed)")
    ap.add_argument("--out", default=None, help="write the figures as JSON")
    ap.add_argument("--pull-only", action="store_true",
                    help="no training: the phase breakdown, ceilings and S3 column on the runs an earlier run left "
                         "in --store")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 column (moto's server)")
    args = ap.parse_args(argv)
    if args.pull_only and not args.store:
        ap.error("--pull-only needs --store (a folder an earlier run of this benchmark filled)")
    args.steps = args.steps or (6 if args.small else 20)
    args.opt_steps = args.opt_steps if args.opt_steps is not None else (args.steps if args.small else 3)
    tmp = tempfile.mkdtemp(prefix="bench-delta-")
    root = args.store or os.path.join(tmp, "store")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    try:
        if args.pull_only:
            store = ucp_store.open_store(root)
            report = {"load": os.getloadavg(), "pulls": [], "sequences": []}
            report["phases"] = pull_phases(store, args, tmp)
            report["load_after"] = os.getloadavg()
            print_phases(report)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1, default=str)
            return 0
        store = ucp_store.open_store(root, create=True)
        model, _cfg = build_model(args.small)
        n_params = sum(p.numel() for p in model.parameters())
        hf = safetensors_bytes(model, tmp)
        del model
        report: dict[str, Any] = {"parameters": n_params, "safetensors_bytes": hf, "load": os.getloadavg(),
                                  "sequences": [], "pulls": []}
        print(f"Llama with {n_params / 1e6:.1f}M parameters; safetensors (bf16) {hf / 2**20:.1f} MiB", file=sys.stderr)
        for lr, label in ((1e-6, "rl"), (1e-5, "sft")):
            runs = {"weights": f"{label}-bf16"}
            if label == "sft":
                runs["opt"] = "pre-fp32"
            got = train(args, lr, store, runs, tmp)
            for kind, rows in got.items():
                report["sequences"].append({**summarize(runs[kind], rows, hf if kind == "weights" else None),
                                            "lr": lr, "rows": rows})
            for hops in (1, 5):
                last = args.steps - hops  # up to three starting versions, spread over the run
                starts = sorted({0, last // 2, last}) if last >= 0 else []
                prs = pull_figures(store, runs["weights"], starts, hops)
                report["pulls"].append({"run": runs["weights"], "hops": hops, **pull_summary(prs), "rows": prs})
            last = store.checkpoint(f"{runs['weights']}@{args.steps}")
            problems = last.verify()
            if problems:
                raise SystemExit(f"verify {last}: {problems[:3]}")
        report["phases"] = pull_phases(store, args, tmp)
        report["load_after"] = os.getloadavg()
        print_report(report)
        print_phases(report)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1, default=str)
    finally:
        if not args.store:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def pull_phases(store, args, tmp: str) -> dict:
    """One rank's one-step pull 1 -> 2 of each bf16 sequence (keyframe: version 0) phase by phase, with the
    ceilings, and (unless ``--no-s3``) the RL sequence's against a bucket."""
    out: dict[str, Any] = {"local": [], "s3": []}
    have = {r["run"]: r["latest_step"] for r in store.runs()}
    runs = [r for r in ("rl-bf16", "sft-bf16") if (have.get(r) or 0) >= 2]
    for run in runs:
        print(f"  phases: {run} 1 -> 2, rank 0", file=sys.stderr)
        out["local"].append(phase_figures(store, run, 1, 1, 0, 0))
    if runs and not args.no_s3:
        print(f"  S3: {runs[0]} 1 -> 2, rank 0", file=sys.stderr)
        out["s3"].append(s3_figures(store, runs[0], 1, 0, 0, tmp))
    return out


def print_phases(r: dict) -> None:
    ph = r.get("phases") or {}
    cols = ("plan", "prepare", "index", "read", "crc", "decode", "apply", "execute")
    print(f"one rank's one-step pull against full loads of its boxes, ms (wall: s, plan, prepare, execute, index, "
          f"read; CPU summed over threads: cpu, crc, decode, apply); load {r['load'][0]:.1f} -> "
          f"{r['load_after'][0]:.1f}")
    print(f"{'where':<6} {'run':<9} {'case':<12} {'MiB read':>8} {'reads':>5} {'s':>7} {'cpu':>7} "
          + " ".join(f"{c:>7}" for c in cols) + f" {'ceiling':>7} {'ceil cpu':>8}")
    for where in ("local", "s3"):
        for rec in ph.get(where, []):
            for case in ("pull", "full_chain", "full_stored", "checkpoint"):
                c = rec.get(case)
                if c is None:
                    continue
                p = c.get("phases", {})
                ms = lambda v: f"{1e3 * v:7.1f}" if v is not None else f"{'-':>7}"  # noqa: E731
                print(f"{where:<6} {rec['run']:<9} {case:<12} "
                      f"{c.get('bytes_read', 0) / 2**20:8.2f} {c.get('requests', 0):>5} {ms(c['s'])} "
                      f"{ms(c.get('cpu_s'))} "
                      + " ".join(ms(p.get(k)) for k in cols)
                      + f" {ms(c.get('ceiling_s'))} {ms(c.get('ceiling_cpu_s')):>8}")
            pull_s = rec["pull"]["s"]
            ratios = ", ".join(f"{case} / pull {rec[case]['s'] / pull_s:.2f}x"
                               for case in ("full_chain", "full_stored", "checkpoint") if case in rec)
            if "ceiling_s" in rec["pull"]:
                fs, pl = rec["full_stored"], rec["pull"]
                ratios += (f"; ceilings: full_stored / pull {fs['ceiling_s'] / pl['ceiling_s']:.2f}x"
                           f" (CPU {fs['ceiling_cpu_s'] / pl['ceiling_cpu_s']:.2f}x)")
            print(f"    {where} {rec['run']}: {ratios}")


def print_report(r: dict) -> None:
    print(f"parameters {r['parameters'] / 1e6:.1f}M, safetensors {r['safetensors_bytes'] / 2**20:.1f} MiB, "
          f"load {r['load'][0]:.1f} -> {r['load_after'][0]:.1f}")
    print(f"{'sequence':<10} {'lr':>7} {'changed':>8} {'floor':>7} {'stored/full':>12} {'max':>6} "
          f"{'vs st':>6} {'publish s':>9} {'first s':>8}")
    def pct(s: dict, k: str) -> str:
        return f"{100 * s[k]:.2f}%" if s.get(k) is not None else "-"

    for s in r["sequences"]:
        states = [row.get("states") for row in s["rows"] if row.get("states")]
        for st in sorted(states[-1]) if states else []:
            f = states[-1][st]
            trial = 100 * (f['largest_delta_over_full'] or 0)
            print(f"    {s['sequence']} [{st}]: {100 * f['changed_frac']:.2f}% changed, {f['xor']}/{f['tensors']} "
                  f"stored as deltas; the largest full one's delta would be {trial:.1f}% of its full size")
        print(f"{s['sequence']:<10} {s['lr']:>7.0e} {pct(s, 'changed_frac_mean'):>8} "
              f"{pct(s, 'floor_over_full_mean'):>7} "
              f"{pct(s, 'stored_over_full_mean'):>12} {pct(s, 'stored_over_full_max'):>6} "
              f"{pct(s, 'stored_over_safetensors_mean'):>6} {s.get('publish_s_mean', math.nan):>9.3f} "
              f"{s['first_publish_s']:>8.3f}")
        if s.get("delta_stored_over_full_mean") is not None:
            print(f"    {s['sequence']}: the versions stored as deltas: {pct(s, 'delta_changed_frac_mean')} changed, "
                  f"stored {pct(s, 'delta_stored_over_full_mean')} of full (max "
                  f"{pct(s, 'delta_stored_over_full_max')}); keyframes (stored full) at steps {s['keyframes']}")
    print(f"{'pull':<10} {'hops':>4} {'read/delta':>10} {'read/box':>9} {'pull warm':>9} {'full warm':>9} "
          f"{'x':>5} {'pull cold':>9} {'full cold':>9} {'x':>5}")
    for p in r["pulls"]:
        if not p["rows"]:
            continue
        print(f"{p['run']:<10} {p['hops']:>4} {p['bytes_read_over_delta']:>10.3f} {p['bytes_read_over_box']:>9.4f} "
              f"{p['pull_warm_s']:>9.4f} {p['full_warm_s']:>9.4f} {p['speedup_warm']:>5.1f} "
              f"{p['pull_cold_s']:>9.4f} {p['full_cold_s']:>9.4f} {p['speedup_cold']:>5.1f}"
              + (f"  ({p['across_keyframe']}/{len(p['rows'])} across a keyframe: N's chain read, read/delta over the "
                 "others)" if p.get("across_keyframe") else ""))


if __name__ == "__main__":
    raise SystemExit(main())
