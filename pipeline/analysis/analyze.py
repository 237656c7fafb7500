"""The statistics of a job from its Parquet output: fidelity, reference metrics, paired bootstrap CIs and
the drift analyses, as one :class:`Analysis` of pandas tables.

Pure pandas / numpy / scipy (plus ``rouge-score`` and, for CIDEr, ``pycocoevalcap``). No MLflow, no
Ray: the driver calls this after a job, and a person can call it on ``pd.read_parquet(out)``. It reads the
labels' methods from the registry (``rcr.methods``, imported on the first call: it brings torch) for their display
order and knobs.

Entry point (the driver and ``pipeline/analysis/tracking.py`` call it): :func:`analyze`
``(df, bootstrap_resamples=10000, seed=0, ...) -> Analysis``; ``pipeline/analysis/report.py`` prints it.
The pieces live beside it: ``text_metrics.py`` (ROUGE-L, CIDEr), ``bootstrap.py``, ``telemetry.py``.

Input: one row per (sample_id, method) in the output schema (``pipeline/schema.py``, names in ``Col``).
The ``full`` row of a sample is the uncompressed reference for the fidelity of every method on the same
(model, sample_id). Rows whose ``error`` is not null are excluded from all statistics, but counted
(``Analysis.errors`` and ``n_errors`` per method).

What is measured, and with what (also in ``Analysis.meta`` and logged to MLflow):

* **Fidelity**: ROUGE-L F1 of a method's ``output_text`` against the ``full`` output of the same model
  and sample. Package ``rouge-score`` (``RougeScorer(["rougeL"])``), with :class:`UnicodeTokenizer`
  (the package's default tokenizer keeps only ``[a-z0-9]`` and so drops all non-ASCII text), no
  stemming. Two outputs that are both empty after tokenisation score 1.0 (they are identical).
* **ROUGE-L vs references**: the same scorer; multi-reference rule: the maximum F1 over the
  sample's references (``RougeScorer.score_multi``).
* **CIDEr** (CIDEr-D as in the COCO caption evaluation code): ``pycocoevalcap`` 1.2 ``Cider`` (n=4,
  sigma=6), which is pure Python; its Java PTB tokenizer is *not* used: texts are tokenised with
  :class:`UnicodeTokenizer` and joined with spaces. Multi-reference rule: CIDEr's own consensus (the
  mean over references of the TF-IDF n-gram cosine). IDF comes from the references of the samples
  scored together (one corpus per (model, method), so the same corpus for every method when they cover
  the same samples). Per-sample scores are bootstrapped with that IDF fixed.
* Samples without references (TextCaps' test split, a video folder without captions) have no reference
  metrics; ``meta["reference_metrics"]`` says which samples they cover, ``absent: ...`` when none does.
* **Paired bootstrap**: percentile CIs from ``n_resamples`` resamples of the samples (default 10,000,
  seeded). Per model, ONE matrix of resampled indices is drawn and used for every method's mean and
  for every difference (method minus ``bacon``, method minus ``rcr``), so the comparisons are paired.
  Equivalent to ``scipy.stats.bootstrap(..., paired=True, method="percentile")`` (tested against it),
  but vectorised as a matrix product of resample counts. A statistic with zero variance (e.g. two
  identical methods) gets the CI [x, x] exactly, never NaN.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats as _scistats

from pipeline.analysis import fixed_tuning
from pipeline.analysis.bootstrap import bootstrap_means, paired_bootstrap
from pipeline.analysis.labels import BASELINES, EXACT, FIXED, FULL, RCR, TERCILE_METHODS, order_methods, parse_sweep_tau
from pipeline.analysis.per_sample import per_sample, reference_coverage
from pipeline.analysis.telemetry import as_2d, model_series, top_position_stability
from pipeline.analysis.text_metrics import CIDER_DESC, FIDELITY_DESC, REF_ROUGE_DESC
from pipeline.schema import ROW_SUMMARIES, Col

REQUIRED = (Col.SAMPLE_ID, Col.METHOD, Col.OUTPUT_TEXT)  # the columns analyze() cannot do without
# per-method means of the rows' summaries (besides refresh_fraction, which gets a CI); each method's MLflow
# run logs them, so a new float column in the schema reaches the tables and MLflow with no edit here
METHOD_MEANS = (*(c for c in ROW_SUMMARIES if c != Col.REFRESH_FRACTION), "reads_per_step", Col.N_STEPS)
CI_METRICS = ("refresh_fraction", "rougeL_ref", "cider")  # CIs on means (fidelity has its paired table)


@dataclasses.dataclass
class Analysis:
    """Tables produced by :func:`analyze` (all plain pandas DataFrames; ``model`` is "" if unnamed).

    * ``per_sample``: one row per ok (model, sample_id, method): fidelity, rougeL_ref, cider,
      refresh_fraction, mean_drift, sample_drift (the sample's drift for terciles), drift_tercile,
      output_len_full, n_steps, read counters, tokens_per_s, sweep_tau.
    * ``methods``: one row per (model, method): n, n_errors, fidelity mean/ci_low/ci_high,
      diff_bacon*/diff_rcr* with CIs and n_pairs, refresh_fraction (+CI), reads per step, tokens/s,
      rougeL_ref and cider (+CI), sweep_tau; with a ``fixed@τ`` sweep, the fixed-τ frontier at the method's own
      refresh fraction and reads per step and the method's difference from it (``frontier_at_refresh``,
      ``diff_frontier_refresh``, ``frontier_at_reads``, ``diff_frontier_reads``, each with its CI).
    * ``terciles``: (model, tercile, method) -> n, drift range, refresh_fraction, fidelity (+CI).
    * ``correlations``: (model, method, against) -> Spearman rho, p-value, n; ``gap`` is
      fidelity(exact) - fidelity(method), against "mean_drift" or "output_length".
    * ``stability``: per model, fraction of adjacent steps with unchanged most-attended prefix position.
    * ``frontier``: per (model, method) fidelity (+CI) against realised refresh fraction, with
      ``kind`` in {"sweep", "rcr", "method"}.
    * ``fixed_comparison``: per model, ``rcr`` against the fixed threshold as the paper compares them
      (``fixed_tuning.py``): τ* chosen on the development half, ``rcr − fixed(τ*)`` on the test half, and
      ``rcr −`` the fixed-τ frontier at rcr's refresh fraction, with CIs; ``status`` "skipped" and a
      ``note`` when the job has no ``fixed@τ`` sweep (or no ``rcr``).
    * ``fixed_tuning``: per (model, fixed-threshold candidate): τ, mean fidelity on each half, refresh,
      and whether it was chosen as τ*.
    * ``errors``: the rows with an error (model, sample_id, method, error).
    * ``meta``: what was used (packages, tokenizer, multi-reference rule, bootstrap settings, drift source).
    """

    per_sample: pd.DataFrame
    methods: pd.DataFrame
    terciles: pd.DataFrame
    correlations: pd.DataFrame
    stability: pd.DataFrame
    frontier: pd.DataFrame
    errors: pd.DataFrame
    meta: dict[str, Any]
    fixed_comparison: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)
    fixed_tuning: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)

    def tables(self) -> dict[str, pd.DataFrame]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), pd.DataFrame)}



@dataclasses.dataclass(frozen=True)
class _Settings:
    resamples: int
    seed: int
    confidence: float
    baselines: Sequence[str]


def _split_rows(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """(ok rows without duplicate keys, the error rows, the number of duplicates dropped)."""
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"output rows lack required columns {missing}")
    df = df.reset_index(drop=True)  # copies; a unique index is assumed below
    df[Col.MODEL] = model_series(df)
    df[Col.SAMPLE_ID] = df[Col.SAMPLE_ID].astype(str)
    err_mask = df[Col.ERROR].notna() if Col.ERROR in df else pd.Series(False, index=df.index)
    errors = df.loc[err_mask, [Col.MODEL, Col.SAMPLE_ID, Col.METHOD] + ([Col.ERROR] if Col.ERROR in df else [])]
    d = df[~err_mask].copy()
    dups = d.duplicated([Col.MODEL, Col.SAMPLE_ID, Col.METHOD], keep="last")
    return d[~dups], errors.reset_index(drop=True), int(dups.sum())


def _wide(pm: pd.DataFrame, samples: list[str], methods: list[str]) -> dict[str, pd.DataFrame]:
    """[samples x methods] tables of the per-sample metrics of one model."""
    return {metric: pm.pivot_table(index="sample_id", columns="method", values=metric, aggfunc="first",
                                   dropna=False).reindex(index=samples, columns=methods)
            for metric in ("fidelity", *CI_METRICS, "reads_per_step")}


def _method_rows(model: str, pm: pd.DataFrame, d: pd.DataFrame, methods: list[str], wide: dict,
                 n_err: pd.Series, st: _Settings) -> list[dict]:
    """One row per method of one model: fidelity and its paired differences, CIs, means (one shared
    resample set: the same seed gives the same resampled indices for every table)."""
    fid = paired_bootstrap(wide["fidelity"], st.baselines, st.resamples, st.seed, st.confidence).set_index("method")
    extra = {}
    for metric in CI_METRICS:
        w = wide[metric].to_numpy(float)
        mean, lo, hi = bootstrap_means(w, None, st.resamples, st.seed, st.confidence)
        extra[metric] = pd.DataFrame({"mean": mean, "ci_low": lo, "ci_high": hi, "n": np.isfinite(w).sum(0)},
                                     index=wide[metric].columns)
    rows = []
    for m in methods:
        g = pm[pm.method == m]
        row: dict[str, Any] = {"model": model, "method": m, "n": int(g.fidelity.notna().sum()), "n_rows": len(g),
                               "n_errors": int(n_err.get((model, m), 0)), "sweep_tau": parse_sweep_tau(m)}
        f = fid.loc[m] if m in fid.index else None
        for key, col in (("fidelity", "mean"), ("fidelity_ci_low", "ci_low"), ("fidelity_ci_high", "ci_high")):
            row[key] = f[col] if f is not None else np.nan
        for b in st.baselines:
            for key in (f"diff_{b}", f"diff_{b}_ci_low", f"diff_{b}_ci_high"):
                row[key] = f[key] if (f is not None and key in f.index) else np.nan
            key = f"n_pairs_{b}"
            row[key] = int(f[key]) if (f is not None and key in f.index and pd.notna(f[key])) else 0
        for metric in CI_METRICS:
            e = extra[metric].loc[m]
            row.update({metric: e["mean"], f"{metric}_ci_low": e["ci_low"], f"{metric}_ci_high": e["ci_high"]})
        for c in METHOD_MEANS:
            row[c] = float(g[c].mean()) if g[c].notna().any() else np.nan
        if m == FIXED and pd.isna(row["sweep_tau"]) and Col.TAU in d:
            row["sweep_tau"] = _constant_tau(d[(d[Col.MODEL] == model) & (d[Col.METHOD] == m)])
        rows.append(row)
    return rows


def _tercile_rows(model: str, pm: pd.DataFrame, wide: dict, st: _Settings) -> tuple[list[dict], pd.Series | None]:
    """Fidelity and refresh by tercile of the per-sample mean drift; and each sample's tercile."""
    sd = pm.drop_duplicates("sample_id").set_index("sample_id")["sample_drift"].dropna()
    if len(sd) < 3:
        return [], None
    terc = pd.qcut(sd.rank(method="first"), 3, labels=["low", "mid", "high"])
    rows = []
    for t in ("low", "mid", "high"):
        ids = terc.index[terc == t]
        for m in TERCILE_METHODS:
            if m not in wide["fidelity"].columns:
                continue
            fv = wide["fidelity"].loc[ids, m].to_numpy(float)
            rv = wide["refresh_fraction"].loc[ids, m].to_numpy(float)
            mean, lo, hi = bootstrap_means(fv, None, st.resamples, st.seed, st.confidence)
            rows.append(dict(
                model=model, tercile=t, method=m, n=int(np.isfinite(fv).sum()),
                drift_min=float(sd[ids].min()), drift_max=float(sd[ids].max()), drift_mean=float(sd[ids].mean()),
                refresh_fraction=float(np.nanmean(rv)) if np.isfinite(rv).any() else np.nan,
                fidelity=mean[0], fidelity_ci_low=lo[0], fidelity_ci_high=hi[0]))
    return rows, pm.sample_id.map(terc).astype("object")


