"""infra/: the KubeRay RayJob names the real entry points with valid flags; the local-cluster script works;
the job entry points fail on a bad config before any model work, naming the field."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_helpers import PY, REPO, free_port, synthetic_records, write_shard  # noqa: E402

from pipeline.config import JobConfig  # noqa: E402

RAYJOB = REPO / "infra" / "kuberay-rayjob.yaml"
JOBS = ("detailcaps", "textcaps", "video")


def _validate_command(cmd: str) -> JobConfig:
    argv = shlex.split(cmd)
    assert argv[0] == "python", cmd
    script = argv[1]
    assert (REPO / script).is_file(), f"{script} is not an entry point in this repository"
    task = Path(script).stem
    assert task in JOBS, script
    return JobConfig.from_args(argv[2:], task=task)  # the job's own validation, as on the cluster


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
    for s in ("local_cluster.sh", "quickstart.sh"):
        r = subprocess.run(["bash", "-n", str(REPO / "infra" / s)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def _job(args, **kw):
    return subprocess.run([PY, *args], cwd=REPO, capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.parametrize("flags, field", [
    (["--methods", "full,warp_drive"], "methods"),
    (["--model", "acme/text-only-llm"], "model"),
    (["--max-new-tokens", "100000"], "max_new_tokens"),
    (["--num-actors", "0"], "num_actors"),
])
def test_bad_config_fails_before_model_work(flags, field, tmp_path):
    t0 = time.time()
    r = _job(["jobs/detailcaps.py", *flags, "--output-dir", str(tmp_path / "out")])
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"field '{field}'" in r.stderr
    assert not (tmp_path / "out").exists()
    assert "SampleEvaluator" not in r.stdout + r.stderr and time.time() - t0 < 60


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


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_local_cluster_script_start_submit_stop(tmp_path):
    env = dict(os.environ, RCR_RUNS_DIR=str(tmp_path / "runs"), RCR_RAY_PORT=str(free_port()),
               RCR_DASHBOARD_PORT=str(free_port()), RCR_MLFLOW_PORT=str(free_port()), RCR_NUM_CPUS="1",
               PATH=f"{Path(PY).parent}:{os.environ.get('PATH', '')}")
    env.pop("RAY_ADDRESS", None)
    script = str(REPO / "infra" / "local_cluster.sh")
    state = tmp_path / "runs" / "local-cluster"
    try:
        r = subprocess.run(["bash", script, "start"], env=env, capture_output=True, text=True, timeout=400)
        assert r.returncode == 0, r.stdout + r.stderr
        pids = [int((state / f).read_text()) for f in ("ray.pid", "mlflow.pid")]
        envfile = (state / "env").read_text()
        assert "RAY_AUTH_MODE=token" in envfile and f"127.0.0.1:{env['RCR_DASHBOARD_PORT']}" in envfile
        wd = tmp_path / "wd"
        wd.mkdir()
        (wd / "hello.py").write_text("import ray; ray.init(); print('cpus', ray.cluster_resources()['CPU'])\n")
        r = subprocess.run(["bash", "-c", f"source {state / 'env'} && ray job submit --working-dir {wd} -- python hello.py"
                            f" && curl -sf $MLFLOW_TRACKING_URI/health || python -c \"import urllib.request,os;"
                            f"print(urllib.request.urlopen(os.environ['MLFLOW_TRACKING_URI']+'/health').read())\""],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "cpus 1.0" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    finally:
        r = subprocess.run(["bash", script, "stop"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    time.sleep(1)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
