"""Drawing for ``ucp plan --plot`` and the demo's ``plan.png``: which ranks read which chunks of one tensor-state
(matplotlib, loaded here only).

The cost is bounded by the picture, not by the chunk grid: each rank's panel is one image of the chunk grid
(touched chunks shaded; a grid finer than ``MAX_CELLS`` cells is drawn in blocks of chunks, a block shaded when
any chunk in it is read), one line collection of the boxes the rank needs, and the chunk lines when there are
few. At most ``MAX_PANELS`` ranks are drawn. ``draw_plan`` and ``draw_boxes`` return what they drew
(``Drawn``), artists counted, which the tests and the demo's report check.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ucp_store.errors import UcpError
from ucp_store.records import TensorInfo, main_state

__all__ = ["MAX_BOXES", "MAX_CELLS", "MAX_PANELS", "Drawn", "Panel", "draw_boxes", "draw_plan", "pick_tensor"]

#: the finest chunk grid one panel draws cell by cell (beyond it, blocks of chunks)
MAX_CELLS = 1 << 18
#: the largest chunk grid whose chunks read are counted exactly (a bool per chunk)
MAX_COUNTED = 1 << 24
#: the most ranks drawn (one panel each)
MAX_PANELS = 16
#: the most box outlines one panel draws (beyond it, only the shading)
MAX_BOXES = 4096
#: chunk lines are drawn when the grid has at most this many chunks along each axis
MAX_LINES = 64
#: the most experts the expert panel labels one by one
MAX_EXPERT_LABELS = 256


@dataclass(frozen=True)
class Panel:
    """One rank's panel: its rank, mesh or topology coordinates, and the boxes (``[(lo, hi), ...]`` per dim,
    in the tensor's logical coordinates) it reads of the tensor-state drawn; ``None``: it holds none."""

    rank: int
    coords: dict
    boxes: list | None


@dataclass
class Drawn:
    """What a drawing showed: the tensor-state, the ranks drawn, the chunks each read, and the artists."""

    name: str
    state: str
    shape: list[int]
    chunk_shape: list[int]
    ranks: list[int] = field(default_factory=list)
    chunks_read: list[int] = field(default_factory=list)
    artists: int = 0
    cell: list[int] = field(default_factory=list)  # chunks per drawn cell along each dim (1: cell = chunk)

    @property
    def label(self) -> str:
        return f"{self.name} [{self.state}]"

    def to_json(self) -> dict:
        return {"name": self.name, "state": self.state, "shape": self.shape, "chunk_shape": self.chunk_shape,
                "ranks": self.ranks, "chunks_read": self.chunks_read, "artists": self.artists, "cell": self.cell}


