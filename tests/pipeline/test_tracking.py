"""MLflow logging against a temporary sqlite store: runs, metrics and artifacts exist after a job, and
backfilling from the Parquet output is idempotent (twice -> one set of runs)."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from urllib.parse import parse_qsl

import pandas as pd
import pytest
from mlflow import MlflowClient

from pipeline.analysis import mlflow_store, mlflow_ui, tracking
from pipeline.analysis.colours import label_colours
from tests.fake_output import make_output_frame, write_output_dir

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("full", "bacon", "exact", "fixed", "rcr", "fixed@0.05")
RES = 500  # bootstrap resamples: small, the statistics are tested in test_metrics.py


def _backfill_main():
    spec = importlib.util.spec_from_file_location("backfill_mlflow", ROOT / "jobs" / "backfill_mlflow.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def _active_runs(uri: str, experiment: str):
    c = MlflowClient(tracking_uri=uri)
    exp = c.get_experiment_by_name(experiment)
    assert exp is not None
    runs = c.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("rcr.role") == "parent"]
    children = [r for r in runs if r.data.tags.get("rcr.role") == "method"]
    return c, parents, children


def _artifact_paths(client, run_id: str, path: str | None = None) -> set[str]:
    out = set()
    for f in client.list_artifacts(run_id, path):
        if f.is_dir:
            out |= _artifact_paths(client, run_id, f.path)
        else:
            out.add(f.path)
    return out


def _store(tmp: Path, name: str) -> str:
    """A new sqlite store: a copy of an empty, already migrated database (creating one takes ~5 s)."""
    template = tmp / "_empty.db"
    if not template.exists():
        MlflowClient(tracking_uri=f"sqlite:///{template}").search_experiments()
    (tmp / name).write_bytes(template.read_bytes())
    return f"sqlite:///{tmp / name}"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A small job: its Parquet output (with a run record like the pipeline's) and one log_job call."""
    tmp = tmp_path_factory.mktemp("mlflow")
    out = tmp / "out"
    df = make_output_frame(n_samples=12, methods=METHODS, errors=2, job_name="tiny-job", config_hash="abc123")
    write_output_dir(df, out)
    config = {"task": "detailcaps", "model": "embedded", "methods": list(METHODS), "job_name": "tiny-job",
              "output_dir": str(out), "experiment": "rcr-test", "rcr": {"selected": 32, "window": 32},
              "bootstrap_resamples": RES}
    (out / "_runs").mkdir()
    (out / "_runs" / "r1.json").write_text(json.dumps({"config": config, "config_hash": "abc123",
                                                       "started": "2026-01-01T00:00:00"}))
    uri = _store(tmp, "mlflow.db")
    # what the driver does at the end of a job
    pid = tracking.log_job(df=pd.read_parquet(out), config=config, tracking_uri=uri, experiment="rcr-test",
                           output_dir=str(out), job_name="tiny-job")
    return {"tmp": tmp, "out": out, "df": df, "config": config, "uri": uri, "pid": pid}


