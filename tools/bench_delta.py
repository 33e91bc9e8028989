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


def summarize(name: str, rows: list[dict], hf_bytes: int | None) -> dict:
    later = rows[1:]
    s: dict[str, Any] = {"sequence": name, "versions": len(rows), "full_bytes": rows[0]["full"]}
    if later:
        s["changed_frac_mean"] = float(np.mean([r["changed_frac"] for r in later]))
        s["stored_over_full_mean"] = float(np.mean([r["stored"] / r["full"] for r in later]))
        s["stored_over_full_max"] = float(max(r["stored"] / r["full"] for r in later))
        s["floor_over_full_mean"] = float(np.mean([r["floor"] / r["full"] for r in later]))
        s["publish_s_mean"] = float(np.mean([r["publish_s"] for r in later]))
    s["first_publish_s"] = rows[0]["publish_s"]
    if hf_bytes:
        s["stored_over_safetensors_mean"] = float(np.mean([r["stored"] / hf_bytes for r in later])) if later else None
    return s


def pull_summary(rows: list[dict]) -> dict:
    if not rows:
        return {}

    def mean(k):
        return float(np.mean([r[k] for r in rows])) if rows else None

    return {"bytes_read_over_delta": float(np.mean([r["bytes_read"] / max(1, r["delta_bytes"]) for r in rows])),
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
    args = ap.parse_args(argv)
    args.steps = args.steps or (6 if args.small else 20)
    args.opt_steps = args.opt_steps if args.opt_steps is not None else (args.steps if args.small else 3)
    tmp = tempfile.mkdtemp(prefix="bench-delta-")
    root = args.store or os.path.join(tmp, "store")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    try:
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
        report["load_after"] = os.getloadavg()
        print_report(report)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1, default=str)
    finally:
        if not args.store:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


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
    print(f"{'pull':<10} {'hops':>4} {'read/delta':>10} {'read/box':>9} {'pull warm':>9} {'full warm':>9} "
          f"{'x':>5} {'pull cold':>9} {'full cold':>9} {'x':>5}")
    for p in r["pulls"]:
        if not p["rows"]:
            continue
        print(f"{p['run']:<10} {p['hops']:>4} {p['bytes_read_over_delta']:>10.3f} {p['bytes_read_over_box']:>9.4f} "
              f"{p['pull_warm_s']:>9.4f} {p['full_warm_s']:>9.4f} {p['speedup_warm']:>5.1f} "
              f"{p['pull_cold_s']:>9.4f} {p['full_cold_s']:>9.4f} {p['speedup_cold']:>5.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
