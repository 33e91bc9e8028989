"""Tensor commands: ``read``, ``stats``, ``diff``, ``verify``. These read arrays, so they load numpy and
TensorStore (through the checkpoint API) when they run, never when the command line starts."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ucp_store.cli.common import EXIT_FAIL, EXIT_OK, Command, open_from_args, progress_wanted
from ucp_store.cli.output import print_json, table

__all__ = ["COMMANDS", "cmd_read", "cmd_stats", "cmd_diff", "cmd_verify", "json_values"]


def cmd_read(args: Any) -> int:
    """Print a tensor or a slice of it, or write it to a ``.npy`` file (only the chunks it touches are read)."""
    import numpy as np

    from ucp_store.registry.checkpoint import parse_slice

    if args.out:
        from ucp_store.errors import ConfigurationError
        from ucp_store.inputs import check_destination

        check_destination(args.out, "--out", ConfigurationError)  # before anything is read
        check_destination(args.out + ".tmp.npy", "--out's temporary file", ConfigurationError)  # np.save opens it
    ck = open_from_args(args).checkpoint(args.ref)
    if args.out:
        from ucp_store.inputs import check_outside

        check_outside(args.out, ck.store.location, "--out", ConfigurationError)
    handle = ck.tensor(args.name, args.state)
    index = parse_slice(args.slice) if args.slice else ()
    data = handle.read_numpy(index)
    if args.out:
        from ucp_store.io import space

        tmp = args.out + ".tmp.npy"
        needed = np.asarray(data).nbytes + 128  # the .npy header
        try:
            with space.guard(args.out, needed, f"tensor {handle.info.name!r} as .npy"):
                space.require(args.out, needed, f"tensor {handle.info.name!r} as .npy")
                np.save(tmp, np.asarray(data), allow_pickle=False)
            os.replace(tmp, args.out)
        except BaseException:  # e.g. --out names a folder: the rename fails; leave no temporary file
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
        print(f"wrote {args.out}: {list(np.shape(data))} {handle.info.dtype}")
    elif args.json:
        print_json({"name": handle.info.name, "state": handle.info.state, "shape": list(np.shape(data)),
                    "dtype": handle.info.dtype, "values": json_values(np.asarray(data))})
    else:
        with np.printoptions(threshold=200, edgeitems=4, linewidth=120), np.errstate(invalid="ignore"):
            print(np.asarray(data).astype(np.float32) if handle.info.dtype == "bfloat16" else np.asarray(data))
    return EXIT_OK


def json_values(data: Any) -> Any:
    """A numpy array as nested lists for ``read --json``: integers and booleans as they are, floats as
    float64 (NaN/Infinity become strings in ``print_json``), complex values as ``[re, im]`` pairs, so an
    element of a complex tensor of shape ``S`` sits at ``values[i][j]...`` = ``[re, im]``."""
    import numpy as np

    if data.dtype.kind in "biu":
        return data.tolist()
    with np.errstate(invalid="ignore"):  # a signaling NaN's cast warns (see checkpoint.compute_stats)
        if data.dtype.kind == "c":
            return np.stack([data.real, data.imag], axis=-1).astype(np.float64).tolist()
        return data.astype(np.float64).tolist()


def cmd_stats(args: Any) -> int:
    """min/max/mean/std/norm/NaN/Inf per tensor-state, computed chunk by chunk."""
    ck = open_from_args(args).checkpoint(args.ref)
    stats = ck.stats(args.name, args.state, progress=progress_wanted(args))
    if args.json:
        print_json([s.to_json() for s in stats])
        return EXIT_OK

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.6g}"

    table([[s.name, s.state, s.dtype, "x".join(map(str, s.shape)) or "()", f(s.min), f(s.max), f(s.mean), f(s.std),
            f(s.norm), s.nan, s.inf] for s in stats],
          ["name", "state", "dtype", "shape", "min", "max", "mean", "std", "norm", "nan", "inf"])
    return EXIT_OK


def cmd_diff(args: Any) -> int:
    """Compare two versions tensor by tensor."""
    from ucp_store.registry.checkpoint import diff

    store = open_from_args(args)
    if args.chunks:
        return _diff_chunks(store, args)
    rows = diff(store.checkpoint(args.ref_a), store.checkpoint(args.ref_b), progress=progress_wanted(args))
    if args.json:
        print_json(rows)
        return EXIT_OK
    counts = {k: sum(r["status"] == k for r in rows) for k in ("same", "changed", "added", "removed")}
    shown = rows if args.all else [r for r in rows if r["status"] != "same"]
    table([[r["name"], r["state"], r["status"], "-" if r.get("relative_change") is None
            else f"{r['relative_change']:.3e}", r.get("detail", "")] for r in shown],
          ["name", "state", "status", "rel. change", "detail"])
    print(", ".join(f"{v} {k}" for k, v in counts.items()))
    return EXIT_OK


def _diff_chunks(store, args: Any) -> int:
    """``diff --chunks``: per tensor-state, which inner chunks of B changed (``registry/pull.chunk_diff``)."""
    from ucp_store.registry.pull import chunk_diff

    rows = chunk_diff(store, args.ref_a, args.ref_b)
    if args.json:
        print_json([{**r, "changed": [list(c) for c in r.get("changed", [])]} for r in rows])
        return EXIT_OK
    shown = rows if args.all else [r for r in rows if r["status"] != "same"]
    table([[r["name"], r["state"], r["status"], f"{len(r.get('changed', []))}/{r.get('chunks', '-')}",
            "x".join(map(str, r.get("chunk_shape", []))) or "-", r.get("how", "-"),
            "-" if r.get("delta_bytes") is None else r["delta_bytes"],
            " ".join(":".join(map(str, c)) for c in r.get("changed", [])[:8])
            + (" ..." if len(r.get("changed", [])) > 8 else "")] for r in shown],
          ["name", "state", "status", "changed chunks", "chunk", "from", "delta bytes", "chunks (first 8)"])
    changed = sum(len(r.get("changed", [])) for r in rows)
    total = sum(r.get("chunks", 0) for r in rows)
    print(f"{changed} of {total} chunks changed in {sum(r['status'] == 'changed' for r in rows)} tensor-states")
    return EXIT_OK


def cmd_verify(args: Any) -> int:
    """Check every chunk checksum and content hash; exit 1 on a mismatch."""
    ck = open_from_args(args).checkpoint(args.ref)
    problems = ck.verify(progress=progress_wanted(args))
    if args.json:
        print_json({"id": ck.id, "ok": not problems, "problems": problems})
    elif problems:
        for p in problems:
            where = f" chunk {p['chunk']} (shard {p.get('shard')})" if p.get("chunk") is not None else ""
            print(f"FAIL {p['tensor']} [{p['state']}] array {p['array']}{where}: {p['error']}", file=sys.stderr)
    else:
        print(f"ok: {ck.run}@{ck.step} ({ck.id}): every chunk checksum and content hash matches")
    return EXIT_FAIL if problems else EXIT_OK


def _read_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("ref")
    sp.add_argument("name")
    sp.add_argument("--state", default=None,
                    help="state (default: fp32, else weight, else the largest, never a 0-d one when a larger exists)")
    sp.add_argument("--slice", default=None, help='numpy-style slice, e.g. "3:5,:"')
    sp.add_argument("--out", default=None, help="write a .npy file")


def _stats_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("ref")
    sp.add_argument("name", nargs="?")
    sp.add_argument("--state", default=None)


def _diff_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("ref_a")
    sp.add_argument("ref_b")
    sp.add_argument("--all", action="store_true", help="list unchanged tensors too")
    sp.add_argument("--chunks", action="store_true",
                    help="which inner chunks changed per tensor-state (from a delta's shard indexes where B is a "
                         "delta of A, else by comparing values)")


def _verify_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("ref")


COMMANDS = {
    "read": Command(cmd_read, "read a tensor or a slice of it (only the chunks it touches); --json: complex "
                    "values as [re, im], NaN/Infinity as strings", _read_args),
    "stats": Command(cmd_stats, "min/max/mean/std/norm/NaN/Inf, computed chunk by chunk", _stats_args),
    "diff": Command(cmd_diff, "compare two versions tensor by tensor", _diff_args),
    "verify": Command(cmd_verify, "check every chunk checksum and content hash (exit 1 on mismatch)", _verify_args),
}
