"""The premise check (pipeline/diagnose, jobs/diagnose.py): its figures are the pipeline's statistics of the rows,
its config adds what the figures need to the user's flags, and it runs on a tiny model of every supported family
(the driver in this process: tests/inline_driver.py)."""

from __future__ import annotations

import dataclasses
import io
import re
import threading

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from pipeline.analysis.analyze import analyze
from pipeline.diagnose import premises
from pipeline.diagnose.run import DEFAULT_LIMIT, METHODS, job_config, parser
from pipeline.run.config import ConfigError
from tests import inline_driver, tiny_models
from tests.conftest import FAMILIES
from tests.fake_output import make_output_frame
from tests.pipeline_helpers import write_shard


@pytest.fixture(scope="module")
def fake():
    df = make_output_frame(n_samples=30, methods=METHODS, seed=3)
    return df, analyze(df, bootstrap_resamples=2000, baselines=("bacon", "prefill_oracle"))


def test_the_figures_are_the_rows_statistics(fake):
    """exact - bacon is the mean paired difference of the samples' fidelities, inside its CI, overall and within
    each drift tercile; the dwell is the analysis' stability; fixed's refresh per drift tercile is the mean over
    that third of the samples, ranked by their fixed rows' mean drift."""
    df, a = fake
    f = premises.by_key(premises.figures(a, None, None, None))
    fid = a.per_sample.pivot(index="sample_id", columns="method", values="fidelity")
    d = f["exact_minus_bacon"]
    assert d.metric == pytest.approx((fid["exact"] - fid["bacon"]).mean()) and d.ci_low < d.metric < d.ci_high
    assert f["fidelity_prefill_oracle"].metric == pytest.approx(fid["prefill_oracle"].mean())
    assert f["dwell"].metric == pytest.approx(float(a.stability["fraction_unchanged"].iloc[0]))
    fixed = df[df.method == "fixed"].set_index("sample_id")
    order = fixed["mean_drift"].rank(method="first").sort_values().index
    third = len(order) // 3
    low = fixed.loc[order[:third], "refresh_fraction"].mean()
    high = fixed.loc[order[-third:], "refresh_fraction"].mean()
    assert f["fixed_refresh_low"].metric == pytest.approx(low)
    assert f["fixed_refresh_high_minus_low"].metric == pytest.approx(high - low)
    per = fixed["mean_drift"]
    assert f["drift_cv"].metric == pytest.approx(per.std(ddof=0) / per.mean())
    text = premises.table(premises.figures(a, None, None, None))
    assert text.splitlines()[0].startswith("premise") and "paper 41% (Qwen2-VL) - 80% (LLaVA-NeXT)" in text
    tercile_lines = [ln for ln in text.splitlines() if "tercile" in ln]  # fixed's refresh, low / high: once
    assert len(tercile_lines) == 2 and f"{low:.3f} / {high:.3f}" in tercile_lines[0], text
    gap = fid["exact"] - fid["bacon"]
    for i, t in enumerate(("low", "mid", "high")):  # the samples' own tercile (drift_tercile), their paired mean
        ids = a.per_sample.drop_duplicates("sample_id").set_index("sample_id")["drift_tercile"]
        e = f[f"exact_minus_bacon_tercile_{t}"]
        assert e.metric == pytest.approx(gap[ids[ids == t].index].mean()) and e.ci_low <= e.metric <= e.ci_high
        assert (f"{e.metric:+.3f}" if i else e.value) in tercile_lines[1]


