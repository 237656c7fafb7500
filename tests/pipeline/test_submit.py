"""infra/submit.py's failures, each in one line (the quickstart's way to submit; a job that fails through a real
head: tests/integration/test_ray_job.py). No Ray head here: the job server is a port nothing listens on."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess

from tests.pipeline_helpers import PY, REPO
from tests.ray_head import free_port


def _submit_module():
    spec = importlib.util.spec_from_file_location("submit", REPO / "infra" / "submit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_job_server_that_does_not_answer_is_one_line():
    address = f"http://127.0.0.1:{free_port()}"
    r = subprocess.run([PY, "infra/submit.py", "--address", address, "--", "python", "-c", "print(1)"], cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"[submit] lost the job server at {address} ("), r.stderr
    assert "rerun the same command" in lines[0]


def test_a_job_server_that_goes_away_mid_job_is_one_line(monkeypatch, capsys):
    """The fault soak's `ray stop` while a submitted job started: Ray's log stream ends with RuntimeError('WebSocket
    connection closed unexpectedly ...'); that is the job server lost, in one line, not a traceback."""
    import ray.job_submission

    class Client:  # the job server as the stream sees it: the job's first line, then the socket closes
        def __init__(self, address):
            pass

        def submit_job(self, **kw):
            return "raysubmit_x"

        async def tail_job_logs(self, sid):
            yield "[rcr-job] job detailcaps-embedded: ...\n"
            raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Client)
    address = "http://127.0.0.1:1"
    assert _submit_module().main(["--address", address, "--", "python", "jobs/detailcaps.py"]) == 1
    out, err = capsys.readouterr()
    assert out == "[rcr-job] job detailcaps-embedded: ...\n"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"[submit] lost the job server at {address} (ConnectionError: "
                                                   "WebSocket connection closed"), err


def test_rays_reason_is_its_first_line_without_the_log_it_appends():
    reason = _submit_module().reason
    message = ("Job entrypoint command failed with exit code 130, last available logs (truncated to 20,000 chars):\n"
               "[rcr-job] interrupted: 6 of 36 rows written to /out; the same command resumes\n")
    assert reason(message) == "Job entrypoint command failed with exit code 130"
    assert reason("Job was intentionally stopped.") == "Job was intentionally stopped."
    assert reason(None) == reason("  ") == "no message"


def test_ctrl_c_while_a_job_script_imports_is_one_line():
    """pipeline.run.interrupt.while_starting: what a job script does around its imports (a minute on a busy machine)
    before the job's own handling takes over. The signal is sent from inside the block: no timing."""
    code = ("import os, signal, time\nfrom pipeline.run import interrupt\nwith interrupt.while_starting():\n"
            f"    os.kill(os.getpid(), signal.{signal.SIGINT.name})\n    time.sleep(60)\n")
    r = subprocess.run([PY, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 130 and not r.stderr, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["[rcr-job] interrupted before the job planned its rows: this run wrote nothing; "
                                     "the same command resumes"]
