"""A job's own output is quiet and truthful: only the project's lines (no Ray or Ray Data INFO/SUCC/WARNING
records, no ANSI codes, no actor-restart notice, no memory warning, no CUDA_HOME probe line, no Python warnings),
one progress display, and at the end where the results are. Both ways a job runs: submitted to a local head as
infra/quickstart.sh submits (infra/submit.py), and a plain `python jobs/detailcaps.py` with its private Ray
(`--help`: tests/pipeline/test_job_help.py)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.pipeline_helpers import PY, REPO, noise_lines, synthetic_records, write_shard
from tests.ray_head import LocalRayHead, free_port

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


def _job_lines(stdout: str) -> list[str]:
    """The job's log from its first line on."""
    job = stdout.splitlines()
    return job[next(i for i, ln in enumerate(job) if ln.startswith("[rcr-job] job ")):]


def test_submitted_job_output_is_quiet(tmp_path):
    """The quickstart's path: infra/submit.py to a local head (private ports, like the other Ray tests)."""
    shards = tmp_path / "shards"
    write_shard(shards / "part-0.parquet", synthetic_records("detailcaps", 2))
    out_dir = tmp_path / "out"
    head = LocalRayHead(tmp_path / "head", num_cpus=2)
    (tmp_path / "head").mkdir()
    head.start()
    try:
        r = head.submit(["jobs/detailcaps.py", "--shards", str(shards), "--methods", "full,bacon",
                         "--max-new-tokens", "8", "--output-dir", str(out_dir),
                         "--mlflow-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--progress-every-s", "2"])
    finally:
        head.stop()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert noise_lines(out) == {}
    assert r.stdout.startswith("[rcr-job] ")  # the job's first line is the first line: no CLI banner or preamble
    # the packaging of the working directory: no notice per packaged file or directory
    assert not re.search(r"Ignoring upload|ignored by default|packaging\.py|Uploading package", out)
    job = _job_lines(r.stdout)
    chatter = [ln for ln in job if re.search(r"logging_progress|Running Dataset|Loading weights", ln)]
    assert not chatter, "\n".join(chatter)
    progress = [ln for ln in job if ln.startswith("[rcr-job] progress: ")]
    assert progress and progress[-1].startswith("[rcr-job] progress: 4/4 rows, 2/2 samples")
    assert any(ln.startswith(f"[rcr-job] Parquet: {out_dir}") for ln in job)


def test_plain_python_job_output_is_quiet_and_cleaned_up(tmp_path):
    """`python jobs/detailcaps.py` with its private Ray in the project's temp dir, on the real core (the actor
    builds or loads the fused kernels: no CUDA probe line); then `local_cluster.sh clean` removes its session and
    the runs directory."""
    shards = write_shard(tmp_path / "shards" / "s.parquet", synthetic_records("detailcaps", 2))
    runs, ray_tmp = tmp_path / "runs", f"/tmp/rcrj{os.getpid()}_{free_port()}"
    db = runs / "mlflow.db"
    env = dict(os.environ, RCR_RUNS_DIR=str(runs), RCR_RAY_TMP=ray_tmp, PYTHONPATH=str(REPO),
               PATH=f"{os.path.dirname(PY)}:{os.environ.get('PATH', '')}")
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([PY, "jobs/detailcaps.py", "--shards", str(shards.parent), "--methods", "full,bacon,rcr",
                        "--max-new-tokens", "8", "--mlflow-uri", f"sqlite:///{db}", "--progress-every-s", "2"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=800, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert noise_lines(out) == {}
    job = _job_lines(r.stdout)
    assert job[-1] == f"[rcr-job] MLflow runs: sqlite:///{db}  (store: {db})"
    assert any(ln.startswith("[mlflow] UI, this job's runs by fidelity: http://127.0.0.1:5000/#/experiments/")
               for ln in job)
    sessions = (runs / "ray-sessions").read_text().split()
    assert len(sessions) == 1 and sessions[0].startswith(f"{ray_tmp}/session_")
    # (the fused kernels' builds, which clean also removes, stay for the other tests: an extension cache of its own)
    c = subprocess.run(["bash", str(REPO / "infra" / "local_cluster.sh"), "clean"],
                       env=dict(env, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext")), capture_output=True, text=True,
                       timeout=120, check=False)
    assert c.returncode == 0, c.stdout + c.stderr
    assert not runs.exists() and not os.path.exists(ray_tmp), c.stdout
