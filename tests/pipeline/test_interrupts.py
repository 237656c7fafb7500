"""A job interrupted (SIGINT / SIGTERM: ``pipeline.run.interrupt.Interrupted``) at each kind of point, in this
process (tests/inline_driver.py: the driver's own code, no Ray): between batches, mid part write, just after a part's
rename, during MLflow logging. Each time: one line saying how many of the job's rows are on disk (counted from the
part files), the run record marked interrupted, nothing half-written, and the same command completes the job. A
record left ``running`` by a job that died without a word is marked ``died`` by the next one. The signals themselves,
sent to a real job process: tests/integration/test_interrupt.py and test_ray_job.py.
"""

from __future__ import annotations

import json
import signal

import pytest

from pipeline.analysis import tracking
from pipeline.run import interrupt, store
from pipeline.run.store import OutputStore
from tests.fault_helpers import METHODS, N, assert_exact, assert_one_parent_one_child_per_method, make_job, run_inline
from tests.pipeline_helpers import FakeEngine


@pytest.fixture
def job(tmp_path):
    return make_job(tmp_path)


def _record(out) -> dict:
    (rec,) = (out / "_runs").glob("*.json")
    return json.loads(rec.read_text())


def _interrupted_line(out, done: int) -> str:
    return f"[rcr-job] interrupted: {done} of {N * len(METHODS)} rows written to {out}; the same command resumes"


def test_interrupted_between_batches(job, monkeypatch, capsys):
    real = FakeEngine.run

    def run(self, *a, **k):  # the third model batch: the signal lands while the engine works
        if self.calls == 2:
            raise interrupt.Interrupted(signal.SIGTERM)
        return real(self, *a, **k)

    monkeypatch.setattr(FakeEngine, "run", run)
    rep = run_inline(job["argv"]("--no-summary"))
    out = job["out"]
    assert rep["status"] == "interrupted" and rep["signal"] == signal.SIGTERM
    assert _interrupted_line(out, 2 * len(METHODS)) in capsys.readouterr().out.splitlines()
    rec = _record(out)
    assert rec["status"] == "interrupted" and rec["error"] == "interrupted by SIGTERM"
    assert rec["n_written"] == 2 * len(METHODS) and rec["n_missing"] == (N - 2) * len(METHODS)
    monkeypatch.setattr(FakeEngine, "run", real)
    assert run_inline(job["argv"]("--no-summary"))["status"] == "ok"
    assert_exact(out, job["ids"])


@pytest.mark.parametrize("where", ["mid-write", "after-rename"])
def test_interrupted_in_a_part_write(job, monkeypatch, capsys, where):
    """Mid-write: the temporary goes, the part never appears. Just after the rename (before the writer counts it):
    the part is whole and counts in the line."""
    real, calls = store.atomic_write_table, [0]

    def write(table, path):
        calls[0] += 1
        if calls[0] < 3:
            return real(table, path)
        if where == "mid-write":
            with store.atomic_path(path) as fh:
                fh.write(b"PAR1 half")
                raise interrupt.Interrupted(signal.SIGINT)
        real(table, path)
        raise interrupt.Interrupted(signal.SIGINT)

    monkeypatch.setattr(store, "atomic_write_table", write)
    rep = run_inline(job["argv"]("--no-summary"))
    out = job["out"]
    done = (2 if where == "mid-write" else 3) * len(METHODS)
    assert rep["status"] == "interrupted" and rep["n_written"] == done
    assert _interrupted_line(out, done) in capsys.readouterr().out.splitlines()
    assert not list(out.glob(".tmp-*")) and len(list(out.glob("part-*.parquet"))) == done // len(METHODS)
    monkeypatch.setattr(store, "atomic_write_table", real)
    rep = run_inline(job["argv"]("--no-summary"))
    assert rep["status"] == "ok" and rep["n_existing"] == done
    assert_exact(out, job["ids"])


