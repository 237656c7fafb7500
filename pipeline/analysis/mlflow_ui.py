"""Where a job's runs are in the MLflow UI, and what makes the UI open on them.

MLflow 3's UI shows an experiment one of two ways: "GenAI" (traces, an overview of LLM calls) or "Model
training" (the runs table). An experiment's kind is the tag ``mlflow.experimentKind``; this project's runs are
model evaluations, kind ``custom_model_development``, set on the experiment when :func:`mark_experiment_kind`
creates or finds it. MLflow 3.17's UI takes the view from its "GenAI | Model training" switch instead (remembered
per browser, GenAI by default) or from the URL's ``workflowType`` parameter, so every URL here carries
``workflowType=machine_learning``: it opens on the runs whichever way the browser was left.

URLs, for a tracking server (``http://...``, its own UI) or a store served with ``mlflow ui`` on 127.0.0.1:5000:

* :func:`job_runs_url`: the job's runs, parent and one per method, best fidelity first (a search on the job's
  ``rcr.job_key`` tag, sorted by the ``fidelity`` metric);
* :func:`run_url`: the parent run: the summary table as its description, each method's ``fidelity/<method>``
  and CI as metrics, and its method runs;
* :func:`experiment_url`: the experiment's runs table (every job, one row per parent run).
"""

from __future__ import annotations

import re
from urllib.parse import quote

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"  # MLflow's kind for model development (not GenAI traces)
WORKFLOW = "workflowType=machine_learning"  # the UI's "Model training" view
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui --host 127.0.0.1` serves a store (its default port)


def mark_experiment_kind(client, experiment) -> None:
    """Tag ``experiment`` (an MLflow Experiment entity) as model development unless it has a kind already (a kind
    someone chose in the UI is kept)."""
    if EXPERIMENT_KIND_TAG not in (experiment.tags or {}):
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)


def is_server(tracking_uri: str) -> bool:
    return re.match(r"https?://", tracking_uri) is not None


def ui_base(tracking_uri: str) -> str:
    """The UI's address: a tracking server is its own UI; a store is served by ``mlflow ui`` (:func:`serve_hint`)."""
    return tracking_uri.rstrip("/") if is_server(tracking_uri) else LOCAL_UI


def experiment_url(tracking_uri: str, experiment_id: str) -> str:
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs?{WORKFLOW}"


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}?{WORKFLOW}"


def job_runs_url(tracking_uri: str, experiment_id: str, job_key: str) -> str:
    """The job's runs only (its ``rcr.job_key`` tag), listed flat and sorted by fidelity, best first."""
    search = quote(f"tags.`rcr.job_key` = '{job_key}'", safe="")
    order = quote("metrics.`fidelity`", safe="")
    return f"{experiment_url(tracking_uri, experiment_id)}&searchFilter={search}&orderByKey={order}&orderByAsc=false"


def serve_hint(tracking_uri: str) -> str:
    """How to browse ``tracking_uri``: a server's address, or the ``mlflow ui`` command that serves a store."""
    if is_server(tracking_uri):
        return f"open {tracking_uri.rstrip('/')} in a browser"
    return f"mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1 --port 5000"


def store_path(tracking_uri: str) -> str | None:
    """The file or directory of a local store (``sqlite:///``, ``file:``); None for a server or another scheme."""
    if tracking_uri.startswith("sqlite:///") and not tracking_uri.endswith(":memory:"):
        return tracking_uri[len("sqlite:///"):]
    if tracking_uri.startswith("file://"):
        return tracking_uri[len("file://"):]
    return None


def ui_lines(tracking_uri: str, experiment_id: str, run_id: str, job_key: str) -> list[str]:
    """What the end of a job prints about its runs in the UI."""
    lines = [] if is_server(tracking_uri) else [f"to browse the store, run: {serve_hint(tracking_uri)}"]
    return lines + [f"UI, this job's runs by fidelity: {job_runs_url(tracking_uri, experiment_id, job_key)}",
                    f"UI, the job's summary (fidelity [CI] per method): {run_url(tracking_uri, experiment_id, run_id)}"]
