"""``ucp plan``: bytes and chunks per rank, read amplification, and a picture of who reads what."""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import UcpError
from .patterns import parse_pattern
from .planner import plan as make_plan
from .topology import Topology


def _infer_layers(infos) -> int:
    layers = [parse_pattern(i.pattern).layer for i in infos if i.pattern]
    layers = [x for x in layers if x is not None]
    return max(layers) + 1 if layers else 0


def topology_from_args(args, infos) -> Topology:
    layers = args.layers if args.layers is not None else _infer_layers(infos)
    if args.pp > 1 and layers == 0:
        raise UcpError("--pp > 1 needs layers: the checkpoint's patterns name no layer placement; pass --layers N")
    return Topology(tp=args.tp, pp=args.pp, dp=args.dp, zero_stage=args.zero, sp=args.sp, ep=args.ep,
                    vocab_multiple=args.vocab_multiple, layers=layers)


def run_plan(args, store) -> int:
    from .cli import _fmt_bytes, _print_json, _table

    ck = store.checkpoint(args.ref)
    infos = ck.tensors()
    topo = topology_from_args(args, infos)
    states = args.states.split(",") if args.states else None
    ranks = [args.rank] if args.rank is not None else list(range(topo.world_size))
    for r in ranks:
        if not 0 <= r < topo.world_size:
            raise UcpError(f"--rank {r} is outside the topology's {topo.world_size} ranks ({topo.describe()})")
    plans = [make_plan(infos, topo, r, states=states) for r in ranks]
    if args.json:
        if len(plans) == 1:
            _print_json(plans[0].to_json())
        else:
            _print_json({"topology": topo.to_json(), "ranks": [
                {"rank": p.rank, "coords": dict(p.coords), **p.to_json()["totals"]} for p in plans]})
    else:
        print(f"{ck.run}@{ck.step} -> {topo.describe()}")
        _table([[p.rank, " ".join(f"{k}{v}" for k, v in p.coords.items()), len(p.tensors), p.num_reads,
                 p.chunks_touched, _fmt_bytes(p.bytes_needed), _fmt_bytes(p.bytes_read), f"{p.read_amplification:.3f}"]
                for p in plans],
               ["rank", "coords", "tensor-states", "reads", "chunks", "bytes needed", "bytes read", "amplification"])
        needed = sum(p.bytes_needed for p in plans)
        read = sum(p.bytes_read for p in plans)
        print(f"all ranks: {_fmt_bytes(read)} read for {_fmt_bytes(needed)} needed "
              f"(amplification {read / needed if needed else 1.0:.3f})")
    if args.plot:
        draw_plan(ck, plans, args.param, args.plot)
        print(f"wrote {args.plot}")
    return 0


def draw_plan(ck, plans, param: str | None, path: str) -> None:
    """One panel per rank: the parameter's chunk grid, chunks the rank reads shaded, its boxes outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    infos = ck.tensors()
    if param is None:
        info = max(infos, key=lambda i: (i.nbytes, i.state == "fp32"))
    else:
        cands = [i for i in infos if i.name == param]
        if not cands:
            raise UcpError(f"--param {param!r}: checkpoint has no such tensor")
        info = next((i for i in cands if i.state == "fp32"), cands[0])
    shape = info.shape if len(info.shape) >= 2 else (1, *(info.shape or (1,)))
    chunk = info.chunk_shape if len(info.chunk_shape) >= 2 else (1, *(info.chunk_shape or (1,)))
    rows, cols = math.prod(shape[:-1]), shape[-1]
    crows = math.prod(chunk[:-1]) if len(chunk) > 1 else 1
    n = len(plans)
    ncols = min(n, 4)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 3.0 * nrows), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for k, p in enumerate(plans):
        ax = axes[k // ncols][k % ncols]
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_title(f"rank {p.rank} " + " ".join(f"{a}{v}" for a, v in p.coords.items() if a in ("tp", "pp", "dp", "ep")),
                     fontsize=8)
        ax.tick_params(labelsize=6)
        tps = [t for t in p.tensors if t.name == info.name and t.state == info.state]
        touched = set()
        for t in tps:
            for r in t.reads:
                box = r.box.ranges if len(r.box.ranges) >= 2 else ((0, 1), *(r.box.ranges or ((0, 1),)))
                r0, r1 = box[0]
                c0, c1 = box[-1]
                ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, fill=False, lw=0.8, ec=cmap(k % 10)))
                for i in range(r0 // crows, (r1 - 1) // crows + 1):
                    for j in range(c0 // chunk[-1], (c1 - 1) // chunk[-1] + 1):
                        touched.add((i, j))
        for i, j in touched:
            ax.add_patch(Rectangle((j * chunk[-1], i * crows), chunk[-1], crows, color=cmap(k % 10), alpha=0.35, lw=0))
        if not tps:
            ax.text(cols / 2, rows / 2, "not on this rank", ha="center", va="center", fontsize=7)
    for k in range(n, nrows * ncols):
        axes[k // ncols][k % ncols].axis("off")
    fig.suptitle(f"{info.name} [{info.state}] {list(info.shape)}, chunks {list(info.chunk_shape)}\n"
                 f"shaded: chunks read; outlined: boxes needed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
