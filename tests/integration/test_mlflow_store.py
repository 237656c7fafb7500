"""One MLflow store for every entry point, in each order (docs/cluster.md, "The MLflow store").

Each test uses a runs directory of its own as the default store (`RCR_RUNS_DIR`, or `HOME` where the README's
`mlflow ui` command is run as written) and checks, at the end, that every new run's plots can be fetched over HTTP
from the server or `mlflow ui` that serves the store then, and that no run is left RUNNING:

(a) the project's MLflow server first (`infra/mlflow_server.sh`, as `infra/local_cluster.sh` starts it), a job
    through it (as the quickstart's), then plain jobs to the default store while it runs and after it stops;
(b) a plain job first, then the server, and a job through it;
(c) `mlflow ui` exactly as the README gives it, on the stopped store;
(d) a store whose experiment a proxying server made (`mlflow-artifacts:/1`): a plain job logs to it, and the
    README's `mlflow ui` serves both runs' plots.

A job is the driver without Ray (tests/inline_driver.py: the job's config, summary and MLflow logging, the fake
engine), a subprocess like `python jobs/detailcaps.py`. Servers run in their own process groups and are stopped by
them; the tests wait on their /health, never on time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import ViewType

from tests.fault_helpers import ENGINE, METHODS, inline_command, subprocess_env
from tests.pipeline_helpers import PY, REPO, fake_model_dir, synthetic_records, write_shard
from tests.ray_head import free_port

pytestmark = pytest.mark.timeout(900)

MLFLOW = str(Path(PY).parent / "mlflow")
PLOT = "plots/fidelity_ci.png"


class Served:
    """A server on 127.0.0.1 in its own process group; ``base`` is its address."""

    def __init__(self, argv: list[str], env: dict, log: Path, port: int):
        self.base, self.log = f"http://127.0.0.1:{port}", log
        self.fh = open(log, "w")  # noqa: SIM115 - the server writes to it until stop()
        self.proc = subprocess.Popen(argv, env=env, cwd=log.parent, stdout=self.fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        while True:  # until it answers (pytest-timeout bounds a server that never does)
            assert self.proc.poll() is None, f"the server exited:\n{log.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"{self.base}/health", timeout=5).close()
                return
            except OSError:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=0.5)  # between tries; returns at once if the server exits

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"{self.base}{path}", timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.fh.close()


def project_server(runs: Path, tmp: Path, env: dict) -> Served:
    """`infra/mlflow_server.sh`: the server `infra/local_cluster.sh start` runs (the quickstart's)."""
    port = free_port()
    return Served(["bash", str(REPO / "infra" / "mlflow_server.sh"), str(runs), str(port)], env,
                  tmp / f"server-{port}.log", port)


def readme_ui_command() -> str:
    """The README's `mlflow ui` command for a stopped store, as written there, its continuation lines joined."""
    text = (REPO / "README.md").read_text()
    cmds = {" ".join(m.split()) for m in re.findall(r"^(mlflow ui .*?(?:\\\n.*?)?)$", text, re.M)}
    assert len(cmds) == 1, cmds  # one command, given the same way wherever the README gives it
    return cmds.pop().replace("\\ ", "")


def readme_mlflow_ui(env: dict, tmp: Path) -> Served:
    """The README's `mlflow ui` command, served (its port made free)."""
    port = free_port()
    cmd = readme_ui_command().replace("--port 5000", f"--port {port}")
    assert "--port 5000" not in cmd and f"--port {port}" in cmd
    return Served(["bash", "-c", f"exec {cmd}"], env, tmp / f"ui-{port}.log", port)


def job_env(**extra: str) -> dict:
    """The environment of the jobs and servers: this venv on PATH, no store named but by ``extra``."""
    env = subprocess_env()
    env["PATH"] = f"{Path(PY).parent}:{env.get('PATH', '')}"
    for k in ("MLFLOW_TRACKING_URI", "RCR_RUNS_DIR"):
        env.pop(k, None)
    return {**env, **extra}


def run_job(tmp: Path, name: str, env: dict, mlflow: str | None = None) -> tuple[str, str]:
    """A small detailcaps job (2 samples x METHODS) into output dir ``name``: (its MLflow parent run id, its
    output)."""
    shards = tmp / "shards"
    if not shards.is_dir():
        write_shard(shards / "s.parquet", synthetic_records("detailcaps", 2))
    argv = ["--model", str(fake_model_dir(tmp)), "--shards", str(shards), "--methods", ",".join(METHODS),
            "--output-dir", str(tmp / name), "--engine", ENGINE, "--job-name", name, "--progress-every-s", "1000"]
    if mlflow:
        argv += ["--mlflow-uri", mlflow]
    r = subprocess.run(inline_command(argv), cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    ids = re.findall(rf"\[mlflow\] logged job '{name}' to \S+, experiment '\S+': parent run (\w+)", r.stdout)
    assert len(ids) == 1, r.stdout[-3000:]
    return ids[0], r.stdout


def assert_plots_served(server: Served, run_ids: list[str]) -> None:
    """Each run's plot downloads, and the Artifacts tab's listing (the UI's own API) names it."""
    for rid in run_ids:
        status, body = server.get(f"/get-artifact?path={PLOT}&run_uuid={rid}")
        assert status == 200 and body[:4] == b"\x89PNG", (rid, status, body[:300])
        status, body = server.get(f"/ajax-api/2.0/mlflow/artifacts/list?run_id={rid}&path=plots")
        assert status == 200 and PLOT in {f["path"] for f in json.loads(body).get("files", [])}, body[:500]


def assert_none_running(db: Path, parents: list[str]) -> None:
    """Every run in the store, deleted ones included, has ended; the given parents FINISHED and complete."""
    c = MlflowClient(f"sqlite:///{db}")
    runs = [r for e in c.search_experiments(view_type=ViewType.ALL)
            for r in c.search_runs([e.experiment_id], run_view_type=ViewType.ALL, max_results=1000)]
    assert runs and not [r.info.run_id for r in runs if r.info.status == "RUNNING"]
    for pid in parents:
        r = c.get_run(pid)
        assert r.info.status == "FINISHED" and r.data.tags["rcr.complete"] == "1", pid


def assert_ui_serves_then_none_running(ui: Served, db: Path, parents: list[str]) -> None:
    """``ui`` serves every parent's plots; once it is stopped, every run in the store has ended."""
    try:
        assert_plots_served(ui, parents)
    finally:
        ui.stop()
    assert_none_running(db, parents)


def test_server_first_then_plain_jobs_with_it_up_and_after_it_stops(tmp_path):
    """(a) The project's server makes the store and the experiment (a job through it, as the quickstart's); plain
    jobs then log to the default store, the same database, while it runs and after it stops: the server serves the
    first plain job's plots, and `mlflow ui` all three jobs' once it is stopped."""
    runs = tmp_path / "runs"
    env = job_env(RCR_RUNS_DIR=str(runs))
    server = project_server(runs, tmp_path, env)
    try:
        quick, _ = run_job(tmp_path, "quick", env, mlflow=server.base)
        up, _ = run_job(tmp_path, "plain-up", env)  # no --mlflow-uri: the default store
        assert_plots_served(server, [quick, up])
    finally:
        server.stop()
    down, log = run_job(tmp_path, "plain-down", env)
    # the command the job prints for browsing its store
    (cmd,) = re.findall(r"^\[mlflow\] to browse the store, run: (mlflow ui .*)$", log, re.M)
    port = free_port()
    ui = Served(["bash", "-c", "exec " + cmd.replace("--port 5000", f"--port {port}")], env, tmp_path / "ui.log", port)
    assert_ui_serves_then_none_running(ui, runs / "mlflow.db", [quick, up, down])
    exp = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}").get_experiment_by_name("rcr-eval")
    assert exp.artifact_location == f"file://{runs / 'mlartifacts'}/{exp.experiment_id}"  # the server's root


def test_plain_job_first_then_the_server_and_the_ui(tmp_path):
    """(b) A plain job makes the store; the project's server then serves its plots, and a job through the server
    logs to the same experiment."""
    runs = tmp_path / "runs"
    env = job_env(RCR_RUNS_DIR=str(runs))
    first, _ = run_job(tmp_path, "plain-first", env)
    server = project_server(runs, tmp_path, env)
    try:
        assert_plots_served(server, [first])
        through, _ = run_job(tmp_path, "through-server", env, mlflow=server.base)
        assert_plots_served(server, [first, through])
        status, page = server.get("/")
        assert status == 200 and b"<title>MLflow</title>" in page  # the UI itself
    finally:
        server.stop()
    assert_none_running(runs / "mlflow.db", [first, through])
    exp = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}").get_experiment_by_name("rcr-eval")
    assert exp.artifact_location == (runs / "mlartifacts").as_uri()  # the plain job's: next to the database


