"""The job driver: the job's steps in order, each in its own module along the data path.

::

    cfg = job_config(task="detailcaps")   # validated: bad fields fail here, before any model work
    result = pipeline.run.driver.run(cfg)

1. Inputs (``inputs.py``): resolve the shards and check each one's schema against ``INPUT_SCHEMA`` (an error
   names the column); read only their ``sample_id`` column to list the rows in scope (``limit``: the first N).
   Pre-flight (``pipeline/run/preflight.py``): the model resolves, is a supported family and its processor loads,
   and ``--device cuda`` has a GPU; a failure is one line naming the flag, exit code 2, before Ray starts.
   Methods that calibrate offline get their held-out rows (``calibration.py``), recorded in the config, so in its
   hash.
2. Plan (``plan.py``): read the keys already in the output directory (only rows of the same config hash count; a
   directory holding another config's rows is refused) and plan the missing (sample, method) pairs; rows the
   driver can reject on their own (a duplicate or missing sample_id) become error rows; the run record.
3. Ray (``ray_stages.py``): ``read_parquet`` -> keep the planned rows (tagged with their missing methods) ->
   blocks of ``batch_size`` rows -> ``map_batches(SampleEvaluator)`` on the actors (``actor.py``) -> each output
   block is written as one atomic Parquet part (``writer.py``, ``store.py``).
4. Summary: the statistics module's per-method table, MLflow logging from the driver only, and the absolute
   locations of the Parquet files and the MLflow runs.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from pipeline import quiet
from pipeline.analysis import mlflow_store, mlflow_ui, report, tracking
from pipeline.analysis.analyze import analyze
from pipeline.quiet import say
from pipeline.run import calibration, interrupt, preflight, ray_stages
from pipeline.run.cli import job_config
from pipeline.run.config import JobConfig
from pipeline.run.inputs import scan_inputs
from pipeline.run.plan import driver_error_table, new_record, new_run_id, plan_job
from pipeline.run.store import OutputStore, PartWriteError
from pipeline.run.writer import PartWriter, Progress, write_failed_line
from rcr.config import ConfigError

MLFLOW_FAILED_EXIT = 3  # the Parquet output is complete but MLflow logging failed (jobs/backfill_mlflow.py)


def resolve_calibration(cfg: JobConfig, inputs: tuple) -> calibration.CalibrationPlan:
    """What each method that calibrates offline is calibrated on (``pipeline/run/calibration.py``), recorded in
    ``rcr.extra["<label>_calibration"]`` so that the config hash, the run record and MLflow carry it; a
    ConfigError naming the method's field when it cannot be."""
    cal = calibration.plan(cfg, inputs[0], inputs[1])
    if cal.records:
        extra = {**cfg.rcr.get("extra", {}), **{f"{label}{calibration.RECORD_SUFFIX}": record
                                                for label, record in cal.records.items()}}
        cfg.rcr = {**cfg.rcr, "extra": extra}
        for label, r in cal.records.items():
            say(f"{label} calibration: {r['source']} (sha256 {r['sha256'] or '-'})")
    return cal


class JobState:
    """What is known of a job as it goes, for the one line an interruption prints (``_interrupted``)."""

    def __init__(self):
        self.run_id: str | None = None
        self.record: dict[str, Any] | None = None
        self.n_pairs: int | None = None  # the job's rows (samples in scope x methods), once planned
        self.n_existing = 0  # of those, already in the output dir when it started
        self.during: str | None = None  # what it was doing, when that is worth saying ("logging to MLflow")


