"""The job's plots (pipeline/analysis/plots.py): every file is written, and the frontier and fidelity-vs-length plots
hold the series they should (full as the reference line, not a point; one series per method)."""

from __future__ import annotations

import matplotlib.lines
import pytest

from pipeline.analysis import plots as P
from pipeline.analysis.analyze import analyze
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
        assert {"bacon", "exact", "rcr", "quest", "fixed tau sweep"} <= labels
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
