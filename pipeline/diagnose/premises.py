"""What RCR assumes of a model, as figures with paired-bootstrap CIs from the pipeline's own statistics.

From a job's rows (``full``, ``bacon``, ``prefill_oracle``, ``exact``, ``fixed`` on the same samples; ``analyze``):

* **dwell**: how often the most-attended prefix position is unchanged between adjacent steps (the paper: 41% on
  Qwen2-VL to 80% on LLaVA-NeXT);
* **staleness**: what a selection fixed at prefill keeps (``bacon``, and ``prefill_oracle``, the best static
  selection, scored with the answer's own attention; the paper: .44-.52 on DetailCaps), against re-selecting at
  every step (``exact``; the paper: .48-.61), and their paired differences;
* **drift between samples**: each sample's mean drift and how it spreads, and ``fixed``'s refresh fraction per
  drift tercile (the paper, at tau = 0.03 on Qwen2-VL DetailCaps: 1% in the low tercile, 35% in the high one);
  and whether low drift still means a stale selection: ``exact`` - ``bacon`` per drift tercile (the paper: exact
  re-selection lifts its low-drift tercile from .462 to .763).

From a few answers' attention (``attention.profile``, ``detector.probe``), per re-selected layer:

* **detector recall**: what the rank-r detector's candidates catch of what each step reads, per KV head, and
  whether the most-attended entry (the sink, in most models) is among them;
* **image share**: the image tokens' share of each answer step's attention (real VLMs put most of it on a few
  sink and text positions); and per drift tercile of samples, over the re-selected layers: drift is the share of a
  step's attention on evicted entries, so a sample whose steps give the image a small share drifts little however
  far its reading moves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from pipeline.analysis.bootstrap import bootstrap_means
from pipeline.analysis.labels import BACON, EXACT, FIXED, PREFILL_ORACLE


@dataclass
class Figure:
    """One line of the premise table: what is measured, its value, what the paper reports (where it does), and
    ``value`` as a number for MLflow (``metric``, where it has one)."""

    name: str
    value: str
    paper: str = ""
    metric: float | None = None
    key: str | None = None  # the MLflow metric name
    ci_low: float | None = None  # the metric's paired-bootstrap CI, where it has one
    ci_high: float | None = None
    shown: bool = True  # a line of the printed table; False: a metric only (its value is in another line)

    def line(self, width: int = 46) -> str:
        return f"{self.name:<{width}} {self.value:<40} {self.paper}".rstrip()


def ci(mean: float, lo: float, hi: float, signed: bool = False) -> str:
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(mean)} [{f.format(lo)}, {f.format(hi)}]"


def _row(methods: pd.DataFrame, m: str) -> pd.Series | None:
    hit = methods[methods["method"] == m]
    return hit.iloc[0] if len(hit) else None


def staleness(a) -> list[Figure]:
    """Fidelity of the static selections and of exact re-selection, and exact minus each, paired."""
    out = []
    ex = _row(a.methods, EXACT)
    for m, paper in ((BACON, ""), (PREFILL_ORACLE, "paper .44-.52 (DetailCaps)"), (EXACT, "paper .48-.61")):
        r = _row(a.methods, m)
        if r is not None:
            d = (float(r["fidelity"]), float(r["fidelity_ci_low"]), float(r["fidelity_ci_high"]))
            out.append(Figure(f"{m} fidelity", ci(*d), paper, d[0], f"fidelity_{m}", d[1], d[2]))
    for base in (BACON, PREFILL_ORACLE):
        col = f"diff_{base}"
        if ex is not None and col in a.methods and pd.notna(ex.get(col)):
            d = (float(ex[col]), float(ex[f"{col}_ci_low"]), float(ex[f"{col}_ci_high"]))
            out.append(Figure(f"exact - {base} (fidelity)", ci(*d, signed=True), "", d[0], f"exact_minus_{base}",
                              d[1], d[2]))
    return out


def dwell(a) -> list[Figure]:
    if not len(a.stability):
        return [Figure("top prefix position unchanged", "n/a (no full rows with record_attention)")]
    s = a.stability.iloc[0]
    value = float(s["fraction_unchanged"])
    return [Figure("top prefix position unchanged", f"{value:.1%} of {int(s['n_pairs'])} layer-step pairs",
                   "paper 41% (Qwen2-VL) - 80% (LLaVA-NeXT)", value, "dwell")]


def drift_spread(a) -> list[Figure]:
    """Each sample's mean drift (the analysis' drift source), its spread, and fixed's refresh by drift tercile."""
    per = a.per_sample.drop_duplicates("sample_id")["sample_drift"].dropna().to_numpy(float)
    if not len(per):
        return [Figure("drift per sample", "n/a (no drift telemetry)")]
    cv = float(per.std() / per.mean()) if per.mean() > 0 else float("nan")
    out = [Figure("drift per sample (mean, min-max)", f"{per.mean():.3f}, {per.min():.3f}-{per.max():.3f}", "",
                  float(per.mean()), "drift_mean"),
           Figure("drift spread between samples (std / mean)", f"{cv:.2f}", "", cv, "drift_cv")]
    t = a.terciles[a.terciles["method"] == FIXED].set_index("tercile") if len(a.terciles) else a.terciles
    if len(t) and {"low", "high"} <= set(t.index):
        lo, hi = float(t.loc["low", "refresh_fraction"]), float(t.loc["high", "refresh_fraction"])
        drift = f"(drift {t.loc['low', 'drift_mean']:.3f} / {t.loc['high', 'drift_mean']:.3f})"
        out += [Figure("fixed refresh, low / high drift tercile", f"{lo:.3f} / {hi:.3f} {drift}",
                       "paper 0.01 / 0.35 (Qwen2-VL, tau 0.03)", hi - lo, "fixed_refresh_high_minus_low"),
                Figure("fixed refresh, low drift tercile", f"{lo:.3f}", "", lo, "fixed_refresh_low", shown=False)]
    return out