def test_runs_metrics_artifacts_exist(job):
    c, parents, children = _active_runs(job["uri"], "rcr-test")
    assert [p.info.run_id for p in parents] == [job["pid"]]
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.info.run_name == "tiny-job"
    t, p = parent.data.tags, parent.data.params
    assert t["rcr.complete"] == "1" and t["rcr.job_key"] and len(t["mlflow.source.git.commit"]) >= 7
    assert "fidelity" in t["mlflow.note.content"]  # the summary table is the run's description
    for k in ("git_commit", "model", "dataset", "task", "config_hash", "config.rcr.selected", "config.methods",
              "fidelity_metric", "reference_rougeL", "cider", "bootstrap_resamples"):
        assert k in p, k
    assert p["dataset"] == "synthetic" and p["config.rcr.selected"] == "32" and "rouge-score" in p["fidelity_metric"]
    assert parent.data.metrics["n_error_rows"] == int(job["df"].error.notna().sum())
    assert 0 < parent.data.metrics["top_pos_unchanged_fraction"] < 1
    assert any(k.startswith("spearman_gap_exact.rcr.vs_mean_drift") for k in parent.data.metrics)
    # the tuned-fixed comparison: tau* as a param and a metric, the held-out difference with its CI
    tau_star = float(p["tuned_fixed.tau_star"])
    assert tau_star in (0.03, 0.05) and parent.data.metrics["tuned_fixed.tau_star"] == tau_star
    m = parent.data.metrics
    assert m["tuned_fixed.diff_tuned_ci_low"] <= m["tuned_fixed.diff_tuned"] <= m["tuned_fixed.diff_tuned_ci_high"]
    # dataset input
    full = c.get_run(job["pid"])
    assert full.inputs.dataset_inputs and full.inputs.dataset_inputs[0].dataset.source_type
    # artifacts: plots, per-sample table, summary, config; stored next to the database, not in the cwd
    arts = _artifact_paths(c, job["pid"])
    for a in ("plots/fidelity_ci.png", "plots/frontier.png", "plots/tau_refresh.png", "plots/drift_heatmap.png",
              "tables/per_sample.parquet", "tables/per_sample.csv", "tables/methods.csv", "tables/terciles.csv",
              "tables/fixed_comparison.csv", "tables/fixed_tuning.csv", "summary.txt", "config.json"):
        assert a in arts, (a, arts)
    assert parent.info.artifact_uri.startswith((job["tmp"] / "mlartifacts").as_uri())
    local = c.download_artifacts(job["pid"], "tables/per_sample.parquet", str(job["tmp"]))
    ps = pd.read_parquet(local)
    assert {"sample_id", "method", "fidelity", "refresh_fraction"} <= set(ps.columns)
    # children: one per method, with CIs and differences
    assert sorted(r.info.run_name for r in children) == sorted(METHODS)
    assert all(r.data.tags["mlflow.parentRunId"] == job["pid"] for r in children)
    rcr = next(r for r in children if r.info.run_name == "rcr")
    m = rcr.data.metrics
    for k in ("fidelity", "fidelity_ci_low", "fidelity_ci_high", "diff_bacon", "diff_bacon_ci_low",
              "diff_bacon_ci_high", "refresh_fraction", "reads_per_step", "keys_read_per_step", "tokens_per_s",
              "rougeL_ref", "cider", "tercile_high_fidelity"):
        assert k in m, k
    assert m["fidelity_ci_low"] <= m["fidelity"] <= m["fidelity_ci_high"]
    assert m["diff_rcr"] == 0.0 and m["diff_rcr_ci_low"] == 0.0 and m["diff_rcr_ci_high"] == 0.0
    hist = c.get_metric_history(rcr.info.run_id, "refresh_rate_by_step")
    assert len(hist) >= 12 and sorted(h.step for h in hist)[:2] == [0, 1]
    sweep = next(r for r in children if r.info.run_name == "fixed@0.05")
    assert sweep.data.params["sweep_tau"] == "0.05"


def test_log_job_twice_is_a_no_op(job):
    pid = tracking.log_job(df=pd.read_parquet(job["out"]), config=job["config"], tracking_uri=job["uri"],
                           experiment="rcr-test", output_dir=str(job["out"]), job_name="tiny-job")
    assert pid == job["pid"]
    _, parents, children = _active_runs(job["uri"], "rcr-test")
    assert len(parents) == 1 and len(children) == len(METHODS)


def test_backfill_twice_leaves_one_set_of_runs(job, capsys):
    main = _backfill_main()
    # into the store the driver already wrote: finds the same job key, skips
    for _ in range(2):
        assert main(["--output-dir", str(job["out"]), "--tracking-uri", job["uri"], "--no-summary"]) == 0
    _, parents, children = _active_runs(job["uri"], "rcr-test")
    assert [p.info.run_id for p in parents] == [job["pid"]] and len(children) == len(METHODS)
    # into a fresh store (MLflow was unreachable during the job): first creates, second skips
    uri2 = _store(job["tmp"], "fresh.db")
    for _ in range(2):
        assert main(["--output-dir", str(job["out"]), "--tracking-uri", uri2, "--experiment", "rebuilt",
                     "--bootstrap-resamples", str(RES)]) == 0
    out = capsys.readouterr().out
    assert "fidelity [95% CI]" in out and "nothing to do" in out
    c2, parents2, children2 = _active_runs(uri2, "rebuilt")
    assert len(parents2) == 1 and len(children2) == len(METHODS)
    assert parents2[0].data.tags["rcr.job_key"] == parents[0].data.tags["rcr.job_key"]
    assert {"plots/fidelity_ci.png", "tables/per_sample.parquet"} <= _artifact_paths(c2, parents2[0].info.run_id)


