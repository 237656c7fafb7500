"""rcr against the fixed threshold as the paper compares them (pipeline/analysis/fixed_tuning.py): the
development/test split by sample-id hash, τ* chosen on the development half only, ``rcr − fixed(τ*)`` on
the test half, and ``rcr −`` the fixed-τ frontier at rcr's refresh fraction with a paired CI."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import pytest

from pipeline.analysis import fixed_tuning as FT
from pipeline.analysis.analyze import _Settings, analyze
from pipeline.analysis.report import format_summary
from tests.fake_output import make_output_frame

ST = _Settings(resamples=2000, seed=0, confidence=0.95, baselines=("bacon", "rcr"))
IDS = [f"sample-{i:03d}" for i in range(60)]


def _wide(fid: dict[str, list[float]], ref: dict[str, float | list[float]], ids=IDS) -> dict[str, pd.DataFrame]:
    """The [samples x methods] tables analyze() hands to fixed_tuning.compare; a scalar refresh is constant."""
    f = pd.DataFrame(fid, index=pd.Index(ids, name="sample_id"))
    r = pd.DataFrame({m: (np.full(len(ids), v) if np.isscalar(v) else v) for m, v in ref.items()}, index=f.index)
    return {"fidelity": f, "refresh_fraction": r[f.columns]}


def test_split_is_a_sha256_of_the_sample_id_alone():
    ids = [f"id-{i}" for i in range(2000)] + ["日本語-0", ""]
    dev = FT.dev_half(ids)
    # the documented rule, written out (a per-process hash() would differ between runs and machines)
    rule = [hashlib.sha256(f"rcr-fixed-tuning:{s}".encode()).digest()[0] < 128 for s in ids]
    assert dev.tolist() == rule
    assert 0.45 < dev[:2000].mean() < 0.55  # a half, give or take
    # membership depends on the id only: not on order, nor on which other samples the job holds
    perm = np.random.default_rng(0).permutation(len(ids))
    assert FT.dev_half([ids[i] for i in perm]).tolist() == dev[perm].tolist()
    assert FT.dev_half(ids[:7]).tolist() == dev[:7].tolist()


@pytest.mark.parametrize("dev_prefers", ["fixed@0.05", "fixed@0.1"])
def test_tau_star_is_chosen_on_the_development_half_and_scored_on_the_test_half(dev_prefers):
    """The development half prefers one τ, the test half (by more) the other, so all samples together prefer
    the test half's: only a choice made on the development half alone picks ``dev_prefers``."""
    other = "fixed@0.1" if dev_prefers == "fixed@0.05" else "fixed@0.05"
    dev = FT.dev_half(IDS)
    assert 10 < dev.sum() < 50
    rng = np.random.default_rng(1)
    fid = {dev_prefers: np.where(dev, 0.80, 0.40), other: np.where(dev, 0.70, 0.90),
           "fixed": np.full(len(IDS), 0.50), "rcr": rng.uniform(0.5, 0.9, len(IDS))}
    assert np.mean(fid[other]) > np.mean(fid[dev_prefers])  # pooled, the other τ would win
    rows, c = FT.compare("m", _wide(fid, {"fixed@0.05": 0.5, "fixed@0.1": 0.3, "fixed": 0.7, "rcr": 0.4}), 0.03, ST)
    assert c["status"] == "ok" and c["tau_star_method"] == dev_prefers
    assert c["tau_star"] == float(dev_prefers.split("@")[1])
    assert (c["n_dev"], c["n_test"]) == (dev.sum(), (~dev).sum())
    # the test half only: the chosen τ's test fidelity, rcr's test mean, and their paired difference
    test = ~dev
    assert c["fixed_test_fidelity"] == pytest.approx(fid[dev_prefers][test].mean())
    assert c["rcr_test_fidelity"] == pytest.approx(fid["rcr"][test].mean())
    assert c["diff_tuned"] == pytest.approx((fid["rcr"] - fid[dev_prefers])[test].mean())
    assert c["diff_tuned_ci_low"] < c["diff_tuned"] < c["diff_tuned_ci_high"] and c["n_pairs_tuned"] == test.sum()
    t = pd.DataFrame(rows).set_index("method")
    assert t.chosen.sum() == 1 and t.loc[dev_prefers, "chosen"]
    assert t.loc["fixed", "tau"] == 0.03  # plain `fixed` is a candidate at its own τ
    assert t.loc[other, "fidelity_dev"] == pytest.approx(0.70) and t.loc[other, "fidelity_test"] == pytest.approx(0.90)


def test_a_dev_sample_missing_a_candidate_does_not_change_the_split():
    """An error row (NaN fidelity) leaves that sample in its half; the mean is over the candidate's own samples."""
    dev = FT.dev_half(IDS)
    fa = np.where(dev, 0.8, 0.5)
    fa[np.flatnonzero(dev)[0]] = np.nan
    _, c = FT.compare("m", _wide({"fixed@0.05": fa, "fixed@0.2": np.full(len(IDS), 0.7), "rcr": np.full(len(IDS), 0.6)},
                                 {"fixed@0.05": 0.5, "fixed@0.2": 0.1, "rcr": 0.3}), None, ST)
    assert c["tau_star_method"] == "fixed@0.05" and c["n_dev"] == dev.sum()


