"""``ucp plan --plot`` and the demo's plan.png (``cli.plot``): the drawing's cost is bounded by the picture, not by
the chunk grid, and the picture still shows which rank reads which chunks (issue 37: one matplotlib patch per
touched chunk made the demo's 8192 x 40 weight with a 0-d chunk shape take five minutes).

Counted, not timed: the artists of the figure ``draw_boxes`` saves (captured at ``savefig``), and the shaded
cells of each rank's panel image.
"""

from __future__ import annotations

import pytest

from ucp_store.cli import plot
from ucp_store.records import TensorInfo

matplotlib = pytest.importorskip("matplotlib")


def _info(name, state, shape, chunk, nbytes=None, position=0):
    n = nbytes if nbytes is not None else 4 * max(1, int(__import__("math").prod(shape)))
    return TensorInfo(name, state, tuple(shape), "float32", None, tuple(chunk), tuple(chunk), "a", "id", nbytes=n,
                      position=position)


@pytest.fixture
def saved(monkeypatch):
    """The figures ``draw_boxes`` saves, kept open for counting (the real savefig still writes the PNG)."""
    from matplotlib.figure import Figure

    figs = []
    real = Figure.savefig

    def keep(self, *a, **k):
        figs.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figs


def _artists(fig) -> int:
    """Every artist in the figure, recursively (patches, lines, images, texts, collections, axis parts)."""
    seen = set()

    def walk(a):
        if id(a) in seen:
            return
        seen.add(id(a))
        for c in a.get_children():
            walk(c)

    walk(fig)
    return len(seen)


def _shaded(ax):
    """The panel image's shaded cells (alpha > 0) as a bool array, rows x cols of the drawn grid."""
    (img,) = ax.get_images()
    return img.get_array()[..., 3] > 0


def test_a_one_element_chunk_grid_over_a_million_elements_draws_a_bounded_picture(tmp_path, saved):
    info = _info("w", "weight", (1000, 1000), (1, 1))
    # four ranks, each reading a quarter of the rows as 250 one-row boxes: 250,000 touched chunks per rank
    panels = [plot.Panel(r, {"dp": r}, [[(250 * r + i, 250 * r + i + 1), (0, 1000)] for i in range(250)])
              for r in range(4)]
    path = tmp_path / "big.png"
    drawn = plot.draw_boxes(info, panels, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = saved
    assert _artists(fig) < 2000, _artists(fig)  # 1,000,000 chunks, a few hundred artists
    assert drawn.ranks == [0, 1, 2, 3] and drawn.chunks_read == [250_000] * 4
    assert drawn.cell != [1, 1]  # drawn in blocks of chunks
    for r, ax in enumerate(fig.axes[:4]):
        shaded = _shaded(ax)
        rows = shaded.any(axis=1)
        quarter = len(rows) // 4
        assert rows[r * quarter:(r + 1) * quarter].all(), r  # its quarter of the rows is shaded ...
        assert not rows[:r * quarter].any() and not rows[(r + 1) * quarter:].any(), r  # ... and nothing else
        assert shaded[rows].all()  # every column of those rows
        assert ax.get_title().startswith(f"rank {r} dp{r}")


def test_a_0d_chunk_shape_is_one_chunk_and_the_grid_is_drawn_exactly(tmp_path, saved):
    """The demo's embedding: 8192 x 40, chunks of 1024 rows; TP=2 reads rows by halves (strided)."""
    info = _info("tok_embeddings.weight", "weight", (8192, 40), (1024, 40))
    halves = [[[(0, 2048), (0, 40)], [(4096, 6144), (0, 40)]], [[(2048, 4096), (0, 40)], [(6144, 8192), (0, 40)]]]
    drawn = plot.draw_boxes(info, [plot.Panel(r, {"tp": r}, b) for r, b in enumerate(halves)], str(tmp_path / "p.png"))
    (fig,) = saved
    assert drawn.chunks_read == [4, 4] and drawn.cell == [1, 1]
    assert [_shaded(ax)[:, 0].tolist() for ax in fig.axes[:2]] == [[1, 1, 0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 1, 1]]
    assert _artists(fig) < 400
    # a 0-d tensor (an optimizer's step) is one chunk, never a grid of its elements
    step = _info("tok_embeddings.weight", "step", (), ())
    drawn = plot.draw_boxes(step, [plot.Panel(0, {}, [[]])], str(tmp_path / "s.png"))
    assert drawn.chunks_read == [1]


def test_pick_tensor_draws_the_weight_not_the_step():
    rows = [_info("e", "step", (), (), position=1), _info("e", "exp_avg", (8, 4), (8, 4), position=2),
            _info("e", "weight", (8, 4), (8, 4), position=3), _info("big", "weight", (64, 64), (8, 8), position=4)]
    assert plot.pick_tensor(rows, "e").state == "weight"
    assert plot.pick_tensor(rows, None).name == "big"
    with pytest.raises(Exception, match="did you mean 'big'"):
        plot.pick_tensor(rows, "bgi")


def test_only_the_first_ranks_are_drawn(tmp_path, saved):
    info = _info("w", "weight", (64, 64), (8, 8))
    panels = [plot.Panel(r, {"dp": r}, [[(r % 64, r % 64 + 1), (0, 64)]]) for r in range(1000)]
    drawn = plot.draw_boxes(info, panels, str(tmp_path / "many.png"))
    (fig,) = saved
    assert len(drawn.ranks) == plot.MAX_PANELS and "first 16 of 1000 ranks" in fig.texts[0].get_text()
    assert _artists(fig) < 2000


def test_draw_plan_reads_a_plans_boxes_and_marks_ranks_without_the_tensor(tmp_path, saved):
    """``ucp plan --plot``'s entry: the plan's reads of the picked state, per rank; a rank that holds none of it
    says so (a pipeline stage without the tensor)."""
    from types import SimpleNamespace as NS

    infos = [_info("emb", "step", (), (), position=1), _info("emb", "fp32", (4096, 64), (256, 64), position=2)]
    ck = NS(tensors=lambda: infos)

    def rank(r, rows):
        reads = [NS(box=NS(ranges=((lo, hi), (0, 64)))) for lo, hi in rows]
        return NS(rank=r, coords={"pp": r}, tensors=[NS(name="emb", state="fp32", reads=reads)] if rows else [])

    drawn = plot.draw_plan(ck, [rank(0, [(0, 1000), (3000, 3100)]), rank(1, [])], None, str(tmp_path / "p.png"))
    (fig,) = saved
    assert drawn.label == "emb [fp32]" and drawn.chunks_read == [6, 0]  # rows 0-1000: chunks 0-3; 3000-3100: 11 and 12
    assert _shaded(fig.axes[0])[:, 0].tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0]
    assert not _shaded(fig.axes[1]).any()
    assert any(t.get_text() == "not on this rank" for t in fig.axes[1].texts)
