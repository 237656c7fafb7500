"""The cost / quality frontier plot (``frontier.png``, written by ``plots.make_plots``).

Per model, two panels: fidelity against the realised refresh fraction (left) and against prefix reads per
decode step (right, symlog). The fixed-threshold points (``fixed@τ`` and plain ``fixed``, the candidates of
``fixed_tuning.py``) are one line joined in x order, each point with its CI whisker; every other method is a
point with its whisker; ``full`` is the dashed reference line (its fidelity against itself is 1). On the left
panel the fixed-τ frontier interpolated at rcr's refresh fraction is drawn with its CI, joined to rcr's star
by a dotted line (the ``rcr − frontier`` gap of the summary table).

Readable by construction: the y-limits come from the CI ends (with a margin), so no whisker is clipped; the
point labels are placed after the layout is final by :func:`place_labels`, which tries offsets around each
point until the label's box overlaps no placed label, no point, no CI whisker and stays inside the axes. Each method
is drawn in its colour (``colours.py``), the fixed-tau sweep in fixed's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from pipeline.analysis.analyze import Analysis
from pipeline.analysis.colours import label_colours, method_colour
from pipeline.analysis.fixed_tuning import candidates
from pipeline.analysis.labels import FIXED, FULL, RCR

SWEEP_LABEL = "fixed-tau sweep (joined in x order)"
FRONTIER_LABEL = "fixed-tau frontier interpolated at rcr's refresh"
_MARKER_PX = 7.0  # half-size of a point's box that labels keep clear of, in pixels (rcr's star: twice that)
_WHISKER_PX = 4.0  # half-width of a CI whisker's box that labels keep clear of, in pixels
# a label's leader line to its point; it vanishes (shrinkB) while the label sits next to the point
LEADER = {"arrowstyle": "-", "lw": 0.5, "color": "0.55", "shrinkA": 0, "shrinkB": 6}


def _offsets(step: float = 11.0, rings: int = 8) -> list[tuple[float, float, str]]:
    """Label offsets from the point in points, nearest first: right/left, above/below, then further out."""
    out = [(6.0, 3.0, "left"), (6.0, -12.0, "left"), (-6.0, 3.0, "right"), (-6.0, -12.0, "right"),
           (0.0, 9.0, "center"), (0.0, -19.0, "center")]
    for k in range(1, rings + 1):
        dy = step * k
        out += [(6.0, 3.0 + dy, "left"), (6.0, -12.0 - dy, "left"), (-6.0, 3.0 + dy, "right"),
                (-6.0, -12.0 - dy, "right"), (14.0 + 6.0 * k, 3.0, "left"), (-14.0 - 6.0 * k, 3.0, "right")]
    return out


def text_box(ann, renderer):
    """The display-space box of an annotation's text alone (``Annotation.get_window_extent`` adds its leader
    line); positions updated first, as ``Annotation.get_window_extent`` does."""
    ann.update_positions(renderer)
    return Text.get_window_extent(ann, renderer)


def _overlap(a, b) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def place_labels(ax, labels: list, points_xy: list[tuple[float, float]], whiskers: list = (),
                 big: set[int] = frozenset()) -> None:
    """Move each annotation (``ax.annotate`` with ``textcoords="offset points"``) to the first offset of
    :func:`_offsets` where its text box overlaps no label placed before it, no point of ``points_xy`` (data
    coordinates; those whose index is in ``big`` have a marker twice the size), no CI whisker of ``whiskers``
    (``(x, low, high)`` in data coordinates) and lies inside the axes; failing that, to the offset with the least
    overlap (their leader lines, ``LEADER``, show which point a moved label belongs to). Call after the axes'
    limits and the layout are final."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    pts = ax.transData.transform(np.asarray(points_xy, float).reshape(-1, 2)) if len(points_xy) else np.zeros((0, 2))
    obstacles = [Bbox.from_extents(x - r, y - r, x + r, y + r)
                 for i, (x, y) in enumerate(pts) if np.isfinite(x) and np.isfinite(y)
                 for r in [_MARKER_PX * (2 if i in big else 1)]]
    for x, lo, hi in whiskers:
        (x0, y0), (_, y1) = ax.transData.transform([(x, lo), (x, hi)])
        if np.isfinite([x0, y0, y1]).all():
            obstacles.append(Bbox.from_extents(x0 - _WHISKER_PX, min(y0, y1), x0 + _WHISKER_PX, max(y0, y1)))
    placed = []
    for ann in labels:
        best, best_cost = None, np.inf
        for dx, dy, ha in _offsets():
            ann.xyann = (dx, dy)
            ann.set_horizontalalignment(ha)
            bb = text_box(ann, renderer)
            outside = max(0.0, frame.x0 - bb.x0) + max(0.0, bb.x1 - frame.x1) + \
                max(0.0, frame.y0 - bb.y0) + max(0.0, bb.y1 - frame.y1)
            cost = sum(_overlap(bb, o) for o in placed + obstacles) + 100.0 * outside
            if cost < best_cost:
                best, best_cost = (dx, dy, ha), cost
            if cost == 0.0:
                break
        dx, dy, ha = best
        ann.xyann = (dx, dy)
        ann.set_horizontalalignment(ha)
        placed.append(text_box(ann, renderer))