def test_frontier_is_interpolated_at_rcr_refresh_with_a_paired_ci():
    """Every method's per-sample fidelity is the sample's difficulty plus a method offset. The points are
    joined in refresh order (not τ order); rcr − frontier is then the same on every resample of the
    samples, so its paired CI is far narrower than the CI of rcr's own fidelity."""
    base = np.random.default_rng(2).uniform(0.2, 0.8, len(IDS))
    fid = {"fixed@0.02": base + 0.15, "fixed@0.05": base + 0.10, "fixed@0.1": base + 0.02, "rcr": base + 0.12}
    ref = {"fixed@0.02": 0.8, "fixed@0.05": 0.5, "fixed@0.1": 0.2, "rcr": 0.4}
    _, c = FT.compare("m", _wide(fid, ref), None, ST)
    w = (0.4 - 0.2) / (0.5 - 0.2)  # between fixed@0.1 (refresh 0.2) and fixed@0.05 (0.5)
    expect = (1 - w) * fid["fixed@0.1"].mean() + w * fid["fixed@0.05"].mean()
    assert c["rcr_refresh"] == pytest.approx(0.4) and c["frontier_between"] == "fixed@0.1,fixed@0.05"
    assert c["frontier_fidelity"] == pytest.approx(expect)
    assert c["diff_frontier"] == pytest.approx(fid["rcr"].mean() - expect)
    assert c["frontier_fidelity_ci_low"] <= c["frontier_fidelity"] <= c["frontier_fidelity_ci_high"]
    assert c["diff_frontier_ci_low"] <= c["diff_frontier"] <= c["diff_frontier_ci_high"]
    assert c["diff_frontier_ci_high"] - c["diff_frontier_ci_low"] < 1e-9  # constant per-sample gap: paired
    assert c["frontier_fidelity_ci_high"] - c["frontier_fidelity_ci_low"] > 0.05  # while the levels vary
    assert c["frontier_resamples"] == ST.resamples


def test_frontier_resamples_recompute_rcr_refresh():
    """With rcr's refresh varying by sample, the frontier value moves with each resample's refresh: a CI
    computed from fixed interpolation weights would be narrower than the recomputed one."""
    rng = np.random.default_rng(3)
    n = len(IDS)
    fid = {"fixed@0.02": np.full(n, 0.9), "fixed@0.2": np.full(n, 0.5), "rcr": np.full(n, 0.8)}
    ref = {"fixed@0.02": 0.9, "fixed@0.2": 0.1, "rcr": rng.uniform(0.2, 0.8, n)}
    _, c = FT.compare("m", _wide(fid, ref), None, ST)
    r = ref["rcr"].mean()
    assert c["frontier_fidelity"] == pytest.approx(0.5 + (r - 0.1) / 0.8 * 0.4)
    # the fidelities are constant: all of the CI's width comes from rcr's resampled refresh fraction
    assert c["frontier_fidelity_ci_high"] - c["frontier_fidelity_ci_low"] > 0.02


def test_every_method_is_matched_to_the_frontier_at_its_own_refresh_and_reads():
    """A method that refreshes rarely but reads much per refresh (RefreshKV's full steps) sits at one point of the
    fixed-τ frontier by refresh and at another by reads: each axis is interpolated on its own, with a paired CI."""
    base = np.random.default_rng(4).uniform(0.2, 0.8, len(IDS))
    fid = {"fixed@0.02": base + 0.15, "fixed@0.05": base + 0.10, "fixed@0.1": base + 0.02, "refreshkv": base + 0.08,
           "bacon": base, "full": np.ones(len(IDS))}
    ref = {"fixed@0.02": 0.8, "fixed@0.05": 0.5, "fixed@0.1": 0.2, "refreshkv": 0.25, "bacon": 0.0, "full": 0.0}
    wide = _wide(fid, ref)
    wide["reads_per_step"] = wide["refresh_fraction"] * 160.0  # fixed reads 160 per refresh
    wide["reads_per_step"]["refreshkv"] = 0.25 * 2 * 310.0  # a full step reads 2 Np
    m = FT.matched_frontier(wide, None, ST)
    assert set(m) == {"refreshkv", "bacon"}  # neither `full` nor the candidates themselves
    r = m["refreshkv"]
    at_refresh = fid["fixed@0.1"].mean() + (0.25 - 0.2) / 0.3 * (fid["fixed@0.05"].mean() - fid["fixed@0.1"].mean())
    assert r["frontier_at_refresh"] == pytest.approx(at_refresh)
    assert r["diff_frontier_refresh"] == pytest.approx(fid["refreshkv"].mean() - at_refresh)
    assert r["diff_frontier_refresh_ci_low"] <= r["diff_frontier_refresh"] <= r["diff_frontier_refresh_ci_high"]
    # 155 reads, beyond the points' 32, 80 and 128: not extrapolated
    assert np.isnan(r["frontier_at_reads"]) and np.isnan(r["diff_frontier_reads_ci_low"])
    wide["reads_per_step"]["refreshkv"] = 0.1 * 2 * 310.0  # 62 reads: between fixed@0.1 (32) and fixed@0.05 (80)
    r = FT.matched_frontier(wide, None, ST)["refreshkv"]
    at_reads = fid["fixed@0.1"].mean() + (62.0 - 32.0) / 48.0 * (fid["fixed@0.05"].mean() - fid["fixed@0.1"].mean())
    assert r["frontier_at_reads"] == pytest.approx(at_reads)
    assert r["diff_frontier_reads"] == pytest.approx(fid["refreshkv"].mean() - at_reads)
    assert np.isnan(m["bacon"]["diff_frontier_refresh"])  # refresh 0: below the points
    assert FT.matched_frontier(_wide({"rcr": base}, {"rcr": 0.4}) | {"reads_per_step": wide["reads_per_step"]},
                               None, ST) == {}  # no sweep: nothing to match


