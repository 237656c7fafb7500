"""The summary tables a job prints: :func:`format_summary` of an :class:`~pipeline.analysis.analyze.Analysis`,
and :func:`minimal_summary` straight from the rows when the statistics fail."""

from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd

from pipeline.analysis.analyze import Analysis
from pipeline.analysis.labels import BACON, FIXED, FULL, RCR, method_class
from pipeline.analysis.text_metrics import rouge_l_f1

WIDTH = 120  # a terminal's columns: every line of the summary fits
MIN_TRUSTED_N = 10  # fewer samples: the table says that its bootstrap CIs are not to be trusted


def _fmt_ci(mean, lo, hi, signed=False, digits=3) -> str:
    if mean is None or pd.isna(mean):
        return "-"
    s = f"{mean:+.{digits}f}" if signed else f"{mean:.{digits}f}"
    if pd.isna(lo) or pd.isna(hi):
        return s
    if signed:
        return f"{s} [{lo:+.{digits}f}, {hi:+.{digits}f}]"
    return f"{s} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _ci(r: pd.Series, key: str, signed: bool = False) -> str:
    """``r[key]`` with its CI from ``r[key + "_ci_low"]`` and ``r[key + "_ci_high"]``."""
    return _fmt_ci(r.get(key), r.get(f"{key}_ci_low"), r.get(f"{key}_ci_high"), signed=signed)


def _fmt_num(x, digits=3) -> str:
    """One format per column, whatever the magnitude (``970.3``, ``1095.0``): no thousands separator."""
    if x is None or pd.isna(x):
        return "-"
    return f"{x:.{digits}f}"


def _reads(r: pd.Series) -> str:
    """Reads per step; ``all`` for a method that keeps the whole prefix resident (``full``): it reads nothing into
    a selection, and attends to every prefix entry at every step."""
    cls = method_class(str(r.method))
    return "all" if cls is not None and cls.uncompressed else _fmt_num(r.reads_per_step, 1)


def _method_table(g: pd.DataFrame, conf: int) -> list[str]:
    """One line per method: fidelity [CI], differences from bacon and rcr [CI], refresh, reads, tok/s, n (and err
    where a method has errors). Wider than :data:`WIDTH`, each CI goes on a second line under its value."""
    errors = bool(g.n_errors.fillna(0).astype(int).any())
    header = ["method", f"fidelity [{conf}% CI]", "vs bacon [CI]", "vs rcr [CI]", "refresh", "reads", "tok/s",
              "n"] + (["err"] if errors else [])
    body = [[str(r.method), _ci(r, "fidelity"), _ci(r, "diff_bacon", signed=True), _ci(r, "diff_rcr", signed=True),
             _fmt_num(r.refresh_fraction), _reads(r), _fmt_num(r.tokens_per_s, 1), str(int(r.n))]
            + ([str(int(r.n_errors))] if errors else []) for _, r in g.iterrows()]
    lines = _columns([header], body)
    if len(lines[0]) <= WIDTH:
        return lines
    headers = [[h.split(" [")[0] for h in header], ["", f"[{conf}% CI]", "[CI]", "[CI]"] + [""] * (len(header) - 4)]
    pairs = []  # per method: its values' line and its CIs' line, without its label
    for b in body:
        values, intervals = zip(*((c.split(" [", 1) + [""])[:2] for c in b[1:4]))
        pairs.append(([*values, *b[4:]], [*(f"[{c}" if c else "" for c in intervals), *[""] * (len(b) - 4)]))
    rest = len(_columns(headers, [["", *r] for p in pairs for r in p])[0]) - len("method")
    rows = []
    for b, (values, intervals) in zip(body, pairs):  # a long label over as many lines as it needs
        label = _chunks(b[0], max(WIDTH - rest, 12))
        rows += [[label[0], *values], [label[1] if len(label) > 1 else "", *intervals]]
        rows += [[part] + [""] * len(values) for part in label[2:]]
    return _columns(headers, rows)


def _chunks(label: str, width: int) -> list[str]:
    """``label`` in pieces of at most ``width`` characters, broken after its commas (a longer piece stays whole)."""
    out = [""]
    for part in (p + "," for p in label.split(",")):
        out[-1:] = [out[-1] + part] if len(out[-1] + part) <= width or not out[-1] else [out[-1], part]
    return [p for p in [*out[:-1], out[-1][:-1]] if p]


def _columns(headers: list[list[str]], body: list[list[str]]) -> list[str]:
    """Header rows and body rows as aligned columns: the first left-aligned, the others right-aligned."""
    rows = headers + body
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [line(r).rstrip() for r in headers] + ["  ".join("-" * w for w in widths)] + [line(r).rstrip() for r in body]


