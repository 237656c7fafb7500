"""`python jobs/diagnose.py` as a user runs it: the pipeline's Ray job on the embedded model, then the per-layer
probes, one table, the Parquet tables and one MLflow run."""

from __future__ import annotations

import os
import subprocess

import pandas as pd
import pytest

from pipeline import quiet
from pipeline.data.synthetic import HELDOUT_SEED
from tests.pipeline_helpers import PY, REPO, synthetic_records, write_shard

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


def test_the_premise_check_runs_on_the_embedded_model(tmp_path):
    shard = write_shard(tmp_path / "shards" / "part-0.parquet", synthetic_records("detailcaps", 3, HELDOUT_SEED))
    out = tmp_path / "out"
    env = dict(os.environ, RCR_RUNS_DIR=str(tmp_path / "runs"), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run([PY, "jobs/diagnose.py", "--shards", str(shard), "--max-new-tokens", "48", "--probe-samples",
                        "1", "--output-dir", str(out), "--mlflow-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=840)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert quiet.RAY_ACTOR_RESTART_NOTICE not in r.stderr  # Ray's per-actor notice stays in Ray's logs
    assert "Loading weights" not in r.stdout + r.stderr  # the probes' model load has no progress bar
    table = r.stdout[r.stdout.index("premise check: embedded, detailcaps, 3 samples"):]
    for line in ("top prefix position unchanged", "exact - bacon (fidelity)", "fixed refresh, low / high",
                 "layer 3: detector recall per KV head", "layer 3: image share",
                 "image share, low / mid / high drift tercile"):
        assert line in table, table
    assert "layer 0:" not in table  # the shipped model's sliding-window layer is never re-selected
    figures = pd.read_parquet(out / "_diagnose" / "figures.parquet")
    assert set(figures["key"].dropna()) >= {"dwell", "exact_minus_bacon", "fixed_refresh_low", "image_share_layer1",
                                               "image_share_tercile_low"}
    assert (out / "_diagnose" / "premises.png").stat().st_size > 0
    assert "MLflow run " in r.stdout
