"""A model batch may take longer than Ray Data lets a dataset go without output (its no-progress timeout, 30 min
by default): at the published models' sizes on a CPU, one batch of every method does (docs/models.md, "Real
sizes"). The job must wait for it, not fail with ExecutionTimeoutError. Here Ray Data's timeout is lowered to 1 s
(``RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S``, its default's environment variable) and the fake engine holds its
batch at a gate until the driver has printed five more progress lines (one per second): the test waits on the
gate file and the driver's own lines, not on a clock."""

from __future__ import annotations

import os
import subprocess
import threading

import pandas as pd
import pytest

from tests.fault_helpers import GATED
from tests.pipeline_helpers import PY, REPO, fake_model_dir, synthetic_records, write_shard
from tests.ray_head import free_port

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


def test_a_batch_slower_than_ray_datas_no_progress_timeout_finishes(tmp_path):
    shards = write_shard(tmp_path / "shards" / "s.parquet", synthetic_records("detailcaps", 2))
    gate, out = tmp_path / "gate", tmp_path / "out"
    env = dict(os.environ, RCR_RUNS_DIR=str(tmp_path / "runs"), RCR_RAY_TMP=f"/tmp/rcrs{os.getpid()}_{free_port()}",
               PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", RCR_TEST_GATE=str(gate), RCR_TEST_GATE_AFTER="0",
               RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S="1")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [PY, "jobs/detailcaps.py", "--model", str(fake_model_dir(tmp_path)), "--shards", str(shards.parent),
         "--methods", "full,bacon", "--engine", GATED, "--batch-size", "2", "--output-dir", str(out),
         "--mlflow-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--progress-every-s", "1", "--no-summary"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    new_line = threading.Condition()

    def read():
        for ln in proc.stdout:
            with new_line:
                lines.append(ln)
                new_line.notify_all()
        with new_line:
            new_line.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        def wait_until(done) -> None:  # on the driver's lines; fail if it exits first
            with new_line:
                while not done():
                    if proc.poll() is not None and not reader.is_alive():
                        raise AssertionError(f"the job exited ({proc.returncode}) first:\n" + "".join(lines)[-3000:])
                    new_line.wait(timeout=1)

        wait_until(lambda: (tmp_path / "gate.waiting").exists())  # the actor holds its batch
        seen = len(lines)
        wait_until(lambda: sum(ln.startswith("[rcr-job] progress:") for ln in lines[seen:]) >= 5)
        held = [ln for ln in lines[seen:] if ln.startswith("[rcr-job] progress:")]
        # the line says what the wait is for: one batch of the job's samples x methods comes back at once
        assert all("0/4 rows, waiting for the first batch" in ln and "returns up to 2 sample(s) x 2 method(s) at once"
                   in ln for ln in held), held
        gate.touch()
        assert proc.wait(timeout=600) == 0, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    assert not any("ExecutionTimeoutError" in ln for ln in lines)
    assert len(pd.read_parquet(out)) == 4  # 2 samples x 2 methods