def test_changed_rows_replace_the_runs(job):
    """A resumed job that added rows: the next log replaces the set, still one set of runs."""
    uri = _store(job["tmp"], "replace.db")
    df = pd.read_parquet(job["out"])
    kw = dict(config=job["config"], tracking_uri=uri, experiment="rcr-test", output_dir=str(job["out"]),
              job_name="tiny-job", verbose=False)
    first = tracking.log_job(df=df[df.sample_id != "s0000"], **kw)
    second = tracking.log_job(df=df, **kw)
    assert first != second
    _, parents, children = _active_runs(uri, "rcr-test")
    assert [p.info.run_id for p in parents] == [second]
    assert len(children) == len(METHODS) and all(r.data.tags["mlflow.parentRunId"] == second for r in children)
    # an interrupted earlier attempt (incomplete parent with the same key) is cleaned up by the next call
    c = MlflowClient(tracking_uri=uri)
    exp = c.get_experiment_by_name("rcr-test").experiment_id
    c.create_run(exp, run_name="interrupted", tags={"rcr.job_key": parents[0].data.tags["rcr.job_key"],
                                                    "rcr.role": "parent", "rcr.complete": "0"})
    assert tracking.log_job(df=df, **kw) == second
    _, parents, _ = _active_runs(uri, "rcr-test")
    assert [p.info.run_id for p in parents] == [second]


def test_reference_metrics_absent_without_references(job):
    """Samples with no references (TextCaps' test split): the parent run says the reference metrics are absent,
    in a param and in the summary, and no method run carries them; a job with references says what they cover."""
    assert job["pid"] and _active_runs(job["uri"], "rcr-test")[1][0].data.params["reference_metrics"] == (
        "on 12 of 12 samples")
    uri = _store(job["tmp"], "norefs.db")
    df = make_output_frame(n_samples=4, methods=("full", "rcr"), references=False)
    tracking.log_job(df=df, config={}, tracking_uri=uri, experiment="norefs", bootstrap_resamples=RES, verbose=False)
    _, parents, children = _active_runs(uri, "norefs")
    p = parents[0].data
    assert p.params["reference_metrics"] == "absent: none of the 4 samples has references"
    assert "reference metrics (ROUGE-L and CIDEr against references): absent" in p.tags["mlflow.note.content"]
    assert len(children) == 2 and not any({"rougeL_ref", "cider"} & set(r.data.metrics) for r in children)


def test_job_key_and_uri():
    df = make_output_frame(n_samples=3, methods=("full", "rcr"), config_hash="h1")
    a = tracking.job_key(df, {}, "/x/out")
    assert a == tracking.job_key(df, {"output_dir": "/x/out"}) != tracking.job_key(df, {}, "/x/other")
    assert a != tracking.job_key(df.assign(config_hash="h2"), {}, "/x/out")
    assert tracking.resolve_tracking_uri(None).startswith("sqlite:////")
    assert tracking.resolve_tracking_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert tracking.resolve_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


def test_experiment_is_tagged_as_model_development(job, tmp_path):
    """The UI's kind for these runs: set on an experiment log_job creates, added to one it finds without a kind,
    and left alone where someone chose another kind."""
    c = MlflowClient(tracking_uri=job["uri"])
    assert c.get_experiment_by_name("rcr-test").tags["mlflow.experimentKind"] == "custom_model_development"
    uri = _store(tmp_path, "kinds.db")
    c = MlflowClient(tracking_uri=uri)
    art = (tmp_path / "artifacts").as_uri()  # not ./mlruns of the working directory
    bare = c.create_experiment("bare", artifact_location=art)
    chosen = c.create_experiment("chosen", artifact_location=art, tags={"mlflow.experimentKind": "genai_development"})
    df = make_output_frame(n_samples=3, methods=("full", "rcr"))
    for name in ("bare", "chosen"):
        tracking.log_job(df=df, config={}, tracking_uri=uri, experiment=name, bootstrap_resamples=RES, verbose=False)
    assert c.get_experiment(bare).tags["mlflow.experimentKind"] == "custom_model_development"
    assert c.get_experiment(chosen).tags["mlflow.experimentKind"] == "genai_development"