def pick_tensor(infos: Sequence[TensorInfo], param: str | None, *, flag: str = "--param") -> TensorInfo:
    """The tensor-state to draw: ``param``'s state by ``records.main_state`` (fp32, weight, the largest, never a
    0-d one when a larger exists), or without ``param`` that of the largest tensor."""
    if param is None:
        if not infos:
            raise UcpError("plot: the checkpoint holds no tensor")
        param = max(infos, key=lambda i: (i.nbytes, -i.position)).name
    cands = [i for i in infos if i.name == param]
    if not cands:
        near = difflib.get_close_matches(param, sorted({i.name for i in infos}), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise UcpError(f"{flag} {param!r}: checkpoint has no such tensor{hint}")
    return main_state(cands)


def _as_2d(shape: Sequence[int]) -> tuple[int, ...]:
    """0-d as 1x1, 1-d as one row; 2-d and more unchanged."""
    shape = tuple(int(s) for s in shape)
    return (1, 1) if not shape else (1, *shape) if len(shape) == 1 else shape


def _box_2d(box: Sequence, ndim: int) -> tuple[tuple[int, int], ...]:
    ranges = tuple((int(lo), int(hi)) for lo, hi in box)
    if ndim == 0:
        return ((0, 1), (0, 1))
    return ((0, 1), *ranges) if ndim == 1 else ranges


def _cell_factors(grid: tuple[int, ...], max_cells: int) -> list[int]:
    """Chunks per drawn cell along each dim, so that the drawn grid has at most ``max_cells`` cells."""
    f = [1] * len(grid)
    while math.prod(-(-g // x) for g, x in zip(grid, f)) > max_cells:
        d = max(range(len(grid)), key=lambda k: -(-grid[k] // f[k]))
        f[d] *= 2
    return f


def _touched(boxes: Iterable, shape: tuple[int, ...], chunk: tuple[int, ...], factors: list[int]):
    """The drawn grid's cells the boxes touch (bool array, one cell per ``factors`` block of chunks) and the
    number of chunks the boxes touch (chunks counted once). Cost: one slice per box."""
    import numpy as np

    grid = tuple(-(-s // c) for s, c in zip(shape, chunk))
    cells = np.zeros(tuple(-(-g // f) for g, f in zip(grid, factors)), dtype=bool)
    exact = np.zeros(grid, dtype=bool) if math.prod(grid) <= MAX_COUNTED else None
    for box in boxes:
        if any(hi <= lo for lo, hi in box):
            continue
        first = [lo // c for (lo, _), c in zip(box, chunk)]
        last = [(hi - 1) // c for (_, hi), c in zip(box, chunk)]
        cells[tuple(slice(a // f, b // f + 1) for a, b, f in zip(first, last, factors))] = True
        if exact is not None:
            exact[tuple(slice(a, b + 1) for a, b in zip(first, last))] = True
    n = int(exact.sum()) if exact is not None else -1  # -1: too many chunks to count here
    return cells, n


def _outlines(boxes: list) -> list:
    """Each box's outline as a closed polyline (x: last dim, y: rows), for one LineCollection."""
    out = []
    for box in boxes:
        (r0, r1), (c0, c1) = box[0], box[-1]
        out.append([(c0, r0), (c1, r0), (c1, r1), (c0, r1), (c0, r0)])
    return out


def _panel(ax: Any, panel: Panel, info: TensorInfo, color: Any, factors: list[int]) -> tuple[int, int]:
    """One rank's panel; returns (artists added, chunks read)."""
    import numpy as np
    from matplotlib.collections import LineCollection

    shape, chunk = _as_2d(info.shape), _as_2d(info.chunk_shape or info.shape)
    flat_rows = len(shape) > 2  # 3-d and more: rows are the flattened leading chunk grid
    rows, cols = math.prod(shape[:-1]), shape[-1]
    artists = 0
    boxes = [_box_2d(b, len(info.shape)) for b in (panel.boxes or [])]
    cells, n = _touched(boxes, shape, chunk, factors)
    image = cells.reshape(-1, cells.shape[-1])
    rgba = np.zeros((*image.shape, 4), dtype=np.float32)
    rgba[image] = (*color[:3], 0.45)
    width = image.shape[1] * factors[-1] * chunk[-1]
    height = image.shape[0] * factors[0] * chunk[0] if not flat_rows else image.shape[0]
    ax.imshow(rgba, extent=(0, width, height, 0), interpolation="nearest", aspect="auto")
    artists += 1
    ax.set_xlim(0, cols)
    ax.set_ylim(rows if not flat_rows else image.shape[0], 0)
    grid = [-(-s // c) for s, c in zip(shape, chunk)]
    if not flat_rows and grid[0] <= MAX_LINES and grid[1] <= MAX_LINES and (grid[0] > 1 or grid[1] > 1):
        ax.hlines([i * chunk[0] for i in range(1, grid[0])], 0, cols, colors="lightgrey", lw=0.4)
        ax.vlines([j * chunk[1] for j in range(1, grid[1])], 0, rows, colors="lightgrey", lw=0.4)
        artists += 2
    if boxes and not flat_rows and len(boxes) <= MAX_BOXES:
        ax.add_collection(LineCollection(_outlines(boxes), colors=[color], linewidths=0.8))
        artists += 1
    if panel.boxes is None:
        ax.text(cols / 2, (rows if not flat_rows else image.shape[0]) / 2, "not on this rank", ha="center",
                va="center", fontsize=7)
        artists += 1
    if flat_rows:
        ax.set_ylabel("chunk rows (dims 0..-2)", fontsize=6)
    shown = " ".join(f"{a}{v}" for a, v in panel.coords.items() if a in ("tp", "pp", "dp", "ep"))
    read = f", {n} chunk{'s' if n != 1 else ''} read" if n >= 0 else ""
    ax.set_title(f"rank {panel.rank} {shown}{read}", fontsize=8)
    ax.tick_params(labelsize=6)
    return artists, n


def _draw_experts(ax: Any, groups: Any, topo: Any, cmap: Any) -> int:
    """Rows: expert groups; columns: experts; colour: the target ep rank holding the expert (one image; each
    expert labelled only when there are few). Returns the artists added."""
    import numpy as np

    width = max(g.num_experts for g in groups)
    rgba = np.ones((len(groups), width, 4), dtype=np.float32)
    labels = []
    for row, g in enumerate(groups):
        per = g.num_experts // topo.ep if g.num_experts % topo.ep == 0 else None
        for e in range(g.num_experts):
            owner = e // per if per else None
            rgba[row, e] = (*cmap(owner % 10)[:3], 0.8) if owner is not None else (0.83, 0.83, 0.83, 0.8)
            labels.append((e, row, f"e{e}" + (f"\nep{owner}" if owner is not None else "")))
    ax.imshow(rgba, extent=(0, width, len(groups), 0), interpolation="nearest", aspect="auto")
    artists = 1
    if len(labels) <= MAX_EXPERT_LABELS:
        for e, row, text in labels:
            ax.text(e + 0.5, row + 0.5, text, ha="center", va="center", fontsize=6)
        artists += len(labels)
    ax.set_yticks([r + 0.5 for r in range(len(groups))] if len(groups) <= MAX_LINES else [])
    if len(groups) <= MAX_LINES:
        ax.set_yticklabels([g.name.split(".deepspeed_moe")[0][-24:] for g in groups], fontsize=6)
    ax.set_xticks([])
    ax.set_title(f"experts by ep rank (ep={topo.ep})", fontsize=8)
    return artists


def draw_boxes(info: TensorInfo, panels: Sequence[Panel], path: str, *, groups: Any = (), topology: Any = None,
               note: str = "") -> Drawn:
    """Draw ``panels`` (at most ``MAX_PANELS``) of tensor-state ``info`` into ``path``; with MoE expert ``groups``
    and their target ``topology``, one more panel: the expert map. Returns what was drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = list(panels)[:MAX_PANELS]
    extra = 1 if groups else 0
    n = len(shown)
    ncols = max(1, min(n + extra, 4))
    nrows = max(1, math.ceil((n + extra) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 3.0 * nrows), squeeze=False)
    cmap = plt.get_cmap("tab10")
    shape, chunk = _as_2d(info.shape), _as_2d(info.chunk_shape or info.shape)
    factors = _cell_factors(tuple(-(-s // c) for s, c in zip(shape, chunk)), MAX_CELLS)
    drawn = Drawn(info.name, info.state, list(info.shape), list(info.chunk_shape), cell=factors)
    try:
        for k, p in enumerate(shown):
            added, count = _panel(axes[k // ncols][k % ncols], p, info, cmap(k % 10), factors)
            drawn.ranks.append(p.rank)
            drawn.chunks_read.append(count)
            drawn.artists += added
        if groups:
            drawn.artists += _draw_experts(axes[n // ncols][n % ncols], groups, topology, cmap)
        for k in range(n + extra, nrows * ncols):
            axes[k // ncols][k % ncols].axis("off")
        more = f" (first {MAX_PANELS} of {len(panels)} ranks)" if len(panels) > MAX_PANELS else ""
        cells = "" if factors == [1] * len(factors) else f"; a cell is {'x'.join(map(str, factors))} chunks"
        fig.suptitle(f"{info.name} [{info.state}] {list(info.shape)}, chunks {list(info.chunk_shape)}{more}\n"
                     f"shaded: chunks read{cells}; outlined: boxes needed{note}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return drawn


def draw_plan(ck: Any, plans: Any, param: str | None, path: str, *, topology: Any = None) -> Drawn:
    """``ucp plan --plot``: one panel per rank (at most ``MAX_PANELS``), the chunk grid of ``param``'s state
    (``pick_tensor``) with the chunks the rank reads shaded and its boxes outlined. With MoE experts (and
    ``topology``), one more panel: every expert of every expert group coloured by the ep rank that holds it."""
    infos = ck.tensors()
    from ucp_store.plan.experts import expert_groups

    groups = expert_groups(infos) if topology is not None else []
    info = pick_tensor(infos, param)
    panels = []
    for p in plans:
        tps = [t for t in p.tensors if t.name == info.name and t.state == info.state]
        boxes = [r.box.ranges for t in tps for r in t.reads] if tps else None
        panels.append(Panel(p.rank, dict(p.coords), boxes))
    return draw_boxes(info, panels, path, groups=groups, topology=topology)