def run(cfg: JobConfig) -> dict[str, Any]:
    """Run one job to completion (or to the first unrecoverable failure). Returns a report dict.

    The job holds the output directory's lock from planning to the end (see ``OutputStore.acquire``). An
    interruption (``interrupt.Interrupted``: SIGINT or SIGTERM inside ``interrupt.interruptible``, or a bare
    KeyboardInterrupt) ends it with ``status: interrupted`` in its run record and the report, and one line."""
    store = OutputStore(cfg.output_dir)
    state = JobState()
    try:
        return _run(cfg, store, state)
    except (interrupt.Interrupted, KeyboardInterrupt) as e:
        return _interrupted(cfg, store, state, e)
    except SystemError as e:  # a signal that landed inside a C extension's call (interrupt.behind)
        if (i := interrupt.behind(e)) is None:
            raise
        return _interrupted(cfg, store, state, i)
    except OSError as e:  # the output dir's lock or run record cannot be written (e.g. the disk is full)
        say(f"the job stopped: {e}. The part files written are whole; fix that, then rerun the same command: it "
            "computes only the missing rows")
        return {"run_id": state.run_id, "status": "failed", "error": str(e), "output_dir": cfg.output_dir}
    finally:
        store.release()


def _interrupted(cfg: JobConfig, store: OutputStore, state: JobState, e: BaseException) -> dict[str, Any]:
    """The run record marked interrupted and the one line: K of N rows on disk (counted from the part files this run
    renamed into place, so a write interrupted after its rename counts), and that the same command resumes."""
    signum = interrupt.signal_of(e)
    done = None
    if state.run_id is not None and state.n_pairs is not None:
        done = state.n_existing + len(store.run_keys(state.run_id))
        if state.record is not None:
            state.record.update(status="interrupted", error=f"interrupted by {signal.Signals(signum).name}"
                                + (f" while {state.during}" if state.during else ""), n_written=done - state.n_existing,
                                n_missing=state.n_pairs - done, finished=time.strftime("%Y-%m-%dT%H:%M:%S"))
            try:
                store.write_run_record(state.run_id, state.record)
            except OSError as err:  # e.g. the disk is full: the parts on disk are what counts
                say(f"could not update the run record in {store.root}: {err}")
    say(interrupt.line(done, state.n_pairs, cfg.output_dir, state.during))
    return {"run_id": state.run_id, "status": "interrupted", "signal": signum, "output_dir": cfg.output_dir,
            "n_pairs": state.n_pairs, "n_written": None if done is None else done - state.n_existing}


