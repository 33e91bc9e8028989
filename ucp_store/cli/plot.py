"""Drawing for ``ucp plan --plot``: which ranks read which chunks of one parameter (matplotlib, loaded here only)."""

from __future__ import annotations

import difflib
import math
from typing import Any

from ..errors import UcpError

__all__ = ["draw_plan"]


def draw_plan(ck: Any, plans: Any, param: str | None, path: str) -> None:
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
            near = difflib.get_close_matches(param, sorted({i.name for i in infos}), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise UcpError(f"--param {param!r}: checkpoint has no such tensor{hint}")
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
    for k in range(n, nrows * ncols):
        axes[k // ncols][k % ncols].axis("off")
    fig.suptitle(f"{info.name} [{info.state}] {list(info.shape)}, chunks {list(info.chunk_shape)}\n"
                 f"shaded: chunks read; outlined: boxes needed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