def label_overlaps(ax, labels: list, points_xy: list[tuple[float, float]]) -> list[tuple[str, str]]:
    """The pairs of labels whose text boxes overlap, and (label, "point") where one covers a point's centre: what
    :func:`place_labels` avoids, for a test to read back from a drawn figure."""
    renderer = ax.figure.canvas.get_renderer()
    boxes = [(a.get_text(), text_box(a, renderer)) for a in labels]
    out = [(a, b) for i, (a, bb) in enumerate(boxes) for b, cc in boxes[i + 1:] if _overlap(bb, cc) > 0]
    for x, y in ax.transData.transform(np.asarray(points_xy, float).reshape(-1, 2)):
        out += [(a, "point") for a, bb in boxes if bb.contains(x, y)]
    return out


def _fixed_points(g: pd.DataFrame, methods: list[str]) -> pd.DataFrame:
    """The rows of ``g`` (one per method) that are fixed-threshold candidates, as ``fixed_tuning`` has them."""
    fixed_tau = g.loc[g.method == FIXED, "tau"]
    tau = float(fixed_tau.iloc[0]) if len(fixed_tau) and pd.notna(fixed_tau.iloc[0]) else None
    labels = [m for m, _ in candidates(methods, tau)]
    return g[g.method.isin(labels)]


def _whiskers(r) -> list[list[float]]:
    return [[max(r.fidelity - r.fidelity_ci_low, 0.0)], [max(r.fidelity_ci_high - r.fidelity, 0.0)]]


def _panel(ax, g: pd.DataFrame, x: str, comparison: pd.Series | None,
           colours: dict[str, str]) -> tuple[list, list, list, set, list[float]]:
    """Draw one panel; returns (labels to place, their points, the CI whiskers, the indices of the big points, every
    y the axes must show). Every method in its colour (``colours.label_colours``); the fixed-tau sweep in fixed's."""
    labels, points, whiskers, big, ys = [], [], [], set(), [1.0]
    sweep = _fixed_points(g, list(g.method)).sort_values(x, kind="stable")
    sweep = sweep[sweep[x].notna()]
    fixed = method_colour(FIXED)
    if not sweep.empty:
        ax.plot(sweep[x], sweep.fidelity, "o-", color=fixed, ms=5, lw=1.5, label=SWEEP_LABEL)
        ax.errorbar(sweep[x], sweep.fidelity, yerr=[(sweep.fidelity - sweep.fidelity_ci_low).clip(lower=0),
                                                    (sweep.fidelity_ci_high - sweep.fidelity).clip(lower=0)],
                    fmt="none", ecolor=fixed, capsize=3, lw=1, label="_nolegend_")
        for r in sweep.itertuples():
            labels.append(ax.annotate(f"tau={r.tau:g}" if pd.notna(r.tau) else r.method, (getattr(r, x), r.fidelity),
                                      textcoords="offset points", xytext=(6, 3), fontsize=8, color=fixed,
                                      arrowprops=LEADER))
            points.append((getattr(r, x), r.fidelity))
            whiskers.append((getattr(r, x), r.fidelity_ci_low, r.fidelity_ci_high))
    for r in g[~g.method.isin(sweep.method)].itertuples():
        xv = getattr(r, x)
        if pd.isna(xv):
            continue
        is_rcr = r.method == RCR
        colour = colours.get(r.method, "black")
        ax.errorbar([xv], [r.fidelity], yerr=_whiskers(r), fmt="*" if is_rcr else "s", ms=14 if is_rcr else 6,
                    capsize=3, color=colour, label=r.method, zorder=3 if is_rcr else 2)
        labels.append(ax.annotate(r.method, (xv, r.fidelity), textcoords="offset points", xytext=(6, 3), fontsize=9,
                                  color=colour, arrowprops=LEADER))
        if is_rcr:
            big.add(len(points))
        points.append((xv, r.fidelity))
        whiskers.append((xv, r.fidelity_ci_low, r.fidelity_ci_high))
    ys += list(g.fidelity_ci_low.dropna()) + list(g.fidelity_ci_high.dropna()) + list(g.fidelity.dropna())
    if comparison is not None and x == "refresh_fraction" and pd.notna(comparison.get("frontier_fidelity")):
        c = comparison
        ax.errorbar([c.rcr_refresh], [c.frontier_fidelity],
                    yerr=[[max(c.frontier_fidelity - c.frontier_fidelity_ci_low, 0)],
                          [max(c.frontier_fidelity_ci_high - c.frontier_fidelity, 0)]],
                    fmt="D", mfc="white", mec=fixed, ecolor=fixed, ms=7, capsize=3, label=FRONTIER_LABEL)
        ax.plot([c.rcr_refresh, c.rcr_refresh], [c.frontier_fidelity, c.rcr_fidelity], ":",
                color=method_colour(RCR), lw=1.2, label=f"rcr - frontier = {c.diff_frontier:+.3f}")
        points.append((c.rcr_refresh, c.frontier_fidelity))
        whiskers.append((c.rcr_refresh, c.frontier_fidelity_ci_low, c.frontier_fidelity_ci_high))
        ys += [c.frontier_fidelity_ci_low, c.frontier_fidelity_ci_high]
    return labels, points, whiskers, big, [y for y in ys if np.isfinite(y)]


