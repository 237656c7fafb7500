"""Fault injection into the job driver and its output store. Each case checks that no row is lost or
duplicated, and that the next run of the same command completes the output with exactly the missing rows.

The driver runs without Ray here (tests/inline_driver.py: the planned rows go through SampleEvaluator in
the same process), so the suite is fast; everything the faults touch (planning, the lock, the writes, the
resume, MLflow logging) is the driver's own code. Faults are injected at known points and the tests wait
on files, never on time. Actor death and `ray job stop` through a real Ray head are in tests/test_ray_job.py.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import inline_driver
from pipeline_helpers import (
    PY,
    REPO,
    fake_model_dir,
    free_port,
    synthetic_records,
    write_shard,
)

from pipeline import run as R
from pipeline.config import ConfigError, JobConfig

METHODS = ["full", "bacon", "rcr"]
N = 8
ENGINE = "tests.pipeline_helpers:FakeEngine"
GATED = "tests.pipeline_helpers:GatedFakeEngine"


@pytest.fixture
def job(tmp_path):
    """Shards of N samples in two files, a fake model dir, and the job's argv (without the task)."""
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


def _inline(monkeypatch, argv: list[str]) -> dict:
    inline_driver.install(monkeypatch.setattr)
    return R.run(JobConfig.from_args(argv, task="detailcaps"))


def _subprocess(argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
    e = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.Popen([PY, str(REPO / "tests" / "inline_driver.py"), "detailcaps", *argv], cwd=REPO, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _keys(df: pd.DataFrame) -> list[tuple[str, str]]:
    return list(zip(df["sample_id"], df["method"]))


def _assert_exact(out: Path, ids: list[str]) -> pd.DataFrame:
    df = pd.read_parquet(out)
    keys = _keys(df)
    assert len(keys) == len(set(keys)), "duplicated (sample_id, method) rows"
    assert set(keys) == {(s, m) for s in ids for m in METHODS}, "rows lost"
    return df


def _parts(out: Path) -> dict[str, set]:
    return {p.name: set(_keys(pd.read_parquet(p))) for p in sorted(out.glob("part-*.parquet"))}


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    """Wait until ``path`` exists; fail (with the log) if ``proc`` exits first."""
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) before {path.name}:\n{proc.stdout.read()[-4000:]}")
        try:
            proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass


def test_enospc_at_part_write_leaves_whole_parts_and_a_rerun_completes(job, monkeypatch, capsys):
    import pyarrow.parquet as pq_mod

    real, calls = pq_mod.write_table, [0]

    def full_disk(table, where, *a, **kw):  # the third part write runs out of space halfway
        calls[0] += 1
        if calls[0] == 3:
            where.write(b"PAR1" + b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(table, where, *a, **kw)

    monkeypatch.setattr(pq_mod, "write_table", full_disk)
    rep = _inline(monkeypatch, job["argv"]("--no-summary"))
    out = job["out"]
    assert rep["status"] == "failed" and f"in {out}" in rep["error"] and "No space left" in rep["error"]
    assert f"writing the output failed: [Errno {errno.ENOSPC}] cannot write a part file in {out}" in capsys.readouterr().out
    assert not list(out.glob(".tmp-*")), "a partial temporary was left"
    first = _parts(out)
    assert len(first) == 2 and rep["n_written"] == 2 * len(METHODS)  # whole parts only; each reads back
    monkeypatch.setattr(pq_mod, "write_table", real)  # space is back

    rep2 = _inline(monkeypatch, job["argv"]("--no-summary"))
    assert rep2["status"] == "ok" and rep2["n_existing"] == 2 * len(METHODS)
    assert rep2["n_written"] == (N - 2) * len(METHODS)
    _assert_exact(out, job["ids"])
    assert {k: v for k, v in _parts(out).items() if k in first} == first  # the first run's parts untouched


def test_driver_sigkilled_mid_write_leaves_no_corrupt_part(job):
    out, sig = job["out"], job["tmp"] / "mid-write"
    proc = _subprocess(job["argv"]("--no-summary"), env={"RCR_TEST_HANG_AT_PART": "4", "RCR_TEST_SIGNAL": str(sig)})
    try:
        _wait_for(sig, proc)  # the 4th part is half written
        assert len(list(out.glob(".tmp-*"))) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    first = _parts(out)  # every visible part reads back whole
    assert len(first) == 3
    done = set().union(*first.values())
    assert len(done) == 3 * len(METHODS)

    rep = _inline_subprocess_free(job)
    assert rep["status"] == "ok" and rep["n_existing"] == len(done) and rep["n_written"] == N * len(METHODS) - len(done)
    assert not list(out.glob(".tmp-*")), "the killed writer's temporary was not cleaned up"
    df = _assert_exact(out, job["ids"])
    assert df["error"].isna().all()


def _inline_subprocess_free(job) -> dict:
    """The rerun, in this process (the killed driver's lock died with it)."""
    mp = pytest.MonkeyPatch()
    try:
        return _inline(mp, job["argv"]("--no-summary"))
    finally:
        mp.undo()


@pytest.mark.parametrize("damage", ["truncated", "bytes-flipped", "not-parquet"])
def test_corrupt_part_is_named_set_aside_and_only_its_rows_redone(job, monkeypatch, capsys, damage):
    out = job["out"]
    assert _inline(monkeypatch, job["argv"]("--no-summary"))["status"] == "ok"
    parts = _parts(out)
    victim = sorted(parts)[2]
    path = out / victim
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) * 2 // 3])
    elif damage == "bytes-flipped":  # inside the data pages, where only the page checksums can see it
        mid = len(data) // 3
        path.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + 16]) + data[mid + 16:])
    else:
        path.write_bytes(b"this was overwritten by something else")
    capsys.readouterr()

    rep = _inline(monkeypatch, job["argv"]("--no-summary"))
    log = capsys.readouterr().out
    assert f"part file {victim} is corrupt or truncated" in log
    assert (out / "_corrupt" / victim).is_file() and not path.exists()
    assert rep["status"] == "ok" and rep["n_written"] == len(parts[victim])
    assert rep["n_existing"] == N * len(METHODS) - len(parts[victim])
    new = {k: v for k, v in _parts(out).items() if k not in parts}
    assert set().union(*new.values()) == parts[victim]  # exactly the lost rows, nothing else
    _assert_exact(out, job["ids"])


