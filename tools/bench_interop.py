"""Interop throughput, side by side in one run: ``ucp import|export hf`` (and ``ucp import dcp``) against the
hand-made way with the same libraries.

    python tools/bench_interop.py --gib 1.1 --repeats 2

- import: ``ucp import hf`` (in-process through ``ucp_store.cli.main``: every header checked, tensors
  from memory maps, source files hashed) against ``safetensors.torch.load_file`` + ``store.save``;
- export: ``ucp export hf`` (in-process too: read from the store, write shards + index + config,
  fsync, rename) against ``model.save_pretrained`` of the same weights already in memory, and against
  the same job by hand: ``Checkpoint.state_dict`` then ``safetensors.torch.save_file`` (fsync of what
  each wrote included, so all are durable writes; ``save_pretrained`` skips the read from the store);
- DCP: ``bench_dcp(args)`` from ``tools/_bench_interop_dcp.py`` when that file exists (the DCP half
  of the issue), so every comparison comes out of one run.

The model is a Llama with GQA built from a config (no hub) sized to ``--gib`` of fp32 weights. Each
repeat uses fresh stores (a second import into the same store would deduplicate every array) and
alternates which side runs first; the table reports the best of the repeats and the ratio to the
fastest way. The source folder was just written, so both import paths read it from the page cache.
No assertion here: the figures go in the closing note.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_store import fsync_tree  # noqa: E402  (one copy, beside the store benchmark)

import ucp_store  # noqa: E402
from ucp_store import cli  # noqa: E402


def build_model(gib: float):
    """A LlamaForCausalLM (GQA: 16 heads, 4 KV heads) with about ``gib`` GiB of fp32 weights, random values."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, vocab = 1024, 2816, 32000
    per_layer = 4 * hidden * hidden // 2 + hidden * hidden // 2 + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((gib * (1 << 30) / 4 - fixed) / per_layer))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
    return model.eval()


CPU: dict[tuple[str, str], list[float]] = {}


def timed(fn):
    """(wall seconds, result); the process CPU seconds (all threads) of the last call go to ``timed.cpu``.
    Dirty pages of earlier steps are flushed first, so no step pays for another's writeback."""
    gc.collect()
    os.sync()
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    timed.cpu = time.process_time() - c0
    return time.perf_counter() - t0, out


def bench_hf(args, work: str) -> list[dict]:
    from safetensors.torch import load_file

    model = build_model(args.gib)
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    print(f"model: {model.config.num_hidden_layers} layers, {nbytes / (1 << 30):.2f} GiB fp32", flush=True)
    src = os.path.join(work, "src")
    times: dict[tuple[str, str], list[float]] = {}

    def rec(job, way, t):
        times.setdefault((job, way), []).append(t)
        CPU.setdefault((job, way), []).append(timed.cpu)
        print(f"  {job:<10} {way:<44} {t:8.2f} s  (cpu {timed.cpu:.2f} s)", flush=True)

    for r in range(args.repeats):
        for d in ("src", "s1", "s2", "out", "hand"):
            shutil.rmtree(os.path.join(work, d), ignore_errors=True)

        def save_pretrained():
            model.save_pretrained(src, max_shard_size=args.max_shard_size)
            fsync_tree(src)

        t, _ = timed(save_pretrained)
        rec("export", "save_pretrained (weights in memory) + fsync", t)

        def ucp_import():
            rc = cli.main(["import", "hf", src, "--run", "ucp", "--store", os.path.join(work, "s1"), "--no-progress"])
            assert rc == 0
            return ucp_store.open_store(os.path.join(work, "s1")), "ucp@0"

        def by_hand():
            store = ucp_store.open_store(os.path.join(work, "s2"), create=True)
            files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
            sd = {}
            for f in files:
                sd.update(load_file(os.path.join(src, f)))
            with open(os.path.join(src, "config.json")) as fh:
                cfg = json.load(fh)
            store.save("hand", 0, sd, objects={"hf.config": cfg})
            del sd

        order = [("ucp import hf", ucp_import), ("load_file + store.save", by_hand)]
        if r % 2:
            order.reverse()
        store = cid = None
        for way, fn in order:
            t, out = timed(fn)
            rec("import", way, t)
            if out is not None:
                store, cid = out
        ck = store.checkpoint(cid)
        dest = os.path.join(work, "out")

        def ucp_export():
            rc = cli.main(["export", "hf", "ucp@0", dest, "--max-shard-size", args.max_shard_size,
                           "--store", os.path.join(work, "s1"), "--no-progress"])
            assert rc == 0

        def hand_export(ck=ck):
            from safetensors.torch import save_file

            out = os.path.join(work, "hand")
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            sd = ck.state_dict("weight")
            save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
            with open(os.path.join(out, "config.json"), "w") as fh:
                json.dump(ck.objects()["hf.config"], fh)
            fsync_tree(out)

        order = [("ucp export hf (from the store)", ucp_export), ("store state_dict + save_file + fsync", hand_export)]
        if r % 2:
            order.reverse()
        for way, fn in order:
            t, _ = timed(fn)
            rec("export", way, t)
    rows = []
    for (job, way), ts in times.items():
        rows.append({"job": job, "way": way, "seconds": min(ts), "all": ts, "bytes": nbytes,
                     "cpu_seconds": min(CPU[(job, way)]), "cpu_all": CPU[(job, way)]})
    return rows


def print_table(rows: list[dict]) -> None:
    print()
    print(f"{'job':<12} {'way':<46} {'best s':>8} {'GiB/s':>7} {'vs fastest':>10} {'cpu s':>7}")
    for job in dict.fromkeys(r["job"] for r in rows):
        mine = [r for r in rows if r["job"] == job]
        best = min(r["seconds"] for r in mine)
        for r in sorted(mine, key=lambda r: r["seconds"]):
            rate = r["bytes"] / (1 << 30) / r["seconds"] if r.get("bytes") else float("nan")
            cpu = f"{r['cpu_seconds']:7.2f}" if "cpu_seconds" in r else "      -"
            print(f"{job:<12} {r['way']:<46} {r['seconds']:8.2f} {rate:7.2f} {r['seconds'] / best:9.2f}x {cpu}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.1, help="model size in GiB of fp32 weights (default 1.1)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--workdir", default=None, help="scratch folder (default: a temp folder, removed after)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-dcp", action="store_true")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    os.environ.setdefault("UCP_PROGRESS", "0")
    work = args.workdir or tempfile.mkdtemp(prefix="bench-interop-")
    os.makedirs(work, exist_ok=True)
    rows: list[dict] = []
    try:
        if not args.skip_hf:
            rows += bench_hf(args, os.path.join(work, "hf"))
        dcp_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bench_interop_dcp.py")
        if not args.skip_dcp and os.path.exists(dcp_file):
            from _bench_interop_dcp import bench_dcp

            args.workdir_dcp = os.path.join(work, "dcp")
            os.makedirs(args.workdir_dcp, exist_ok=True)
            print_table(rows)  # the HF figures stand even if the DCP part fails
            try:
                got = bench_dcp(args)
            except Exception as exc:  # noqa: BLE001 - report it, keep the HF figures
                import traceback

                traceback.print_exc()
                print(f"bench_dcp failed: {exc!r}")
                got = None
            if isinstance(got, list):
                rows += [r for r in got if isinstance(r, dict) and {"job", "way", "seconds"} <= set(r)]
        elif not args.skip_dcp:
            print("(tools/_bench_interop_dcp.py not present: no DCP comparison in this run)")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
