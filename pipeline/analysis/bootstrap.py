"""Paired percentile bootstrap: one seeded set of resampled sample indices shared by every column, so the
CIs of means and of differences between methods are paired."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd

from pipeline.analysis.labels import BASELINES


def resample_means(values: np.ndarray, valid: np.ndarray | None = None, n_resamples: int = 10_000,
                   seed: int | np.random.Generator = 0, max_chunk_elems: int = 4_000_000) -> np.ndarray:
    """The column means of ``values`` ([n_samples, k]) in each of ``n_resamples`` resamples of the samples:
    an [n_resamples, k] matrix. One seeded set of resampled sample indices serves every column (the set
    :func:`bootstrap_means` uses for the same seed and n), so a statistic computed from several columns of
    one resample is paired. A resample's mean of a column is over its valid resampled entries (``valid``
    [n, k] bool; default: the finite entries); NaN where a resample holds none."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    n, k = x.shape
    m = np.isfinite(x) if valid is None else (np.asarray(valid, dtype=bool).reshape(n, k) & np.isfinite(x))
    xm = np.where(m, x, 0.0)
    mf = m.astype(np.float64)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    stats = np.empty((n_resamples, k))
    chunk = max(1, min(n_resamples, max_chunk_elems // max(n, 1)))
    done = 0
    while done < n_resamples:
        b = min(chunk, n_resamples - done)
        idx = rng.integers(0, n, size=(b, n))
        flat = (idx + (np.arange(b)[:, None] * n)).ravel()
        w = np.bincount(flat, minlength=b * n).reshape(b, n).astype(np.float64)  # (b, n) resample counts
        with np.errstate(invalid="ignore", divide="ignore"):
            stats[done:done + b] = (w @ xm) / (w @ mf)
        done += b
    return stats


def percentile_ci(stats: np.ndarray, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) percentile bounds over the resamples (axis 0) of ``stats``, ignoring NaN resamples."""
    alpha = (1.0 - confidence) / 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
        q = np.nanpercentile(stats, [100 * alpha, 100 * (1 - alpha)], axis=0)
    return q[0], q[1]


def bootstrap_means(values: np.ndarray, valid: np.ndarray | None = None, n_resamples: int = 10_000,
                    seed: int | np.random.Generator = 0, confidence: float = 0.95,
                    max_chunk_elems: int = 4_000_000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Percentile bootstrap CIs of the column means of ``values`` ([n_samples, k]), all columns paired.

    One set of resampled sample indices (seeded, :func:`resample_means`) is shared by all k columns, so a
    column holding a per-sample difference ``a - b`` gives the paired-bootstrap CI of ``mean(a) - mean(b)``.
    ``valid`` ([n, k] bool) marks usable entries; a resample's mean of a column is over its valid
    resampled entries (for complete data this is the ordinary bootstrap). Returns ``(mean, low, high)``
    arrays of length k. Columns whose valid values are all equal (to 1e-12 relative) get
    ``low == high == mean`` exactly;
    columns with no valid value get NaN.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    n, k = x.shape
    m = np.isfinite(x) if valid is None else (np.asarray(valid, dtype=bool).reshape(n, k) & np.isfinite(x))
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(m, x, 0.0).sum(0) / m.sum(0)
    if n == 0:
        return mean, np.full(k, np.nan), np.full(k, np.nan)
    stats = resample_means(x, m, n_resamples, seed, max_chunk_elems)
    low, high = percentile_ci(stats, confidence)
    # zero variance: every resample mean is the same number -> report it exactly, never NaN
    for j in range(k):
        v = x[m[:, j], j]
        if v.size == 0:
            low[j] = high[j] = mean[j] = np.nan
        elif np.all(v == v[0]):
            low[j] = high[j] = mean[j] = float(v[0])
        elif np.ptp(v) <= 1e-12 * max(1.0, float(np.abs(v).max())):  # constant up to float rounding
            low[j] = high[j] = mean[j]
    return mean, low, high


def paired_bootstrap(table: pd.DataFrame, baselines: Sequence[str] = BASELINES, n_resamples: int = 10_000,
                     seed: int = 0, confidence: float = 0.95) -> pd.DataFrame:
    """Means, CIs and paired differences for a [samples x methods] table (NaN = missing).

    Returns one row per method with ``mean, ci_low, ci_high, n`` and, for each baseline ``b`` present,
    ``diff_<b>, diff_<b>_ci_low, diff_<b>_ci_high, n_pairs_<b>`` (method minus baseline, over the
    samples where both are present). One shared set of resampled indices serves every column.
    """
    methods = list(table.columns)
    cols, valid, names = [table[m].to_numpy(float) for m in methods], [], []
    valid = [np.isfinite(c) for c in cols]
    names = [("mean", m, None) for m in methods]
    for b in baselines:
        if b not in table.columns:
            continue
        vb = table[b].to_numpy(float)
        for m in methods:
            vm = table[m].to_numpy(float)
            ok = np.isfinite(vm) & np.isfinite(vb)
            cols.append(np.where(ok, vm - vb, 0.0))
            valid.append(ok)
            names.append(("diff", m, b))
    if not cols:
        return pd.DataFrame(columns=["method", "mean", "ci_low", "ci_high", "n"])
    X = np.stack(cols, 1)
    M = np.stack(valid, 1)
    mean, lo, hi = bootstrap_means(X, M, n_resamples=n_resamples, seed=seed, confidence=confidence)
    rows = {m: {"method": m} for m in methods}
    for j, (kind, m, b) in enumerate(names):
        if kind == "mean":
            rows[m].update(mean=mean[j], ci_low=lo[j], ci_high=hi[j], n=int(M[:, j].sum()))
        else:
            rows[m].update({f"diff_{b}": mean[j], f"diff_{b}_ci_low": lo[j], f"diff_{b}_ci_high": hi[j],
                            f"n_pairs_{b}": int(M[:, j].sum())})
    return pd.DataFrame([rows[m] for m in methods])