def tercile_staleness(a) -> list[Figure]:
    """``exact`` - ``bacon`` fidelity per drift tercile, paired (the analysis' bootstrap settings): how much
    re-selection lifts the samples that drift little, which a fixed threshold rarely refreshes."""
    ps = a.per_sample
    if "drift_tercile" not in ps or not {EXACT, BACON} <= set(ps["method"]):
        return []
    wide = ps.pivot_table(index="sample_id", columns="method", values="fidelity", aggfunc="first")
    terc = ps.drop_duplicates("sample_id").set_index("sample_id")["drift_tercile"].dropna()
    diffs = {}
    for t in ("low", "mid", "high"):
        d = (wide[EXACT] - wide[BACON]).reindex(terc.index[terc == t]).dropna().to_numpy(float)
        if len(d):
            m = a.meta
            mean, lo, hi = bootstrap_means(d, None, m["bootstrap_resamples"], m["seed"], m["confidence"])
            diffs[t] = (float(mean[0]), float(lo[0]), float(hi[0]))
    if not diffs:
        return []
    order = [t for t in ("low", "mid", "high") if t in diffs]
    value = " / ".join(ci(*diffs[t], signed=True) if i == 0 else f"{diffs[t][0]:+.3f}" for i, t in enumerate(order))
    out = [Figure(f"exact - bacon, {' / '.join(order)} drift tercile", value,
                  "paper low: fixed .462, exact .763 (Qwen2-VL)")]  # the first tercile's CI, the others' means
    out += [Figure(f"exact - bacon, {t} drift tercile", ci(*diffs[t], signed=True), "", diffs[t][0],
                   f"exact_minus_bacon_tercile_{t}", diffs[t][1], diffs[t][2], shown=False) for t in order]
    return out


