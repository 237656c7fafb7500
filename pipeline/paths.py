"""Where the project's files go by default: the runs directory (``$RCR_RUNS_DIR``, else ``~/rcr-runs``) and the MLflow
store in it. Every entry point reads them from here (the jobs, the backfill command, the embedded tooling), so that
they agree without importing one another."""

from __future__ import annotations

import os
from pathlib import Path


def default_runs_root() -> Path:
    return Path(os.environ.get("RCR_RUNS_DIR", Path.home() / "rcr-runs")).expanduser().resolve()


def default_tracking_uri() -> str:
    """The store every entry point uses unless told otherwise: ``<runs dir>/mlflow.db`` (the local cluster's MLflow
    server serves the same one; pipeline/analysis/mlflow_store.py)."""
    return f"sqlite:///{default_runs_root() / 'mlflow.db'}"
