"""End to end through a real local Ray head on 127.0.0.1: `ray job submit --working-dir . -- python jobs/...`.

One head serves the module (started with `ray start --head --block` on private ports and a private token,
stopped by its own pid in the fixture teardown). The tests:

1. N samples x M methods -> exactly N*M rows, no duplicate (sample_id, method), with the real core.
2. An actor is SIGKILLed mid-batch (at a gate after K samples); Ray restarts it and retries its batch;
   still exactly N*M rows.
3. The job is stopped at a gate after K samples (`ray job stop`: SIGTERM): it says in one line how many rows it
   left and marks its run record interrupted; resubmitted, it computes only the missing rows.
4. A shard with one example of each bad input: each bad one becomes error rows, each good one has output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest

from rcr.embedded import model_dir
from tests.pipeline_helpers import (
    REPO,
    bad_input_records,
    fake_model_dir,
    synthetic_records,
    tiny_qwen2_vl_dir,
    write_shard,
)
from tests.ray_head import TESTS_RUNTIME_ENV, LocalRayHead

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

EMBEDDED_MODEL = model_dir()


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    h = LocalRayHead(tmp_path_factory.mktemp("ray-head"), num_cpus=2)
    h.start()
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def real_model(tmp_path_factory) -> str:
    if (EMBEDDED_MODEL / "config.json").is_file():
        return "embedded"
    return str(tiny_qwen2_vl_dir(tmp_path_factory.mktemp("model")))


def _job_args(script: str, out: Path, shards: Path, model: str, methods: str, *extra: str) -> list[str]:
    return [script, "--model", model, "--shards", str(shards), "--methods", methods, "--output-dir", str(out),
            "--mlflow-uri", f"sqlite:///{out.parent / 'mlflow.db'}", "--progress-every-s", "1", *extra]


def _runtime_env(env_vars: dict) -> dict:
    """The runtime environment a raw `ray job submit --no-wait` gets: ``env_vars`` and the tests' code (the working
    directory itself is packaged as .rayignore says, the project's packages only)."""
    return {**TESTS_RUNTIME_ENV, "env_vars": env_vars}


def _keys(df: pd.DataFrame) -> list[tuple[str, str]]:
    return list(zip(df["sample_id"], df["method"]))


def _assert_exact(df: pd.DataFrame, sample_ids: list[str], methods: list[str]) -> None:
    keys = _keys(df)
    assert len(keys) == len(set(keys)), "duplicate (sample_id, method) rows"
    assert set(keys) == {(s, m) for s in sample_ids for m in methods}
    assert len(df) == len(sample_ids) * len(methods)


def _submit_ok(head, args, **kw):
    r = head.submit(args, **kw)
    assert r.returncode == 0, f"ray job submit failed:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_submit_gives_exactly_n_x_m_rows(head, real_model, tmp_path):
    recs = synthetic_records("detailcaps", 3)
    write_shard(tmp_path / "shards" / "s0.parquet", recs)
    out = tmp_path / "out"
    methods = ["full", "bacon", "prefill_oracle", "exact", "fixed", "rcr"]
    log = _submit_ok(head, _job_args("jobs/detailcaps.py", out, tmp_path / "shards", real_model, ",".join(methods),
                                     "--max-new-tokens", "4", "--batch-size", "2", "--num-actors", "2"))
    df = pd.read_parquet(out)
    _assert_exact(df, [r["sample_id"] for r in recs], methods)
    assert df["error"].isna().all(), df["error"].dropna().tolist()
    assert (df["n_steps"] >= 1).all() and df["output_ids"].map(len).eq(df["n_steps"]).all()
    assert df["config_hash"].nunique() == 1 and df["drift"].map(len).eq(df["n_layers"]).all()
    # the job printed progress, the per-method summary and where the results are
    assert "[rcr-job] progress:" in log
    assert "rcr" in log and "fidelity" in log
    assert f"Parquet: {out}" in log and "MLflow runs: sqlite:///" in log
    assert (tmp_path / "mlflow.db").is_file()


