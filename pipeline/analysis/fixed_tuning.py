"""``rcr`` against the fixed threshold as the RCR paper compares them: a τ tuned per setting, and the fixed-τ
frontier at rcr's own refresh fraction (docs/algorithms.md, "Tuned fixed threshold").

Input: one model's [samples x methods] fidelity and refresh-fraction tables (``analyze._wide``) and the
``fixed@τ`` sweep labels among its methods. Two comparisons, per model:

* **Tuned fixed**. The samples are split into a development half and a test half by
  :func:`dev_half` (a hash of the sample id: the same split on every run and machine, whatever else is in
  the job). τ* is the candidate with the best mean fidelity on the development half; ``rcr − fixed(τ*)``
  is reported on the test half only, with a paired percentile bootstrap CI (``bootstrap.paired_bootstrap``).
* **Frontier**. The candidates' (mean realised refresh fraction, mean fidelity) points, sorted by refresh,
  linearly interpolated at rcr's mean refresh fraction (no extrapolation), on every sample; ``rcr −
  frontier`` with a CI from the same resampled sample indices as every other CI of the model
  (``bootstrap.resample_means``): each resample recomputes every point and rcr's refresh, then interpolates.

* **Matched** (:func:`matched_frontier`). Every other method (``refreshkv``, ``exact``, ...) against the same
  frontier, read at its own mean refresh fraction and at its own mean reads per step, with the same paired CI:
  columns of the ``methods`` table.

The candidates are the ``fixed@τ`` labels and, when the sweep exists, plain ``fixed`` at its own τ
(``fixed.tau``) unless a sweep label has that τ. Without a sweep both comparisons are skipped,
and the table says so.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pandas as pd

from pipeline.analysis.bootstrap import paired_bootstrap, percentile_ci, resample_means
from pipeline.analysis.labels import FIXED, FULL, RCR, parse_sweep_tau

SPLIT_SALT = "rcr-fixed-tuning"
SPLIT_RULE = (f"development half: first byte of sha256('{SPLIT_SALT}:' + sample_id) < 128 (utf-8); "
              "test half: the other samples")
SELECTION_RULE = ("tau* = the candidate with the highest mean fidelity over its development-half samples "
                  "(ties: the larger tau, fewer refreshes)")
NO_SWEEP = ("no fixed@TAU sweep labels in this job: tuned-fixed and frontier comparisons skipped (add e.g. "
            "--methods ...,fixed@0.02,fixed@0.05,fixed@0.1,fixed@0.15)")
CANDIDATE_COLUMNS = ["model", "method", "tau", "n_dev", "fidelity_dev", "n_test", "fidelity_test",
                     "refresh_fraction", "fidelity", "chosen"]


def dev_half(sample_ids) -> np.ndarray:
    """(n,) bool: which samples form the development half. A pure function of each sample id (sha256, not
    Python's per-process ``hash``): stable across runs, machines and whatever other samples a job holds."""
    return np.array([hashlib.sha256(f"{SPLIT_SALT}:{s}".encode()).digest()[0] < 128 for s in sample_ids], bool)


def candidates(methods: list[str], fixed_tau: float | None) -> list[tuple[str, float]]:
    """(label, τ) of the fixed-threshold points, sorted by τ; empty when the job has no ``fixed@τ`` label."""
    sweep = [(m, parse_sweep_tau(m)) for m in methods if str(m).startswith(f"{FIXED}@")]
    sweep = [(m, float(t)) for m, t in sweep if t is not None]
    if not sweep:
        return []
    if FIXED in methods and fixed_tau is not None and np.isfinite(fixed_tau):
        tau = float(f"{fixed_tau:.6g}")  # recorded as float32 telemetry: 0.03 reads back as 0.0299999993
        if not any(np.isclose(t, tau) for _, t in sweep):
            sweep.append((FIXED, tau))
    return sorted(sweep, key=lambda mt: mt[1])


def interpolate(x: float, xs: np.ndarray, ys: np.ndarray) -> float:
    """The piecewise-linear curve through (xs, ys) sorted by xs, at x; points with the same x are averaged.
    NaN outside [min xs, max xs] (no extrapolation) or when x is NaN."""
    ok = np.isfinite(xs) & np.isfinite(ys)
    xs, ys = xs[ok], ys[ok]
    if not xs.size or not np.isfinite(x) or x < xs.min() or x > xs.max():
        return float("nan")
    u, inv = np.unique(xs, return_inverse=True)  # sorted, ties collapsed
    yu = np.bincount(inv, ys) / np.bincount(inv)
    return float(np.interp(x, u, yu))


def compare(model: str, wide: dict[str, pd.DataFrame], fixed_tau: float | None, st) -> tuple[list[dict], dict]:
    """One model's candidate rows (``CANDIDATE_COLUMNS``) and its comparison row (see the module docstring).
    ``st``: the analysis settings (resamples, seed, confidence)."""
    fid, ref = wide["fidelity"], wide["refresh_fraction"]
    cands = candidates(list(fid.columns), fixed_tau)
    row: dict[str, Any] = {"model": model, "split": SPLIT_RULE, "selection": SELECTION_RULE,
                           "candidates": ",".join(m for m, _ in cands)}
    if not cands:
        return [], {**row, "status": "skipped", "note": NO_SWEEP}
    if RCR not in fid.columns:
        return [], {**row, "status": "skipped", "note": "no rcr rows: nothing to compare the fixed threshold with"}
    dev = dev_half(fid.index)
    labels = [m for m, _ in cands]
    dev_mean = fid.loc[dev, labels].mean()  # NaN-skipping: over each candidate's own dev samples
    test_mean = fid.loc[~dev, labels].mean()
    scored = [(dev_mean[m], t, m) for m, t in cands if np.isfinite(dev_mean[m])]
    best = max(scored)[2] if scored else None
    rows = [{"model": model, "method": m, "tau": t, "n_dev": int(fid.loc[dev, m].notna().sum()),
             "fidelity_dev": dev_mean[m], "n_test": int(fid.loc[~dev, m].notna().sum()), "fidelity_test": test_mean[m],
             "refresh_fraction": ref[m].mean(), "fidelity": fid[m].mean(), "chosen": m == best} for m, t in cands]
    row.update(status="ok", note="", n_dev=int(dev.sum()), n_test=int((~dev).sum()))
    row.update(_tuned(fid.loc[~dev], best, dict(cands), st))
    row.update(_frontier_gap(fid, ref, cands, st))
    return rows, row


def _tuned(test: pd.DataFrame, best: str | None, taus: dict[str, float], st) -> dict[str, Any]:
    """rcr and fixed(τ*) on the test half, and their paired difference."""
    if best is None:
        return {"tuned_note": "no candidate has a development-half sample"}
    out: dict[str, Any] = {"tau_star": taus[best], "tau_star_method": best}
    pb = paired_bootstrap(test[[RCR, best]], (best,), st.resamples, st.seed, st.confidence).set_index("method")
    for name, m in (("rcr_test", RCR), ("fixed_test", best)):
        out.update({f"{name}_fidelity": pb.loc[m, "mean"], f"{name}_fidelity_ci_low": pb.loc[m, "ci_low"],
                    f"{name}_fidelity_ci_high": pb.loc[m, "ci_high"]})
    d = pb.loc[RCR]
    out.update(diff_tuned=d[f"diff_{best}"], diff_tuned_ci_low=d[f"diff_{best}_ci_low"],
               diff_tuned_ci_high=d[f"diff_{best}_ci_high"], n_pairs_tuned=int(d[f"n_pairs_{best}"]))
    out["tuned_note"] = "" if out["n_pairs_tuned"] else "no test-half sample has both rcr and fixed(tau*)"
    return out


def _gap(f: np.ndarray, r: np.ndarray) -> tuple[float, float]:
    """(frontier fidelity at the method's x, method − frontier) from column means: index 0 is the method, 1.. the
    points; ``r`` their x (refresh fraction or reads per step)."""
    y = interpolate(r[0], r[1:], f[1:])
    return y, f[0] - y


def frontier_gap(fid: pd.DataFrame, x: pd.DataFrame, method: str, cands: list[tuple[str, float]], st) -> dict:
    """``method`` against the candidates' frontier, their (mean ``x``, mean fidelity) points joined in ``x`` order
    and read at the method's own mean ``x`` (refresh fraction or reads per step), on every sample, with a paired
    bootstrap CI. Keys: ``x``, ``fidelity``, ``frontier`` and ``diff`` (method − frontier) with ``_ci_low`` /
    ``_ci_high``, ``between`` (the two points around it), ``resamples`` and ``note``."""
    cols = [method] + [m for m, _ in cands]
    k = len(cols)
    data = np.concatenate([fid[cols].to_numpy(float), x[cols].to_numpy(float)], 1)  # (n, 2k): fidelity | x
    means = pd.DataFrame(data).mean().to_numpy(float)  # NaN-skipping column means; NaN for an empty column
    y, diff = _gap(means[:k], means[k:])
    out: dict[str, Any] = {"x": means[k], "fidelity": means[0], "frontier": y, "diff": diff, "note": ""}
    lo_pts = [(r, m) for r, m in zip(means[k + 1:], cols[1:]) if np.isfinite(r) and r <= means[k]]
    hi_pts = [(r, m) for r, m in zip(means[k + 1:], cols[1:]) if np.isfinite(r) and r >= means[k]]
    out["between"] = ",".join(m for m in (max(lo_pts)[1] if lo_pts else None,
                                          min(hi_pts)[1] if hi_pts else None) if m)
    if not np.isfinite(y):
        pts = means[k + 1:][np.isfinite(means[k + 1:])]
        span = f"[{pts.min():.3f}, {pts.max():.3f}]" if pts.size else "(none)"
        out["note"] = (f"{method}'s {means[k]:.3f} lies outside the fixed points' range {span}: not interpolated "
                       "(no extrapolation)")
        return out
    stats = resample_means(data, None, st.resamples, st.seed)  # the model's shared resample indices
    boot = np.array([_gap(s[:k], s[k:]) for s in stats])  # (resamples, 2)
    ok = np.isfinite(boot[:, 1])
    lo, hi = percentile_ci(boot[ok], st.confidence) if ok.any() else (np.full(2, np.nan), np.full(2, np.nan))
    out.update(frontier_ci_low=lo[0], frontier_ci_high=hi[0], diff_ci_low=lo[1], diff_ci_high=hi[1],
               resamples=int(ok.sum()),
               note="" if ok.all() else (f"{int((~ok).sum())} of {len(ok)} resamples put {method}'s value outside "
                                         "the points' range; the CI is over the others"))
    return out


def _frontier_gap(fid: pd.DataFrame, ref: pd.DataFrame, cands: list[tuple[str, float]], st) -> dict[str, Any]:
    """rcr against the candidates' frontier at rcr's refresh, on every sample, with a paired bootstrap CI."""
    g = frontier_gap(fid, ref, RCR, cands, st)
    out = {"rcr_refresh": g["x"], "rcr_fidelity": g["fidelity"], "frontier_fidelity": g["frontier"],
           "diff_frontier": g["diff"], "frontier_between": g["between"], "frontier_note": g["note"]}
    if "resamples" in g:
        out.update(frontier_fidelity_ci_low=g["frontier_ci_low"], frontier_fidelity_ci_high=g["frontier_ci_high"],
                   diff_frontier_ci_low=g["diff_ci_low"], diff_frontier_ci_high=g["diff_ci_high"],
                   frontier_resamples=g["resamples"])
    return out


# the axes a method is matched to the frontier on: (the [samples x methods] table, the methods-row name)
MATCHED_AXES = (("refresh_fraction", "refresh"), ("reads_per_step", "reads"))


def matched_frontier(wide: dict[str, pd.DataFrame], fixed_tau: float | None, st) -> dict[str, dict[str, Any]]:
    """Every method but ``full`` and the fixed-threshold candidates against the fixed-τ frontier, at its own mean
    refresh fraction and at its own mean reads per step: per method, ``frontier_at_<axis>`` and
    ``diff_frontier_<axis>`` (method − frontier) with ``_ci_low`` / ``_ci_high``, NaN where the method lies outside
    the points' range (for the ``methods`` table, so every method's MLflow run has them). Empty without a sweep."""
    fid = wide["fidelity"]
    cands = candidates(list(fid.columns), fixed_tau)
    if not cands:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for m in fid.columns:
        if m == FULL or m in dict(cands):
            continue
        row: dict[str, Any] = {}
        for table, axis in MATCHED_AXES:
            g = frontier_gap(fid, wide[table], m, cands, st)
            for key, name in (("frontier", f"frontier_at_{axis}"), ("diff", f"diff_frontier_{axis}")):
                row[name] = g[key]
                row[f"{name}_ci_low"] = g.get(f"{key}_ci_low", np.nan)
                row[f"{name}_ci_high"] = g.get(f"{key}_ci_high", np.nan)
        out[m] = row
    return out


def mlflow_values(comparison: pd.DataFrame, multi: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(params, metrics) of the parent run: τ* and the two comparisons per model (suffixed by the model's
    name when a job has several)."""
    params: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    for _, r in comparison.iterrows():
        sfx = f".{r.model}" if multi else ""
        params[f"tuned_fixed.status{sfx}"] = r.status if r.status == "ok" else f"skipped: {r.note}"
        if r.status != "ok":
            continue
        params[f"tuned_fixed.tau_star{sfx}"] = r.get("tau_star")
        params[f"tuned_fixed.candidates{sfx}"] = r.candidates
        params["tuned_fixed.split"] = r.split
        for key in ("tau_star", "n_dev", "n_test", "n_pairs_tuned", "rcr_test_fidelity", "fixed_test_fidelity",
                    "diff_tuned", "diff_tuned_ci_low", "diff_tuned_ci_high", "rcr_refresh", "frontier_fidelity",
                    "frontier_fidelity_ci_low", "frontier_fidelity_ci_high", "diff_frontier", "diff_frontier_ci_low",
                    "diff_frontier_ci_high"):
            metrics[f"tuned_fixed.{key}{sfx}"] = r.get(key)
    return params, metrics
