"""Ctrl-C as a user meets it: SIGINT to a plain `python jobs/detailcaps.py`'s process group (what a terminal sends)
after its first batches. The job prints one line, "interrupted: K of N rows written to <dir>; the same command
resumes", no traceback, exits 130, marks its run record interrupted and leaves no temporary; the same command then
computes only the missing rows. SIGTERM, what `ray job stop` sends, is tested through a real head in
tests/integration/test_ray_job.py (test_stopped_job_resumes_only_missing_rows).

The job's engine lets K batches through, then waits on a gate file (``GatedFakeEngine``), so the signal lands at a
known point; the test waits on files, never on time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pandas as pd
import pytest

from tests.pipeline_helpers import PY, REPO, fake_model_dir, synthetic_records, write_shard

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

METHODS = ["full", "bacon", "rcr"]


def test_ctrl_c_ends_a_plain_job_in_one_line_and_the_same_command_resumes(tmp_path):
    n, k = 5, 2
    recs = synthetic_records("detailcaps", n)
    write_shard(tmp_path / "shards" / "s0.parquet", recs)
    out, gate = tmp_path / "out", tmp_path / "gate"
    argv = [PY, "jobs/detailcaps.py", "--model", str(fake_model_dir(tmp_path)), "--shards", str(tmp_path / "shards"),
            "--methods", ",".join(METHODS), "--engine", "tests.pipeline_helpers:GatedFakeEngine", "--batch-size", "1",
            "--num-actors", "1", "--output-dir", str(out), "--mlflow-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--progress-every-s", "1000", "--no-summary"]
    env = dict(os.environ, PYTHONPATH=str(REPO), RCR_RUNS_DIR=str(tmp_path / "runs"), RCR_TEST_GATE=str(gate),
               RCR_TEST_GATE_AFTER=str(k))
    job = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)  # its own process group, as a terminal's foreground job
    try:
        while not (os.path.exists(f"{gate}.waiting") and len(list(out.glob("part-*.parquet"))) == k):
            assert job.poll() is None, job.stdout.read()[-4000:]
            time.sleep(0.2)
        os.killpg(job.pid, signal.SIGINT)
        log, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 130, log[-4000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-4000:]
    done = len(pd.read_parquet(out))
    assert done == k * len(METHODS)
    said = [ln for ln in log.splitlines() if "interrupted" in ln]
    assert said == [f"[rcr-job] interrupted: {done} of {n * len(METHODS)} rows written to {out}; the same command "
                    "resumes"], log[-4000:]
    record = json.loads(next((out / "_runs").glob("*.json")).read_text())
    assert record["status"] == "interrupted" and record["error"] == "interrupted by SIGINT"
    assert record["n_written"] == done and record["n_missing"] == n * len(METHODS) - done
    assert not list(out.glob(".tmp-*"))

    gate.touch()
    again = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert f"{done} already in the output dir, {n * len(METHODS) - done} to compute" in again.stdout
    df = pd.read_parquet(out)
    keys = list(zip(df["sample_id"], df["method"]))
    assert len(keys) == len(set(keys)) == n * len(METHODS)
