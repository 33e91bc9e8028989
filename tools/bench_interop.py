"""Interop throughput, side by side in one run: ``ucp import|export hf`` and ``ucp import dcp`` against the
fastest way to do the same job by hand with the same libraries, and against the issue's named peers.

    python tools/bench_interop.py --gib 1.1 --repeats 3

Per job, the way by hand that the 1.2x goal is judged by (``HAND``; the table's ``x hand`` column):

- ``import hf``: ``ucp import hf`` (in-process through ``ucp_store.cli.main``: every header checked,
  tensors from memory maps, source files hashed) against ``safetensors.torch.load_file`` + ``store.save``;
- ``export hf``: ``ucp export hf`` (in-process too: read from the store, write shards + index + config,
  fsync, rename) against ``Checkpoint.state_dict`` into the model then ``model.save_pretrained`` + fsync,
  the same job by hand with transformers' own writer (``state_dict`` + ``safetensors.torch.save_file``, a
  slower way by hand, is shown beside it). ``model.save_pretrained`` of the same weights *already in
  memory* is shown for reference (it skips the read from the store, so it does less than the job);
- ``import dcp``: ``bench_dcp(args)`` from ``tools/_bench_interop_dcp.py``: ``ucp import dcp`` against
  DCP's ``_load_state_dict`` + ``store.save`` by hand, with DCP's ``dcp_to_torch_save`` (+ fsync) of the
  same folder for reference (it writes one torch file, not a store).

Ceilings, in the same run, per job: the bytes the job reads (the source folder for the imports, the store's
array files for the export) copied into one file and fsynced, through an 8 MiB buffer (``raw_copy``) and by
the kernel alone (``kernel_copy``, ``copy_file_range``); ``x ceil`` is each way against the faster of the two.
Each way's output is removed once its clock stopped, so the disk holds one copy at a time.

fsync on every side: the store's writes fsync (TensorStore), ``ucp export hf`` fsyncs its files and
folders, and every hand-made or reference file is fsynced before the clock stops; dirty pages of earlier
steps are flushed (``os.sync``) before each clock starts.

The model is a Llama with GQA built from a config (no hub) sized to ``--gib`` of fp32 weights. Every way
runs once, untimed, on a tiny model first (first-use set-up goes to no way in particular). Each repeat
uses fresh stores (a second import into the same store would deduplicate every array) and alternates
which side runs first; the table reports the best of the repeats. The source folder was just written, so
both import paths read it from the page cache. No assertion here: the figures go in the closing note.
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

import ucp_store
from ucp_store import cli


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


def raw_copy(files: list[str], dest: str) -> int:
    """The machine's ceiling for moving these bytes: every file read into one reused 8 MiB buffer and
    appended to ``dest``, fsynced (what any way must at least do: read the bytes and write them durably)."""
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    total = 0
    with open(dest, "wb", buffering=0) as out:
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    out.write(view[:n])
                    total += n
        os.fsync(out.fileno())
    return total


def kernel_copy(files: list[str], dest: str) -> int:
    """The same bytes copied by the kernel alone (``os.copy_file_range``: page cache to page cache, no
    user-space buffer), fsynced: the lowest bound this machine sets for the job."""
    total = 0
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for path in files:
            src = os.open(path, os.O_RDONLY)
            try:
                left = os.fstat(src).st_size
                while left:
                    n = os.copy_file_range(src, fd, left)
                    if n == 0:
                        break
                    left -= n
                    total += n
            finally:
                os.close(src)
        os.fsync(fd)
    finally:
        os.close(fd)
    return total


def files_under(path: str) -> list[str]:
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs)


def remove(path: str) -> None:
    """Remove a way's output once its clock stopped (outside the timing), so the disk holds one at a time."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


CEILINGS = ("ceiling: raw copy (read + write) + fsync", "ceiling: kernel copy_file_range + fsync")


# The fastest way to do each job by hand with the same libraries: the ratio that the goal
# (within 1.2x) is judged by. The other peers are shown for reference (they do a different job).
HAND = {
    "import hf": "load_file + store.save",
    "export hf": "store state_dict + save_pretrained + fsync",
    "import dcp": "DCP load + store.save (by hand)",
}
REFERENCE = {
    "export hf": ("save_pretrained (weights in memory) + fsync", "does not read the store: the weights are "
                  "already in memory"),
    "import dcp": ("dcp_to_torch_save + fsync", "writes one torch.save file, not a store"),
}