def test_no_extrapolation_and_interpolation_rules():
    xs, ys = np.array([0.5, 0.1, 0.5, 0.3]), np.array([0.9, 0.5, 0.7, 0.6])
    assert FT.interpolate(0.4, xs, ys) == pytest.approx((0.6 + 0.8) / 2)  # ties at 0.5 averaged: 0.8
    assert FT.interpolate(0.1, xs, ys) == pytest.approx(0.5)
    assert np.isnan(FT.interpolate(0.6, xs, ys)) and np.isnan(FT.interpolate(0.05, xs, ys))
    _, c = FT.compare("m", _wide({"fixed@0.05": np.full(len(IDS), 0.7), "rcr": np.full(len(IDS), 0.8)},
                                 {"fixed@0.05": 0.3, "rcr": 0.6}), None, ST)
    assert np.isnan(c["frontier_fidelity"]) and "outside" in c["frontier_note"]
    assert c["tau_star_method"] == "fixed@0.05"  # the tuned comparison still runs


def test_candidates_and_skips():
    assert FT.candidates(["rcr", "fixed", "fixed@0.1", "fixed@0.02"], 0.0299999993) == [
        ("fixed@0.02", 0.02), ("fixed", 0.03), ("fixed@0.1", 0.1)]
    assert FT.candidates(["fixed", "fixed@0.03"], 0.03) == [("fixed@0.03", 0.03)]  # the same τ once
    assert FT.candidates(["fixed", "rcr"], 0.03) == []  # plain fixed alone is no sweep
    assert FT.candidates(["rcr@0.1", "fixed@0.1"], None) == [("fixed@0.1", 0.1)]
    _, c = FT.compare("m", _wide({"fixed": np.full(len(IDS), 0.7), "rcr": np.full(len(IDS), 0.8)},
                                 {"fixed": 0.3, "rcr": 0.6}), 0.03, ST)
    assert c["status"] == "skipped" and "fixed@" in c["note"]
    _, c = FT.compare("m", _wide({"fixed@0.1": np.full(len(IDS), 0.7)}, {"fixed@0.1": 0.3}), None, ST)
    assert c["status"] == "skipped" and "rcr" in c["note"]


def test_analysis_summary_and_mlflow_values_name_tau_star():
    df = make_output_frame(n_samples=30, methods=("full", "bacon", "fixed", "rcr", "fixed@0.02", "fixed@0.05",
                                                  "fixed@0.15"))
    a = analyze(df, bootstrap_resamples=500)
    (c,) = a.fixed_comparison.itertuples()
    chosen = a.fixed_tuning[a.fixed_tuning.chosen]
    assert len(chosen) == 1 and chosen.method.iloc[0] == c.tau_star_method
    assert set(a.fixed_tuning.method) == {"fixed@0.02", "fixed", "fixed@0.05", "fixed@0.15"}
    txt = format_summary(a)
    assert f"tau* = {c.tau_star:g} ({c.tau_star_method})" in txt and "rcr - fixed(tau*)" in txt
    assert "rcr - frontier" in txt
    assert "method - fixed-tau frontier at the method's own refresh and reads/step" in txt
    row = a.methods.set_index("method").loc["rcr"]
    assert f"  rcr: refresh {row.refresh_fraction:.3f}: {row.diff_frontier_refresh:+.3f}" in txt
    assert row.diff_frontier_refresh == pytest.approx(c.diff_frontier)  # the same comparison as the rcr line
    params, metrics = FT.mlflow_values(a.fixed_comparison, multi=False)
    assert params["tuned_fixed.tau_star"] == c.tau_star and metrics["tuned_fixed.diff_tuned"] == c.diff_tuned
    assert "sha256" in params["tuned_fixed.split"] and "sha256" in a.meta["fixed_tuning"]
    a0 = analyze(make_output_frame(n_samples=8, methods=("full", "bacon", "fixed", "rcr")), bootstrap_resamples=200)
    assert "tuned fixed: no fixed@TAU sweep labels" in format_summary(a0)
    assert FT.mlflow_values(a0.fixed_comparison, multi=False)[0]["tuned_fixed.status"].startswith("skipped")