def test_actor_killed_mid_job_still_n_x_m(head, tmp_path):
    """The actor is killed at a known point: its engine lets K samples through, then waits on a gate file, so
    the kill lands mid-batch with some parts written, whatever the machine's load. The gate is opened after
    the kill: the restarted actor redoes the interrupted batch and the rest."""
    n, k, methods = 8, 3, ["full", "bacon", "rcr"]
    recs = synthetic_records("textcaps", n)
    write_shard(tmp_path / "shards" / "s0.parquet", recs)
    out = tmp_path / "out"
    gate = tmp_path / "gate"
    sub = f"kill-actor-{uuid.uuid4().hex[:8]}"
    args = _job_args("jobs/textcaps.py", out, tmp_path / "shards", str(fake_model_dir(tmp_path)), ",".join(methods),
                     "--engine", "tests.pipeline_helpers:GatedFakeEngine", "--batch-size", "1", "--num-actors", "1",
                     "--no-summary")
    env = _runtime_env({"RCR_TEST_GATE": str(gate), "RCR_TEST_GATE_AFTER": str(k)})
    r = head.ray_cli("job", "submit", "--address", head.address, "--working-dir", str(REPO), "--no-wait",
                     "--submission-id", sub, "--runtime-env-json", json.dumps(env), "--", "python", *args, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    _wait_at_gate(head, sub, gate, out)
    pids = head.actor_pids("SampleEvaluator")
    assert len(pids) == 1, f"expected the one SampleEvaluator actor, found {pids}"
    os.kill(pids[0], signal.SIGKILL)
    gate.touch()
    assert head.wait_job(sub, timeout=600) == "SUCCEEDED", head.job_logs(sub)[-6000:]
    df = pd.read_parquet(out)
    _assert_exact(df, [r["sample_id"] for r in recs], methods)
    assert df["error"].isna().all()
    assert pids[0] not in head.actor_pids("SampleEvaluator")


def _wait_at_gate(head, sub: str, gate: Path, out: Path, parts: int = 1, stream_s: float = 300) -> None:
    """Until the job's engine waits at ``gate`` and ``parts`` parts are on disk (files, not time); fail with
    the job's log if the job ends first. Once the engine waits, every batch before the gate is finished, and
    the driver must write each one as it arrives (no block held back for the next): parts that do not follow
    within ``stream_s`` never will, since the gate stays shut."""
    waiting = Path(f"{gate}.waiting")
    while not waiting.exists():
        assert head.job_status(sub) in ("PENDING", "RUNNING"), head.job_logs(sub)[-4000:]
        time.sleep(0.5)
    deadline = time.monotonic() + stream_s
    while len(list(out.glob("part-*.parquet"))) < parts:
        assert head.job_status(sub) in ("PENDING", "RUNNING"), head.job_logs(sub)[-4000:]
        assert time.monotonic() < deadline, (
            f"{len(list(out.glob('part-*.parquet')))} of the {parts} finished batches reached the output: the driver "
            "holds finished blocks back")
        time.sleep(0.5)


def test_stopped_job_resumes_only_missing_rows(head, tmp_path):
    """The job is stopped at a known point: the engine lets K samples through, then waits on a gate file
    that is never created, so `ray job stop` lands with 1..K parts written and at least N - K samples left,
    whatever the machine's load."""
    n, k, methods = 8, 3, ["full", "bacon", "rcr"]
    recs = synthetic_records("detailcaps", n)
    write_shard(tmp_path / "shards" / "s0.parquet", recs)
    out = tmp_path / "out"
    gate = tmp_path / "gate"
    args = _job_args("jobs/detailcaps.py", out, tmp_path / "shards", str(fake_model_dir(tmp_path)), ",".join(methods),
                     "--engine", "tests.pipeline_helpers:GatedFakeEngine", "--batch-size", "1", "--num-actors", "1",
                     "--no-summary")
    sub = f"stop-job-{uuid.uuid4().hex[:8]}"
    env = _runtime_env({"RCR_TEST_GATE": str(gate), "RCR_TEST_GATE_AFTER": str(k)})
    r = head.ray_cli("job", "submit", "--address", head.address, "--working-dir", str(REPO), "--no-wait",
                     "--submission-id", sub, "--runtime-env-json", json.dumps(env), "--", "python", *args, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    _wait_at_gate(head, sub, gate, out, parts=k)  # all K finished batches stream out while the 4th waits
    head.ray_cli("job", "stop", "--address", head.address, sub, timeout=120)
    assert head.wait_job(sub, timeout=300) == "STOPPED"
    first_files = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    first = pd.read_parquet(out)
    n_first = first["sample_id"].nunique()
    assert len(first_files) == n_first == k
    assert len(first) == n_first * len(methods) == len(set(_keys(first)))
    k = len(first)
    # `ray job stop` sends SIGTERM: the job says in one line what it left, with no traceback, and its record says so
    stopped_log = head.job_logs(sub)
    said = [ln for ln in stopped_log.splitlines() if "interrupted" in ln]
    assert said == [f"[rcr-job] interrupted: {k} of {n * len(methods)} rows written to {out}; the same command "
                    "resumes"], stopped_log[-4000:]
    assert "Traceback" not in stopped_log and "SIGTERM received" not in stopped_log, stopped_log[-4000:]
    record = json.loads(next((out / "_runs").glob("*.json")).read_text())
    assert record["status"] == "interrupted" and record["error"] == "interrupted by SIGTERM"
    assert not list(out.glob(".tmp-*"))

    log = _submit_ok(head, args)  # the same command again
    assert f"{k} already in the output dir, {n * len(methods) - k} to compute" in log
    df = pd.read_parquet(out)
    _assert_exact(df, [r["sample_id"] for r in recs], methods)
    # the first run's parts are untouched, and the second run's parts hold exactly the missing keys
    assert {p: out.joinpath(p).stat().st_mtime_ns for p in first_files} == first_files
    new_parts = [p for p in out.glob("part-*.parquet") if p.name not in first_files]
    second = pd.concat([pd.read_parquet(p) for p in new_parts])
    assert set(_keys(second)) == set(_keys(df)) - set(_keys(first))
    assert len(second) == n * len(methods) - k


def test_bad_inputs_become_error_rows(head, real_model, tmp_path):
    recs, expect = bad_input_records(synthetic_records("detailcaps", 1)[0])
    write_shard(tmp_path / "shards" / "bad.parquet", recs)
    out = tmp_path / "out"
    methods = ["full", "bacon", "rcr"]
    _submit_ok(head, _job_args("jobs/detailcaps.py", out, tmp_path / "shards", real_model, ",".join(methods),
                               "--max-new-tokens", "3", "--batch-size", "4", "--no-summary"))
    df = pd.read_parquet(out)
    _assert_exact(df, list(expect), methods)
    for sid, err in expect.items():
        rows = df[df["sample_id"] == sid]
        if err is None:
            assert rows["error"].isna().all(), (sid, rows["error"].tolist())
            assert (rows["n_steps"] >= 1).all() and rows["output_ids"].map(len).gt(0).all(), sid
        else:
            assert rows["error"].notna().all() and rows["error"].str.contains(err, regex=False).all(), (
                sid, rows["error"].tolist())
            assert rows["output_text"].isna().all()


def test_a_failed_submitted_job_reports_its_error(head, tmp_path):
    """As the quickstart submits (infra/submit.py): the job's own error line reaches the output, Ray's reason
    follows on stderr, and the exit status is 1."""
    r = head.submit(["jobs/detailcaps.py", "--methods", "full,warp_drive", "--output-dir", str(tmp_path / "out")])
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "config error: field 'methods': unknown method 'warp_drive'" in r.stdout + r.stderr
    assert re.search(r"\[submit\] job \S+ failed: ", r.stderr), r.stderr