def test_parent_run_carries_each_methods_fidelity_and_ci(job):
    c, parents, children = _active_runs(job["uri"], "rcr-test")
    pm = parents[0].data.metrics
    for child in children:
        label = child.info.run_name.replace("@", "_")  # MLflow metric names take no '@'
        for name in ("fidelity", "fidelity_ci_low", "fidelity_ci_high"):
            assert pm[f"{name}/{label}"] == pytest.approx(child.data.metrics[name]), (name, label)


def test_each_method_run_has_its_plots_colour(job):
    """The UI draws a run in its mlflow.runColor: every method run carries its method's colour from the plots' table,
    so no two methods share one in the charts and runs table (MLflow would hash the run ids into its palette)."""
    _, _, children = _active_runs(job["uri"], "rcr-test")
    colours = label_colours([r.data.tags["rcr.method"] for r in children])
    tagged = {r.data.tags["rcr.method"]: r.data.tags["mlflow.runColor"] for r in children}
    assert tagged == colours and len(set(tagged.values())) == len(tagged) == len(METHODS)


def test_ui_urls_open_the_runs_of_the_job(job, capsys):
    """The job URL names the job's shared view (an experiment tag), whose search and sort, as MLflow's own search,
    give exactly the job's runs, best fidelity first; its columns and charts are metrics every method run has.
    Every URL asks for the runs view (workflowType), which MLflow 3.17's UI reads from the URL."""
    c, parents, children = _active_runs(job["uri"], "rcr-test")
    exp = c.get_experiment_by_name("rcr-test").experiment_id
    key = parents[0].data.tags["rcr.job_key"]
    url = mlflow_ui.job_runs_url("http://127.0.0.1:5000/", exp, key)
    route, _, query = url.partition("?")
    assert route == f"http://127.0.0.1:5000/#/experiments/{exp}/runs"
    q = dict(parse_qsl(query))
    # the UI applies a shared view only to a URL without search parameters
    assert q == {"workflowType": "machine_learning", "viewStateShareKey": key}
    view = json.loads(c.get_experiment(exp).tags[mlflow_ui.VIEW_TAG_PREFIX + key])
    assert view["orderByAsc"] is False
    found = c.search_runs([exp], filter_string=view["searchFilter"], order_by=[f"{view['orderByKey']} DESC"])
    assert {r.info.run_id for r in found} == {r.info.run_id for r in parents + children}
    ranked = [r.data.metrics["fidelity"] for r in found if "fidelity" in r.data.metrics]
    assert len(ranked) == len(children) and ranked == sorted(ranked, reverse=True)
    columns = [re.fullmatch(r"metrics\.`(.+)`", col).group(1) for col in view["selectedColumns"]]
    charts = [ch["metricKey"] for ch in view["compareRunCharts"]]
    assert {"fidelity", "fidelity_ci_low", "fidelity_ci_high", "refresh_fraction", "reads_per_step"} == set(columns)
    assert charts and all(m in r.data.metrics for r in children for m in columns + charts)
    assert {ch["metricSectionId"] for ch in view["compareRunCharts"]} == {s["uuid"] for s in view["compareRunSections"]}
    pid = parents[0].info.run_id
    assert mlflow_ui.run_url("http://h:1", exp, pid) == f"http://h:1/#/experiments/{exp}/runs/{pid}?workflowType=machine_learning"
    assert mlflow_ui.experiment_url("sqlite:////a.db", exp).startswith(f"http://127.0.0.1:5000/#/experiments/{exp}/runs?")
    # what log_job prints: how to serve the store (its artifacts too), then the two URLs
    tracking.log_job(df=pd.read_parquet(job["out"]), config=job["config"], tracking_uri=job["uri"],
                     experiment="rcr-test", output_dir=str(job["out"]), job_name="tiny-job")
    out = capsys.readouterr().out
    assert (f"mlflow ui --backend-store-uri {job['uri']} --artifacts-destination {job['tmp'] / 'mlartifacts'} "
            "--host 127.0.0.1 --port 5000") in out
    assert mlflow_ui.job_runs_url(job["uri"], exp, key) in out and mlflow_ui.run_url(job["uri"], exp, pid) in out
    # and, for the UI's own Experiments list (whose links name no view), where to click once
    assert "[mlflow] UI, from its Experiments list: set the 'GenAI | Model training' switch (top left) to Model " \
           "training, once\n" in out
    assert mlflow_ui.store_path(job["uri"]) == str(job["tmp"] / "mlflow.db")
    assert mlflow_ui.store_path("http://127.0.0.1:5000") is None


