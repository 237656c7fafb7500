"""Matplotlib (Agg) PNGs of a job's analysis. Driver side; no display needed.

:func:`make_plots` ``(df, analysis, out_dir) -> list[Path]`` writes:

* ``fidelity_ci.png``: fidelity mean with its 95% CI per method (one panel per model);
* ``tau_refresh.png``: tau and the refresh fraction over decode steps for a few ``rcr`` samples;
* ``drift_heatmap.png``: mean drift per layer x step (``rcr`` rows, else any drift-detector method); a layer never
  re-selected (a sliding-window layer, the embedded model's layer 0) has no drift, and its blank row says so;
* ``frontier.png``: fidelity against realised refresh fraction (left) and against prefix reads per decode
  step (right) across methods, the fixed-τ sweep as one line and ``rcr`` with the sweep's frontier at its
  refresh fraction; ``full`` reads the whole prefix at every step, so it is drawn as the reference line, not
  as a point at refresh fraction 0 (``frontier_plot.py``);
* ``fidelity_vs_length.png``: per-sample fidelity against the uncompressed output length, per method.

Every method has its colour in every plot: ``colours.label_colours`` (the same one its MLflow run has).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

from pipeline.analysis import frontier_plot
from pipeline.analysis.analyze import Analysis
from pipeline.analysis.colours import label_colours
from pipeline.analysis.labels import FIXED, RCR, order_methods
from pipeline.analysis.telemetry import as_2d, model_series, ok_rows
from pipeline.schema import Col

matplotlib.use("Agg", force=True)  # before pyplot: the driver has no display
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["make_plots", "plot_fidelity", "plot_tau_refresh", "plot_drift_heatmap", "plot_frontier",
           "plot_fidelity_vs_length", "length_bins"]


def _models(analysis: Analysis) -> list[str]:
    return list(analysis.meta.get("models") or [""])


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_fidelity(analysis: Analysis, path: Path) -> Path:
    models = _models(analysis)
    fig, axes = plt.subplots(len(models), 1, figsize=(8, 3.6 * len(models)), squeeze=False)
    conf = int(round(analysis.meta.get("confidence", 0.95) * 100))
    for ax, model in zip(axes[:, 0], models):
        g = analysis.methods[analysis.methods.model == model].dropna(subset=["fidelity"])
        g = g.set_index("method").loc[order_methods(g.method)]
        x = np.arange(len(g))
        lo = (g.fidelity - g.fidelity_ci_low).clip(lower=0).to_numpy()
        hi = (g.fidelity_ci_high - g.fidelity).clip(lower=0).to_numpy()
        colours = label_colours(g.index)
        ax.bar(x, g.fidelity, color=[colours[m] for m in g.index])
        ax.errorbar(x, g.fidelity, yerr=[lo, hi], fmt="none", ecolor="black", capsize=4, lw=1.2)
        for xi, v, top in zip(x, g.fidelity, g.fidelity_ci_high.fillna(g.fidelity)):
            ax.text(xi, min(max(v, top) + 0.015, 1.05), f"{v:.3f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, g.index, rotation=30, ha="right")
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("fidelity (ROUGE-L F1 vs full)")
        ax.set_title(f"{model or 'model'}: mean fidelity with {conf}% paired-bootstrap CI "
                     f"(n={int(g.n.max()) if len(g) else 0})")
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def _pick_samples(d: pd.DataFrame, k: int) -> list[int]:
    """Up to k row positions spread over output length (shortest, median, longest...)."""
    if d.empty:
        return []
    order = d.assign(_len=pd.to_numeric(d.get(Col.N_STEPS, 0), errors="coerce").fillna(0)).sort_values(
        ["_len", Col.SAMPLE_ID]).index.to_list()
    if len(order) <= k:
        return order
    pos = np.linspace(0, len(order) - 1, k).round().astype(int)
    return [order[p] for p in pos]


def plot_tau_refresh(df: pd.DataFrame, path: Path, method: str = RCR, n_samples: int = 4,
                     rho: float | None = None, model: str | None = None) -> Path | None:
    d = ok_rows(df)
    d = d[d[Col.METHOD] == method]
    if model is not None:
        d = d[model_series(d) == model]
    if d.empty or Col.TAU not in d or Col.TRIGGER not in d:
        return None
    picks = _pick_samples(d, n_samples)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for idx in picks:
        r = d.loc[idx]
        tau = as_2d(r[Col.TAU], float)
        trig = as_2d(r[Col.TRIGGER], float)
        if tau is None or trig is None:
            continue
        L, T = tau.shape
        # decode order: step t runs layers 0..L-1, and tau is carried from layer to layer
        xs = (np.arange(T)[None, :] + np.arange(L)[:, None] / L).T.ravel()
        line, = ax1.plot(xs, tau.T.ravel(), lw=1, label=f"{r[Col.SAMPLE_ID]} ({T} steps)")
        per_step = np.nanmean(trig, 0)
        cum = np.cumsum(per_step) / np.arange(1, T + 1)
        ax2.plot(np.arange(T), cum, color=line.get_color(), lw=1.5)
        ax2.plot(np.arange(T), per_step, color=line.get_color(), lw=0.6, alpha=0.4)
    if rho is not None:
        ax2.axhline(rho, color="black", ls="--", lw=1, label=f"target rho = {rho:g}")
        ax2.legend(loc="upper right", fontsize=8)
    ax1.set_ylabel("tau")
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    ax1.set_title(f"{method}: threshold tau per layer-step, for {len(picks)} samples")
    ax2.set_ylabel("refresh fraction")
    ax2.set_xlabel("decode step")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_title("refresh fraction: running (thick) and per step over layers (thin)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_drift_heatmap(df: pd.DataFrame, path: Path, methods=(RCR, FIXED), max_steps: int = 512,
                       model: str | None = None) -> Path | None:
    d = ok_rows(df)
    if model is not None:
        d = d[model_series(d) == model]
    for method in list(methods) + sorted(set(d[Col.METHOD]) - set(methods)):
        g = d[d[Col.METHOD] == method]
        if Col.DRIFT not in g:
            return None
        mats = [a for a in (as_2d(x, float) for x in g[Col.DRIFT]) if a is not None and a.size]
        if mats:
            break
    else:
        return None
    L = max(a.shape[0] for a in mats)
    T = min(max(a.shape[1] for a in mats), max_steps)
    acc = np.full((len(mats), L, T), np.nan)
    for i, a in enumerate(mats):
        acc[i, : a.shape[0], : min(a.shape[1], T)] = a[:, :T]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(acc, 0)
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.25 * L + 1.5)))
    im = ax.imshow(mean, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="mean drift (attention mass on evicted prefix)")
    for layer in np.flatnonzero(np.isnan(mean).all(1)):  # a row left blank: say why
        ax.text(T / 2, layer, f"layer {layer}: never re-selected (it keeps its whole prefix), so no drift",
                ha="center", va="center", fontsize=8, color="0.3")
    ax.set_xlabel("decode step")
    ax.set_ylabel("layer")
    ax.set_title(f"{method}: drift per layer x step, mean over {len(mats)} samples")
    return _save(fig, path)


def plot_frontier(analysis: Analysis, path: Path) -> Path | None:
    """``frontier.png``: fidelity against realised refresh fraction and against prefix reads per decode step
    (``frontier_plot.py``)."""
    return frontier_plot.plot_frontier(analysis, path, _save)


def plot_fidelity_vs_length(analysis: Analysis, path: Path, n_bins: int = 5) -> Path | None:
    """Per-sample fidelity against the length of the uncompressed (``full``) output, one series per method:
    the samples as dots and the mean per length quantile bin as a line."""
    ps = analysis.per_sample
    if ps.empty or "output_len_full" not in ps:
        return None
    ps = ps[(ps.method != "full") & ps.fidelity.notna() & ps.output_len_full.notna()]
    if ps.empty:
        return None
    models = _models(analysis)
    fig, axes = plt.subplots(len(models), 1, figsize=(9, 5 * len(models)), squeeze=False)
    colours = label_colours(ps.method.unique())
    for ax, model in zip(axes[:, 0], models):
        g = ps[ps.model == model]
        for method in order_methods(g.method.unique()):
            d = g[g.method == method]
            ax.scatter(d.output_len_full, d.fidelity, s=10, alpha=0.35, color=colours[method])
            b = length_bins(d.output_len_full, d.fidelity, n_bins)
            ax.plot(b.x, b.y, "o-", color=colours[method], lw=2.2 if method == RCR else 1.2, ms=4, label=method)
        ax.set_xlabel("uncompressed (full) output length, tokens")
        ax.set_ylabel("fidelity (ROUGE-L F1 vs full)")
        ax.set_ylim(-0.02, 1.05)
        ax.set_title(f"{model or 'model'}: fidelity against output length (dots: samples; line: mean per "
                     f"length quantile)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2, loc="lower left")
    return _save(fig, path)


def length_bins(length: pd.Series, value: pd.Series, n_bins: int) -> pd.DataFrame:
    """Mean ``value`` (column ``y``) and mean ``length`` (``x``) per length quantile bin, in length order. Bins are
    cut on the lengths themselves, so samples of one length share a bin and no two bins have the same x (a line
    through them has no vertical segment); with at most ``n_bins`` lengths, one bin per length."""
    length = pd.to_numeric(length, errors="coerce")
    bins = length if length.nunique() <= n_bins else pd.qcut(length, n_bins, duplicates="drop")
    b = pd.DataFrame({"x": length, "y": value}).groupby(bins, observed=True).mean()
    return b.sort_values("x").reset_index(drop=True)


def make_plots(df: pd.DataFrame, analysis: Analysis, out_dir: str | os.PathLike, rho: float | None = None,
               n_samples: int = 4) -> list[Path]:
    """Write all PNGs into ``out_dir`` (one set; per-model panels where it matters). Returns their paths.

    ``df`` is the raw output rows (for the telemetry lists), ``analysis`` from
    :func:`pipeline.analysis.analyze.analyze`.
    A plot whose inputs are missing (e.g. no ``rcr`` rows) is skipped, never an error.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_fidelity(analysis, out / "fidelity_ci.png"), plot_frontier(analysis, out / "frontier.png"),
             plot_fidelity_vs_length(analysis, out / "fidelity_vs_length.png")]
    models = _models(analysis)
    for model in models:
        suffix = "" if len(models) == 1 else f"_{_slug(model)}"
        m = model if len(models) > 1 else None
        paths.append(plot_tau_refresh(df, out / f"tau_refresh{suffix}.png", rho=rho, n_samples=n_samples, model=m))
        paths.append(plot_drift_heatmap(df, out / f"drift_heatmap{suffix}.png", model=m))
    return [p for p in paths if p is not None]


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in s)[:60] or "model"
