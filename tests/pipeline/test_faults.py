"""Fault injection into the job driver and its output store, in this process (no Ray, no subprocess).

The driver runs without Ray (tests/inline_driver.py: the planned rows go through SampleEvaluator here), so
everything a fault touches (planning, the lock, the writes, the resume, MLflow logging) is the driver's own
code. Each case checks that no row is lost or duplicated and that the next run of the same command
completes the output with exactly the missing rows. Faults that need a second process (SIGKILL, two jobs
at once, a tracking server killed mid-job) are in tests/integration/test_faults.py.
"""

from __future__ import annotations

import errno
import json
import os
import shlex

import pandas as pd
import pytest

from pipeline.analysis import backfill as backfill_mlflow
from pipeline.run import driver
from pipeline.run.config import ConfigError
from pipeline.run.store import OutputStore
from tests import inline_driver
from tests.fault_helpers import (
    METHODS,
    N,
    assert_exact,
    assert_one_parent_one_child_per_method,
    keys,
    make_job,
    parts,
    run_inline,
)
from tests.pipeline_helpers import REPO, bad_input_records, synthetic_records, tiny_qwen2_vl_dir, write_shard
from tests.ray_head import free_port


@pytest.fixture
def job(tmp_path):
    return make_job(tmp_path)


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
    rep = run_inline(job["argv"]("--no-summary"))
    out = job["out"]
    assert rep["status"] == "failed" and f"in {out}" in rep["error"] and "No space left" in rep["error"]
    assert (f"writing the output failed: [Errno {errno.ENOSPC}] cannot write a part file in {out}"
            in capsys.readouterr().out)
    assert not list(out.glob(".tmp-*")), "a partial temporary was left"
    first = parts(out)
    assert len(first) == 2 and rep["n_written"] == 2 * len(METHODS)  # whole parts only; each reads back
    monkeypatch.setattr(pq_mod, "write_table", real)  # space is back

    rep2 = run_inline(job["argv"]("--no-summary"))
    assert rep2["status"] == "ok" and rep2["n_existing"] == 2 * len(METHODS)
    assert rep2["n_written"] == (N - 2) * len(METHODS)
    assert_exact(out, job["ids"])
    assert {k: v for k, v in parts(out).items() if k in first} == first  # the first run's parts untouched


def test_stale_temporary_of_a_killed_writer_is_removed(job, capsys):
    """What a writer killed mid-write leaves (a hidden half-written temporary) is cleared by the next job,
    under the lock; readers never saw it. The kill itself: tests/integration/test_faults.py."""
    out = job["out"]
    out.mkdir()
    (out / ".tmp-part-x-00000.parquet.123").write_bytes(b"PAR1 half a part")
    rep = run_inline(job["argv"]("--no-summary"))
    assert f"removed the temporary file(s) of an interrupted write in {out}" in capsys.readouterr().out
    assert rep["status"] == "ok" and not list(out.glob(".tmp-*"))
    assert_exact(out, job["ids"])


@pytest.mark.parametrize("damage", ["truncated", "bytes-flipped", "not-parquet"])
def test_corrupt_part_is_named_set_aside_and_only_its_rows_redone(job, capsys, damage):
    out = job["out"]
    assert run_inline(job["argv"]("--no-summary"))["status"] == "ok"
    before = parts(out)
    victim = sorted(before)[2]
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

    rep = run_inline(job["argv"]("--no-summary"))
    log = capsys.readouterr().out
    assert f"part file {victim} is corrupt or truncated" in log
    assert (out / "_corrupt" / victim).is_file() and not path.exists()
    assert rep["status"] == "ok" and rep["n_written"] == len(before[victim])
    assert rep["n_existing"] == N * len(METHODS) - len(before[victim])
    new = {k: v for k, v in parts(out).items() if k not in before}
    assert set().union(*new.values()) == before[victim]  # exactly the lost rows, nothing else
    assert_exact(out, job["ids"])


def test_lock_is_exclusive_names_its_holder_and_is_released(tmp_path):
    a, b = OutputStore(tmp_path / "o"), OutputStore(tmp_path / "o")
    a.acquire()
    with pytest.raises(ConfigError, match=rf"in use by another job \(pid {os.getpid()} "):
        b.acquire()
    a.release()
    b.acquire()  # free again once released
    b.release()


def test_the_driver_holds_the_lock_for_the_whole_job_and_releases_it(job):
    """While the job writes its parts another job is refused; afterwards the directory is free again."""
    seen = []
    real = OutputStore.write_part

    def write_part(self, table, run_id, seq):
        with pytest.raises(ConfigError, match="in use by another job"):
            OutputStore(job["out"]).acquire()
        seen.append(seq)
        return real(self, table, run_id, seq)

    mp = pytest.MonkeyPatch()
    mp.setattr(OutputStore, "write_part", write_part)
    try:
        assert run_inline(job["argv"]("--no-summary"))["status"] == "ok"
    finally:
        mp.undo()
    assert len(seen) == N
    other = OutputStore(job["out"])
    other.acquire()
    other.release()