def layer_figures(layers: list[dict], detector: list[list[dict]], treated: tuple[bool, ...]) -> list[Figure]:
    """Per re-selected layer: the image share of a step's attention and the detector's recall per KV head, with
    whether the most-attended entry is among its candidates."""
    out = []
    for i, (att, heads) in enumerate(zip(layers, detector)):
        if not treated[i]:
            continue
        recall = " ".join(f"{r['recall']:.2f}" for r in heads)
        top = min(heads, key=lambda r: r["cand"])  # the head whose candidates catch its top entry least
        out.append(Figure(f"layer {i}: detector recall per KV head", recall, "", float(min(r["recall"] for r in heads)),
                          f"detector_recall_min_layer{i}"))
        out.append(Figure(f"layer {i}: top entry among candidates", f"entry {top['top']}: {top['cand']:.2f} of steps "
                          f"(mass {top['mass']:.2f}, in basis {top['in_basis']:.2f})", "", float(top["cand"]),
                          f"top_entry_candidate_layer{i}"))
        out.append(Figure(f"layer {i}: image share of a step's attention", f"{att['on_image']:.3f}",
                          "real VLMs: mostly on sink and text", float(att["on_image"]), f"image_share_layer{i}"))
    return out


def probe_picks(a, order: list[str], n: int) -> dict[str, str]:
    """The samples the per-layer probes answer, sample id -> drift tercile: the first ``n`` of each tercile, in
    ``order`` (the input's sample ids); the first ``n`` samples, as tercile "all", where the rows have none."""
    per = a.per_sample.drop_duplicates("sample_id").set_index("sample_id")
    terc = per["drift_tercile"].dropna().to_dict() if "drift_tercile" in per else {}
    if not terc:
        return {sid: "all" for sid in order[:n]}
    picks: dict[str, str] = {}
    for t in ("low", "mid", "high"):
        picks |= {sid: t for sid in [s for s in order if terc.get(s) == t][:n]}
    return picks


def tercile_share(by_tercile: dict[str, list[dict]], treated: tuple[bool, ...]) -> list[Figure]:
    """The image share of a step's attention per drift tercile (``by_tercile``: tercile -> per-layer profile of
    its probed samples), averaged over the re-selected layers."""
    if not any(treated):
        return []
    share = {t: float(np.mean([p["on_image"] for p, on in zip(layers, treated) if on]))
             for t, layers in by_tercile.items() if t != "all"}
    order = [t for t in ("low", "mid", "high") if t in share]
    if not order:
        return []
    return [Figure(f"image share, {' / '.join(order)} drift tercile", " / ".join(f"{share[t]:.3f}" for t in order) +
                   " (re-selected layers)", "", share[order[0]], f"image_share_tercile_{order[0]}")]


def figures(a, layers: list[dict] | None, detector: list[list[dict]] | None,
            treated: tuple[bool, ...] | None, by_tercile: dict[str, list[dict]] | None = None) -> list[Figure]:
    """The whole premise table: from the rows' analysis ``a`` and, where measured, the per-layer probes (over all
    probed samples, and per drift tercile in ``by_tercile``)."""
    out = dwell(a) + staleness(a) + drift_spread(a) + tercile_staleness(a)
    if layers is not None and detector is not None:
        out += layer_figures(layers, detector, treated)
    if by_tercile and treated is not None:
        out += tercile_share(by_tercile, treated)
    return out


def table(figs: list[Figure]) -> str:
    """The printed premise table: one line per shown figure."""
    figs = [f for f in figs if f.shown]
    width = max(46, *(len(f.name) + 1 for f in figs))
    return "\n".join([f"{'premise':<{width}} {'measured':<40} the paper", *(f.line(width) for f in figs)])


def frame(figs: list[Figure]) -> pd.DataFrame:
    return pd.DataFrame([asdict(f) for f in figs]).astype({"metric": float})


def by_key(figs: list[Figure]) -> dict[str, Figure]:
    return {f.key: f for f in figs if f.key}


def finite_metrics(figs: list[Figure]) -> dict[str, float]:
    return {f.key: f.metric for f in figs if f.key and f.metric is not None and np.isfinite(f.metric)}
