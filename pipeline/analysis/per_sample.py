"""The per-sample table of a job's rows (``analyze.py``'s first step): each ok row's fidelity against its ``full``
output, its reference metrics, its telemetry summaries, its sample's drift, and the fixed sweep's τ."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from pipeline.analysis.labels import EXACT, FIXED, FULL, RCR, parse_sweep_tau
from pipeline.analysis.telemetry import model_series, numeric
from pipeline.analysis.text_metrics import cider_scores, reference_length_gaps, rouge_pairs
from pipeline.schema import ROW_SUMMARIES, Col

# which row's mean drift is "the sample's mean drift" for the tercile / correlation analyses, in order
DRIFT_SOURCES = ((FIXED, Col.MEAN_DRIFT), (RCR, Col.MEAN_DRIFT), (EXACT, Col.MEAN_DRIFT),
                 (RCR, Col.MEAN_DRIFT_EXACT), (EXACT, Col.MEAN_DRIFT_EXACT))


def fidelity_column(d: pd.DataFrame, n_jobs: int | None = None) -> pd.Series:
    """ROUGE-L F1 of every row's output against the ``full`` output of the same (model, sample)."""
    full = d[d[Col.METHOD] == FULL]
    ref = {(m, s): t for m, s, t in zip(model_series(full), full[Col.SAMPLE_ID], full[Col.OUTPUT_TEXT])}
    keys = []
    for m, s, t in zip(model_series(d), d[Col.SAMPLE_ID], d[Col.OUTPUT_TEXT]):
        r = ref.get((m, s), _NO_REF)
        keys.append(None if r is _NO_REF else ("" if r is None else str(r), "" if t is None else str(t)))
    uniq = sorted({k for k in keys if k is not None})
    scores = dict(zip(uniq, rouge_pairs(uniq, n_jobs)))
    return pd.Series([np.nan if k is None else scores[k] for k in keys], index=d.index, dtype=float)


_NO_REF = object()


def ref_rouge_column(d: pd.DataFrame, n_jobs: int | None = None) -> list[float]:
    """Max ROUGE-L F1 over each row's references (rows given all have references)."""
    keys = [[(str(r), "" if t is None else str(t)) for r in refs if r is not None]
            for refs, t in zip(d[Col.REFERENCES], d[Col.OUTPUT_TEXT])]
    uniq = sorted({k for ks in keys for k in ks})
    scores = dict(zip(uniq, rouge_pairs(uniq, n_jobs)))
    return [max(scores[k] for k in ks) if ks else np.nan for ks in keys]


def has_refs(x) -> bool:
    if x is None:
        return False
    try:
        return len(x) > 0
    except TypeError:
        return False


def sample_drift(d: pd.DataFrame) -> tuple[pd.Series, str | None]:
    """Per (model, sample) mean drift from the first available source in DRIFT_SOURCES."""
    for method, col in DRIFT_SOURCES:
        if col not in d:
            continue
        g = d[(d[Col.METHOD] == method)]
        v = numeric(g, col)
        if v.notna().any():
            key = list(zip(model_series(g), g[Col.SAMPLE_ID]))
            return pd.Series(v.to_numpy(), index=pd.MultiIndex.from_tuples(key)), f"{method}.{col}"
    return pd.Series(dtype=float), None


def reference_metrics_into(d: pd.DataFrame, ps: pd.DataFrame, n_jobs: int | None) -> bool | None:
    """ROUGE-L and CIDEr against the references, into ``ps``; whether CIDEr ran (None: no references)."""
    has = d[Col.REFERENCES].map(has_refs)
    if not has.any():
        return None
    ps.loc[has, "rougeL_ref"] = ref_rouge_column(d[has], n_jobs)
    try:
        for _, g in d[has].groupby([Col.MODEL, Col.METHOD], sort=False):
            texts, refs = list(g[Col.OUTPUT_TEXT]), [list(r) for r in g[Col.REFERENCES]]
            ps.loc[g.index, "ref_length_gap"] = reference_length_gaps(texts, refs)
            ps.loc[g.index, "cider"] = cider_scores(texts, refs)
        return True
    except ImportError as e:  # pycocoevalcap is in the `pipeline` extra
        warnings.warn(f"CIDEr skipped: {e}", stacklevel=2)
        return False


def reference_coverage(d: pd.DataFrame, reference_metrics: bool) -> str:
    """Which samples the reference metrics cover, for the summary and MLflow: "absent" when no sample has
    references (e.g. TextCaps' test split), so that no one reads a missing number as a computed one."""
    if not reference_metrics:
        return "not computed (reference_metrics=False)"
    n = d[Col.SAMPLE_ID].nunique()
    with_refs = d.loc[d[Col.REFERENCES].map(has_refs), Col.SAMPLE_ID].nunique() if Col.REFERENCES in d else 0
    if with_refs == 0:
        return f"absent: none of the {n} samples has references"
    return f"on {with_refs} of {n} samples" + (" (the others have no references)" if with_refs < n else "")


def per_sample(d: pd.DataFrame, reference_metrics: bool, n_jobs: int | None) -> tuple[pd.DataFrame, bool | None,
                                                                                        str | None]:
    """One row per ok (model, sample, method) with its metrics; whether CIDEr ran; the drift source."""
    ps = pd.DataFrame({"model": d[Col.MODEL], "sample_id": d[Col.SAMPLE_ID], "method": d[Col.METHOD].astype(str)})
    for c in (Col.TASK, Col.SOURCE):
        if c in d:
            ps[c] = d[c]
    ps["fidelity"] = fidelity_column(d, n_jobs)
    ps["rougeL_ref"] = np.nan
    ps["cider"] = np.nan
    ps["ref_length_gap"] = np.nan  # words between the output and its nearest reference (CIDEr-D's length penalty)
    cider_ok = reference_metrics_into(d, ps, n_jobs) if reference_metrics and Col.REFERENCES in d else None
    for col in (*ROW_SUMMARIES, Col.N_STEPS, Col.PREFILL_S, Col.DECODE_S):
        ps[col] = numeric(d, col)
    ps["reads_per_step"] = ps[Col.KEYS_READ_PER_STEP] + ps[Col.VALUES_READ_PER_STEP]
    full_len = ps[ps.method == FULL].set_index(["model", "sample_id"])["n_steps"]
    full_len = full_len[~full_len.index.duplicated()]
    ps["output_len_full"] = full_len.reindex(list(zip(ps.model, ps.sample_id))).to_numpy()
    drift, drift_src = sample_drift(d)
    ps["sample_drift"] = drift.reindex(list(zip(ps.model, ps.sample_id))).to_numpy() if len(drift) else np.nan
    ps["sweep_tau"] = ps.method.map(parse_sweep_tau).astype(float)
    return ps.reset_index(drop=True), cider_ok, drift_src
