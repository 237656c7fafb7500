"""Telemetry analyses over the output rows: per-step refresh rate and tau, the stability of the most-attended
prefix position, and the row helpers the analyses and the plots share."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd

from pipeline.analysis.labels import FULL, RCR
from pipeline.schema import Col


def as_2d(x, dtype=float) -> np.ndarray | None:
    """[layer][step] nested list / array of arrays -> 2-D array (None if missing or empty). A null layer (a
    ``trigger`` row of a layer that is never re-selected) becomes a row of NaN (float) / False."""
    if x is None:
        return None
    if isinstance(x, float) and math.isnan(x):
        return None
    try:
        rows = [None if r is None else np.asarray(r, dtype=dtype) for r in x]
    except TypeError:
        return None
    if not any(r is not None for r in rows):
        return None
    width = max(r.shape[0] for r in rows if r is not None)
    rows = [np.empty(0, dtype=dtype) if r is None else r for r in rows]
    if any(r.shape[0] != width for r in rows):  # ragged: pad with NaN (float) / False
        fill = np.nan if np.issubdtype(np.dtype(dtype), np.floating) else 0
        rows = [np.concatenate([r, np.full(width - r.shape[0], fill, dtype=dtype)]) for r in rows]
    return np.stack(rows, 0)


def _ragged_mean(seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Mean over sequences of different lengths, position by position; returns (mean, count)."""
    seqs = [np.asarray(s, float) for s in seqs if s is not None and len(s)]
    if not seqs:
        return np.zeros(0), np.zeros(0, int)
    T = max(len(s) for s in seqs)
    acc = np.full((len(seqs), T), np.nan)
    for i, s in enumerate(seqs):
        acc[i, : len(s)] = s
    cnt = np.isfinite(acc).sum(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(acc, 0), cnt


def refresh_by_step(df: pd.DataFrame, method: str = RCR, model: str | None = None) -> pd.DataFrame:
    """Refresh rate (mean trigger over layers, then over samples) and mean tau at each decode step.

    Columns: ``step, refresh_rate, tau_mean, n_samples``. Samples shorter than a step drop out of it.
    """
    d = ok_rows(df)
    d = d[d[Col.METHOD] == method]
    if model is not None and Col.MODEL in d:
        d = d[d[Col.MODEL].fillna("") == model]
    trig, tau = [], []
    for _, r in d.iterrows():
        t = as_2d(r.get(Col.TRIGGER), float)
        if t is not None and np.isfinite(t).any():
            trig.append(np.nanmean(t, 0))
        a = as_2d(r.get(Col.TAU), float)
        if a is not None and np.isfinite(a).any():  # methods without a threshold record NaN tau
            tau.append(np.nanmean(a, 0))
    rm, rc = _ragged_mean(trig)
    tm, _ = _ragged_mean(tau)
    T = max(len(rm), len(tm))
    out = pd.DataFrame({"step": np.arange(T)})
    out["refresh_rate"] = np.pad(rm, (0, T - len(rm)), constant_values=np.nan) if T else []
    out["tau_mean"] = np.pad(tm, (0, T - len(tm)), constant_values=np.nan) if T else []
    out["n_samples"] = np.pad(rc, (0, T - len(rc))) if T else []
    return out


def unchanged_top_pairs(top: np.ndarray) -> tuple[int, int]:
    """(unchanged, compared) adjacent-step pairs of one sample's most-attended prefix positions.

    ``top`` is (L, T): per layer, the top prefix position at each decode step. A pair is compared only where
    both steps hold a real position (negative or non-finite marks a step that was not recorded).
    """
    a = np.asarray(top, dtype=float)
    if a.ndim != 2 or a.shape[1] < 2:
        return 0, 0
    ok = (a[:, 1:] >= 0) & (a[:, :-1] >= 0) & np.isfinite(a[:, 1:]) & np.isfinite(a[:, :-1])  # (L, T-1)
    return int(((a[:, 1:] == a[:, :-1]) & ok).sum()), int(ok.sum())


def top_position_stability(df: pd.DataFrame) -> pd.DataFrame:
    """Fraction of adjacent decode steps whose most-attended prefix position is unchanged, per model.

    From ``top_prefix_pos`` [layer][step] of the ``full`` rows. ``fraction_unchanged`` pools all
    (sample, layer, adjacent step pair) comparisons; ``fraction_unchanged_sample_mean`` first averages
    within each sample. Negative positions are padding and are skipped.
    """
    d = ok_rows(df)
    d = d[d[Col.METHOD] == FULL]
    rows = []
    if Col.TOP_PREFIX_POS not in d:
        return pd.DataFrame(columns=["model", "n_samples", "n_pairs", "fraction_unchanged",
                                     "fraction_unchanged_sample_mean"])
    for model, g in d.groupby(model_series(d), sort=True):
        same_tot = pairs_tot = 0
        per_sample = []
        for x in g[Col.TOP_PREFIX_POS]:
            a = as_2d(x, float)
            if a is None:
                continue
            same, pairs = unchanged_top_pairs(a)
            if pairs == 0:
                continue
            same_tot += same
            pairs_tot += pairs
            per_sample.append(same / pairs)
        if pairs_tot:
            rows.append(dict(model=model, n_samples=len(per_sample), n_pairs=pairs_tot,
                             fraction_unchanged=same_tot / pairs_tot,
                             fraction_unchanged_sample_mean=float(np.mean(per_sample))))
    return pd.DataFrame(rows, columns=["model", "n_samples", "n_pairs", "fraction_unchanged",
                                       "fraction_unchanged_sample_mean"])


def ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows without an error, in (sample, method) order whatever order the parts held them in: a mean summed in
    another order differs in its last bit (a batch retried after an actor's death lands in a later part)."""
    d = df[df[Col.ERROR].isna()] if Col.ERROR in df else df
    keys = [c for c in (Col.SAMPLE_ID, Col.METHOD) if c in d]
    return d.sort_values(keys, kind="stable") if keys else d


def model_series(df: pd.DataFrame) -> pd.Series:
    if Col.MODEL in df:
        return df[Col.MODEL].fillna("").astype(str)
    return pd.Series([""] * len(df), index=df.index)


def numeric(df: pd.DataFrame, col: str) -> pd.Series:
    if col in df:
        return pd.to_numeric(df[col], errors="coerce").astype(float)
    return pd.Series(np.nan, index=df.index, dtype=float)
