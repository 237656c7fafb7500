"""Where a job's runs are in the MLflow UI, and what makes the UI open on them (the store itself:
``mlflow_store.py``).

MLflow 3's UI shows an experiment one of two ways: "GenAI" (traces, an overview of LLM calls) or
"Model training" (the runs table). An experiment's kind is the tag ``mlflow.experimentKind``; this project's runs
are model evaluations, kind ``custom_model_development``, set on the experiment when :func:`mark_experiment_kind`
creates or finds it. MLflow 3.17's UI does not read that tag: its feature flag for the workflow switch is on in the
open-source build, and the view comes from the URL's ``workflowType`` parameter, else from the "GenAI | Model
training" switch at the top left (kept in the browser's local storage, ``mlflow.workflowType``; GenAI until it is
changed). So every URL here carries ``workflowType=machine_learning`` and opens on the runs however the browser was
left; the links of the UI's own Experiments list carry none, and open on the GenAI overview ("No data") until the
switch is set to Model training once, which the job's last lines and the README say (:data:`LIST_HINT`). Nothing a
server sends can set the switch short of serving a changed UI.

URLs, for a tracking server (``http://...``, its own UI) or a store served with ``mlflow ui`` on 127.0.0.1:5000:

* :func:`job_runs_url`: the job's runs, parent and one per method, best fidelity first, with each method's
  fidelity, its CI, refresh fraction and reads per step as columns, and a chart of each in the chart view. The
  UI has no URL parameter for columns or charts: it takes them from a *shared view*, an experiment tag
  ``mlflow.sharedViewState.<key>`` holding the view as JSON (:func:`job_view_state`), named by the URL's
  ``viewStateShareKey`` (what its "Share" button makes). The UI applies a shared view only to a URL without
  search parameters, so the job's search and sort are in the view too;
* :func:`run_url`: the parent run: the summary table as its description, each method's ``fidelity/<method>``
  and CI as metrics, and its method runs;
* :func:`experiment_url`: the experiment's runs table (every job, one row per parent run).
"""

from __future__ import annotations

import json

from pipeline.analysis.mlflow_store import artifacts_dir, is_server

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"  # MLflow's kind for model development (not GenAI traces)
WORKFLOW = "workflowType=machine_learning"  # the UI's "Model training" view
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui --host 127.0.0.1` serves a store (its default port)
VIEW_TAG_PREFIX = "mlflow.sharedViewState."  # the UI's experiment tag for a shared view
LIST_HINT = "from its Experiments list: set the 'GenAI | Model training' switch (top left) to Model training, once"

# what a job's runs page shows: the method runs' figures as columns, and a chart of each first in the chart view
JOB_COLUMNS = ("fidelity", "fidelity_ci_low", "fidelity_ci_high", "refresh_fraction", "reads_per_step")
JOB_CHARTS = ("fidelity", "refresh_fraction", "reads_per_step")


def mark_experiment_kind(client, experiment) -> None:
    """Tag ``experiment`` (an MLflow Experiment entity) as model development unless it has a kind already (a kind
    someone chose in the UI is kept)."""
    if EXPERIMENT_KIND_TAG not in (experiment.tags or {}):
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)


def store_path(tracking_uri: str) -> str | None:
    """The file or directory of a local store (``sqlite:///``, ``file:``); None for a server or another scheme."""
    if tracking_uri.startswith("sqlite:///") and not tracking_uri.endswith(":memory:"):
        return tracking_uri[len("sqlite:///"):]
    if tracking_uri.startswith("file://"):
        return tracking_uri[len("file://"):]
    return None


def ui_base(tracking_uri: str) -> str:
    """The UI's address: a tracking server is its own UI; a store is served by ``mlflow ui`` (:func:`serve_hint`)."""
    return tracking_uri.rstrip("/") if is_server(tracking_uri) else LOCAL_UI


def experiment_url(tracking_uri: str, experiment_id: str) -> str:
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs?{WORKFLOW}"


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}?{WORKFLOW}"


def job_runs_url(tracking_uri: str, experiment_id: str, job_key: str) -> str:
    """The job's runs with their figures (the shared view :func:`set_job_view` stores under ``job_key``)."""
    return f"{experiment_url(tracking_uri, experiment_id)}&viewStateShareKey={job_key}"


def job_view_state(job_key: str) -> dict:
    """The shared view of a job's runs: only its runs (a search on its ``rcr.job_key`` tag), best fidelity first,
    every run shown in the charts (the parent, which has no ``fidelity``, sorts last), :data:`JOB_COLUMNS` as
    columns and, first in the chart view, a section with a bar chart of each of :data:`JOB_CHARTS` across the
    methods (MLflow adds its own charts of the other metrics after it). Field names: MLflow's
    ``ExperimentPageSearchFacetsState`` and ``ExperimentPageUIState``."""
    section = f"rcr-{job_key}"
    return {
        "searchFilter": f"tags.`rcr.job_key` = '{job_key}'",
        "orderByKey": "metrics.`fidelity`",
        "orderByAsc": False,
        "selectedColumns": [f"metrics.`{m}`" for m in JOB_COLUMNS],
        "runsHiddenMode": "SHOW_ALL",
        "compareRunSections": [{"uuid": section, "name": "this job, per method", "display": True,
                                "isReordered": True}],
        "compareRunCharts": [{"type": "BAR", "uuid": f"{section}-{m}", "metricSectionId": section, "deleted": False,
                              "isGenerated": False, "metricKey": m} for m in JOB_CHARTS],
        "isAccordionReordered": True,  # keeps this section first
    }


def set_job_view(client, experiment_id: str, job_key: str) -> None:
    """Store :func:`job_view_state` as the experiment's shared view ``job_key`` (replacing an older one)."""
    client.set_experiment_tag(experiment_id, VIEW_TAG_PREFIX + job_key, json.dumps(job_view_state(job_key)))


def serve_hint(tracking_uri: str) -> str:
    """How to browse ``tracking_uri``: a server's address, or the ``mlflow ui`` command that serves a store."""
    if is_server(tracking_uri):
        return f"open {tracking_uri.rstrip('/')} in a browser"
    art = artifacts_dir(tracking_uri)
    dest = f" --artifacts-destination {art}" if art else ""
    return f"mlflow ui --backend-store-uri {tracking_uri}{dest} --host 127.0.0.1 --port 5000"


def ui_lines(tracking_uri: str, experiment_id: str, run_id: str, job_key: str) -> list[str]:
    """What the end of a job prints about its runs in the UI."""
    lines = [] if is_server(tracking_uri) else [f"to browse the store, run: {serve_hint(tracking_uri)}"]
    return lines + [f"UI, this job's runs by fidelity: {job_runs_url(tracking_uri, experiment_id, job_key)}",
                    f"UI, the job's summary (fidelity [CI] per method): {run_url(tracking_uri, experiment_id, run_id)}",
                    f"UI, {LIST_HINT}"]
