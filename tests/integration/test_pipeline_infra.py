"""infra/: the KubeRay RayJob names the real entry points with valid flags; the local-cluster script works;
the job entry points fail on a bad config before any model work, naming the field."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.run.cli import job_config
from pipeline.run.config import JobConfig
from tests.pipeline_helpers import PY, REPO, noise_lines, synthetic_records, write_shard
from tests.ray_head import free_port

RAYJOB = REPO / "infra" / "kuberay-rayjob.yaml"
JOBS = ("detailcaps", "textcaps", "video")


def _validate_command(cmd: str) -> JobConfig:
    argv = shlex.split(cmd)
    assert argv[0] == "python", cmd
    script = argv[1]
    assert (REPO / script).is_file(), f"{script} is not an entry point in this repository"
    task = Path(script).stem
    assert task in JOBS, script
    return job_config(argv[2:], task=task)  # the job's own validation, as on the cluster


def test_kuberay_rayjob_is_valid_and_names_the_entry_points():
    doc = yaml.safe_load(RAYJOB.read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob"
    spec = doc["spec"]
    cfg = _validate_command(spec["entrypoint"])
    assert cfg.model == "Qwen/Qwen2-VL-7B-Instruct" and cfg.output_dir.startswith("/data/")
    assert cfg.mlflow_uri.startswith("sqlite:////data/")
    cluster = spec["rayClusterSpec"]
    assert cluster["authOptions"]["mode"] == "token"
    assert tuple(int(x) for x in cluster["rayVersion"].split(".")) >= (2, 52, 0)  # token auth needs >= 2.52
    workers = cluster["workerGroupSpecs"]
    assert workers and all(
        c["resources"]["limits"].get("nvidia.com/gpu") == "1"
        for w in workers for c in w["template"]["spec"]["containers"])
    assert all(w["rayStartParams"]["num-gpus"] == "1" for w in workers)
    assert yaml.safe_load(spec["runtimeEnvYAML"])["working_dir"]
    # the commented alternatives name the other entry points and models, with valid flags too
    text = RAYJOB.read_text()
    alts = re.findall(r"#\s+(python jobs/\w+\.py[^\n]*)\n\s*#\s+(--[^\n]*)", text)
    assert {Path(shlex.split(a)[1]).stem for a, _ in alts} == {"textcaps", "video"}
    models = {_validate_command(f"{a} {b}").model for a, b in alts}
    assert models == {"llava-hf/llava-v1.6-mistral-7b-hf", "Qwen/Qwen3-VL-8B-Instruct"}


def test_scripts_parse():
    for s in ("local_cluster.sh", "quickstart.sh", "mlflow_server.sh"):
        r = subprocess.run(["bash", "-n", str(REPO / "infra" / s)], check=False, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def _job(args, **kw):
    return subprocess.run([PY, *args], check=False, cwd=REPO, capture_output=True, text=True, **kw)


@pytest.mark.parametrize("flags, field", [
    (["--methods", "full,warp_drive"], "methods"),
    (["--model", "acme/text only llm"], "model"),  # not a Hub id; a well-formed one: tests/pipeline/test_preflight.py
    (["--max-new-tokens", "100000"], "max_new_tokens"),
    (["--num-actors", "0"], "num_actors"),
])
def test_bad_config_fails_before_model_work(flags, field, tmp_path):
    r, work = _job_watched(["jobs/detailcaps.py", *flags, "--output-dir", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"field '{field}'" in r.stderr
    assert not (tmp_path / "out").exists()
    assert work == {"ray_imported": False, "model_loads": 0}, work
    assert "[rcr-job] job " not in r.stdout  # the driver's first line: run() never started


# Runs a job script like `python jobs/x.py`, counting the model work it starts: calls of the model loader
# (rcr.models.load, which every engine uses) and whether Ray was imported (actors, Ray Data); written at exit.
_WATCH = """
import atexit, json, runpy, sys
import rcr.models
mark, script = sys.argv[1], sys.argv[2]
loads = []
real_load = rcr.models.load
def load(*a, **kw):
    loads.append(1)
    return real_load(*a, **kw)