def _notes(g: pd.DataFrame, per_sample: pd.DataFrame) -> list[str]:
    """What a reader of the table must know to read it: too few samples for the CIs, a method's own recalls,
    CIDEr-D's zeros and where they come from."""
    lines = []
    n = int(g.n.max()) if len(g) else 0
    if 0 < n < MIN_TRUSTED_N:
        lines.append(f"n = {n} samples (< {MIN_TRUSTED_N}): the bootstrap CIs are not to be trusted; run "
                     f"--limit {MIN_TRUSTED_N} or more before reading them")
    if "recalled_per_step" in g and g.recalled_per_step.notna().any():
        parts = [f"{r.method} {r.recalled_per_step:.1f}" for _, r in g.iterrows() if pd.notna(r.recalled_per_step)]
        lines.append("recalled into a method's own page cache per KV head per layer-step, besides its reads: "
                     + ", ".join(parts))
    zero = g[(g.cider.notna()) & (g.cider.round(3) == 0) & (g.rougeL_ref > 0)] if "cider" in g else g.iloc[0:0]
    if len(zero):
        gap = per_sample[per_sample.model.isin(g.model)].groupby("method")["ref_length_gap"].median() \
            if "ref_length_gap" in per_sample else pd.Series(dtype=float)
        off = ", ".join(f"{m} {gap[m]:.0f}" for m in zero.method if m in gap and pd.notna(gap[m]))
        lines.append(f"CIDEr 0.000 for {', '.join(zero.method)}: CIDEr-D multiplies each match by exp(-d^2/72), d the "
                     "words between the output's length and a reference's, so an output tens of words off scores ~0"
                     + (f" (median d: {off})" if off else ""))
    return lines


def _reference_lines(g: pd.DataFrame) -> list[str]:
    if not (g.rougeL_ref.notna().any() or g.cider.notna().any()):
        return []
    lines = ["against references (ROUGE-L: max over references; CIDEr-D: pycocoevalcap):"]
    w = max(len(str(x)) for x in g.method)
    for _, r in g.iterrows():
        figures = f"ROUGE-L {_ci(r, 'rougeL_ref')}   CIDEr {_ci(r, 'cider')}"
        one = f"  {str(r.method):<{w}}  {figures}"
        lines += [one] if len(one) <= WIDTH else [f"  {r.method}", f"      {figures}"]
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
                     f"{r.frontier_between.replace(',', ' and ')}; all samples): {_ci(r, 'frontier_fidelity')}")
        lines.append(f"  rcr - frontier {_ci(r, 'diff_frontier', signed=True)}")
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
    """The table a job prints at the end, every line at most :data:`WIDTH` columns: per model, one line per method
    with fidelity mean [95% CI], difference from bacon [CI], difference from rcr [CI], realised refresh fraction,
    prefix reads (keys + values) per KV head per layer-step, tokens/s, n (and errors); the reference metrics; the
    notes it needs (:func:`_notes`); then the tuned-fixed comparison (τ* and ``rcr − fixed(τ*)`` on held-out
    samples, ``rcr −`` the fixed-τ frontier), each method's difference from that frontier at its own refresh and
    reads per step, the tercile table, the correlations and the top-position stability, and lines on how it was
    measured."""
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
        prose = (_notes(g, analysis.per_sample) + _fixed_lines(analysis, model) + _matched_lines(g)
                 + _drift_lines(analysis, model))
        lines += _method_table(g, conf) + _reference_lines(g) + [_wrap(x) for x in prose] + [""]
    meta = analysis.meta
    tail = len(lines)
    lines.append(f"errors: {meta.get('n_error_rows', 0)} row(s) excluded"
                 + (f"; {meta.get('n_samples_without_full')} sample(s) without a 'full' row"
                    if meta.get("n_samples_without_full") else ""))
    lines.append(f"fidelity: {meta.get('fidelity')}")
    if meta.get("reference_metrics"):
        lines.append(f"reference metrics (ROUGE-L and CIDEr against references): {meta['reference_metrics']}")
    lines.append(f"CI: {meta.get('bootstrap')}")
    lines.append("refresh = realised fraction of refreshed layer-steps; reads = prefix keys+values read into the "
                 "selection per KV head per layer-step (all: the method keeps the whole prefix resident and attends "
                 "to every entry of it)")
    return "\n".join(lines[:tail] + [_wrap(x) for x in lines[tail:]])


def _wrap(line: str) -> str:
    """A prose line longer than :data:`WIDTH` on several, the later ones indented (the tables fit already)."""
    if len(line) <= WIDTH:
        return line
    return "\n".join(textwrap.wrap(line, WIDTH, subsequent_indent="    ", break_long_words=False,
                                   break_on_hyphens=False))


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