def test_per_layer_figures_leave_out_layers_that_are_never_reselected():
    """Per re-selected layer: the detector's recall of each KV head, the head whose candidates catch its top entry
    least, and the image share; a sliding-window layer gets none."""
    layers = [{"on_image": 0.9, "top": 0.5}, {"on_image": 0.3, "top": 0.6}]
    heads = [[{"recall": 1.0, "top": 0, "mass": 0.1, "in_basis": 1.0, "cand": 1.0}] * 2,
             [{"recall": 0.9, "top": 1, "mass": 0.7, "in_basis": 0.9, "cand": 1.0},
              {"recall": 0.8, "top": 1, "mass": 0.6, "in_basis": 0.05, "cand": 0.4}]]
    f = premises.by_key(premises.layer_figures(layers, heads, (False, True)))
    assert set(f) == {"detector_recall_min_layer1", "top_entry_candidate_layer1", "image_share_layer1"}
    assert f["detector_recall_min_layer1"].value == "0.90 0.80" and f["detector_recall_min_layer1"].metric == 0.8
    assert f["top_entry_candidate_layer1"].metric == 0.4 and "in basis 0.05" in f["top_entry_candidate_layer1"].value


def test_the_probes_answer_the_first_samples_of_each_drift_tercile(fake):
    """probe_picks: the first n samples (in the given input order) of each drift tercile, by the rows' own terciles;
    the first n samples where the rows carry no drift."""
    _, a = fake
    terc = a.per_sample.drop_duplicates("sample_id").set_index("sample_id")["drift_tercile"]
    order = sorted(terc.index, reverse=True)
    picks = premises.probe_picks(a, order, 2)
    assert sorted(picks.values()) == ["high", "high", "low", "low", "mid", "mid"]
    for t in ("low", "mid", "high"):
        assert [s for s in picks if picks[s] == t] == [s for s in order if terc[s] == t][:2]
    no_drift = dataclasses.replace(a, per_sample=a.per_sample.assign(drift_tercile=pd.NA))
    assert premises.probe_picks(no_drift, order, 2) == {order[0]: "all", order[1]: "all"}


def test_image_share_per_tercile_is_the_mean_over_the_reselected_layers():
    """One line with each tercile's image share, averaged over the re-selected layers only; no line without a
    re-selected layer."""
    by = {"low": [{"on_image": 0.9}, {"on_image": 0.02}, {"on_image": 0.04}],
          "mid": [{"on_image": 0.9}, {"on_image": 0.1}, {"on_image": 0.2}],
          "high": [{"on_image": 0.9}, {"on_image": 0.4}, {"on_image": 0.6}]}
    (f,) = premises.tercile_share(by, (False, True, True))
    assert f.value.startswith("0.030 / 0.150 / 0.500") and f.metric == pytest.approx(0.03)
    assert f.name == "image share, low / mid / high drift tercile" and f.key == "image_share_tercile_low"
    assert premises.tercile_share(by, (False, False, False)) == []


def test_profiles_are_averaged_within_each_group_of_answers():
    """Each drift tercile's per-layer profile is the mean over its own probed answers only, per KV head too, and the
    groups keep the order they first appear in."""
    from pipeline.diagnose.attention import mean_profiles_by

    def answer(x):  # one answer's profile: two layers, two KV heads in the second
        return [{"on_image": x}, {"on_image": 2 * x, "heads": [{"on_image": x}, {"on_image": 3 * x}]}]

    got = mean_profiles_by([answer(0.1), answer(0.4), answer(0.3)], ["high", "low", "high"])
    assert list(got) == ["high", "low"]
    assert got["high"][0]["on_image"] == pytest.approx(0.2) and got["low"][0]["on_image"] == pytest.approx(0.4)
    assert got["high"][1]["on_image"] == pytest.approx(0.4)
    assert [h["on_image"] for h in got["high"][1]["heads"]] == pytest.approx([0.2, 0.6])


def test_the_config_adds_what_the_figures_need_to_the_users_flags(tmp_path):
    out = str(tmp_path / "o")
    cfg, probes = job_config(["--output-dir", out])
    assert cfg.methods == list(METHODS) and cfg.limit == DEFAULT_LIMIT and probes == 3
    assert cfg.rcr["exact_drift"] and cfg.rcr["record_attention"] and not cfg.summary
    assert cfg.job_name == "diagnose-detailcaps-embedded" and cfg.output_dir == out
    cfg, probes = job_config(["--methods", "rcr,bacon", "--limit", "5", "--probe-samples", "0", "--output-dir", out])
    assert cfg.methods == [*METHODS, "rcr"] and cfg.limit == 5 and probes == 0
    with pytest.raises(ConfigError, match="probe_samples"):
        job_config(["--probe-samples", "-1"])
    with pytest.raises(ConfigError, match="field 'methods'"):
        job_config(["--methods", "nonsense"])


