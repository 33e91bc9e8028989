"""Drawing for ``ucp plan --plot``: which ranks read which chunks of one parameter (matplotlib, loaded here only)."""

from __future__ import annotations

import difflib
import math
from typing import Any

from ucp_store.errors import UcpError

__all__ = ["draw_plan"]


def _draw_experts(ax: Any, groups: Any, topo: Any, cmap: Any, rectangle: Any) -> None:
    """Rows: expert groups; columns: experts; colour: the target ep rank holding the expert."""
    width = max(g.num_experts for g in groups)
    ax.set_xlim(0, width)
    ax.set_ylim(len(groups), 0)
    for row, g in enumerate(groups):
        per = g.num_experts // topo.ep if g.num_experts % topo.ep == 0 else None
        for e in range(g.num_experts):
            owner = e // per if per else None
            color = cmap(owner % 10) if owner is not None else "lightgrey"
            ax.add_patch(rectangle((e, row), 1, 1, color=color, alpha=0.8, ec="white", lw=1))
            ax.text(e + 0.5, row + 0.5, f"e{e}" + (f"\nep{owner}" if owner is not None else ""), ha="center",
                    va="center", fontsize=6)
    ax.set_yticks([r + 0.5 for r in range(len(groups))])
    ax.set_yticklabels([g.name.split(".deepspeed_moe")[0][-24:] for g in groups], fontsize=6)
    ax.set_xticks([])
    ax.set_title(f"experts by ep rank (ep={topo.ep})", fontsize=8)


def draw_plan(ck: Any, plans: Any, param: str | None, path: str, *, topology: Any = None) -> None:
    """One panel per rank: the parameter's chunk grid, chunks the rank reads shaded, its boxes outlined.

    With MoE experts (and ``topology``), one more panel: the expert map, every expert of every expert group
    coloured by the ep rank that holds it in the target topology."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    infos = ck.tensors()
    from ucp_store.plan.experts import expert_groups

    groups = expert_groups(infos) if topology is not None else []
    if param is None:
        info = max(infos, key=lambda i: (i.nbytes, i.state == "fp32"))
    else:
        cands = [i for i in infos if i.name == param]
        if not cands:
            near = difflib.get_close_matches(param, sorted({i.name for i in infos}), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise UcpError(f"--param {param!r}: checkpoint has no such tensor{hint}")
        info = next((i for i in cands if i.state == "fp32"), cands[0])
    shape = info.shape if len(info.shape) >= 2 else (1, *(info.shape or (1,)))
    chunk = info.chunk_shape if len(info.chunk_shape) >= 2 else (1, *(info.chunk_shape or (1,)))
    rows, cols = math.prod(shape[:-1]), shape[-1]
    crows = math.prod(chunk[:-1]) if len(chunk) > 1 else 1
    n = len(plans)
    ncols = min(n + (1 if groups else 0), 4)
    nrows = math.ceil((n + (1 if groups else 0)) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 3.0 * nrows), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for k, p in enumerate(plans):
        ax = axes[k // ncols][k % ncols]
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        shown = " ".join(f"{a}{v}" for a, v in p.coords.items() if a in ("tp", "pp", "dp", "ep"))
        ax.set_title(f"rank {p.rank} {shown}", fontsize=8)
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
    if groups:
        _draw_experts(axes[n // ncols][n % ncols], groups, topology, cmap, Rectangle)
        n += 1
    for k in range(n, nrows * ncols):
        axes[k // ncols][k % ncols].axis("off")
    fig.suptitle(f"{info.name} [{info.state}] {list(info.shape)}, chunks {list(info.chunk_shape)}\n"
                 f"shaded: chunks read; outlined: boxes needed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