def _run(cfg: JobConfig, store: OutputStore, state: JobState) -> dict[str, Any]:
    t_start = time.perf_counter()
    quiet.quiet_driver_logging()
    inputs = scan_inputs(cfg)  # bad shards: field 'shards', before the model is looked at
    preflight.check(cfg)  # model and device: one line and exit code 2, before anything is written or Ray starts
    cal = resolve_calibration(cfg, inputs)  # before the config hash is read: it is part of it
    paths, plan = plan_job(cfg, store, inputs)
    say(f"job {cfg.job_name}: task={cfg.task} model={cfg.model} methods={','.join(cfg.methods)} "
        f"max_new_tokens={cfg.max_new_tokens} config_hash={cfg.config_hash}")
    say(f"output dir: {cfg.output_dir}")
    say(f"mlflow: {cfg.mlflow_uri}")
    run_id = new_run_id()
    n_samples_todo = len(plan.todo) + len(plan.driver_errors)
    say(f"{len(paths)} shard file(s), {len(plan.rows)} samples x {len(plan.methods)} methods = {plan.n_pairs} rows; "
        f"{plan.n_existing} already in the output dir, {plan.n_todo_pairs} to compute "
        f"({n_samples_todo} samples), run id {run_id}")
    record = new_record(cfg, run_id, paths, plan)
    state.run_id, state.n_pairs, state.n_existing = run_id, plan.n_pairs, plan.n_existing
    store.write_run_record(run_id, record)
    state.record = record

    progress = Progress(plan.n_todo_pairs, n_samples_todo, cfg.progress_every_s,
                        batch=f"{min(cfg.batch_size, len(plan.todo) or 1)} sample(s) x {len(plan.methods)} method(s)")
    writer = PartWriter(store, run_id, {(k, m) for k, m in record["planned"]}, progress, t_start)
    status, error = "ok", None
    try:
        if plan.driver_errors:
            writer.write(driver_error_table(cfg, plan))
        if plan.todo:
            status, error = ray_stages.stream(cfg, paths, plan, writer, cal.payload())
    except PartWriteError as e:  # the driver's own error rows could not be written (e.g. the disk is full)
        say(write_failed_line(e))
        status, error = "failed", str(e)
    except ConfigError as e:  # the cluster cannot run this config (no GPU, no node holds an actor): exit 2
        record.update(status="failed", error=str(e), finished=time.strftime("%Y-%m-%dT%H:%M:%S"))
        store.write_run_record(run_id, record)
        raise

    missing = writer.missing()
    if missing and status == "ok":
        status = "incomplete"
    record.update(status=status, error=error, n_written=len(writer.written), n_missing=len(missing),
                  finished=time.strftime("%Y-%m-%dT%H:%M:%S"), wall_s=time.perf_counter() - t_start,
                  written_parts=writer.seq)
    try:
        store.write_run_record(run_id, record)
    except OSError as e:  # e.g. the disk is full: the parts written are whole, the record is a convenience
        say(f"could not update the run record in {store.root}: {e}")
    if missing:
        say(f"{len(missing)} planned row(s) were not written (e.g. {missing[0]}); rerun the same command to "
            "compute only those")
    say(f"wrote {len(writer.written)} row(s) in {writer.seq} part file(s) in {time.perf_counter() - t_start:.1f}s")
    out = {"run_id": run_id, "status": status, "output_dir": cfg.output_dir, "mlflow_uri": cfg.mlflow_uri,
           "n_pairs": plan.n_pairs, "n_existing": plan.n_existing, "n_written": len(writer.written),
           "n_missing": len(missing), "error": error, "write_times_s": writer.write_times,
           "write_samples": writer.write_samples,
           "first_write_samples": writer.write_samples[0] if writer.write_samples else 0}
    if cfg.summary:
        state.during = "logging to MLflow"
        out.update(summarize(cfg, store, [r.key for r in plan.rows], log=not missing))
        state.during = None
    say(f"Parquet: {cfg.output_dir}  (pandas: pd.read_parquet({cfg.output_dir!r}))")
    db = mlflow_ui.store_path(cfg.mlflow_uri)
    where = f"store: {db}" if db else "a tracking server: its own UI"
    say(f"MLflow runs: {cfg.mlflow_uri}  ({where})")
    return out


# ---------------------------------------------------------------------- summary


def summarize(cfg: JobConfig, store: OutputStore, samples: list[str], log: bool = True) -> dict[str, Any]:
    """The per-method summary of this job's ``samples`` (its rows in scope, written by this run or earlier ones), and
    its MLflow runs, keyed on the output dir, the config and those samples: a job on another subset of the same
    directory (``--limit``) gets its own parent run and leaves the others as they are. ``log=False`` (rows missing):
    no MLflow runs; the rerun that completes the rows logs them."""
    table = store.read()
    if table is None:
        return {}
    df = table.to_pandas()
    df = df[df["config_hash"] == cfg.config_hash]
    in_dir = df["sample_id"].nunique()
    df = df[df["method"].isin(cfg.methods) & df["sample_id"].isin(set(samples))]
    if df.empty:
        return {}
    out: dict[str, Any] = {}
    text = None
    analysis = None
    try:
        analysis = analyze(df)
        text = report.format_summary(analysis)
    except Exception as e:  # noqa: BLE001 - the summary must never lose the outputs
        interrupt.unwrap(e)
        say(f"the statistics failed ({type(e).__name__}: {e}); printing the minimal summary")
    if text is None:
        text = report.minimal_summary(df)
    say(scope_line(sorted(set(df["sample_id"])), len(samples), in_dir))
    print(text, flush=True)
    out["summary"] = text
    if not log:
        say("MLflow: not logged, since the job's rows are not all written; the same command computes the missing "
            "ones and logs the job")
        return out
    try:
        tracking.check_tracking_server(cfg.mlflow_uri)
        info = tracking.log_job(df=df, config=cfg.record(), analysis=analysis, tracking_uri=cfg.mlflow_uri,
                                experiment=cfg.experiment, output_dir=cfg.output_dir, job_name=cfg.job_name,
                                samples=samples)
        out["mlflow"] = info
    except Exception as e:  # noqa: BLE001 - the rows are written: report, and exit with MLFLOW_FAILED_EXIT
        interrupt.unwrap(e)
        out["mlflow_error"] = mlflow_store.error_cause(e)
        when = "when the server answers again" if mlflow_ui.is_server(cfg.mlflow_uri) else "once that is fixed"
        how = (f"python jobs/backfill_mlflow.py --output-dir {cfg.output_dir} --tracking-uri {cfg.mlflow_uri}"
               if len(samples) == in_dir else "the same command again (it computes nothing more)")
        say(f"MLflow logging failed ({out['mlflow_error']}); any run it started is marked FAILED, and the Parquet "
            f"output is complete. Log it {when}: {how}")
    return out


