"""The summary tables a job prints: :func:`format_summary` of an :class:`~pipeline.analysis.analyze.Analysis`,
and :func:`minimal_summary` straight from the rows when the statistics fail."""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipeline.analysis.analyze import Analysis
from pipeline.analysis.labels import BACON, FIXED, FULL, RCR
from pipeline.analysis.text_metrics import rouge_l_f1


def _fmt_ci(mean, lo, hi, signed=False, digits=3) -> str:
    if mean is None or pd.isna(mean):
        return "-"
    s = f"{mean:+.{digits}f}" if signed else f"{mean:.{digits}f}"
    if pd.isna(lo) or pd.isna(hi):
        return s
    if signed:
        return f"{s} [{lo:+.{digits}f}, {hi:+.{digits}f}]"
    return f"{s} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _fmt_num(x, digits=3) -> str:
    """One format per column, whatever the magnitude (``970.3``, ``1095.0``): no thousands separator."""
    if x is None or pd.isna(x):
        return "-"
    return f"{x:.{digits}f}"


def _method_table(g: pd.DataFrame, conf: int) -> list[str]:
    """One line per method: fidelity [CI], differences from bacon and rcr [CI], refresh, reads (and ArkVale's own
    recalls), tok/s, n, err."""
    header = ["method", f"fidelity [{conf}% CI]", "vs bacon [CI]", "vs rcr [CI]", "refresh", "reads/step",
              "recalled/step", "tok/s", "n", "err"]
    body = []
    for _, r in g.iterrows():
        body.append([
            str(r.method),
            _fmt_ci(r.fidelity, r.fidelity_ci_low, r.fidelity_ci_high),
            _fmt_ci(r.get("diff_bacon"), r.get("diff_bacon_ci_low"), r.get("diff_bacon_ci_high"), signed=True),
            _fmt_ci(r.get("diff_rcr"), r.get("diff_rcr_ci_low"), r.get("diff_rcr_ci_high"), signed=True),
            _fmt_num(r.refresh_fraction), _fmt_num(r.reads_per_step, 1), _fmt_num(r.get("recalled_per_step"), 1),
            _fmt_num(r.tokens_per_s, 1),
            str(int(r.n)), str(int(r.n_errors)),
        ])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))),
             "  ".join("-" * w for w in widths)]
    for b in body:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths))))
    if g.rougeL_ref.notna().any() or g.cider.notna().any():
        lines.append("against references (ROUGE-L: max over references; CIDEr-D: pycocoevalcap):")
        w = max(len(str(x)) for x in g.method)
        for _, r in g.iterrows():
            lines.append(f"  {str(r.method):<{w}}  "
                         f"ROUGE-L {_fmt_ci(r.rougeL_ref, r.rougeL_ref_ci_low, r.rougeL_ref_ci_high)}"
                         f"   CIDEr {_fmt_ci(r.cider, r.cider_ci_low, r.cider_ci_high)}")
    return lines


def _drift_lines(analysis: Analysis, model: str) -> list[str]:
    """The drift terciles, the Spearman correlations and the top-position stability of one model."""
    lines = []
    t = analysis.terciles[analysis.terciles.model == model]
    if not t.empty:
        lines.append(f"drift terciles (sample drift from {analysis.meta.get('drift_source')}): "
                     "refresh fraction / fidelity")
        for tt in ("low", "mid", "high"):
            tr = t[t.tercile == tt]
            if tr.empty:
                continue
            parts = [f"{r.method} {_fmt_num(r.refresh_fraction)} / {_fmt_num(r.fidelity)}" for _, r in tr.iterrows()]
            lines.append(f"  {tt:<4} n={int(tr.n.max()):<4} drift {tr.drift_min.iloc[0]:.3g}-"
                         f"{tr.drift_max.iloc[0]:.3g}: " + ";  ".join(parts))
    c = analysis.correlations[(analysis.correlations.model == model)]
    c = c[c.method.isin([RCR, FIXED, BACON, "infinigen"])]
    if not c.empty:
        parts = []
        for meth, cg in c.groupby("method", sort=False):
            vals = {r.against: r.spearman_rho for _, r in cg.iterrows()}
            parts.append(f"{meth}: drift {_fmt_num(vals.get('mean_drift'), 2)}, "
                         f"length {_fmt_num(vals.get('output_length'), 2)}")
        lines.append("Spearman of the gap to exact with  " + ";  ".join(parts))
    s = analysis.stability[analysis.stability.model == model]
    if not s.empty:
        lines.append(f"most-attended prefix position unchanged between adjacent steps: "
                     f"{s.fraction_unchanged.iloc[0]:.1%} of {int(s.n_pairs.iloc[0])} layer-step pairs "
                     f"({int(s.n_samples.iloc[0])} samples)")
    return lines


def _ci(r: pd.Series, key: str, signed: bool = False) -> str:
    """``r[key]`` with its CI from ``r[key + "_ci_low"]`` and ``r[key + "_ci_high"]``."""
    return _fmt_ci(r.get(key), r.get(f"{key}_ci_low"), r.get(f"{key}_ci_high"), signed=signed)