def _correlation_rows(model: str, pm: pd.DataFrame, methods: list[str], samples: list[str], wide: dict) -> list[dict]:
    """Spearman of each method's gap to exact against the sample's mean drift and output length."""
    if EXACT not in wide["fidelity"].columns:
        return []
    ex = wide["fidelity"][EXACT]
    per = pm.drop_duplicates("sample_id").set_index("sample_id")
    against = {"mean_drift": per["sample_drift"].reindex(samples),
               "output_length": per["output_len_full"].reindex(samples)}
    rows = []
    for m in methods:
        if m in (EXACT, FULL) or m not in wide["fidelity"].columns:
            continue
        gap = ex - wide["fidelity"][m]
        for name, x in against.items():
            ok = gap.notna() & x.notna()
            rho, p = _spearman(gap[ok].to_numpy(float), x[ok].to_numpy(float))
            rows.append(dict(model=model, method=m, gap="fidelity(exact) - fidelity(method)", against=name,
                             spearman_rho=rho, p_value=p, n=int(ok.sum())))
    return rows


TERCILE_COLUMNS = ["model", "tercile", "method", "n", "drift_min", "drift_max", "drift_mean", "refresh_fraction",
                   "fidelity", "fidelity_ci_low", "fidelity_ci_high"]
CORRELATION_COLUMNS = ["model", "method", "gap", "against", "spearman_rho", "p_value", "n"]


