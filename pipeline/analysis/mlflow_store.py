"""The one MLflow store every entry point writes and reads, and what a failed logging leaves in it.

**Layout.** A local store is a SQLite database and, next to it, the directory ``mlartifacts/`` (:func:`artifacts_dir`):
by default ``~/rcr-runs/mlflow.db`` and ``~/rcr-runs/mlartifacts``. Every experiment the project makes there has a
plain ``file://`` artifact location inside that directory, whoever makes it: a job writing to the database
(:func:`experiment_location`, used by ``tracking.py``) or the local cluster's MLflow server
(``infra/mlflow_server.sh``: ``--default-artifact-root file://<runs>/mlartifacts``). So a job logging
through that server and a job writing to the database put their plots in the same directory, and the server, or
``mlflow ui`` once it is stopped, serves them from there (``/get-artifact`` reads a ``file://`` run location itself).

An experiment made by a server that proxies artifacts (``mlflow server`` without ``--default-artifact-root``) has an
``mlflow-artifacts:/<path>`` location, which MLflow's client writes only through that server; a server started with
``--artifacts-destination <runs>/mlartifacts`` (as the local cluster's is) keeps them in
``<runs>/mlartifacts/<path>``. So a job writing to the database writes them there itself (:func:`upload`), and the
``mlflow ui`` command a job prints passes the same ``--artifacts-destination`` (``mlflow_ui.serve_hint``).

**Failures.** A logging call that fails part way marks every run it started FAILED (:func:`fail_runs`), so no run
is left RUNNING; :func:`error_cause` is the one-line cause the entry points print.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

ARTIFACTS_DIR = "mlartifacts"  # next to the database
PROXIED = "mlflow-artifacts:"  # the scheme of a server-proxied artifact location


def is_server(tracking_uri: str) -> bool:
    return re.match(r"https?://", tracking_uri) is not None


def artifacts_dir(tracking_uri: str) -> Path | None:
    """The artifact directory of a SQLite store: ``mlartifacts/`` next to the database; None for another store."""
    if not tracking_uri.startswith("sqlite:///") or tracking_uri.endswith(":memory:"):
        return None
    return Path(tracking_uri[len("sqlite:///"):]).resolve().parent / ARTIFACTS_DIR


def experiment_location(tracking_uri: str) -> str | None:
    """The artifact location of an experiment a job makes in the store at ``tracking_uri``: the store's
    ``mlartifacts/`` as a ``file://`` URI (not ``./mlruns`` of whatever directory the job runs in); None (the
    store's own default) for a server, which decides it itself."""
    root = artifacts_dir(tracking_uri)
    return root.as_uri() if root is not None else None


def _local_repository(tracking_uri: str, artifact_uri: str):
    """A run location ``mlflow-artifacts:/<path>`` seen without a server: the directory a proxying server keeps it
    in, ``<store>/mlartifacts/<path>``, as a local artifact repository; None where MLflow's own client can write."""
    if not artifact_uri.startswith(PROXIED) or is_server(tracking_uri):
        return None
    root = artifacts_dir(tracking_uri)
    if root is None:
        return None
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

    return LocalArtifactRepository(str(root / urlparse(artifact_uri).path.lstrip("/")))


def upload(client, tracking_uri: str, run, local: str | Path, artifact_path: str | None = None) -> None:
    """Log the file or directory ``local`` as artifacts of ``run`` (an MLflow Run entity): with MLflow's client,
    or into the store's directory where the run's location is one only a server could write."""
    local = Path(local)
    repo = _local_repository(tracking_uri, run.info.artifact_uri)
    if repo is None:
        if local.is_dir():
            client.log_artifacts(run.info.run_id, str(local), artifact_path)
        else:
            client.log_artifact(run.info.run_id, str(local), artifact_path)
    elif local.is_dir():
        repo.log_artifacts(str(local), artifact_path)
    else:
        repo.log_artifact(str(local), artifact_path)


def fail_runs(client, run_ids: list[str]) -> None:
    """Mark each run FAILED; a store that cannot take even that (a server that went away) is left as it is."""
    for rid in run_ids:
        try:
            client.set_terminated(rid, "FAILED")
        except Exception:  # noqa: BLE001 - best effort: the caller is already handling the first failure
            return


def error_cause(e: BaseException, limit: int = 300) -> str:
    """``<type>: <first sentence>`` of ``e`` on one line, shortened at a word boundary (with ``…``) when longer
    than ``limit`` characters, never cut inside a word."""
    text = " ".join(str(e).split())
    first = re.split(r"(?<=[.!?;])\s", text, maxsplit=1)[0].rstrip(".;")
    if len(first) > limit:
        cut = first[:limit + 1].rfind(" ")  # the last word boundary within the limit
        first = (first[:cut] if cut > 0 else first.split(" ")[0]).rstrip(",;:") + " …"
    return f"{type(e).__name__}: {first}" if first else type(e).__name__