def test_interrupted_while_logging_to_mlflow_then_the_same_command_logs(job, monkeypatch, capsys):
    """All rows are written; the signal lands in the second method run: the runs started are marked FAILED, none
    RUNNING, the line says so; the same command computes nothing and logs one set of runs."""
    real, calls = tracking._log_child, []

    def child(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise interrupt.Interrupted(signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(tracking, "_log_child", child)
    rep = run_inline(job["argv"]())
    out, uri = job["out"], f"sqlite:///{job['tmp'] / 'mlflow.db'}"
    assert rep["status"] == "interrupted"
    total = N * len(METHODS)
    assert (f"[rcr-job] interrupted while logging to MLflow: {total} of {total} rows written to {out}; the same "
            "command resumes") in capsys.readouterr().out.splitlines()
    from mlflow import MlflowClient

    c = MlflowClient(uri)
    runs = [r for e in c.search_experiments() for r in c.search_runs([e.experiment_id])]
    assert runs and {r.info.status for r in runs} == {"FAILED"}
    assert _record(out)["status"] == "interrupted"
    monkeypatch.setattr(tracking, "_log_child", real)
    rep = run_inline(job["argv"]())
    assert rep["status"] == "ok" and rep["n_written"] == 0 and "mlflow_error" not in rep
    assert_one_parent_one_child_per_method(uri)


def test_a_record_left_running_is_marked_died_by_the_next_job(job, capsys):
    out = job["out"]
    (out / "_runs").mkdir(parents=True)
    (out / "_runs" / "old.json").write_text(json.dumps({"run_id": "old", "status": "running"}))
    assert run_inline(job["argv"]("--no-summary"))["status"] == "ok"
    assert "run(s) old ended without updating their record" in capsys.readouterr().out
    old = json.loads((out / "_runs" / "old.json").read_text())
    assert old["status"] == "died" and "killed, or its node or cluster was lost" in old["error"]
    assert [json.loads(p.read_text())["status"] for p in (out / "_runs").glob("*.json")].count("ok") == 1


def test_run_keys_counts_only_that_runs_parts(job):
    assert run_inline(job["argv"]("--no-summary"))["status"] == "ok"
    s = OutputStore(job["out"])
    run_id = _record(job["out"])["run_id"]
    assert len(s.run_keys(run_id)) == N * len(METHODS) and s.run_keys("another-run") == set()


def _in_a_c_call(signum: int) -> SystemError:
    """What a signal handler's exception becomes when it is raised inside a C extension's call (Ray's Cython
    ``CoreWorker.wait``): a SystemError whose cause is the Interrupted."""
    try:
        raise interrupt.Interrupted(signum)
    except interrupt.Interrupted as i:
        e = SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set")
        e.__cause__ = i
        return e


@pytest.mark.parametrize("where", ["reading the inputs", "waiting for a batch"])
def test_interrupted_inside_a_c_call_is_the_interruption_not_a_failure(job, monkeypatch, capsys, where):
    """The fault soak's SIGINT while the actors loaded (Ray Data's read waits in ``ray.wait``): a SystemError
    carrying the Interrupted is the interruption (one line, exit 130, the record interrupted), not a traceback or a
    'the Ray pipeline failed' line; and the same command completes the job."""
    from tests.inline_driver import InlineDataset  # what the driver's build_dataset gives without Ray

    init, batches = InlineDataset.__init__, InlineDataset.iter_batches

    def build(self, *a, **k):  # ray.data.read_parquet, in build_dataset: where the soak's signal landed
        raise _in_a_c_call(signal.SIGINT)

    def iter_batches(self, **kw):  # the driver's wait for the next batch
        it = batches(self, **kw)
        yield next(it)
        raise _in_a_c_call(signal.SIGINT)

    if where == "reading the inputs":
        monkeypatch.setattr(InlineDataset, "__init__", build)
    else:
        monkeypatch.setattr(InlineDataset, "iter_batches", iter_batches)
    rep = run_inline(job["argv"]("--no-summary"))
    out = job["out"]
    assert rep["status"] == "interrupted" and rep["signal"] == signal.SIGINT
    done = 0 if where == "reading the inputs" else len(METHODS)  # batch size 1: one sample's rows
    printed = capsys.readouterr().out
    assert _interrupted_line(out, done) in printed.splitlines() and "pipeline failed" not in printed
    assert _record(out)["status"] == "interrupted"
    monkeypatch.setattr(InlineDataset, "__init__", init)
    monkeypatch.setattr(InlineDataset, "iter_batches", batches)
    assert run_inline(job["argv"]("--no-summary"))["status"] == "ok"
    assert_exact(out, job["ids"])


def test_a_signal_after_the_job_ended_changes_nothing(job):
    """The fault soak's SIGINT after MLflow logging: the job had said everything, then the signal reached Ray's and the
    interpreter's teardown and the process died by it (exit -2) without a word. As a command (``main`` reading
    sys.argv), a signal after the job ended is held back: the process ends with the job's own status. The signal is
    sent by the job process itself, right after ``main`` returns: no timing."""
    import os
    import subprocess

    from tests.pipeline_helpers import PY, REPO

    code = ("import os, signal, sys; from tests import inline_driver; from pipeline.run import driver; "
            "inline_driver.install(); sys.argv = ['eval'] + sys.argv[1:]; status = driver.main('detailcaps'); "
            "print('main returned', status, flush=True); os.kill(os.getpid(), signal.SIGINT); "
            "os.kill(os.getpid(), signal.SIGTERM); print('after the signals', flush=True); sys.exit(status)")
    r = subprocess.run([PY, "-c", code, *job["argv"]("--no-summary")], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=600, check=False)
    lines = r.stdout.splitlines()
    assert "main returned 0" in lines, r.stdout + r.stderr
    assert r.returncode == 0 and lines[-1] == "after the signals", (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr


def test_handlers_that_ray_init_replaces_are_put_back():
    """``ray.init`` replaces the SIGTERM handler (Python's, then the core worker's at the C level): inside
    ``interrupt.kept()`` (around ray.init in ``init_ray``) that replacement lasts only as long as the block, and the
    job's SIGTERM is again the interruption. The job stopped by ``ray job stop``: tests/integration/test_ray_job.py."""
    import os

    def rays(signum, frame):
        raise RuntimeError("Ray's handler ran")

    with pytest.raises(interrupt.Interrupted) as e, interrupt.interruptible():
        with interrupt.kept():
            signal.signal(signal.SIGTERM, rays)
            assert signal.getsignal(signal.SIGTERM) is rays
        os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.signum == signal.SIGTERM


def test_a_signal_inside_logging_is_raised_after_it():
    """The fault soak's seed 18: SIGINT landed in logging's ``_releaseLock`` (called from a weakref callback when a
    logging handler went away); the Interrupted was dropped ("Exception ignored in"), logging's lock stayed taken,
    and Ray Data's thread waited on it for ever. A signal that lands while the main thread runs logging's code, here
    with logging's module lock taken (``getLogger`` making a logger), and again while it is held back, is raised
    once the main thread has left logging, and logging's lock is free. The signals are sent from inside the
    logging call, so they land there: no timing."""
    import logging
    import os
    import threading

    held = []

    class SignalInside(logging.Logger):
        def __init__(self, name):
            super().__init__(name)
            held.append(logging._lock._is_owned())
            for signum in (signal.SIGINT, signal.SIGTERM):
                os.kill(os.getpid(), signum)
                for _ in range(1000):  # bytecodes inside logging's call, where Python runs the pending handler
                    pass

    before = logging.getLoggerClass()
    logging.setLoggerClass(SignalInside)
    try:
        with pytest.raises(interrupt.Interrupted) as e, interrupt.interruptible():
            logging.getLogger("rcr-test-interrupt-in-logging")
            threading.Event().wait(60)  # the signal, sent again, ends this wait (60 s: only if it never comes)
    finally:
        logging.setLoggerClass(before)
        logging.Logger.manager.loggerDict.pop("rcr-test-interrupt-in-logging", None)
    assert held == [True]  # the signals landed with logging's module lock taken
    assert e.value.signum in (signal.SIGINT, signal.SIGTERM)
    where = {os.path.dirname(entry.path) for entry in e.traceback}
    assert os.path.dirname(logging.__file__) not in where, [str(entry.path) for entry in e.traceback]
    assert logging._lock.acquire(blocking=False)  # free (an RLock: this thread would take it again if it held it)
    logging._lock.release()
    assert not logging._lock._is_owned()


def test_an_interruption_inside_ray_init_keeps_the_signals_ignored():
    """``kept()`` puts back the handlers ``ray.init`` replaced; when the job is interrupted inside it, the signals stay
    ignored instead, so a second Ctrl-C does not cut the clean-up (the one line, the run record) short."""
    import os

    with interrupt.interruptible():
        with pytest.raises(interrupt.Interrupted), interrupt.kept():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)  # ignored: nothing raised
        for _ in range(1000):
            pass


def test_an_interruption_python_drops_is_raised_again():
    """Where Python cannot raise (``__del__``, a weakref callback) it drops the exception with "Exception ignored in":
    an Interrupted dropped there is raised again in the main thread, and the job does not go on with the signals
    ignored. The signal is sent from inside ``__del__``, so it lands there: no timing."""
    import gc
    import os
    import threading

    class SignalInDel:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # bytecodes inside __del__, where Python runs the pending handler
                pass

    with pytest.raises(interrupt.Interrupted) as e, interrupt.interruptible():
        doomed = SignalInDel()
        del doomed
        gc.collect()
        threading.Event().wait(60)  # the signal, sent again, ends this wait (60 s: only if it never comes)
    assert e.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # the handlers before the block are back
