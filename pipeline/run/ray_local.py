"""The project's own Ray temp directory, and the record of the Ray sessions the project starts in it.

A plain ``python jobs/...`` starts a private Ray (``pipeline/run/driver.py``) whose session (logs, sockets, spilled
objects) goes under :func:`ray_temp_dir`: ``$RCR_RAY_TMP``, default ``/tmp/rcr-ray-<uid>``, the directory
``infra/local_cluster.sh`` gives its head too; never Ray's shared default ``/tmp/ray``. Each session directory is
appended to ``<runs dir>/ray-sessions`` (the local cluster appends its head's), and
``infra/local_cluster.sh clean`` removes exactly those sessions and the runs directory: no other session in the
temp directory (another runs directory's, another cluster's), nothing under ``/tmp/ray``.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.run.config import default_runs_root

SESSIONS_FILE = "ray-sessions"  # in the runs directory: one session directory per line


def ray_temp_dir() -> str:
    """Short on purpose: Ray's unix socket paths under it must stay under 108 bytes."""
    return os.environ.get("RCR_RAY_TMP") or f"/tmp/rcr-ray-{os.getuid()}"


def record_session(session_dir: str) -> None:
    """Append ``session_dir`` to the runs directory's list of the Ray sessions the project started."""
    runs = default_runs_root()
    runs.mkdir(parents=True, exist_ok=True)
    with open(runs / SESSIONS_FILE, "a") as f:
        f.write(f"{Path(session_dir).resolve()}\n")