def test_out_of_memory_on_one_sample_errors_only_that_sample(job):
    recs = synthetic_records("detailcaps", N)
    recs[3]["prompt"] = "OOM " + recs[3]["prompt"]
    for f in (job["tmp"] / "shards").glob("*.parquet"):
        f.unlink()
    write_shard(job["tmp"] / "shards" / "s0.parquet", recs)
    rep = run_inline(job["argv"]("--no-summary", "--batch-size", "4"))
    assert rep["status"] == "ok"
    df = assert_exact(job["out"], job["ids"])
    bad = df[df["sample_id"] == recs[3]["sample_id"]]
    assert bad["error"].str.contains("model error: OutOfMemoryError: CUDA out of memory").all()
    assert df[df["sample_id"] != recs[3]["sample_id"]]["error"].isna().all()
    assert (df[df["error"].isna()]["n_steps"] > 0).all()
    rep2 = run_inline(job["argv"]("--no-summary", "--batch-size", "4"))
    assert rep2["n_written"] == 0  # error rows are rows: the output is complete


def test_ray_that_does_not_start_is_one_line_and_the_same_command_completes(job, monkeypatch, capsys):
    """The soak's `ray stop` landing while a plain job's private Ray started: ray.init raised out of the driver (a
    traceback, exit 1, the record left running). Now: one line, the record failed, nothing written; the rerun
    computes every row."""
    inline_driver.install(monkeypatch.setattr)

    def no_ray(cfg):
        raise ConnectionError("ray client connection timeout\n  (the GCS did not answer)")

    monkeypatch.setattr(driver.ray_stages, "init_ray", no_ray)
    assert driver.main("detailcaps", job["argv"]("--no-summary")) == 1
    log = capsys.readouterr().out
    assert ("[rcr-job] could not start or join Ray (ConnectionError: ray client connection timeout (the GCS did not "
            "answer)); rerun the same command: it computes only the missing rows") in log.splitlines()
    assert "Traceback" not in log and not parts(job["out"])
    (rec,) = (job["out"] / "_runs").glob("*.json")
    assert json.loads(rec.read_text())["status"] == "failed"
    inline_driver.install(monkeypatch.setattr)  # Ray is back
    assert run_inline(job["argv"]("--no-summary"))["status"] == "ok"
    assert_exact(job["out"], job["ids"])


def test_mlflow_server_down_for_the_whole_job_then_backfill(job, monkeypatch, capsys):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    inline_driver.install(monkeypatch.setattr)
    code = driver.main("detailcaps", job["argv"](mlflow=down))
    log = capsys.readouterr().out
    assert code == driver.MLFLOW_FAILED_EXIT == 3
    line = [ln for ln in log.splitlines() if "MLflow logging failed" in ln]
    assert line and "the Parquet output is complete" in line[0] and "python jobs/backfill_mlflow.py" in line[0]
    assert f"--output-dir {job['out']}" in line[0] and f"--tracking-uri {down}" in line[0]
    assert_exact(job["out"], job["ids"])

    store = f"sqlite:///{job['tmp'] / 'later.db'}"  # where the runs go once tracking is back
    assert backfill_mlflow.main(["--output-dir", str(job["out"]), "--tracking-uri", store,
                                 "--bootstrap-resamples", "200", "--no-summary"]) == 0
    assert_one_parent_one_child_per_method(store)