def test_failed_logging_marks_its_runs_failed_and_the_next_call_replaces_them(job, monkeypatch):
    """A store that fails part way (here: on the third method run): log_job raises, and every run it started is
    FAILED, none RUNNING; the next call logs one complete set and deletes the failed one."""
    uri = _store(job["tmp"], "fails.db")
    kw = dict(df=pd.read_parquet(job["out"]), config=job["config"], tracking_uri=uri, experiment="rcr-test",
              output_dir=str(job["out"]), job_name="tiny-job", verbose=False)
    real, calls = tracking._log_child, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            half = MlflowClient(uri).create_run(a[1], run_name="half-made", tags={"rcr.job_key": k["key"]})
            k["started"].append(half.info.run_id)
            raise OSError("No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(tracking, "_log_child", flaky)
    with pytest.raises(OSError, match="No space left"):
        tracking.log_job(**kw)
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name("rcr-test").experiment_id
    runs = c.search_runs([exp], max_results=1000)
    assert len(runs) == 1 + 3 and {r.info.status for r in runs} == {"FAILED"}
    monkeypatch.setattr(tracking, "_log_child", real)
    pid = tracking.log_job(**kw)
    runs = c.search_runs([exp], max_results=1000)
    assert len(runs) == 1 + len(METHODS) and {r.info.status for r in runs} == {"FINISHED"}
    assert c.get_run(pid).data.tags["rcr.complete"] == "1"


def test_an_experiment_with_proxied_artifacts_is_written_to_the_stores_directory(job):
    """An experiment an MLflow server made with proxied artifacts (`mlflow-artifacts:/<id>`, which MLflow's client
    can write only through that server): a job writing to the database puts its artifacts where that server keeps
    them, the store's mlartifacts/<id>/..., instead of failing."""
    uri = _store(job["tmp"], "proxied.db")
    c = MlflowClient(uri)
    exp = c.create_experiment("served", artifact_location="mlflow-artifacts:/7")
    pid = tracking.log_job(df=pd.read_parquet(job["out"]), config=job["config"], tracking_uri=uri, experiment="served",
                           output_dir=str(job["out"]), job_name="tiny-job", verbose=False)
    assert c.get_run(pid).info.artifact_uri == f"mlflow-artifacts:/7/{pid}/artifacts"
    plots = job["tmp"] / "mlartifacts" / "7" / pid / "artifacts" / "plots"
    assert (plots / "fidelity_ci.png").read_bytes()[:4] == b"\x89PNG"
    assert {r.info.status for r in c.search_runs([exp])} == {"FINISHED"}


def test_error_cause_is_one_line_of_whole_words():
    long = ("When an mlflow-artifacts URI was supplied, the tracking URI must be a valid http or https URI, but it "
            "was currently set to sqlite:////srv/rcr-runs/mlflow.db. Perhaps you forgot to set the tracking URI "
            "to the running MLflow server. To use either of the following:\n - a\n - b")
    cause = mlflow_store.error_cause(RuntimeError(long))
    assert cause == ("RuntimeError: When an mlflow-artifacts URI was supplied, the tracking URI must be a valid http "
                     "or https URI, but it was currently set to sqlite:////srv/rcr-runs/mlflow.db")
    words = " ".join(f"word{i}" for i in range(100))
    short = mlflow_store.error_cause(ValueError(words), limit=50)
    assert "\n" not in short and short.endswith(" …") and len(short) <= len("ValueError: ") + 52
    assert all(w in words.split() for w in short.removeprefix("ValueError: ").removesuffix(" …").split())
    assert mlflow_store.error_cause(KeyError()) == "KeyError"
