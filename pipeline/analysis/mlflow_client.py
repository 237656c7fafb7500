"""MLflow client helpers for the job's tracking (``tracking.py``): the tracking URI, the client and experiment, the
job's runs, and writing params, metrics, series and datasets in MLflow's limits. Driver side only."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.analysis import mlflow_store, mlflow_ui
from pipeline.schema import Col

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
REPO_ROOT = Path(__file__).resolve().parents[2]

TAG_KEY = "rcr.job_key"
TAG_ROLE = "rcr.role"
TAG_FP = "rcr.fingerprint"
TAG_COMPLETE = "rcr.complete"
TAG_SUPERSEDED = "rcr.superseded_by"  # on the runs of a job's older complete set: the parent that replaced it


def resolve_tracking_uri(uri: str | None) -> str:
    """The one tracking-URI resolver (the job config and :func:`log_job` both call it).

    ``None`` -> ``sqlite:///mlflow.db``. Relative sqlite/file paths and bare directories become absolute,
    so a job started from a temporary working directory (``ray job submit --working-dir``) does not lose
    its store; ``file:`` paths with leading slashes are absolute. ``sqlite:///:memory:`` (SQLite's
    in-memory database, not a file) and other schemes (http, databricks, ...) are returned unchanged."""
    uri = DEFAULT_TRACKING_URI if uri is None else uri
    if not isinstance(uri, str) or not uri:
        raise ValueError(f"tracking URI must be a non-empty string, got {uri!r}")
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):]
        if path.startswith("/") or path == ":memory:":
            return uri
        return "sqlite:///" + str(Path(path).expanduser().resolve())
    if uri.startswith("file:"):
        path = uri[len("file:"):]
        path = "/" + path.lstrip("/") if path.startswith("/") else path
        return "file://" + str(Path(path).expanduser().resolve())
    if re.match(r"^[a-z][a-z0-9+.-]*://", uri):
        return uri
    return "file://" + str(Path(uri).expanduser().resolve())  # a bare directory

def client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)

def experiment_id(client, name: str, tracking_uri: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        mlflow_ui.mark_experiment_kind(client, exp)
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=mlflow_store.experiment_location(tracking_uri),
                                        tags={mlflow_ui.EXPERIMENT_KIND_TAG: mlflow_ui.EXPERIMENT_KIND})
    except Exception:  # created concurrently
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        mlflow_ui.mark_experiment_kind(client, exp)
        return exp.experiment_id

def find_job_runs(client, experiment_id: str, key: str) -> list:
    """All active runs (parents and children) carrying ``rcr.job_key = key``."""
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_KEY}` = '{key}'",
                                  max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs

def git_commit() -> tuple[str, bool | None]:
    try:
        sha = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if not re.fullmatch(r"[0-9a-f]{40}", sha):
            return "unknown", None
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return sha, dirty
    except Exception:  # noqa: BLE001 - no git, not a checkout, a timeout: the commit is a label, not a result
        return "unknown", None

def flatten(d: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(d, (list, tuple)):
        out[prefix[:-1]] = ",".join(map(str, d))
    else:
        out[prefix[:-1]] = str(d)
    return out

def finite(x) -> bool:
    try:
        return x is not None and not isinstance(x, bool) and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False

def metric_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", s)

def log_metrics(client, run_id: str, values: dict[str, Any], step: int = 0, ts: int | None = None) -> None:
    from mlflow.entities import Metric

    ts = ts or int(time.time() * 1000)
    ms = [Metric(metric_name(k), float(v), ts, step) for k, v in values.items() if finite(v)]
    for i in range(0, len(ms), 1000):
        client.log_batch(run_id, metrics=ms[i:i + 1000])

def log_series(client, run_id: str, name: str, values: Iterable[float]) -> None:
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    ms = [Metric(name, float(v), ts, i) for i, v in enumerate(values) if finite(v)]
    for i in range(0, len(ms), 1000):
        client.log_batch(run_id, metrics=ms[i:i + 1000])

def log_params(client, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    ps = [Param(metric_name(k)[:250], str(v)[:6000]) for k, v in params.items() if v is not None]
    for i in range(0, len(ps), 100):
        client.log_batch(run_id, params=ps[i:i + 100])

def log_dataset(client, run_id: str, df: pd.DataFrame, output_dir: str | None, name: str) -> None:
    """The evaluated samples (one row per sample) as an MLflow dataset input of the parent run."""
    import mlflow.data
    from mlflow.entities import DatasetInput, InputTag

    cols = [c for c in (Col.SAMPLE_ID, Col.TASK, Col.SOURCE, Col.PROMPT, Col.REFERENCES) if c in df]
    samples = df[cols].drop_duplicates(Col.SAMPLE_ID).reset_index(drop=True)
    if Col.REFERENCES in samples:
        samples[Col.REFERENCES] = samples[Col.REFERENCES].map(
            lambda r: json.dumps(list(r) if r is not None else [], ensure_ascii=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = mlflow.data.from_pandas(samples, source=output_dir or "unknown", name=name)
        client.log_inputs(run_id, datasets=[DatasetInput(ds._to_mlflow_entity(),
                                                         tags=[InputTag("mlflow.data.context", "evaluation")])])

def joined_unique(df: pd.DataFrame, col: str) -> str | None:
    if col not in df:
        return None
    v = sorted(set(df[col].dropna().astype(str)))
    return ",".join(v) if v else None

def delete_runs(client, runs: list, keep: set[str]) -> int:
    """Delete ``runs`` but ``keep``; one an interrupted call left RUNNING is marked FAILED first."""
    n = 0
    for r in runs:
        if r.info.run_id in keep:
            continue
        try:
            if r.info.status == "RUNNING":
                client.set_terminated(r.info.run_id, "FAILED")
            client.delete_run(r.info.run_id)
            n += 1
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"could not delete stale MLflow run {r.info.run_id}: {e}", stacklevel=2)
    return n

@contextlib.contextmanager
def quiet_run_urls():
    """Against a tracking server MLflow prints two URL lines per finished run (22 for a 10-method job), which
    would bury the job's summary; the parent's URL is printed once instead."""
    name = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
    before = os.environ.get(name)
    os.environ[name] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before

def check_tracking_server(uri: str) -> None:
    """Raise ConnectionError at once if an http(s) tracking server does not answer its health check:
    MLflow's client would otherwise retry a dead server for minutes before failing."""
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=10).close()
    except urllib.error.HTTPError:
        return  # it answers (e.g. 401 behind auth): let MLflow's client deal with it
    except OSError as e:
        raise ConnectionError(f"the tracking server {uri} does not answer ({e})") from None