def test_second_job_on_the_same_output_dir_is_refused(job, monkeypatch):
    out, gate = job["out"], job["tmp"] / "gate"
    first = _subprocess(job["argv"]("--no-summary", engine=GATED),
                        env={"RCR_TEST_GATE": str(gate), "RCR_TEST_GATE_AFTER": "2"})
    try:
        _wait_for(Path(f"{gate}.waiting"), first)  # the first job holds the lock, mid-run
        second = subprocess.run([PY, str(REPO / "tests" / "inline_driver.py"), "detailcaps",
                                 *job["argv"]("--no-summary", engine=GATED)], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                                capture_output=True, text=True, timeout=300, check=False)
        assert second.returncode == 2, second.stdout + second.stderr
        msg = [ln for ln in second.stderr.splitlines() if "in use by another job" in ln]
        assert msg and f"pid {first.pid} " in msg[0] and str(out / "_lock") in msg[0], second.stderr
        gate.touch()
        log, _ = first.communicate(timeout=300)
        assert first.returncode == 0, log[-4000:]
    finally:
        if first.poll() is None:
            first.kill()
    _assert_exact(out, job["ids"])
    assert len(pd.read_parquet(out)) == N * len(METHODS)
    rep = _inline(monkeypatch, job["argv"]("--no-summary", engine=GATED))  # the lock is free; nothing left to do
    assert rep["n_existing"] == N * len(METHODS) and rep["n_written"] == 0


def test_lock_is_released_and_held_per_process(tmp_path):
    from pipeline.io import OutputStore

    a, b = OutputStore(tmp_path / "o"), OutputStore(tmp_path / "o")
    a.acquire()
    with pytest.raises(ConfigError, match=f"pid {os.getpid()} .*in use|in use by another job .pid {os.getpid()} "):
        b.acquire()
    a.release()
    b.acquire()  # free again once released
    b.release()


def test_out_of_memory_on_one_sample_errors_only_that_sample(job, monkeypatch):
    recs = synthetic_records("detailcaps", N)
    recs[3]["prompt"] = "OOM " + recs[3]["prompt"]
    for f in (job["tmp"] / "shards").glob("*.parquet"):
        f.unlink()
    write_shard(job["tmp"] / "shards" / "s0.parquet", recs)
    rep = _inline(monkeypatch, job["argv"]("--no-summary", "--batch-size", "4"))
    assert rep["status"] == "ok"
    df = _assert_exact(job["out"], job["ids"])
    bad = df[df["sample_id"] == recs[3]["sample_id"]]
    assert bad["error"].str.contains("model error: OutOfMemoryError: CUDA out of memory").all()
    assert df[df["sample_id"] != recs[3]["sample_id"]]["error"].isna().all()
    assert (df[df["error"].isna()]["n_steps"] > 0).all()
    rep2 = _inline(monkeypatch, job["argv"]("--no-summary", "--batch-size", "4"))
    assert rep2["n_written"] == 0  # error rows are rows: the output is complete


# ---------------------------------------------------------------------- MLflow


def _runs(uri: str):
    import mlflow

    client = mlflow.MlflowClient(uri)
    exps = client.search_experiments()
    runs = [r for e in exps for r in client.search_runs([e.experiment_id], max_results=1000)]
    parents = [r for r in runs if r.data.tags.get("rcr.role") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    return parents, children


def _backfill(out: Path, uri: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "jobs/backfill_mlflow.py", "--output-dir", str(out), "--tracking-uri", uri,
                           "--bootstrap-resamples", "200"], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), check=False)


