"""MLflow logging of a finished job. Driver side only: actors never talk to MLflow (SQLite does not
tolerate concurrent writers), and nothing here runs inside Ray tasks.

Public entry point (stable)::

    log_job(df, config, tracking_uri="sqlite:///mlflow.db", experiment="rcr-eval", job_name=None,
            artifacts_dir=None, *, analysis=None, output_dir=None, ...) -> parent_run_id

What it writes, per job:

* one **parent run** (``rcr.role=parent``): params (the flattened config, model, dataset, git commit,
  metric definitions, bootstrap settings), the config as ``config.json``, the dataset as an MLflow
  dataset input, the summary table as the run's description, parent-level metrics (each method's fidelity and
  CI as ``fidelity/<method>``, ``fidelity_ci_low/<method>``, ``fidelity_ci_high/<method>``; counts, top-position
  stability, Spearman correlations), the tuned-fixed comparison (``tuned_fixed.*`` params and metrics: τ*,
  ``rcr − fixed(τ*)`` on the test half and ``rcr −`` the fixed-τ frontier, with CIs), and artifacts:
  ``plots/*.png``, ``tables/per_sample.parquet`` (+csv),
  ``tables/{methods,terciles,correlations,stability,frontier,fixed_comparison,fixed_tuning,errors}.csv``,
  ``summary.txt``;
* one **child run per method** (per (model, method) when a job has several models), tagged
  ``mlflow.parentRunId`` and ``mlflow.runColor`` (the method's colour in the plots, ``colours.py``: the UI's
  charts and runs table draw each method in it): every numeric column of its ``Analysis.methods`` row (``fidelity`` and
  ``diff_bacon`` / ``diff_rcr`` with ``_ci_low`` / ``_ci_high``, ``refresh_fraction`` (+CI), reference
  metrics (+CI), and the per-method means of the output rows' summaries, which derive from the output
  schema: ``keys_read_per_step``, ``reads_per_step``, ``bytes_moved_per_step``, ``tokens_per_s``, ...),
  tercile metrics, and ``refresh_rate_by_step`` / ``tau_mean_by_step`` as step histories.

Idempotence: the parent carries ``rcr.job_key`` = hash(absolute output dir, config hash(es)) (the job
name when no output dir is known) and ``rcr.fingerprint`` = hash(row contents, analysis settings,
logging version). Logging a job whose key already has a complete parent with the same fingerprint does
nothing and returns that run's id. Otherwise the new set of runs is logged first, marked complete
(``rcr.complete=1``), and only then are all older runs with the same key deleted, so a crash at any
point leaves at most one complete set, and the next call cleans up. ``jobs/backfill_mlflow.py`` uses
the same function to rebuild the runs from a Parquet output directory.

Where: a store's experiment keeps its artifacts in the store's own ``mlartifacts/`` directory, whichever entry
point made it (``pipeline/analysis/mlflow_store.py``). A call that fails part way marks the runs it started FAILED
and raises; the caller prints ``mlflow_store.error_cause`` of it.

The experiment is tagged as model development, and the URLs printed open the UI on the runs, with their figures as
columns and charts (``pipeline/analysis/mlflow_ui.py``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.analysis import fixed_tuning, mlflow_client, mlflow_store, mlflow_ui, report
from pipeline.analysis.analyze import Analysis, analyze
from pipeline.analysis.colours import label_colours
from pipeline.analysis.labels import order_methods, target_rho
from pipeline.analysis.mlflow_client import (
    DEFAULT_TRACKING_URI,
    TAG_COMPLETE,
    TAG_FP,
    TAG_KEY,
    TAG_ROLE,
    check_tracking_server,
    resolve_tracking_uri,
)
from pipeline.analysis.telemetry import refresh_by_step
from pipeline.analysis.text_metrics import FIDELITY_DESC, REF_ROUGE_DESC
from pipeline.schema import Col
from rcr.fileio import atomic_write_text

__all__ = ["log_job", "check_tracking_server", "job_key", "data_fingerprint", "resolve_tracking_uri",
           "DEFAULT_TRACKING_URI", "DEFAULT_EXPERIMENT", "TRACKING_VERSION"]

DEFAULT_EXPERIMENT = "rcr-eval"
TRACKING_VERSION = "4"  # bump when what is logged changes: existing runs are then replaced, not skipped
RUN_COLOUR_TAG = "mlflow.runColor"  # the UI draws a run in the colour this tag holds (else one hashed from its id)

# ---------------------------------------------------------------------------------------------- keys


def _config_hashes(df: pd.DataFrame, config: dict | None) -> list[str]:
    if Col.CONFIG_HASH in df and df[Col.CONFIG_HASH].notna().any():
        return sorted(set(df[Col.CONFIG_HASH].dropna().astype(str)))
    ch = (config or {}).get("config_hash")
    return [str(ch)] if ch else []


def job_key(df: pd.DataFrame, config: dict | None = None, output_dir: str | os.PathLike | None = None,
            job_name: str | None = None) -> str:
    """The identity of a job's MLflow runs: hash of the absolute output dir and the config hash(es).

    Without an output dir (neither the argument nor ``config["output_dir"]``), the job name is used.
    The driver and the backfill command derive the same key for the same output."""
    out = output_dir or (config or {}).get("output_dir")
    where = str(Path(out).expanduser().resolve()) if out else f"job:{job_name or (config or {}).get('job_name')}"
    blob = json.dumps({"where": where, "config_hash": _config_hashes(df, config)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


_FP_COLS = (Col.MODEL, Col.SAMPLE_ID, Col.METHOD, Col.CONFIG_HASH, Col.OUTPUT_TEXT, Col.ERROR,
            Col.REFRESH_FRACTION, Col.MEAN_DRIFT, Col.N_STEPS, Col.TOKENS_PER_S)


def data_fingerprint(df: pd.DataFrame, extra: dict | None = None) -> str:
    """Content hash of the rows (key columns, outputs, errors, summary telemetry) and of ``extra``."""
    cols = [c for c in _FP_COLS if c in df.columns]
    d = df[cols].copy()
    for c in cols:
        d[c] = d[c].astype(str)
    d = d.sort_values([c for c in (Col.MODEL, Col.SAMPLE_ID, Col.METHOD, Col.CONFIG_HASH) if c in cols])
    h = hashlib.sha256()
    h.update(pd.util.hash_pandas_object(d, index=False).to_numpy().tobytes())
    h.update(json.dumps(extra or {}, sort_keys=True, default=str).encode())
    h.update(TRACKING_VERSION.encode())
    return h.hexdigest()[:20]


# ---------------------------------------------------------------------------------------------- helpers


# ---------------------------------------------------------------------------------------------- log_job
def log_job(df: pd.DataFrame, config: dict | None, tracking_uri: str | None = DEFAULT_TRACKING_URI,
            experiment: str | None = DEFAULT_EXPERIMENT, job_name: str | None = None,
            artifacts_dir: str | os.PathLike | None = None, *, analysis: Analysis | None = None,
            output_dir: str | os.PathLike | None = None, bootstrap_resamples: int | None = None,
            seed: int | None = None, force: bool = False, verbose: bool = True) -> str:
    """Log a finished job to MLflow (one parent run, one child run per method); idempotent.

    Args:
        df: the job's output rows (``pd.read_parquet(output_dir)``, possibly filtered to one config hash).
        config: the job config as a dict (``JobConfig.to_dict()``); flattened into params, logged as
            ``config.json``. ``output_dir``, ``job_name``, ``bootstrap_resamples`` and ``seed`` are read
            from it when not given as arguments, and rcr's target refresh fraction from its ``methods``.
        tracking_uri: any MLflow URI; default ``sqlite:///mlflow.db``, relative paths made absolute.
        experiment: experiment name (created if missing; for a sqlite store its artifacts go to
            ``mlartifacts/`` next to the database file, ``mlflow_store.py``).
        job_name: the parent run's name (default: ``config["job_name"]``, else the rows' ``job_name``).
        artifacts_dir: where the plots and tables are written before upload (kept); default: a
            temporary directory (removed).
        analysis: a ready :class:`pipeline.analysis.analyze.Analysis` of ``df``; computed when ``None``.
        output_dir: the job's Parquet directory; part of the job key, so pass it (the driver and the
            backfill command must agree on it).
        force: log a new set of runs even when an identical complete one exists (the old one is deleted).

    Returns:
        The parent run id (of the existing run when nothing had to be logged).

    Raises:
        Whatever the store raises; the runs this call started are then marked FAILED, and the next call with the
        same job deletes them.
    """
    config = dict(config or {})
    tracking_uri = mlflow_client.resolve_tracking_uri(tracking_uri)
    experiment = experiment or config.get("experiment") or DEFAULT_EXPERIMENT
    output_dir = output_dir or config.get("output_dir")
    output_dir = str(Path(output_dir).expanduser().resolve()) if output_dir else None
    job_name = job_name or config.get("job_name") or mlflow_client.joined_unique(df, Col.JOB_NAME) or "job"
    if bootstrap_resamples is None:
        bootstrap_resamples = int(config.get("bootstrap_resamples", 10_000))
    if seed is None:
        seed = int(config.get("bootstrap_seed", config.get("seed", 0)) or 0)
    rho = target_rho(config.get("methods") or df[Col.METHOD].unique())

    client = mlflow_client.client(tracking_uri)
    exp_id = mlflow_client.experiment_id(client, experiment, tracking_uri)
    key = job_key(df, config, output_dir, job_name)
    mlflow_ui.set_job_view(client, exp_id, key)  # what the printed runs URL opens (also for runs logged without it)
    fp = data_fingerprint(df, {"bootstrap_resamples": bootstrap_resamples, "seed": seed})
    existing = mlflow_client.find_job_runs(client, exp_id, key)
    done = None if force else _complete_parent(client, existing, fp)
    if done is not None:
        if verbose:
            print(f"[mlflow] job already logged (parent run {done}, key {key}); nothing to do")
            _print_ui(tracking_uri, exp_id, done, key)
        return done

    if analysis is None:
        analysis = analyze(df, bootstrap_resamples=bootstrap_resamples, seed=seed)
    summary = report.format_summary(analysis)
    started: list[str] = []  # the runs this call creates, marked FAILED if it does not finish
    try:
        with _artifacts_dir(artifacts_dir) as adir, mlflow_client.quiet_run_urls():
            parent_id = _log_new(client, exp_id, df, config, analysis, summary, adir, key=key, fp=fp,
                                 job_name=job_name, output_dir=output_dir, tracking_uri=tracking_uri, rho=rho,
                                 started=started)
    except BaseException:
        mlflow_store.fail_runs(client, started)
        raise
    # only now remove what this replaces (an older set with the same key, or an interrupted one)
    n_del = mlflow_client.delete_runs(client, existing, {parent_id})
    if verbose:
        what = f"replaced {n_del} older run(s)" if n_del else "new"
        print(f"[mlflow] logged job '{job_name}' to {tracking_uri}, experiment '{experiment}': parent run "
              f"{parent_id} ({what})")
        _print_ui(tracking_uri, exp_id, parent_id, key)
    return parent_id


def _print_ui(tracking_uri: str, exp_id: str, parent_id: str, key: str) -> None:
    for line in mlflow_ui.ui_lines(tracking_uri, exp_id, parent_id, key):
        print(f"[mlflow] {line}")


def _complete_parent(client, existing: list, fp: str) -> str | None:
    """The id of a complete parent run with fingerprint ``fp`` among ``existing`` (whose other runs, the
    leftovers of an interrupted earlier call, are deleted), or None."""
    for r in existing:
        t = r.data.tags
        if (t.get(TAG_ROLE) == "parent" and t.get(TAG_FP) == fp and t.get(TAG_COMPLETE) == "1"
                and r.info.status == "FINISHED"):
            stale = [x for x in existing if x.info.run_id != r.info.run_id
                     and x.data.tags.get("mlflow.parentRunId") != r.info.run_id]
            mlflow_client.delete_runs(client, stale, set())
            return r.info.run_id
    return None


@contextlib.contextmanager
def _artifacts_dir(artifacts_dir: str | os.PathLike | None):
    """The given directory (kept), or a temporary one (removed on exit)."""
    if artifacts_dir is None:
        with tempfile.TemporaryDirectory(prefix="rcr-mlflow-") as tmp:
            yield Path(tmp)
        return
    adir = Path(artifacts_dir).expanduser().resolve()
    adir.mkdir(parents=True, exist_ok=True)
    yield adir


def _log_new(client, exp_id: str, df: pd.DataFrame, config: dict, a: Analysis, summary: str, adir: Path, *,
             key: str, fp: str, job_name: str, output_dir: str | None, tracking_uri: str, rho: float | None,
             started: list[str]) -> str:
    """One parent run (params, dataset, metrics, artifacts), then one child run per (model, method); each run's id
    goes to ``started`` as it is created."""
    commit, dirty = mlflow_client.git_commit()
    commit = config.get("git_commit") or commit
    models = a.meta.get("models") or [""]
    dataset = mlflow_client.joined_unique(df, Col.SOURCE) or "unknown"
    task = mlflow_client.joined_unique(df, Col.TASK)
    tags = {
        TAG_KEY: key, TAG_ROLE: "parent", TAG_FP: fp, TAG_COMPLETE: "0",
        "rcr.job_name": job_name, "rcr.output_dir": output_dir or "",
        "rcr.config_hash": mlflow_client.joined_unique(df, Col.CONFIG_HASH) or "",
        "rcr.model": ",".join(models), "rcr.dataset": dataset, "rcr.task": task or "",
        "mlflow.source.git.commit": commit, "mlflow.source.name": "pipeline.analysis.tracking.log_job",
        "mlflow.note.content": "```\n" + summary[:7900] + "\n```",
    }
    if dirty is not None:
        tags["rcr.git_dirty"] = str(dirty).lower()
    parent = client.create_run(exp_id, run_name=job_name, tags=tags)
    pid = parent.info.run_id
    started.append(pid)

    params = {f"config.{k}": v for k, v in mlflow_client.flatten(config).items() if k}
    params.update({
        "job_name": job_name, "model": ",".join(models), "dataset": dataset, "task": task,
        "git_commit": commit, "output_dir": output_dir, "config_hash": mlflow_client.joined_unique(df, Col.CONFIG_HASH),
        "n_samples": a.meta.get("n_samples"), "n_rows": a.meta.get("n_rows"),
        "methods": ",".join(order_methods(df[Col.METHOD].astype(str))),
        "fidelity_metric": FIDELITY_DESC, "reference_rougeL": REF_ROUGE_DESC, "cider": a.meta.get("cider"),
        "reference_metrics": a.meta.get("reference_metrics"),  # "absent: ..." when no sample has references
        "bootstrap": a.meta.get("bootstrap"), "bootstrap_resamples": a.meta.get("bootstrap_resamples"),
        "bootstrap_seed": a.meta.get("seed"), "drift_source": a.meta.get("drift_source"),
        # what the infinigen rows were calibrated on (pipeline/run/calibration.py); None (not logged) without them
        "infinigen_calibration": mlflow_client.joined_unique(df, Col.CALIBRATION),
        "infinigen_calibration_sha256": mlflow_client.joined_unique(df, Col.CALIBRATION_SHA256),
    })
    mlflow_client.log_params(client, pid, params)
    try:
        mlflow_client.log_dataset(client, pid, df, output_dir, name=f"{dataset}:{task}" if task else dataset)
    except Exception as e:  # noqa: BLE001 - the dataset entity is a convenience
        warnings.warn(f"MLflow dataset input not logged: {e}", stacklevel=2)
    mlflow_client.log_metrics(client, pid, _parent_metrics(a, multi=len(models) > 1))
    tuned_params, tuned_metrics = fixed_tuning.mlflow_values(a.fixed_comparison, multi=len(models) > 1)
    mlflow_client.log_params(client, pid, tuned_params)
    mlflow_client.log_metrics(client, pid, tuned_metrics)
    _log_artifacts(client, tracking_uri, parent, df, a, summary, config, adir, rho)
    colours = label_colours(a.methods.method)  # each method run's colour in the UI: the plots' (colours.py)
    for _, row in a.methods.iterrows():
        _log_child(client, exp_id, pid, df, a, row, key=key, job_name=job_name, commit=commit, multi=len(models) > 1,
                   started=started, colour=colours[str(row.method)])
    client.set_tag(pid, TAG_COMPLETE, "1")
    client.set_terminated(pid, "FINISHED")
    return pid


def _parent_metrics(a: Analysis, multi: bool) -> dict[str, Any]:
    """Each method's fidelity and CI (``fidelity/<method>``: the runs page of the parent shows them without
    opening a method's run), counts, top-position stability and Spearman correlations (suffixed by model when
    there are several)."""
    pm: dict[str, Any] = {}
    for _, r in a.methods.iterrows():
        sfx = f".{r.model}" if multi else ""
        for name in ("fidelity", "fidelity_ci_low", "fidelity_ci_high"):
            pm[f"{name}/{r.method}{sfx}"] = r[name]
    pm |= {"n_rows": a.meta.get("n_rows"), "n_samples": a.meta.get("n_samples"),
           "n_error_rows": a.meta.get("n_error_rows"), "n_samples_without_full": a.meta.get("n_samples_without_full")}
    for _, s in a.stability.iterrows():
        sfx = f".{s.model}" if multi else ""
        pm[f"top_pos_unchanged_fraction{sfx}"] = s.fraction_unchanged
        pm[f"top_pos_unchanged_fraction_sample_mean{sfx}"] = s.fraction_unchanged_sample_mean
    for _, c in a.correlations.iterrows():
        sfx = f".{c.model}" if multi else ""
        pm[f"spearman_gap_exact.{c.method}.vs_{c.against}{sfx}"] = c.spearman_rho
    return pm


def _log_artifacts(client, tracking_uri: str, run, df: pd.DataFrame, a: Analysis, summary: str, config: dict,
                   adir: Path, rho: float | None) -> None:
    """Plots, tables, the summary, the analysis settings and the config, written to ``adir`` and uploaded to
    ``run``'s location (``mlflow_store.upload``)."""
    from pipeline.analysis import plots

    pdir, tdir = adir / "plots", adir / "tables"
    tdir.mkdir(parents=True, exist_ok=True)
    try:
        plots.make_plots(df, a, pdir, rho=rho)
    except Exception as e:  # noqa: BLE001 - a broken plot must not lose the numbers
        warnings.warn(f"plots failed: {type(e).__name__}: {e}", stacklevel=2)
    a.per_sample.to_parquet(tdir / "per_sample.parquet", index=False)
    a.per_sample.to_csv(tdir / "per_sample.csv", index=False)
    for name in ("methods", "terciles", "correlations", "stability", "frontier", "fixed_comparison", "fixed_tuning",
                 "errors"):
        getattr(a, name).to_csv(tdir / f"{name}.csv", index=False)
    atomic_write_text(summary + "\n", adir / "summary.txt")
    atomic_write_text(json.dumps(a.meta, indent=1, default=str), adir / "analysis_meta.json")
    atomic_write_text(json.dumps(config, indent=1, default=str), adir / "config.json")
    if pdir.is_dir():
        mlflow_store.upload(client, tracking_uri, run, pdir, "plots")
    mlflow_store.upload(client, tracking_uri, run, tdir, "tables")
    for f in ("summary.txt", "analysis_meta.json", "config.json"):
        mlflow_store.upload(client, tracking_uri, run, adir / f)