def test_readme_mlflow_ui_on_the_stopped_store_serves_the_plots(tmp_path):
    """(c) The default store under an empty HOME (~/rcr-runs): a job through the project's server, then one after it
    stops; the README's `mlflow ui` command, as written, serves both jobs' plots."""
    home = tmp_path / "home"
    runs = home / "rcr-runs"
    env = job_env(HOME=str(home))
    server = project_server(runs, tmp_path, env)
    try:
        quick, _ = run_job(tmp_path, "quick", env, mlflow=server.base)
    finally:
        server.stop()
    plain, _ = run_job(tmp_path, "plain", env)
    ui = readme_mlflow_ui(env, tmp_path)
    assert_ui_serves_then_none_running(ui, runs / "mlflow.db", [quick, plain])


def test_a_store_a_proxying_server_made_takes_plain_jobs_and_the_readme_ui_serves_it(tmp_path):
    """(d) A server that proxies artifacts (no --default-artifact-root) makes the experiment: its location is
    `mlflow-artifacts:/1`, which MLflow's client writes only through that server. After it stops, a plain job logs to
    the store all the same (its plots where that server keeps them, ~/rcr-runs/mlartifacts/1/...), and the README's
    `mlflow ui` serves both jobs' plots."""
    home = tmp_path / "home"
    runs = home / "rcr-runs"
    runs.mkdir(parents=True)
    env = job_env(HOME=str(home))
    port = free_port()
    old = Served([MLFLOW, "server", "--host", "127.0.0.1", "--port", str(port), "--backend-store-uri",
                  f"sqlite:///{runs / 'mlflow.db'}", "--artifacts-destination", str(runs / "mlartifacts"),
                  "--workers", "1"], env, tmp_path / "old-server.log", port)
    try:
        quick, _ = run_job(tmp_path, "quick", env, mlflow=old.base)
    finally:
        old.stop()
    exp = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}").get_experiment_by_name("rcr-eval")
    assert exp.artifact_location.startswith("mlflow-artifacts:")
    plain, _ = run_job(tmp_path, "plain", env)
    assert (runs / "mlartifacts" / exp.experiment_id / plain / "artifacts" / PLOT).is_file()
    ui = readme_mlflow_ui(env, tmp_path)
    assert_ui_serves_then_none_running(ui, runs / "mlflow.db", [quick, plain])


def test_readme_gives_one_mlflow_ui_command():
    """The command test (c) and (d) run is the one the README gives, with the store's artifact directory."""
    argv = shlex.split(readme_ui_command())
    assert argv[argv.index("--backend-store-uri") + 1] == "sqlite:///$HOME/rcr-runs/mlflow.db"
    assert argv[argv.index("--artifacts-destination") + 1] == "$HOME/rcr-runs/mlartifacts"