def analyze(df: pd.DataFrame, bootstrap_resamples: int = 10_000, seed: int = 0, confidence: float = 0.95,
            reference_metrics: bool = True, baselines: Sequence[str] = BASELINES,
            n_jobs: int | None = None) -> Analysis:
    """Compute every statistic of a job from its output rows (see the module docstring).

    Args:
        df: the job's rows, e.g. ``pd.read_parquet(output_dir)``; one row per (sample_id, method).
        bootstrap_resamples: resamples of the paired bootstrap (default 10,000).
        seed: bootstrap seed. The same seed is used for each model's shared resample set.
        confidence: CI level (0.95).
        reference_metrics: compute ROUGE-L vs references and CIDEr where references exist.
        baselines: methods every other method is differenced against (paired).
        n_jobs: processes for the ROUGE-L scoring when there are many pairs (default: CPU count, <= 16).
    """
    d, errors, n_dups = _split_rows(df)
    ps, cider_ok, drift_src = per_sample(d, reference_metrics, n_jobs)
    st = _Settings(bootstrap_resamples, seed, confidence, tuple(baselines))
    n_err = errors.groupby([Col.MODEL, Col.METHOD]).size() if len(errors) else pd.Series(dtype=int)
    models = sorted(set(ps.model) | set(errors[Col.MODEL] if len(errors) else []))
    ps["drift_tercile"] = pd.Series(pd.NA, index=ps.index, dtype="object")
    method_rows, terc_rows, corr_rows, tune_rows, cmp_rows = [], [], [], [], []
    for model in models:
        pm = ps[ps.model == model]
        methods = order_methods(set(pm.method) | set(errors.loc[errors[Col.MODEL] == model, Col.METHOD]
                                                     if len(errors) else []))
        samples = sorted(set(pm.sample_id))
        wide = _wide(pm, samples, methods)
        rows = _method_rows(model, pm, d, methods, wide, n_err, st)
        fixed_tau = next((r["sweep_tau"] for r in rows if r["method"] == FIXED), None)
        matched = fixed_tuning.matched_frontier(wide, fixed_tau, st)
        method_rows += [{**r, **matched.get(r["method"], {})} for r in rows]
        rows, comparison = fixed_tuning.compare(model, wide, fixed_tau, st)
        tune_rows += rows
        cmp_rows.append(comparison)
        rows, terciles = _tercile_rows(model, pm, wide, st)
        terc_rows += rows
        if terciles is not None:
            ps.loc[pm.index, "drift_tercile"] = terciles.to_numpy()
        corr_rows += _correlation_rows(model, pm, methods, samples, wide)
    methods_df = pd.DataFrame(method_rows)
    meta = _meta(st, cider_ok, drift_src, n_rows=len(df), errors=errors, n_dups=n_dups, ps=ps, models=models)
    meta["reference_metrics"] = reference_coverage(d, reference_metrics)
    return Analysis(per_sample=ps, methods=methods_df, terciles=pd.DataFrame(terc_rows, columns=TERCILE_COLUMNS),
                    correlations=pd.DataFrame(corr_rows, columns=CORRELATION_COLUMNS),
                    stability=top_position_stability(df), frontier=_frontier(methods_df), errors=errors, meta=meta,
                    fixed_comparison=pd.DataFrame(cmp_rows),
                    fixed_tuning=pd.DataFrame(tune_rows, columns=fixed_tuning.CANDIDATE_COLUMNS))