def scope_line(ids: list[str], n_job: int, n_dir: int) -> str:
    """Which samples the summary and the MLflow runs cover: this job's (``--limit``), of the output dir's. ``ids``:
    the job's samples that have rows; ``n_job``: the job's samples; ``n_dir``: the output dir's of this config."""
    span = ids[0] if len(ids) == 1 else f"{ids[0]} … {ids[-1]}"
    where = ("every sample of this config in the output dir" if n_job == n_dir else
             f"the output dir holds {n_dir} sample(s) of this config, and covers only these")
    gap = f"; {n_job - len(ids)} of them have no rows yet" if len(ids) < n_job else ""
    return f"summary of this job's {n_job} sample(s) ({span}): {where}{gap}"


def main(task: str | None = None, argv: list[str] | None = None) -> int:
    """The jobs' entry point (``jobs/eval.py``, ``rcr-eval``; ``task``: a task's own alias, ``jobs/detailcaps.py``):
    parse + validate the config, run, exit non-zero on failure (docs/pipeline.md, "Exit status")."""
    cfg = result = None
    try:
        with interrupt.interruptible():
            cfg = job_config(argv, task=task)
            with quiet.stderr_without(quiet.RAY_ACTOR_RESTART_NOTICE, unsaid=f"[rcr-job] {unsaid_line(cfg)}"):
                result = run(cfg)
    except ConfigError as e:
        print(f"[rcr-job] {e}", file=sys.stderr, flush=True)
        return 2
    except interrupt.Interrupted as e:
        if result is None:  # before run() took over (parsing the flags, starting the stderr filter)
            say(interrupt.line(None, None, cfg.output_dir if cfg else None))
            return e.exit_status
        # after the job had finished and said so (while the stderr filter drained): its status stands
    status = _exit_status(result)
    if argv is None:  # run as a command: a signal during Ray's teardown, after the job said how it ended, changes
        interrupt.closing()  # nothing (a caller's own process keeps its signals)
    return status


def unsaid_line(cfg: JobConfig) -> str:
    """The line said for a driver that died where it could say nothing (``quiet.stderr_without``)."""
    return (f"the job's driver (pid {os.getpid()}) ended without a word: killed (SIGKILL, out of memory) or ended by "
            "Ray's core worker when the driver's Ray went away. The part files written are whole, and its run record "
            f"stays 'running' until the next job marks it 'died'; the same command resumes ({cfg.output_dir})")


def _exit_status(result: dict[str, Any]) -> int:
    if result["status"] == "interrupted":
        return 128 + result["signal"]
    if result["status"] != "ok":
        return 1
    if result.get("mlflow_error"):
        return MLFLOW_FAILED_EXIT
    return 0