def _assert_one_parent_one_child_per_method(uri: str) -> None:
    parents, children = _runs(uri)
    assert len(parents) == 1, [p.info.run_id for p in parents]
    mine = [c for c in children if c.data.tags["mlflow.parentRunId"] == parents[0].info.run_id]
    assert len(mine) == len(children) == len(METHODS)
    assert sorted(c.data.tags.get("rcr.method", c.info.run_name) for c in mine) == sorted(METHODS) or \
        sorted(c.info.run_name for c in mine) == sorted(METHODS)


def test_mlflow_server_down_for_the_whole_job(job, monkeypatch, capsys):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    inline_driver.install(monkeypatch.setattr)
    code = R.main("detailcaps", job["argv"](mlflow=down))
    log = capsys.readouterr().out
    assert code == R.MLFLOW_FAILED_EXIT
    line = [ln for ln in log.splitlines() if "MLflow logging failed" in ln]
    assert line and "the Parquet output is complete" in line[0] and "python jobs/backfill_mlflow.py" in line[0]
    assert f"--output-dir {job['out']}" in line[0]
    _assert_exact(job["out"], job["ids"])

    store = f"sqlite:///{job['tmp'] / 'later.db'}"  # where the runs go once tracking is back
    r = _backfill(job["out"], store)
    assert r.returncode == 0, r.stdout + r.stderr
    _assert_one_parent_one_child_per_method(store)


@pytest.mark.timeout(900)
def test_mlflow_server_killed_mid_job_then_backfill(job, tmp_path):
    port, db = free_port(), tmp_path / "server.db"
    uri = f"http://127.0.0.1:{port}"

    def server() -> subprocess.Popen:
        return subprocess.Popen([str(Path(PY).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                                 str(port), "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination",
                                 str(tmp_path / "art"), "--workers", "1"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(p: subprocess.Popen) -> None:
        import urllib.request

        while True:
            assert p.poll() is None, "the MLflow server exited"
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2).close()
                return
            except OSError:
                try:
                    p.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass

    def stop(p: subprocess.Popen) -> None:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # its own process group: the server and its workers
        p.wait(timeout=60)

    srv = server()
    gate = tmp_path / "gate"
    proc = None
    try:
        wait_up(srv)
        proc = _subprocess(job["argv"](engine=GATED, mlflow=uri),
                           env={"RCR_TEST_GATE": str(gate), "RCR_TEST_GATE_AFTER": "3"})
        _wait_for(Path(f"{gate}.waiting"), proc)  # mid-job: 3 samples done
        stop(srv)
        gate.touch()
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == R.MLFLOW_FAILED_EXIT, log[-4000:]
        line = [ln for ln in log.splitlines() if "MLflow logging failed" in ln]
        assert line and "python jobs/backfill_mlflow.py" in line[0] and uri in line[0], log[-3000:]
        _assert_exact(job["out"], job["ids"])

        srv = server()  # the server is back, on the same store
        wait_up(srv)
        for _ in range(2):  # a second backfill changes nothing
            r = _backfill(job["out"], uri)
            assert r.returncode == 0, r.stdout + r.stderr
            _assert_one_parent_one_child_per_method(uri)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        stop(srv)


def test_every_bad_input_kind_through_the_driver(tmp_path, monkeypatch):
    """All row-level bad inputs (tests/pipeline_helpers.bad_input_records) in one shard, through the driver
    and the real engine (the context check needs its processor): each bad sample becomes its error rows,
    every good one is evaluated."""
    from pipeline_helpers import bad_input_records, tiny_qwen2_vl_dir

    model = "embedded" if (REPO / "assets" / "embedded" / "model" / "config.json").is_file() else \
        str(tiny_qwen2_vl_dir(tmp_path))
    recs, expect = bad_input_records(synthetic_records("detailcaps", 1)[0])
    write_shard(tmp_path / "shards" / "bad.parquet", recs)
    out = tmp_path / "out"
    rep = _inline(monkeypatch, ["--model", model, "--shards", str(tmp_path / "shards"), "--methods", ",".join(METHODS),
                                "--output-dir", str(out), "--max-new-tokens", "3", "--batch-size", "4", "--no-summary",
                                "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"])
    assert rep["status"] == "ok"
    df = pd.read_parquet(out)
    keys = _keys(df)
    assert len(keys) == len(set(keys)) and set(keys) == {(s, m) for s in expect for m in METHODS}
    assert sum(e is not None for e in expect.values()) >= 12  # kinds of bad input, besides the 2 pre-flight ones
    for sid, err in expect.items():
        rows = df[df["sample_id"] == sid]
        if err is None:
            assert rows["error"].isna().all() and (rows["n_steps"] >= 1).all(), (sid, rows["error"].tolist())
        else:
            assert rows["error"].str.contains(err, regex=False).all(), (sid, rows["error"].tolist())
