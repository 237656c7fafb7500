"""A job whose model or device fails the pre-flight (pipeline/run/preflight.py) prints one line and exits with
code 2 before Ray starts or anything is written; offline (HF_HUB_OFFLINE=1), on an empty Hub cache."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.pipeline_helpers import PY, REPO, synthetic_records, write_shard


def _job(args: list[str], tmp_path, **env) -> subprocess.CompletedProcess:
    shards = write_shard(tmp_path / "shards" / "s.parquet", synthetic_records("detailcaps", 2))
    e = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), RCR_RUNS_DIR=str(tmp_path / "runs"),
             **env)
    e.pop("RAY_ADDRESS", None)
    return subprocess.run([PY, "jobs/detailcaps.py", "--shards", str(shards), "--output-dir", str(tmp_path / "out"),
                           *args], cwd=REPO, env=e, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("args, env, line", [
    (["--model", "acme/absent-vlm"], {},
     "[rcr-job] --model acme/absent-vlm: not in the local cache and the Hub is unreachable: download it first with "
     "`hf download acme/absent-vlm`, or pass a local directory (HF_HUB_OFFLINE is set)"),
    (["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": ""},
     "[rcr-job] --device cuda but no GPU is visible (CUDA_VISIBLE_DEVICES=''): pass --device cpu, or --device auto "
     "to use a GPU where there is one"),
], ids=["model_not_cached", "no_gpu"])
def test_the_job_prints_one_line_and_exits_2_before_ray(args, env, line, tmp_path):
    (tmp_path / "hub").mkdir()
    r = _job(args, tmp_path, **env)
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 2, out
    assert out == line
    assert not (tmp_path / "out").exists()  # nothing written; the one line above shows nothing else ran