def hf_ways(args, model):
    """The HF ways: (name, function of the work folder, what it leaves that is removed after its clock
    stops). They read ``work/src`` or the store ``work/s1`` that ``ucp import hf`` wrote this repeat."""
    from safetensors.torch import load_file, save_file

    def save_pretrained(work):
        src = os.path.join(work, "src")
        shutil.rmtree(src, ignore_errors=True)
        model.save_pretrained(src, max_shard_size=args.max_shard_size)
        fsync_tree(src)

    def ucp_import(work):
        rc = cli.main(["import", "hf", os.path.join(work, "src"), "--run", "ucp", "--store", os.path.join(work, "s1"),
                       "--no-progress"])
        assert rc == 0

    def hand_import(work):
        src = os.path.join(work, "src")
        store = ucp_store.open_store(os.path.join(work, "s2"), create=True)
        sd = {}
        for f in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):
            sd.update(load_file(os.path.join(src, f)))
        with open(os.path.join(src, "config.json")) as fh:
            cfg = json.load(fh)
        store.save("hand", 0, sd, objects={"hf.config": cfg})
        del sd

    def ucp_export(work):
        out = os.path.join(work, "out")
        rc = cli.main(["export", "hf", "ucp@0", out, "--max-shard-size", args.max_shard_size,
                       "--store", os.path.join(work, "s1"), "--no-progress"])
        assert rc == 0

    def hand_export(work):
        ck = ucp_store.open_store(os.path.join(work, "s1")).checkpoint("ucp@0")
        out = os.path.join(work, "hand")
        os.makedirs(out)
        sd = ck.state_dict("weight")
        save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out, "config.json"), "w") as fh:
            json.dump(ck.objects()["hf.config"], fh)
        fsync_tree(out)
        del sd

    def hand_export_pretrained(work):
        # the weights come from the store into the model, then transformers writes them: the same job as
        # `ucp export hf`, with the libraries' own fastest writer
        ck = ucp_store.open_store(os.path.join(work, "s1")).checkpoint("ucp@0")
        out = os.path.join(work, "hand2")
        sd = ck.state_dict("weight")
        model.load_state_dict(sd, strict=False)
        del sd
        model.save_pretrained(out, max_shard_size=args.max_shard_size)
        fsync_tree(out)

    def ceilings(what):
        """The two ceilings of a job, over the bytes it reads: ``src`` (imports) or the store (exports)."""
        def files(work):
            return (files_under(os.path.join(work, "src")) if what == "src" else
                    files_under(os.path.join(work, "s1", "arrays")))
        return [(CEILINGS[0], lambda work: raw_copy(files(work), os.path.join(work, "raw.bin")), "raw.bin"),
                (CEILINGS[1], lambda work: kernel_copy(files(work), os.path.join(work, "raw.bin")), "raw.bin")]

    imports = [("ucp import hf", ucp_import, None), (HAND["import hf"], hand_import, "s2")] + ceilings("src")
    exports = [("ucp export hf (from the store)", ucp_export, "out"),
               (HAND["export hf"], hand_export_pretrained, "hand2"),
               ("store state_dict + save_file + fsync", hand_export, "hand")] + ceilings("store")
    return save_pretrained, imports, exports