def _log_child(client, exp_id: str, pid: str, df: pd.DataFrame, a: Analysis, row: pd.Series, *, key: str,
               job_name: str, commit: str, multi: bool, started: list[str], colour: str) -> None:
    """One method's run: every column of its ``Analysis.methods`` row as a metric (they derive from the
    output schema, see ``METHOD_MEANS``), its tercile and correlation figures, and its per-step series."""
    method, model = str(row.method), str(row.model)
    ctags = {"mlflow.parentRunId": pid, TAG_KEY: key, TAG_ROLE: "method", "rcr.method": method, RUN_COLOUR_TAG: colour,
             "rcr.model": model, "rcr.job_name": job_name, "mlflow.source.git.commit": commit}
    cid = client.create_run(exp_id, run_name=f"{method} [{model}]" if multi else method, tags=ctags).info.run_id
    started.append(cid)
    tau = row.get("sweep_tau")
    mlflow_client.log_params(client, cid, {"method": method, "model": model,
                                           "sweep_tau": tau if mlflow_client.finite(tau) else None})
    cm = {k: v for k, v in row.items() if k not in ("model", "method")}
    t = a.terciles[(a.terciles.model == model) & (a.terciles.method == method)]
    for _, tr in t.iterrows():
        cm[f"tercile_{tr.tercile}_fidelity"] = tr.fidelity
        cm[f"tercile_{tr.tercile}_refresh_fraction"] = tr.refresh_fraction
    c = a.correlations[(a.correlations.model == model) & (a.correlations.method == method)]
    for _, cr in c.iterrows():
        cm[f"spearman_gap_exact_vs_{cr.against}"] = cr.spearman_rho
    mlflow_client.log_metrics(client, cid, cm)
    if mlflow_client.finite(row.get("refresh_fraction")) and 0 < float(row.get("refresh_fraction")) < 1:
        steps = refresh_by_step(df, method, model=model)
        mlflow_client.log_series(client, cid, "refresh_rate_by_step", steps.refresh_rate)
        mlflow_client.log_series(client, cid, "tau_mean_by_step", steps.tau_mean)
    client.set_terminated(cid, "FINISHED")