rcr.models.load = load
atexit.register(lambda: open(mark, "w").write(json.dumps(
    {"ray_imported": "ray" in sys.modules, "model_loads": len(loads)})))
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def _job_watched(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    import json

    mark = tmp_path / "model-work.json"
    r = _job(["-c", _WATCH, str(mark), *args])
    assert mark.is_file(), r.stdout + r.stderr  # the watch ran to the end of the job
    return r, json.loads(mark.read_text())


def test_wrong_shard_schema_fails_before_model_work(tmp_path):
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"sample_id": ["a"], "prompt": ["p"], "image": [b"x"]}), bad)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2_vl"}')
    r = _job(["jobs/textcaps.py", "--model", str(model), "--shards", str(bad), "--output-dir", str(tmp_path / "out")])
    assert r.returncode == 2 and "field 'shards'" in r.stderr and "column 'task' is missing" in r.stderr, r.stderr
    good = write_shard(tmp_path / "ok" / "s.parquet", synthetic_records("textcaps", 1))
    r = _job(["jobs/textcaps.py", "--model", str(model), "--shards", str(good), "--methods", "full,bogus"])
    assert r.returncode == 2 and "unknown method 'bogus'" in r.stderr


@pytest.mark.parametrize("column, bad_type, want", [
    ("images", pa.binary(), "column 'images' has type binary"),
    ("references", pa.string(), "column 'references' has type string"),  # references that are not a list
])
def test_wrong_column_type_in_one_shard_of_several_is_a_preflight_error(tmp_path, column, bad_type, want):
    recs = synthetic_records("textcaps", 6)
    for i in range(3):
        write_shard(tmp_path / "shards" / f"s{i}.parquet", recs[2 * i: 2 * i + 2])
    bad = tmp_path / "shards" / "s1.parquet"
    t = pq.read_table(bad)
    col = t.column(column).to_pylist()
    value = [c[0] if c else None for c in col] if column == "images" else ["; ".join(c) for c in col]
    pq.write_table(t.set_column(t.schema.get_field_index(column), column, pa.array(value, bad_type)), bad)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2_vl"}')
    r, work = _job_watched(["jobs/textcaps.py", "--model", str(model), "--shards", str(tmp_path / "shards"),
                            "--output-dir", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    line = [ln for ln in r.stderr.splitlines() if "field 'shards'" in ln]
    assert line and str(bad) in line[0] and want in line[0], r.stderr
    assert work == {"ray_imported": False, "model_loads": 0}, work
    assert not (tmp_path / "out").exists()


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_quickstart_on_the_local_cluster_then_stop(tmp_path):
    """infra/quickstart.sh (install skipped: this venv) starts Ray + MLflow on 127.0.0.1 via
    infra/local_cluster.sh, submits jobs/detailcaps.py with `ray job submit`, and the job ends with the
    per-method summary and the locations; then `local_cluster.sh stop` stops exactly what it started.

    It runs in a copy of the checkout where the README's lmms-eval task command ran first, and which holds a file
    over Ray's 100 MiB package limit (what that command used to write into the checkout: every submitted job
    then failed with HTTP 413): the job's package carries the project's packages only (.rayignore).

    Meanwhile another process (this one) holds the dashboard agent's default port, 52365, as another Ray on
    the machine would: the cluster takes another port and the main command still succeeds. Every socket the
    cluster listens on is on 127.0.0.1."""
    from tests.pipeline_helpers import tiny_qwen2_vl_dir

    runs = tmp_path / "runs"
    env = _cluster_env(runs)
    env.update(RCR_SKIP_INSTALL="1", RCR_NUM_CPUS="2")
    checkout = _copy_of_the_checkout(tmp_path / "checkout")
    files = sorted(p for p in checkout.rglob("*") if "__pycache__" not in p.parts)
    r = subprocess.run([PY, "-m", "pipeline.lmms.tasks"], cwd=checkout, env=env, capture_output=True, text=True,
                       timeout=600, check=False)  # as the README writes it
    assert r.returncode == 0, r.stdout + r.stderr
    assert {p.name for p in (runs / "lmms-tasks").glob("*.yaml")} == {"rcr_detailcaps.yaml", "rcr_textcaps.yaml"}
    assert sorted(p for p in checkout.rglob("*") if "__pycache__" not in p.parts) == files  # nothing in the checkout
    big = checkout / "tasks" / "shards" / "detailcaps" / "detailcaps-00000.parquet"
    big.parent.mkdir(parents=True)
    big.write_bytes(os.urandom(110 * 2**20))  # incompressible: a package with it passes the limit
    blocker = _hold_port(52365)  # None if another process holds it already: held either way
    shards = write_shard(tmp_path / "shards" / "s.parquet", synthetic_records("detailcaps", 2))
    model = str(tiny_qwen2_vl_dir(tmp_path))
    out = runs / "quick"
    state = runs / "local-cluster"
    script = str(checkout / "infra" / "local_cluster.sh")
    pids = []
    try:
        r = subprocess.run(["bash", str(checkout / "infra" / "quickstart.sh"), "--model", model, "--shards",
                            str(shards), "--methods", "full,bacon,rcr", "--max-new-tokens", "3", "--output-dir",
                            str(out)], cwd=checkout, env=env, capture_output=True, text=True, timeout=800, check=False)
        pids = [int((state / f).read_text()) for f in ("ray.pid", "mlflow.pid") if (state / f).is_file()]
        log = r.stdout + r.stderr
        assert r.returncode == 0, log[-6000:]
        assert "RAY_AUTH_MODE=token" in (state / "env").read_text()
        assert "[quickstart] submitting:" in log and "[rcr-job] progress:" in log and "fidelity" in log
        assert noise_lines(log) == {}  # only the project's lines: tests/integration/test_job_output.py
        mlflow_url = f"http://127.0.0.1:{env['RCR_MLFLOW_PORT']}"
        assert f"Parquet: {out}" in log and f"MLflow runs: {mlflow_url}" in log
        # a tracking server is its own UI: the job's URLs once, not MLflow's two lines per run; then the store
        assert f"[mlflow] UI, this job's runs by fidelity: {mlflow_url}/#/experiments/" in log and "View run" not in log
        assert f"[quickstart] done. MLflow store: {runs / 'mlflow.db'}" in log
        import pandas as pd

        df = pd.read_parquet(out)
        assert len(df) == 2 * 3 and df["error"].isna().all()
        socks = _listening(_cluster_pids(env["RCR_RAY_TMP"], pids))
        assert any(port == int(env["RCR_DASHBOARD_PORT"]) for _, port, _ in socks), socks
        assert any(port == int(env["RCR_MLFLOW_PORT"]) for _, port, _ in socks), socks
        exposed = [s for s in socks if s[0] not in LOOPBACK]
        assert not exposed, f"the cluster listens on non-loopback addresses: {exposed}"
        assert not any(port == 52365 for _, port, _ in socks)
    finally:
        if blocker is not None:
            blocker.close()
        r = subprocess.run(["bash", script, "stop"], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert pids, "local_cluster.sh wrote no pid files"
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    left = []  # nothing of that cluster survives (its processes all name its private temp dir)
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and env["RCR_RAY_TMP"].encode() in (p / "cmdline").read_bytes():
                left.append(int(p.name))
        except OSError:
            pass
    assert not left, f"processes of the stopped cluster still run: {left}"
    # its head's session was listed; `clean` removes it with the runs directory (and the temp dir, now empty)
    sessions = (runs / "ray-sessions").read_text().split()
    assert len(sessions) == 1 and Path(sessions[0]).parent == Path(env["RCR_RAY_TMP"]), sessions
    # (the kernels' builds this machine's other tests use stay: clean looks in an extension cache of its own here)
    r = subprocess.run(["bash", script, "clean"], check=False, capture_output=True, text=True, timeout=120,
                       env=dict(env, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext")))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not runs.exists() and not Path(env["RCR_RAY_TMP"]).exists(), r.stdout
    assert re.search(rf"removed the runs directory \(.*\) {re.escape(str(runs))} \(\d+(\.\d)? MB\)", r.stdout), r.stdout


def _copy_of_the_checkout(dest: Path) -> Path:
    """The checkout's files as git sees them (tracked, and untracked ones not ignored), without .git."""
    names = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, names):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


LOOPBACK = ("127.0.0.1", "::ffff:127.0.0.1", "::1")


def test_a_plain_python_job_listens_on_loopback_only(tmp_path):
    """`python jobs/detailcaps.py` with no cluster starts a private Ray in-process: its GCS, raylet, workers and
    the driver itself listen on 127.0.0.1 only. Checked while the job is known to be running: its engine waits
    on a gate file (files, not time), and the job then finishes normally."""
    from tests.pipeline_helpers import fake_model_dir

    shards = write_shard(tmp_path / "shards" / "s.parquet", synthetic_records("detailcaps", 2))
    out, gate = tmp_path / "out", tmp_path / "gate"
    ray_tmp = f"/tmp/rcrl{os.getpid()}_{free_port()}"  # short: Ray's socket paths have a length limit
    env = dict(os.environ, RCR_TEST_GATE=str(gate), RCR_RAY_TMP=ray_tmp, RCR_RUNS_DIR=str(tmp_path / "runs"),
               PYTHONPATH=str(REPO))
    for k in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(k, None)
    job = subprocess.Popen(
        [PY, "jobs/detailcaps.py", "--model", str(fake_model_dir(tmp_path)), "--shards", str(shards.parent),
         "--methods", "full,bacon", "--output-dir", str(out), "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}",
         "--engine", "tests.pipeline_helpers:GatedFakeEngine", "--no-summary", "--num-actors", "1"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        while not Path(f"{gate}.waiting").exists():  # the actor is up and inside the engine
            assert job.poll() is None, job.stdout.read()[-4000:]
            time.sleep(0.2)
        socks = _listening(_cluster_pids(ray_tmp, [job.pid]))
        assert any(pid == job.pid for _, _, pid in socks) and len({pid for _, _, pid in socks}) >= 3, socks
        exposed = [s for s in socks if s[0] not in LOOPBACK]
        assert not exposed, f"the job's private Ray listens on non-loopback addresses: {exposed}"
        gate.touch()
        log, _ = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert job.returncode == 0, log[-4000:]
    assert len(pq.read_table(out)) == 2 * 2
    # its session went to the project's temp dir, and is listed for `local_cluster.sh clean`
    sessions = (tmp_path / "runs" / "ray-sessions").read_text().split()
    assert len(sessions) == 1 and Path(sessions[0]).parent == Path(ray_tmp)


def _cluster_env(runs: Path) -> dict:
    env = dict(os.environ, RCR_RUNS_DIR=str(runs), RCR_RAY_PORT=str(free_port()),
               RCR_DASHBOARD_PORT=str(free_port()), RCR_MLFLOW_PORT=str(free_port()),
               RCR_RAY_TMP=f"/tmp/rcrq{os.getpid()}_{free_port()}",
               PATH=f"{Path(PY).parent}:{os.environ.get('PATH', '')}")
    env.pop("RAY_ADDRESS", None)
    return env


def _hold_port(port: int):
    """A listening socket on 0.0.0.0:port owned by this test process, or None if the port is taken already."""
    import socket

    s = socket.socket()
    try:
        s.bind(("0.0.0.0", port))
    except OSError:
        s.close()
        return None
    s.listen()
    return s


def _cluster_pids(ray_tmp: str, group_leaders: list[int]) -> set[int]:
    """The cluster's processes: those in the process groups local_cluster.sh started, or naming its temp dir."""
    pids = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if os.getpgid(int(p.name)) in group_leaders or ray_tmp.encode() in (p / "cmdline").read_bytes():
                pids.add(int(p.name))
        except OSError:
            pass
    return pids


def _listening(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket listening in ``pids``, from `ss -ltnpH`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True, timeout=30).stdout
    socks = []
    for line in out.splitlines():
        cols = line.split()
        addr, _, port = cols[3].rpartition(":")
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                socks.append((addr.strip("[]"), int(port), pid))
    return socks


def test_local_cluster_start_names_a_busy_port_and_its_holder_in_one_line(tmp_path):
    """A port set in the environment that another process holds: `start` fails at once, before starting
    anything, with one line naming the port, the variable and the holder's pid."""
    blocker = _hold_port(0)
    port = blocker.getsockname()[1]
    try:
        env = _cluster_env(tmp_path / "runs")
        env["RCR_AGENT_HTTP_PORT"] = str(port)
        r = subprocess.run(["bash", str(REPO / "infra" / "local_cluster.sh"), "start"], env=env, capture_output=True,
                           text=True, timeout=120, check=False)
    finally:
        blocker.close()
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"port {port} (agent_http, set by RCR_AGENT_HTTP_PORT) is in use by pid {os.getpid()} " in lines[0]
    assert "RCR_AGENT_HTTP_PORT to another port" in lines[0]
    assert not (tmp_path / "runs" / "local-cluster" / "ray.pid").exists()  # nothing was started