def _meta(st: _Settings, cider_ok: bool | None, drift_src: str | None, *, n_rows: int, errors: pd.DataFrame,
          n_dups: int, ps: pd.DataFrame, models: list[str]) -> dict[str, Any]:
    """What was measured and how (logged to MLflow as params and ``analysis_meta.json``)."""
    return {
        "fidelity": FIDELITY_DESC,
        "rougeL_ref": REF_ROUGE_DESC,
        "cider": CIDER_DESC if cider_ok is not False else "not computed (pycocoevalcap missing)",
        "bootstrap": (f"paired percentile bootstrap, {st.resamples} resamples, seed {st.seed}, "
                      f"{int(st.confidence * 100)}% CI; one shared resample-index set per model for all "
                      "methods and differences; zero variance -> CI [x, x]"),
        "bootstrap_resamples": st.resamples, "seed": st.seed, "confidence": st.confidence,
        "drift_source": drift_src,
        "tercile_rule": "pd.qcut on the rank of the per-sample mean drift (3 equal-count bins)",
        "fixed_tuning": f"{fixed_tuning.SPLIT_RULE}; {fixed_tuning.SELECTION_RULE}; rcr - fixed(tau*) on the test half",
        "n_rows": int(n_rows), "n_error_rows": int(len(errors)), "n_duplicate_rows_dropped": n_dups,
        "n_samples": int(ps[["model", "sample_id"]].drop_duplicates().shape[0]),
        "n_samples_without_full": int(ps[ps.fidelity.isna()][["model", "sample_id"]].drop_duplicates().shape[0]),
        "models": models,
        "baselines": list(st.baselines),
    }


def _constant_tau(rows: pd.DataFrame) -> float | None:
    for x in rows[Col.TAU]:
        a = as_2d(x, float)
        if a is not None and a.size:
            v = a[np.isfinite(a)]
            if v.size and np.allclose(v, v[0]):
                return float(v[0])
    return None


def _spearman(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    if len(a) < 3 or np.all(a == a[0]) or np.all(b == b[0]):
        return float("nan"), float("nan")  # undefined (constant input or too few samples)
    r = _scistats.spearmanr(a, b)
    return float(r.statistic), float(r.pvalue)


def _frontier(methods_df: pd.DataFrame) -> pd.DataFrame:
    cols = ["model", "method", "kind", "tau", "refresh_fraction", "fidelity", "fidelity_ci_low",
            "fidelity_ci_high"]
    if methods_df.empty:
        return pd.DataFrame(columns=cols)
    f = methods_df.copy()
    f["kind"] = np.where(f.method.map(parse_sweep_tau).notna(), "sweep", np.where(f.method == RCR, "rcr", "method"))
    f["tau"] = f["sweep_tau"]
    f = f[f.refresh_fraction.notna() & f.fidelity.notna()]
    return f[cols].sort_values(["model", "kind", "refresh_fraction"]).reset_index(drop=True)
