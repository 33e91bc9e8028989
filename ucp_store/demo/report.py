"""The demo's verdict: the loss table, the tolerance each resumed run is held to, and the loss picture.

Which tolerance applies where, and why:

- **bitwise** (`"bitwise"`): resuming on the mesh that saved (TP=2 x DP=2). Every rank holds the same
  shards as before, runs the same kernels on one thread in the same order, and the losses of the dp ranks
  are averaged in the same order: if the checkpoint restored every bit of the model and optimizer state,
  each later loss is the same float, so any difference at all is a failed resume.
- **relative** (`RTOL`): resuming on another mesh. The state loads bit for bit there too (`verify` checks
  it on every rank), but the arithmetic that follows is not the same: TP splits the matmuls of attention
  and the MLP into partial sums added in another order, FSDP over another dp degree averages the gradients
  of other sub-batches in another order, and the loss is a mean over other sub-batch means. Floating point
  addition is not associative, so the losses differ in the last bits at the first step and drift slowly
  after it. `RTOL` bounds |resumed - uninterrupted| / |uninterrupted| at every step; it is loose enough
  for that drift over the demo's steps and tight enough that a wrong shard, a lost optimizer moment or
  a 1% change of one tensor fails it.
"""

from __future__ import annotations

import math

__all__ = ["RTOL", "Verdict", "compare", "draw_losses", "print_table"]

RTOL = 1e-5


class Verdict:
    """One resumed run against the uninterrupted one: the rule, the largest differences, pass or fail."""

    def __init__(self, key: str, label: str, rule: str, steps: list[int], max_abs: float, max_rel: float,
                 worst_step: int | None, ok: bool) -> None:
        self.key, self.label, self.rule, self.steps = key, label, rule, steps
        self.max_abs, self.max_rel, self.worst_step, self.ok = max_abs, max_rel, worst_step, ok

    def describe(self) -> str:
        """One line: the run, its rule and how it fared."""
        rule = "bitwise" if self.rule == "bitwise" else f"relative difference <= {RTOL:.0e}"
        where = f" (worst at step {self.worst_step})" if self.worst_step is not None else ""
        state = "ok" if self.ok else "DIVERGED"
        return (f"{self.label}: {state}: rule {rule}; largest |difference| {self.max_abs:.3e}, "
                f"relative {self.max_rel:.3e}{where}")


def compare(key: str, label: str, rule: str, base: dict[int, float], resumed: dict[int, float]) -> Verdict:
    """Hold `resumed` to `rule` ("bitwise" or "relative") against the uninterrupted losses `base`."""
    steps = sorted(resumed)
    max_abs, max_rel, worst = 0.0, 0.0, None
    ok = True
    for s in steps:
        a, b = base[s], resumed[s]
        if not (math.isfinite(a) and math.isfinite(b)):
            ok = False
            worst = s
            max_abs = max_rel = math.inf
            continue
        d = abs(a - b)
        rel = d / max(abs(a), 1e-30)
        if d > max_abs:
            max_abs, worst = d, s
        max_rel = max(max_rel, rel)
        if rule == "bitwise":
            ok = ok and a == b
        else:
            ok = ok and rel <= RTOL
    return Verdict(key, label, rule, steps, max_abs, max_rel, worst, ok)


def print_table(console, base_label: str, base: dict[int, float], runs: list[tuple[str, dict[int, float]]],
                verdicts: list[Verdict]) -> None:
    """A rich table: one row per step, the uninterrupted run and every resumed run side by side."""
    from rich.table import Table

    t = Table(title="loss per step (resumed runs start after the checkpoint they load)", header_style="bold",
              title_justify="left")
    t.add_column("step", justify="right")
    t.add_column(base_label, justify="right")
    for label, _ in runs:
        t.add_column(label, justify="right")
    for s in sorted(base):
        row = [str(s), f"{base[s]:.7f}"]
        for _, losses in runs:
            if s not in losses:
                row.append("")
            elif losses[s] == base[s]:
                row.append(f"{losses[s]:.7f} [green]=[/]")
            else:
                row.append(f"{losses[s]:.7f}")
        t.add_row(*row)
    t.add_section()
    t.add_row("max |diff|", "", *[f"{v.max_abs:.2e}" for v in verdicts])
    t.add_row("max rel.", "", *[f"{v.max_rel:.2e}" for v in verdicts])
    t.add_row("tolerance", "", *["bitwise" if v.rule == "bitwise" else f"rel <= {RTOL:.0e}" for v in verdicts])
    t.add_row("verdict", "", *["[green]ok[/]" if v.ok else "[red bold]DIVERGED[/]" for v in verdicts])
    console.print(t)


def draw_losses(path: str, base_label: str, base: dict[int, float], runs: list[tuple[str, dict[int, float]]],
                resume_step: int, saves: dict[int, str]) -> None:
    """`loss_curves.png`: the curves overlaid, and beside them each resumed run's relative difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    xs = sorted(base)
    ax.plot(xs, [base[s] for s in xs], "k-", lw=1.5, label=base_label)
    markers = ["o", "x", "+", "s", "^", "v"]
    floor = 1e-12
    for i, (label, losses) in enumerate(runs):
        rs = sorted(losses)
        ax.plot(rs, [losses[s] for s in rs], markers[i % len(markers)], ms=5, mfc="none", label=label)
        rel = [max(abs(losses[s] - base[s]) / max(abs(base[s]), 1e-30), floor) for s in rs]
        bx.semilogy(rs, rel, markers[i % len(markers)] + "-", ms=4, mfc="none", lw=0.8, label=label)
    for s, kind in sorted(saves.items()):
        ax.axvline(s, color="tab:blue" if kind == "async" else "grey", lw=0.6, ls=":")
    ax.axvline(resume_step, color="tab:blue", lw=1.0, ls="--")
    ax.annotate(f"resume from step {resume_step}\n(the async save)", (resume_step, ax.get_ylim()[1]),
                xytext=(4, -4), textcoords="offset points", va="top", fontsize=8, color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("resumed runs overlaid on the uninterrupted one")
    ax.legend(fontsize=7, loc="lower left")
    bx.axhline(RTOL, color="red", lw=0.8, ls="--", label=f"tolerance {RTOL:.0e} (other meshes)")
    bx.set_ylim(floor / 3, max(1e-2, RTOL * 30))
    bx.text(0.01, 0.02, "bottom row: bit-identical", transform=bx.transAxes, ha="left", va="bottom", fontsize=7)
    bx.set_xlabel("step")
    bx.set_ylabel("|resumed - uninterrupted| / uninterrupted")
    bx.set_title("relative loss difference")
    bx.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