def _full_line(ax, analysis: Analysis, model: str, note: str) -> None:
    """``full`` as a horizontal reference line (its fidelity against itself is 1 by definition)."""
    m = analysis.methods
    full = m[(m.model == model) & (m.method == FULL)].fidelity.dropna()
    if len(full):
        ax.axhline(float(full.iloc[0]), color=method_colour(FULL), ls="--", lw=1, label=f"full (reference: {note})")


def plot_frontier(analysis: Analysis, path: Path, save) -> Path | None:
    """Write ``frontier.png`` (see the module docstring) with ``save(fig, path)``; None when nothing to draw."""
    f = analysis.frontier
    f = f[f.method != FULL] if not f.empty else f
    if f.empty:
        return None
    models = list(analysis.meta.get("models") or [""])
    reads = analysis.methods.set_index(["model", "method"])["reads_per_step"] \
        if "reads_per_step" in analysis.methods else pd.Series(dtype=float)
    cmp = analysis.fixed_comparison
    import matplotlib.pyplot as plt  # here: plots.py selects the Agg backend before pyplot is first imported

    fig, axes = plt.subplots(len(models), 2, figsize=(14, 5.6 * len(models)), squeeze=False)
    colours = label_colours(f.method)
    to_place = []
    for (ax, ax_r), model in zip(axes, models):
        g = f[f.model == model].copy()
        g["reads_per_step"] = [reads.get((model, m), np.nan) for m in g.method]
        c = cmp[cmp.model == model] if "model" in cmp else cmp
        c = c.iloc[0] if len(c) and c.iloc[0].get("status") == "ok" else None
        for axis, x, label, note in (
                (ax, "refresh_fraction", "realised refresh fraction (of layer-steps)",
                 "every entry resident"),
                (ax_r, "reads_per_step", "prefix reads per decode step (keys + values per KV head per layer; symlog)",
                 "reads the whole prefix")):
            labels, points, whiskers, big, ys = _panel(axis, g, x, c, colours)
            _full_line(axis, analysis, model, note)
            lo, hi = min(ys), max(ys)
            pad = 0.06 * max(hi - lo, 0.05)
            axis.set_ylim(lo - pad, hi + pad)  # every whisker inside the axes
            axis.set_xlabel(label)
            axis.set_ylabel("fidelity (ROUGE-L F1 vs full)")
            axis.grid(alpha=0.3)
            handles, names = axis.get_legend_handles_labels()
            keep = [(h, n) for h, n in zip(handles, names)
                    if n in (SWEEP_LABEL, FRONTIER_LABEL) or n.startswith(("full", "rcr - frontier"))]
            if keep:
                axis.legend(*zip(*keep), loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=8,
                            frameon=False)
            to_place.append((axis, labels, points, whiskers, big))
        ax.set_xlim(-0.05, 1.05)
        # reads are >= 0: the static methods sit at 0, the others within a decade or so of each other; a linear part
        # up to a quarter of the fewest reads leaves that decade most of the width
        positive = g.reads_per_step[g.reads_per_step > 0]
        linthresh = max(1.0, float(positive.min()) / 4) if len(positive) else 1.0
        ax_r.set_xscale("symlog", linthresh=linthresh, linscale=0.5)
        reads_max = g.reads_per_step.max() if g.reads_per_step.notna().any() else 1.0
        ax_r.set_xlim(-0.1 * linthresh, 1.6 * reads_max + 1.0)  # room at the right for the labels
        ax.set_title(f"{model or 'model'}: cost / quality frontier (refresh fraction)")
        ax_r.set_title(f"{model or 'model'}: cost / quality frontier (reads per step)")
    fig.subplots_adjust(hspace=0.45, wspace=0.22)
    for axis, labels, points, whiskers, big in to_place:  # last: the layout and the limits are final
        place_labels(axis, labels, points, whiskers, big)
    return save(fig, path)