def test_help_states_the_premise_checks_own_defaults(capsys):
    """`diagnose.py --help`: the flags whose default differs from the evaluation job's say the premise check's."""
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"--limit LIMIT first N input rows, in shard order (default: {DEFAULT_LIMIT})" in text
    assert "every row" not in text and "(default: all)" not in text and "--no-summary" not in text
    assert f"added to the ones the figures need ({', '.join(METHODS)})" in text
    assert "(default: diagnose-<task>-<model name>" in text and "exact_drift=true" in text


def test_a_failed_mlflow_log_marks_the_run_failed(tmp_path, fake):
    """log_run on a store that fails part way (a file that is not there): the run is FAILED, none RUNNING."""
    from mlflow import MlflowClient

    from pipeline.diagnose.run import log_run

    _, a = fake
    cfg, _ = job_config(["--output-dir", str(tmp_path / "o"), "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"])
    figs = premises.figures(a, None, None, None)
    with pytest.raises(OSError):
        log_run(cfg, figs, [tmp_path / "absent.parquet"], 30)
    c = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    runs = c.search_runs([c.get_experiment_by_name(cfg.experiment).experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    (tmp_path / "figures.parquet").write_bytes(b"PAR1")
    rid = log_run(cfg, figs, [tmp_path / "figures.parquet"], 30)  # its artifacts next to the database
    assert c.get_run(rid).info.status == "FINISHED"
    assert (tmp_path / "mlartifacts" / rid / "artifacts" / "diagnose" / "figures.parquet").is_file()


def family_dir(root, name: str):
    model, proc = tiny_models.FAMILIES[name]()
    d = root / name
    model.save_pretrained(d)
    proc.save_pretrained(d)
    return d


def records(n: int) -> list[dict]:
    out = []
    for i in range(n):
        buf = io.BytesIO()
        tiny_models.random_image(i, 112).save(buf, format="PNG")
        out.append(dict(sample_id=f"s{i}", task="detailcaps", prompt=tiny_models.random_prompt(i, 6),
                        images=[buf.getvalue()], references=[], source="test"))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_it_runs_on_a_tiny_model_of_every_family(name, tmp_path, monkeypatch, capsys):
    """One table, the per-layer figures of every re-selected layer (none of a sliding-window one) and the image
    share per drift tercile, the Parquet tables under <output dir>/_diagnose, and one MLflow run with the figures
    as metrics."""
    from mlflow import MlflowClient

    from pipeline.diagnose.run import run
    from rcr.models import geometry

    inline_driver.install(monkeypatch.setattr)
    shard = write_shard(tmp_path / "shards" / "part-0.parquet", records(4))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg, _ = job_config(["--model", str(family_dir(tmp_path, name)), "--shards", str(shard), "--max-new-tokens", "8",
                         "--output-dir", str(tmp_path / "out"), "--mlflow-uri", uri, "--device", "cpu",
                         "--rcr", "window=8", "--rcr", "selected=4"])  # a tiny prompt
    assert run(cfg, probe_samples=2) == 0
    out = capsys.readouterr().out
    assert "premise check:" in out and "exact - bacon (fidelity)" in out
    assert "image share, low / mid / high drift tercile" in out  # 4 samples: 2, 1 and 1 of the terciles probed
    for stage in (r"greedy answers \(up to 8 tokens each\)", "attention profiles", "detector recall"):
        assert re.search(rf"^\[rcr-job\] probes: {stage} (\d+)/\1 in \d+ s$", out, re.M), out  # each stage's end
    figs = pd.read_parquet(tmp_path / "out" / "_diagnose" / "figures.parquet")
    geo = geometry(tiny_models.FAMILIES[name]()[0])
    layers = pq.read_table(tmp_path / "out" / "_diagnose" / "layers.parquet").to_pandas()
    heads = pd.read_parquet(tmp_path / "out" / "_diagnose" / "heads.parquet")
    reselected = list(layers["reselected"])  # Gemma 3's local layers (a window of 12 tokens) are the only others
    assert len(reselected) == geo.n_layers and all(reselected) == (name != "gemma3") and any(reselected)
    assert len(heads) == geo.n_layers * geo.n_kv_heads and heads["recall"].between(0, 1 + 1e-6).all()
    per_layer = {k for k in figs["key"].dropna() if k.startswith("image_share_layer")}
    assert per_layer == {f"image_share_layer{i}" for i, t in enumerate(reselected) if t}
    assert len(pd.read_parquet(tmp_path / "out")) == 4 * len(METHODS)  # the rows; _diagnose is skipped
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(cfg.experiment).experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == cfg.job_name
    metrics = runs[0].data.metrics
    assert np.isfinite(metrics["exact_minus_bacon"]) and any(k.startswith("image_share_layer") for k in metrics)


def test_the_probes_load_the_model_in_the_jobs_dtype(tmp_path, monkeypatch, capsys):
    """The probes answer the job's samples again: with the job's --dtype, as its actors load the model, not the
    checkpoint's own (a float32 tiny checkpoint here, run at --dtype bfloat16)."""
    import rcr.models
    from pipeline.diagnose.run import run

    loaded: list[str] = []
    real_load = rcr.models.load

    def load(*args, dtype="auto", **kw):
        loaded.append(str(dtype).removeprefix("torch."))
        return real_load(*args, dtype=dtype, **kw)

    monkeypatch.setattr(rcr.models, "load", load)
    inline_driver.install(monkeypatch.setattr)
    shard = write_shard(tmp_path / "shards" / "part-0.parquet", records(3))
    cfg, _ = job_config(["--model", str(family_dir(tmp_path, "qwen2_vl")), "--shards", str(shard), "--max-new-tokens",
                         "4", "--output-dir", str(tmp_path / "out"), "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}",
                         "--device", "cpu", "--dtype", "bfloat16", "--rcr", "window=8", "--rcr", "selected=4"])
    assert run(cfg, probe_samples=1) == 0
    assert "probes: greedy answers" in capsys.readouterr().out
    assert len(loaded) >= 2 and set(loaded) == {"bfloat16"}, loaded  # the actor's load, then the probes'


def test_a_long_probe_stage_says_where_it_is_while_it_runs(monkeypatch):
    """A stage whose item takes longer than --progress-every-s still prints: a heartbeat line with the items
    finished so far while the next one runs, then one line when the stage ends. The item here waits until the
    heartbeat has spoken (an event, not a duration)."""
    from pipeline import progress

    lines, spoke = [], threading.Event()

    def say(msg):
        lines.append(msg)
        if "1/3," in msg:
            spoke.set()

    monkeypatch.setattr(progress, "say", say)
    with progress.Stage("probes: greedy answers", 3, every_s=0.01) as stage:
        stage(1)
        assert spoke.wait(60), "no heartbeat line while the second item ran"
        stage(3)
    assert any(re.fullmatch(r"probes: greedy answers 1/3, \d+ s", ln) for ln in lines), lines
    assert re.fullmatch(r"probes: greedy answers 3/3 in \d+ s", lines[-1]), lines
    n = len(lines)
    with pytest.raises(RuntimeError), progress.Stage("probes: detector recall", 2, every_s=60):
        raise RuntimeError("a failed stage says no 'done' line")
    assert len(lines) == n


def test_durations_read_as_minutes_and_seconds():
    from pipeline.progress import duration

    assert [duration(s) for s in (0.4, 41, 125, 3600)] == ["0 s", "41 s", "2 min 5 s", "60 min 0 s"]