def _fixed_lines(analysis: Analysis, model: str) -> list[str]:
    """rcr against the tuned fixed threshold and against the fixed-τ frontier (``fixed_tuning.py``)."""
    c = analysis.fixed_comparison
    c = c[c.model == model] if "model" in c else c.iloc[0:0]
    if c.empty:
        return []
    r = c.iloc[0]
    if r.status != "ok":
        return [f"tuned fixed: {r.note}"]
    if pd.notna(r.get("tau_star")):
        lines = [f"tuned fixed: tau* = {r.tau_star:g} ({r.tau_star_method}), the best mean fidelity on the development "
                 f"half (n={int(r.n_dev)}) of {r.candidates.replace(',', ', ')}",
                 f"  test half (n={int(r.n_test)}): rcr - fixed(tau*) {_ci(r, 'diff_tuned', signed=True)}; "
                 f"rcr {_ci(r, 'rcr_test_fidelity')}, fixed(tau*) {_ci(r, 'fixed_test_fidelity')}"]
    else:
        lines = [f"tuned fixed: {r.get('tuned_note')}"]
    if pd.notna(r.get("frontier_fidelity")):
        lines.append(f"  fixed-tau frontier at rcr's refresh {r.rcr_refresh:.3f} (between "
                     f"{r.frontier_between.replace(',', ' and ')}; all samples): "
                     f"{_ci(r, 'frontier_fidelity')}; rcr - frontier {_ci(r, 'diff_frontier', signed=True)}")
    if r.get("frontier_note"):
        lines.append(f"  fixed-tau frontier: {r.frontier_note}")
    return lines


def _matched_lines(g: pd.DataFrame) -> list[str]:
    """Each method against the fixed-τ frontier at its own refresh fraction and reads per step
    (``fixed_tuning.matched_frontier``); a method outside the points' range on both axes is left out."""
    lines = []
    for _, r in g.iterrows():
        parts = [f"{axis} {_fmt_num(r.get(col), digits)}: {_ci(r, f'diff_frontier_{axis}', signed=True)}"
                 for axis, col, digits in (("refresh", "refresh_fraction", 3), ("reads", "reads_per_step", 1))
                 if pd.notna(r.get(f"diff_frontier_{axis}"))]
        if parts:
            lines.append(f"  {r.method}: " + ";  ".join(parts))
    if lines:
        lines.insert(0, "method - fixed-tau frontier at the method's own refresh and reads/step (all samples):")
    return lines


def format_summary(analysis: Analysis) -> str:
    """The table a job prints at the end: per model, one line per method with
    fidelity mean [95% CI], difference from bacon [CI], difference from rcr [CI], realised refresh
    fraction, prefix reads (keys + values) per KV head per layer-step, tokens/s, n and errors; then the
    tuned-fixed comparison (τ* and ``rcr − fixed(τ*)`` on held-out samples, ``rcr −`` the fixed-τ frontier), each
    method's difference from that frontier at its own refresh and reads per step, the
    tercile table, the correlations and the top-position stability, and a line on how it was measured."""
    m = analysis.methods
    lines: list[str] = []
    conf = int(round(analysis.meta.get("confidence", 0.95) * 100))
    if m.empty:
        lines.append("no rows to summarise")
    for model in analysis.meta.get("models", []):
        g = m[m.model == model]
        if g.empty:
            continue
        lines.append(f"== model: {model or '(unnamed)'} ==")
        lines += _method_table(g, conf) + _fixed_lines(analysis, model) + _matched_lines(g)
        lines += _drift_lines(analysis, model) + [""]
    meta = analysis.meta
    lines.append(f"errors: {meta.get('n_error_rows', 0)} row(s) excluded"
                 + (f"; {meta.get('n_samples_without_full')} sample(s) without a 'full' row"
                    if meta.get("n_samples_without_full") else ""))
    lines.append(f"fidelity: {meta.get('fidelity')}")
    if meta.get("reference_metrics"):
        lines.append(f"reference metrics (ROUGE-L and CIDEr against references): {meta['reference_metrics']}")
    lines.append(f"CI: {meta.get('bootstrap')}")
    lines.append("refresh = realised fraction of refreshed layer-steps; reads/step = prefix keys+values read "
                 "per KV head per layer-step")
    return "\n".join(lines)


def minimal_summary(df: pd.DataFrame) -> str:
    """Per method: rows, errors, fidelity mean (ROUGE-L F1 vs full, :func:`rouge_l_f1`), refresh fraction.
    Printed when the statistics fail, so it uses the rows and the text metric only."""
    ok = df[df["error"].isna()]
    full = ok[ok["method"] == FULL].set_index("sample_id")["output_text"].to_dict()
    lines = [f"{'method':<18}{'rows':>6}{'errors':>8}{'fidelity':>10}{'refresh':>9}"]
    for m, g in df.groupby("method", sort=False):
        gok = g[g["error"].isna()]
        fid = [rouge_l_f1(full[s], t) for s, t in zip(gok["sample_id"], gok["output_text"]) if s in full]
        rf = gok["refresh_fraction"].dropna()
        fid_mean = np.mean(fid) if fid else float("nan")
        rf_mean = rf.mean() if len(rf) else float("nan")
        lines.append(f"{m:<18}{len(g):>6}{len(g) - len(gok):>8}{fid_mean:>10.3f}{rf_mean:>9.3f}")
    return "\n".join(lines)
