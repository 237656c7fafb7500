"""Fault injection that needs a second process: the driver SIGKILLed mid-write, two jobs started on one
output directory, and the MLflow tracking server killed mid-job. The driver runs without Ray
(tests/inline_driver.py) in a subprocess; faults are injected at known points (a gate file, a hung write)
and the tests wait on files, never on time. Each case checks that no row is lost or duplicated and that the
next run completes the output. In-process faults: tests/pipeline/test_faults.py; actor death and
`ray job stop` through a real Ray head: tests/integration/test_ray_job.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from pipeline.run import driver
from tests.fault_helpers import (
    GATED,
    METHODS,
    N,
    assert_exact,
    assert_one_parent_one_child_per_method,
    backfill,
    inline_command,
    make_job,
    parts,
    run_inline,
    subprocess_env,
)
from tests.pipeline_helpers import PY, REPO
from tests.ray_head import free_port

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def job(tmp_path):
    return make_job(tmp_path)


def _start(argv: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen(inline_command(argv), cwd=REPO, env=subprocess_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    """Wait until ``path`` exists; fail (with the log) if ``proc`` exits first."""
    while not path.exists():
        try:
            proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            continue
        raise AssertionError(f"the job exited ({proc.returncode}) before {path.name}:\n{proc.stdout.read()[-4000:]}")


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def test_driver_sigkilled_mid_write_leaves_no_corrupt_part(job):
    out, sig = job["out"], job["tmp"] / "mid-write"
    proc = _start(job["argv"]("--no-summary"), RCR_TEST_HANG_AT_PART="4", RCR_TEST_SIGNAL=str(sig))
    try:
        _wait_for(sig, proc)  # the 4th part is half written
        assert len(list(out.glob(".tmp-*"))) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        said = proc.stdout.read()  # to its end: the stderr filter, which says the killed driver's line, exits last
    finally:
        _kill(proc)
    assert f"[rcr-job] the job's driver (pid {proc.pid}) ended without a word" in said, said[-3000:]
    first = parts(out)  # every visible part reads back whole
    assert len(first) == 3
    done = set().union(*first.values())
    assert len(done) == 3 * len(METHODS)

    rep = run_inline(job["argv"]("--no-summary"))  # the killed driver's lock died with it
    assert rep["status"] == "ok" and rep["n_existing"] == len(done)
    assert rep["n_written"] == N * len(METHODS) - len(done)
    assert not list(out.glob(".tmp-*")), "the killed writer's temporary was not cleaned up"
    df = assert_exact(out, job["ids"])
    assert df["error"].isna().all()


def test_second_job_on_the_same_output_dir_is_refused(job):
    out, gate = job["out"], job["tmp"] / "gate"
    first = _start(job["argv"]("--no-summary", engine=GATED), RCR_TEST_GATE=str(gate), RCR_TEST_GATE_AFTER="2")
    try:
        _wait_for(Path(f"{gate}.waiting"), first)  # the first job holds the lock, mid-run
        second = subprocess.run(inline_command(job["argv"]("--no-summary", engine=GATED)), cwd=REPO,
                                env=subprocess_env(), capture_output=True, text=True, check=False)
        assert second.returncode == 2, second.stdout + second.stderr
        msg = [ln for ln in second.stderr.splitlines() if "in use by another job" in ln]
        assert msg and f"pid {first.pid} " in msg[0] and str(out / "_lock") in msg[0], second.stderr
        assert "field 'output_dir'" in msg[0]
        gate.touch()
        log, _ = first.communicate()
        assert first.returncode == 0, log[-4000:]
    finally:
        _kill(first)
    assert_exact(out, job["ids"])
    assert len(pd.read_parquet(out)) == N * len(METHODS)
    rep = run_inline(job["argv"]("--no-summary", engine=GATED))  # the lock is free; nothing left to do
    assert rep["n_existing"] == N * len(METHODS) and rep["n_written"] == 0


def test_mlflow_server_killed_mid_job_then_backfill(job, tmp_path):
    port, db = free_port(), tmp_path / "server.db"
    uri = f"http://127.0.0.1:{port}"

    def server() -> subprocess.Popen:
        return subprocess.Popen([str(Path(PY).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                                 str(port), "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination",
                                 str(tmp_path / "art"), "--workers", "1"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(p: subprocess.Popen) -> None:
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=5).close()
                return
            except OSError:
                try:
                    p.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    continue
                raise AssertionError("the MLflow server exited") from None

    def stop(p: subprocess.Popen) -> None:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # its own process group: the server and its workers
        p.wait()

    srv = server()
    gate = tmp_path / "gate"
    proc = None
    try:
        wait_up(srv)
        proc = _start(job["argv"](engine=GATED, mlflow=uri), RCR_TEST_GATE=str(gate), RCR_TEST_GATE_AFTER="3")
        _wait_for(Path(f"{gate}.waiting"), proc)  # mid-job: 3 samples done
        stop(srv)
        gate.touch()
        log, _ = proc.communicate()
        assert proc.returncode == driver.MLFLOW_FAILED_EXIT, log[-4000:]
        line = [ln for ln in log.splitlines() if "MLflow logging failed" in ln]
        assert line and "python jobs/backfill_mlflow.py" in line[0] and uri in line[0], log[-3000:]
        assert_exact(job["out"], job["ids"])

        srv = server()  # the server is back, on the same store
        wait_up(srv)
        for _ in range(2):  # a second backfill changes nothing
            r = backfill(job["out"], uri)
            assert r.returncode == 0, r.stdout + r.stderr
            assert_one_parent_one_child_per_method(uri)
    finally:
        _kill(proc)
        stop(srv)
