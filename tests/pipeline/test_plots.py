"""The job's plots (pipeline/analysis/plots.py): every file is written, and the frontier and fidelity-vs-length plots
hold the series they should (full as the reference line, not a point; one series per method); the frontier's
geometry: whiskers inside the axes, labels that do not overlap, the fixed-τ sweep as one line in refresh order."""

from __future__ import annotations

import itertools

import matplotlib.lines
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from pipeline.analysis import plots as P
from pipeline.analysis.analyze import analyze
from pipeline.analysis.frontier_plot import FRONTIER_LABEL, SWEEP_LABEL, text_box
from tests.fake_output import make_output_frame

METHODS = ("full", "bacon", "exact", "fixed", "rcr", "quest", "fixed@0.02", "fixed@0.05")


@pytest.fixture(scope="module")
def frame_and_analysis():
    df = make_output_frame(n_samples=24, methods=METHODS)
    return df, analyze(df, bootstrap_resamples=200, seed=0)


@pytest.fixture
def figures(monkeypatch):
    """Every figure passed to plots._save, by file name (before it is closed)."""
    seen = {}
    save = P._save

    def capture(fig, path):
        seen[path.name] = fig
        return save(fig, path)

    monkeypatch.setattr(P, "_save", capture)
    return seen


def _labels(ax) -> set[str]:
    return {c.get_label() for c in ax.containers} | {ln.get_label() for ln in ax.get_lines()}


def test_make_plots_writes_every_file(tmp_path, frame_and_analysis):
    df, a = frame_and_analysis
    paths = P.make_plots(df, a, tmp_path, rho=0.4)
    names = {p.name for p in paths}
    assert {"fidelity_ci.png", "frontier.png", "fidelity_vs_length.png", "tau_refresh.png",
            "drift_heatmap.png"} <= names
    for p in paths:
        assert p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_frontier_full_is_the_reference_line(tmp_path, frame_and_analysis, figures):
    _, a = frame_and_analysis
    P.plot_frontier(a, tmp_path / "frontier.png")
    left, right = figures["frontier.png"].axes[:2]
    for ax in (left, right):
        labels = _labels(ax)
        assert "full" not in labels  # no point for full
        (ref,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("full (reference")]
        assert set(ref.get_ydata()) == {1.0}  # full against itself
        assert {"bacon", "exact", "rcr", "quest", SWEEP_LABEL} <= labels
    m = a.methods.set_index("method")
    # the right panel's x is reads per step: rcr's point sits at its measured reads
    (rcr_line,) = [c.lines[0] for c in right.containers if c.get_label() == "rcr"]
    assert rcr_line.get_xdata()[0] == pytest.approx(m.loc["rcr", "reads_per_step"])
    assert "reads per decode step" in right.get_xlabel() and "refresh fraction" in left.get_xlabel()


def test_fidelity_vs_length_has_one_series_per_method(tmp_path, frame_and_analysis, figures):
    _, a = frame_and_analysis
    P.plot_fidelity_vs_length(a, tmp_path / "fl.png")
    (ax,) = figures["fl.png"].axes
    lines = {ln.get_label(): ln for ln in ax.get_lines() if isinstance(ln, matplotlib.lines.Line2D)}
    assert set(lines) == set(METHODS) - {"full"}
    ps = a.per_sample
    rcr = ps[(ps.method == "rcr")]
    x = lines["rcr"].get_xdata()
    assert min(x) >= rcr.output_len_full.min() and max(x) <= rcr.output_len_full.max()
    assert len(ax.collections) == len(METHODS) - 1  # one scatter of samples per method


def _crowded(a):
    """The analysis with several methods moved onto one point, and rcr's whisker reaching far down: labels
    that would sit on each other, and a CI end below any fixed y-limit."""
    crowded = type(a)(**{k: (v.copy() if hasattr(v, "copy") else v) for k, v in vars(a).items()})
    f, m = crowded.frontier, crowded.methods
    same = f.method.isin(["bacon", "quest", "exact"])
    f.loc[same, ["refresh_fraction", "fidelity", "fidelity_ci_low", "fidelity_ci_high"]] = [0.0, 0.6, 0.55, 0.65]
    m.loc[m.method.isin(["bacon", "quest", "exact"]), "reads_per_step"] = 0.0
    f.loc[f.method == "rcr", "fidelity_ci_low"] = 0.05
    return crowded


def test_frontier_geometry(tmp_path, frame_and_analysis, figures):
    _, a = frame_and_analysis
    a = _crowded(a)
    P.plot_frontier(a, tmp_path / "frontier.png")
    fig = figures["frontier.png"]
    canvas = FigureCanvasAgg(fig)  # plt.close() detached the figure from pyplot's canvas
    canvas.draw()
    renderer = canvas.get_renderer()
    left, right = fig.axes[:2]
    f = a.frontier[a.frontier.method != "full"]
    c = a.fixed_comparison.iloc[0]
    assert c.status == "ok"
    for ax in (left, right):
        lo, hi = ax.get_ylim()
        ends = [*f.fidelity_ci_low, *f.fidelity_ci_high, 1.0]
        assert lo <= min(ends) and max(ends) <= hi  # every whisker inside the axes, 0.05 included
        boxes = [text_box(t, renderer) for t in ax.texts]
        assert len(boxes) == len(f)  # one label per point
        frame = ax.get_window_extent(renderer)
        for b in boxes:
            assert frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1
        for b1, b2 in itertools.combinations(boxes, 2):
            assert not b1.overlaps(b2), (b1, b2)
        # the sweep: one line through the fixed-threshold points, in x order
        (sweep,) = [ln for ln in ax.get_lines() if ln.get_label() == SWEEP_LABEL]
        pts = a.fixed_tuning.set_index("method")
        x = "refresh_fraction" if ax is left else "reads_per_step"
        want = a.methods.set_index("method").loc[pts.index].sort_values(x)
        np.testing.assert_allclose(sweep.get_xdata(), want[x])
        np.testing.assert_allclose(sweep.get_ydata(), want.fidelity)
        assert np.all(np.diff(sweep.get_xdata()) >= 0) and len(want) == 3  # fixed@0.02, fixed, fixed@0.05
    # rcr and the frontier at its refresh fraction, on the left panel
    (front,) = [cont for cont in left.containers if cont.get_label() == FRONTIER_LABEL]
    assert front.lines[0].get_xdata()[0] == pytest.approx(c.rcr_refresh)
    assert front.lines[0].get_ydata()[0] == pytest.approx(c.frontier_fidelity)
    (star,) = [cont for cont in left.containers if cont.get_label() == "rcr"]
    assert star.lines[0].get_xdata()[0] == pytest.approx(c.rcr_refresh)
