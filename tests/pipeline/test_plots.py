"""The job's plots (pipeline/analysis/plots.py): every file is written, and the frontier and fidelity-vs-length plots
hold the series they should (full as the reference line, not a point; one series per method); the frontier's
geometry: whiskers inside the axes, labels that overlap no label, point or whisker, the fixed-τ sweep as one line in
refresh order; each method's one colour in every plot; the notes a plot needs (a layer never re-selected, the
premises plot's terciles)."""

from __future__ import annotations

import itertools

import matplotlib.image
import matplotlib.lines
import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb

import rcr
from pipeline.analysis import plots as P
from pipeline.analysis.analyze import analyze
from pipeline.analysis.colours import label_colours, method_colour
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


# ------------------------------------------------------------------------------------- colours, read back


def _pixels(path) -> set[tuple[int, int, int]]:
    img = (matplotlib.image.imread(path)[..., :3] * 255).round().astype(int)
    return set(map(tuple, img.reshape(-1, 3)))


def test_one_colour_per_method_the_same_in_every_plot(tmp_path, frame_and_analysis, figures):
    """Every method has its table colour (derived from the registry) in the bars of fidelity_ci.png (read back from
    the PNG), the lines of fidelity_vs_length and the points of the frontier; no two labels share one."""
    df, a = frame_and_analysis
    colours = label_colours(METHODS)
    assert len(set(colours.values())) == len(METHODS)
    assert colours["rcr"] != colours["fixed"] and colours["fixed@0.05"] != colours["fixed"]
    P.make_plots(df, a, tmp_path, rho=0.4)
    pixels = _pixels(tmp_path / "fidelity_ci.png")
    for m in METHODS:
        assert tuple(round(c * 255) for c in to_rgb(colours[m])) in pixels, m
    lines = {ln.get_label(): ln.get_color() for ln in figures["fidelity_vs_length.png"].axes[0].get_lines()}
    assert lines == {m: colours[m] for m in METHODS if m != "full"}
    left = figures["frontier.png"].axes[0]
    points = {c.get_label(): c.lines[0].get_color() for c in left.containers if c.get_label() in colours}
    assert points and points == {m: colours[m] for m in points}
    assert {ln.get_color() for ln in left.get_lines() if ln.get_label() == SWEEP_LABEL} == {colours["fixed"]}


def test_a_method_registered_later_gets_a_colour_of_its_own(monkeypatch):
    late = type("Late", (rcr.methods.Exact,), {"name": "a_late"})
    monkeypatch.setitem(rcr.METHODS, late.name, late)
    colours = label_colours(list(rcr.METHODS))
    assert len(set(colours.values())) == len(rcr.METHODS) and colours["a_late"] == method_colour("a_late")


def test_samples_of_one_length_share_a_bin():
    """fidelity_vs_length's line: bins cut on the lengths, so no two bins sit at one x (no vertical segment)."""
    length = pd.Series([300, 320, 353, 353, 353, 353, 353, 353, 340, 330])
    b = P.length_bins(length, pd.Series(np.linspace(0, 1, len(length))), 5)
    assert np.all(np.diff(b.x) > 0) and b.x.iloc[-1] == 353
    few = P.length_bins(pd.Series([5, 5, 7]), pd.Series([0.0, 1.0, 0.2]), 5)
    assert few.x.tolist() == [5, 7] and few.y.tolist() == [0.5, 0.2]


def test_a_layer_never_reselected_is_named_in_the_heatmap(tmp_path, frame_and_analysis, figures):
    df, _ = frame_and_analysis
    df = df.copy()
    nan_layer0 = df.method == "rcr"
    df.loc[nan_layer0, "drift"] = df.loc[nan_layer0, "drift"].map(lambda d: [[float("nan")] * len(d[0]), *d[1:]])
    P.plot_drift_heatmap(df, tmp_path / "h.png")
    texts = [t.get_text() for t in figures["h.png"].axes[0].texts]
    assert texts == ["layer 0: never re-selected (it keeps its whole prefix), so no drift"]


def test_the_premises_plot_names_its_tercile_colours(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from matplotlib.figure import Figure

    from pipeline.diagnose.run import plot

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(fig))
    per = pd.DataFrame({"sample_id": list("abcdef"), "sample_drift": np.linspace(0.1, 0.3, 6),
                        "drift_tercile": ["low", "low", "mid", "mid", "high", "high"]})
    plot(SimpleNamespace(per_sample=per), None, None, tmp_path / "premises.png")
    legend = seen[0].axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["low drift", "mid drift", "high drift"]
    dots = seen[0].axes[0].collections[0].get_facecolors()
    handles = [h.get_facecolor()[0] for h in legend.legend_handles]
    assert [tuple(d) for d in dots[[0, 2, 4]]] == [tuple(h) for h in handles]


def _cluster(a):
    """The analysis with the embedded default job's cluster: rcr, fixed and exact at one fidelity, with reads of
    69, 110 and 342 per step, quest below them (the job's own figures: docs/pipeline.md's table)."""
    cl = type(a)(**{k: (v.copy() if hasattr(v, "copy") else v) for k, v in vars(a).items()})
    figures = {"rcr": (0.429, 68.7, 0.954, 0.930, 0.973), "fixed": (0.687, 109.9, 0.954, 0.929, 0.972),
               "exact": (1.0, 342.0, 0.956, 0.932, 0.974), "quest": (1.0, 64.0, 0.895, 0.857, 0.926),
               "fixed@0.02": (0.8, 150.0, 0.955, 0.931, 0.975), "fixed@0.05": (0.55, 90.0, 0.952, 0.925, 0.97)}
    for m, (refresh, reads, fid, lo, hi) in figures.items():
        for t in (cl.frontier, cl.methods):
            t.loc[t.method == m, ["refresh_fraction", "fidelity", "fidelity_ci_low", "fidelity_ci_high"]] = \
                [refresh, fid, lo, hi]
        cl.methods.loc[cl.methods.method == m, "reads_per_step"] = reads
    cl.fixed_comparison = cl.fixed_comparison.assign(status="skipped")  # no frontier diamond
    return cl


def test_frontier_labels_clear_every_point_and_whisker(tmp_path, frame_and_analysis, figures):
    """Around rcr, fixed and exact (one fidelity, reads 69 to 342) no label covers another label, a point or a CI
    whisker, on either panel."""
    _, a = frame_and_analysis
    P.plot_frontier(_cluster(a), tmp_path / "frontier.png")
    fig = figures["frontier.png"]
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    for ax in fig.axes[:2]:
        boxes = {t.get_text(): text_box(t, renderer) for t in ax.texts}
        assert {"rcr", "exact", "tau=0.02"} <= set(boxes)
        for (n1, b1), (n2, b2) in itertools.combinations(boxes.items(), 2):
            assert not b1.overlaps(b2), (n1, n2)
        sweep = [ln.get_xydata() for ln in ax.get_lines() if ln.get_label() == SWEEP_LABEL]
        centres = ax.transData.transform(np.vstack([*sweep, *(c.lines[0].get_xydata() for c in ax.containers
                                                               if c.lines[0] is not None)]))
        segments = [ax.transData.transform(s) for c in ax.containers for s in c.lines[2][0].get_segments()]
        for name, b in boxes.items():
            assert not any(b.contains(x, y) for x, y in centres), name  # a point's centre
            for (x0, y0), (_, y1) in segments:  # a whisker
                assert not (b.x0 < x0 < b.x1 and min(y0, y1) < b.y1 and max(y0, y1) > b.y0), name
