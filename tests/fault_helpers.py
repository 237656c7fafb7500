"""Shared by the fault-injection tests (tests/pipeline/test_faults.py in-process, tests/integration/test_faults.py
with subprocesses): a small job on N samples in two shards, and the checks that no row is lost or duplicated."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from pipeline.run import driver
from pipeline.run.cli import job_config
from tests import inline_driver
from tests.pipeline_helpers import PY, REPO, fake_model_dir, synthetic_records, write_shard

METHODS = ["full", "bacon", "rcr"]
N = 8
ENGINE = "tests.pipeline_helpers:FakeEngine"
GATED = "tests.pipeline_helpers:GatedFakeEngine"


def make_job(tmp_path: Path) -> dict:
    """Shards of N samples in two files, a fake model dir, and ``argv(...)``: the job's flags (no task)."""
    recs = synthetic_records("detailcaps", N)
    write_shard(tmp_path / "shards" / "s0.parquet", recs[: N // 2])
    write_shard(tmp_path / "shards" / "s1.parquet", recs[N // 2:])
    out = tmp_path / "out"

    def argv(*extra: str, engine: str = ENGINE, mlflow: str | None = None) -> list[str]:
        return ["--model", str(fake_model_dir(tmp_path)), "--shards", str(tmp_path / "shards"), "--methods",
                ",".join(METHODS), "--output-dir", str(out), "--engine", engine, "--batch-size", "1",
                "--mlflow-uri", mlflow or f"sqlite:///{tmp_path / 'mlflow.db'}", "--progress-every-s", "1000",
                *extra]

    return {"ids": [r["sample_id"] for r in recs], "out": out, "argv": argv, "tmp": tmp_path}


def run_inline(argv: list[str]) -> dict:
    """The driver in this process (tests/inline_driver.py), undoing its patches afterwards."""
    mp = pytest.MonkeyPatch()
    try:
        inline_driver.install(mp.setattr)
        return driver.run(job_config(argv, task="detailcaps"))
    finally:
        mp.undo()


def inline_command(argv: list[str]) -> list[str]:
    """The command line of a detailcaps job run by tests/inline_driver.py in a subprocess (cwd: REPO)."""
    return [PY, "-m", "tests.inline_driver", "detailcaps", *argv]


def subprocess_env(**extra: str) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)


def keys(df: pd.DataFrame) -> list[tuple[str, str]]:
    return list(zip(df["sample_id"], df["method"]))


def assert_exact(out: Path, ids: list[str]) -> pd.DataFrame:
    """Exactly one row per (sample, method): none lost, none duplicated."""
    df = pd.read_parquet(out)
    k = keys(df)
    assert len(k) == len(set(k)), "duplicated (sample_id, method) rows"
    assert set(k) == {(s, m) for s in ids for m in METHODS}, "rows lost"
    return df


def parts(out: Path) -> dict[str, set]:
    """Each visible part file -> its keys (reading each one whole: a corrupt part fails here)."""
    return {p.name: set(keys(pd.read_parquet(p))) for p in sorted(out.glob("part-*.parquet"))}


def mlflow_runs(uri: str) -> tuple[list, list]:
    """(parent runs, child runs) in every experiment of the tracking store at ``uri``."""
    import mlflow

    client = mlflow.MlflowClient(uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id], max_results=1000)]
    parents = [r for r in runs if r.data.tags.get("rcr.role") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    return parents, children


def assert_one_parent_one_child_per_method(uri: str) -> None:
    parents, children = mlflow_runs(uri)
    assert len(parents) == 1, [p.info.run_id for p in parents]
    mine = [c for c in children if c.data.tags["mlflow.parentRunId"] == parents[0].info.run_id]
    assert len(mine) == len(children) == len(METHODS)
    assert sorted(c.data.tags["rcr.method"] for c in mine) == sorted(METHODS)


def backfill(out: Path, uri: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "jobs/backfill_mlflow.py", "--output-dir", str(out), "--tracking-uri", uri,
                           "--bootstrap-resamples", "200", "--no-summary"], cwd=REPO, capture_output=True, text=True,
                          env=subprocess_env(), check=False)