def bench_hf(args, work: str) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = build_model(args.gib)
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    print(f"model: {model.config.num_hidden_layers} layers, {nbytes / (1 << 30):.2f} GiB fp32", flush=True)
    times: dict[tuple[str, str], list[float]] = {}

    def rec(job, way, t):
        times.setdefault((job, way), []).append(t)
        CPU.setdefault((job, way), []).append(timed.cpu)
        print(f"  {job:<10} {way:<44} {t:8.2f} s  (cpu {timed.cpu:.2f} s)  load {os.getloadavg()[0]:.1f}",
              flush=True)

    def fresh(folder):
        for d in ("s1", "s2", "out", "hand", "hand2", "raw.bin"):  # a second import into one store would dedup
            remove(os.path.join(folder, d))

    # warm-up, untimed: every way once on a tiny model, so lazy imports and first-use set-up (TensorStore
    # context, catalog migrations, safetensors, transformers' save path) go to no way in particular
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    warm = os.path.join(work, "warm")
    save, imports, exports = hf_ways(args, tiny)
    save(warm)
    for _, fn, left in imports + exports:
        fn(warm)
        if left:
            remove(os.path.join(warm, left))
    shutil.rmtree(warm, ignore_errors=True)

    save, imports, exports = hf_ways(args, model)
    for r in range(args.repeats):
        fresh(work)
        # the export reference writes the source folder of this repeat (its time is recorded once per repeat)
        t, _ = timed(lambda: save(work))
        rec("export hf", REFERENCE["export hf"][0], t)
        for job, ways in (("import hf", imports), ("export hf", exports)):
            # ucp import hf runs first in every repeat (the exports read the store it writes); the others
            # rotate, so no way always runs right after the same one
            head = ways[:1] if job == "import hf" else []
            rest = ways[len(head):]
            k = r % len(rest)
            for way, fn, left in head + rest[k:] + rest[:k]:
                t, _ = timed(lambda fn=fn: fn(work))
                rec(job, way, t)
                if left:
                    remove(os.path.join(work, left))
    fresh(work)
    shutil.rmtree(os.path.join(work, "src"), ignore_errors=True)
    return [{"job": job, "way": way, "seconds": min(ts), "all": ts, "bytes": nbytes,
             "cpu_seconds": min(CPU[(job, way)]), "cpu_all": CPU[(job, way)]} for (job, way), ts in times.items()]


def print_table(rows: list[dict]) -> None:
    """Per job: every way, its role (ucp / by hand / reference / ceiling), best seconds, and the ratio to the
    fastest way by hand (``x hand``: the figure the 1.2x goal is judged by), to the machine's ceiling for
    the same bytes (``x ceil``: the faster of the two raw copies + fsync measured in this run) and to the
    fastest row of the job."""
    print()
    print(f"{'job':<11} {'way':<46} {'role':<10} {'best s':>7} {'GiB/s':>6} {'cpu s':>6} {'x hand':>7} "
          f"{'x ceil':>7} {'x fastest':>9}  all s")
    for job in dict.fromkeys(r["job"] for r in rows):
        mine = [r for r in rows if r["job"] == job]
        best = min(r["seconds"] for r in mine)
        hand = next((r["seconds"] for r in mine if r["way"] == HAND.get(job)), None)
        ceil = min((r["seconds"] for r in mine if r["way"] in CEILINGS), default=None)
        for r in sorted(mine, key=lambda r: r["seconds"]):
            role = ("ucp" if r["way"].startswith("ucp ") else "by hand" if r["way"] == HAND.get(job) else
                    "ceiling" if r["way"] in CEILINGS else "reference")
            rate = r["bytes"] / (1 << 30) / r["seconds"] if r.get("bytes") else float("nan")
            cpu = f"{r['cpu_seconds']:6.2f}" if "cpu_seconds" in r else "     -"
            vs_hand = f"{r['seconds'] / hand:6.2f}x" if hand else "      -"
            vs_ceil = f"{r['seconds'] / ceil:6.2f}x" if ceil else "      -"
            every = " ".join(f"{t:.2f}" for t in r.get("all", []))
            print(f"{job:<11} {r['way']:<46} {role:<10} {r['seconds']:7.2f} {rate:6.2f} {cpu} {vs_hand} {vs_ceil} "
                  f"{r['seconds'] / best:8.2f}x  {every}")
    print()
    for job, way in HAND.items():
        if any(r["job"] == job for r in rows):
            print(f"{job}: the fastest way by hand is '{way}'" +
                  (f"; '{REFERENCE[job][0]}' is shown for reference ({REFERENCE[job][1]})" if job in REFERENCE
                   else ""))
    print("ceiling: the same bytes (the source folder for imports, the store's array files for the export) "
          "copied into one file and fsynced, through an 8 MiB buffer or by copy_file_range; 'x ceil' is against "
          "the faster of the two.")
    print("fsync: on every side (ucp and the store's writes fsync through TensorStore; the hand-made, "
          "reference and ceiling files are fsynced before the clock stops).")


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