def test_mlflow_logging_that_fails_part_way_leaves_no_run_running_and_the_printed_command_logs_it(
        job, monkeypatch, capsys):
    """The store fails in the middle of the logging (here on the second method run, with a long multi-line MLflow
    error): exit 3, every run it started FAILED (none RUNNING), the rows all there, and one line that names the
    cause in whole words and a command; that command then logs the job."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from pipeline.analysis import mlflow_store, tracking

    store = f"sqlite:///{job['tmp'] / 'mlflow.db'}"
    real, calls = tracking._log_child, []
    error = MlflowException("When an mlflow-artifacts URI was supplied, the tracking URI must be a valid http or "
                            f"https URI, but it was currently set to {store}. Perhaps you forgot to set the "
                            "tracking URI to the running MLflow server. To use either of the following:\n - a\n - b")

    def fails_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise error
        return real(*a, **k)

    monkeypatch.setattr(tracking, "_log_child", fails_second)
    inline_driver.install(monkeypatch.setattr)
    assert driver.main("detailcaps", job["argv"]()) == driver.MLFLOW_FAILED_EXIT
    log = capsys.readouterr().out
    (line,) = [ln for ln in log.splitlines() if "MLflow logging failed" in ln]
    assert f"({mlflow_store.error_cause(error)})" in line and "use either of the followin" not in line
    assert mlflow_store.error_cause(error).endswith(f"set to {store}")
    assert_exact(job["out"], job["ids"])
    c = MlflowClient(store)
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()], max_results=1000)
    assert len(runs) == 1 + 1 and {r.info.status for r in runs} == {"FAILED"}  # the parent, the first method

    monkeypatch.setattr(tracking, "_log_child", real)
    cmd = shlex.split(line[line.index("python jobs/backfill_mlflow.py"):])
    assert cmd[:2] == ["python", "jobs/backfill_mlflow.py"]
    assert backfill_mlflow.main(cmd[2:] + ["--bootstrap-resamples", "200", "--no-summary"]) == 0
    assert_one_parent_one_child_per_method(store)
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()], max_results=1000)
    assert {r.info.status for r in runs} == {"FINISHED"}


def test_a_backfill_that_fails_is_one_line_and_exit_3(job, capsys):
    """A tracking server that does not answer: no traceback, one line naming the cause and the command to run
    again, exit 3."""
    run_inline(job["argv"]("--no-summary"))
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code = backfill_mlflow.main(["--output-dir", str(job["out"]), "--tracking-uri", down, "--no-summary"])
    err = capsys.readouterr().err
    assert code == 3, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"[backfill] MLflow logging failed (ConnectionError: the tracking server {down} does "
                           "not answer") and "Traceback" not in err
    assert line.endswith(f"python jobs/backfill_mlflow.py --output-dir {job['out']} --tracking-uri {down} --no-summary")


def test_every_bad_input_kind_through_the_driver(tmp_path):
    """All row-level bad inputs (tests/pipeline_helpers.bad_input_records) in one shard, through the driver
    and the real engine (the context check needs its processor): each bad sample becomes its error rows,
    every good one is evaluated. The two pre-flight kinds (a wrong column type in one shard of several,
    references that are not a list) are in tests/integration/test_pipeline_infra.py."""
    model = "embedded" if (REPO / "assets" / "embedded" / "model" / "config.json").is_file() else \
        str(tiny_qwen2_vl_dir(tmp_path))
    recs, expect = bad_input_records(synthetic_records("detailcaps", 1)[0])
    write_shard(tmp_path / "shards" / "bad.parquet", recs)
    out = tmp_path / "out"
    rep = run_inline(["--model", model, "--shards", str(tmp_path / "shards"), "--methods", ",".join(METHODS),
                      "--output-dir", str(out), "--max-new-tokens", "3", "--batch-size", "4", "--no-summary",
                      "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"])
    assert rep["status"] == "ok"
    df = pd.read_parquet(out)
    k = keys(df)
    assert len(k) == len(set(k)) and set(k) == {(s, m) for s in expect for m in METHODS}
    assert sum(e is not None for e in expect.values()) >= 12  # kinds of bad input, besides the 2 pre-flight ones
    for sid, err in expect.items():
        rows = df[df["sample_id"] == sid]
        if err is None:
            assert rows["error"].isna().all() and (rows["n_steps"] >= 1).all(), (sid, rows["error"].tolist())
        else:
            assert rows["error"].str.contains(err, regex=False).all(), (sid, rows["error"].tolist())


def test_the_head_is_watched_while_the_inputs_are_read(job, monkeypatch):
    """The soak's `ray stop` of a plain job's private Ray while its actors loaded: Ray Data's read of the inputs
    (in build_dataset) waited on the lost GCS, and Ray ended the driver 60 s later with no line of ours, because the
    head's watch only started after the read. The watch (and its one line) must cover the read."""
    import contextlib

    from pipeline.run import placement

    inline_driver.install(monkeypatch.setattr)
    watching = []

    @contextlib.contextmanager
    def watch_nodes(*a, **k):
        watching.append(True)
        try:
            yield
        finally:
            watching.append(False)

    seen = []
    init = inline_driver.InlineDataset.__init__

    def build(self, *a, **k):  # what build_dataset makes: Ray Data's read starts here
        seen.append(watching[-1] if watching else False)
        init(self, *a, **k)

    monkeypatch.setattr(placement, "watch_nodes", watch_nodes)
    monkeypatch.setattr(inline_driver.InlineDataset, "__init__", build)
    assert driver.main("detailcaps", job["argv"]("--no-summary")) == 0
    assert seen == [True] and watching == [True, False]
