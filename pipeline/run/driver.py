"""The job driver: validate, plan the missing work, stream shards through Ray actors, write Parquet.

::

    cfg = JobConfig.from_args(task="detailcaps")   # validated: bad fields fail here, before any model work
    result = pipeline.run.driver.run(cfg)

Steps:

1. Resolve the shards and check each one's schema against ``INPUT_SCHEMA`` (an error names the column).
   Read only their ``sample_id`` column to list the rows in scope (``limit`` = the first N rows).
   Pre-flight (``pipeline/preflight.py``): the model resolves, is a supported family and its processor loads,
   and ``--device cuda`` has a GPU; a failure is one line naming the flag, exit code 2, before Ray starts.
   With ``infinigen`` among the methods, its offline calibration is resolved (``pipeline/run/calibration.py``)
   and recorded in the config, so in its hash.
2. Resume: read the keys already in the output directory (only rows of the same config hash count; a
   directory holding another config's rows is refused). Plan the missing (sample, method) pairs.
3. Rows the driver can reject on their own (a duplicate or missing sample_id) become error rows here.
4. Ray Data: ``read_parquet`` -> keep the planned rows (and tag each with its missing methods) ->
   blocks of ``batch_size`` rows -> ``map_batches(SampleEvaluator, concurrency=num_actors,
   num_gpus=1 or 0)`` -> the driver writes each output block as one atomic Parquet part.
5. Summary: the statistics module's per-method table, MLflow logging from the driver only, and the
   absolute locations of the Parquet files and the MLflow runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline import preflight, quiet
from pipeline.analysis import mlflow_store, mlflow_ui, report, tracking
from pipeline.analysis.analyze import analyze
from pipeline.data import convert, shards, synthetic
from pipeline.run import calibration, placement, ray_local
from pipeline.run.actor import SampleEvaluator
from pipeline.run.config import (
    EMBEDDED,
    REPO_ROOT,
    ConfigError,
    JobConfig,
    default_runs_root,
)
from pipeline.run.select import select_planned
from pipeline.run.store import (
    CORRUPT_DIR,
    OutputStore,
    PartWriteError,
    Plan,
    make_plan,
    new_run_id,
    read_rows,
    resolve_shards,
    scan_shards,
)
from pipeline.schema import INPUT_SCHEMA, JobStamp, error_rows, output_table

# Memory a read/select task asks for. Ray Data's high-memory detector warns when a stage's workers use more than
# they asked for (asked for nothing, a 0.25-CPU task counts as asking for 0.6 GiB) or, at the end, more than 4/5 of
# it. Measured: up to 0.88 GiB (USS, the object-store pages it wrote included) per read worker on the embedded
# shards (files of 123 MiB), with the read function in a module that does not import torch (pipeline/run/select.py;
# importing torch adds 0.45 GiB). Capped at a quarter of the cluster's memory, so that it stays schedulable.
READER_MEMORY = 1536 * 2**20
MLFLOW_FAILED_EXIT = 3  # the Parquet output is complete but MLflow logging failed (jobs/backfill_mlflow.py)


def say(msg: str) -> None:
    print(f"[rcr-job] {msg}", flush=True)


# ---------------------------------------------------------------------- inputs


def embedded_shards(task: str) -> list[str]:
    """The embedded synthetic shards for ``task``, generated once (deterministic) into the runs directory."""
    # keyed on the scene layout: shards cached for an earlier embedded model's layout are never reused
    layout = synthetic.DEFAULT_LAYOUT
    cache = default_runs_root() / "shards" / layout / task
    if not (cache / shards.SUCCESS_MARKER).is_file():  # absent, or an interrupted write
        write_embedded_shards(task, cache, layout=layout)
    return [str(cache)]


def write_embedded_shards(task: str, out_dir: Path, n: int | None = None, layout: str | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    say(f"writing the embedded synthetic {task} shards to {out_dir}")
    shards.write_synthetic_shards(task=task, out_dir=str(out_dir), n=n, layout=layout)


def dataset_shards(spec: str, task: str) -> list[str]:
    """``--dataset``: the named dataset converted in full once, by the task's converter, into input shards under
    ``~/rcr-runs/datasets/`` (a new revision, split or changed local copy gets its own directory). The job
    then streams them like any shards: resume and ``limit`` work on their sample ids. The Hub's pinned revision,
    once converted, is used as it is; otherwise the split is located first (a split the copy lacks fails here,
    before any model work), and the revision read, or the split's files, name the directory."""
    named = convert.parse_dataset(spec, task)
    root = default_runs_root() / "datasets"
    if named.local_path is None and (root / named.cache_name() / shards.SUCCESS_MARKER).is_file():
        return [str(root / named.cache_name())]
    try:
        loc = named.locate()
        if loc.note:
            say(loc.note)
        cache = root / named.cache_name(loc)
        if not (cache / shards.SUCCESS_MARKER).is_file():  # absent, or an interrupted write
            say(f"converting {spec} to input shards in {cache} (once)")
            shards.write_shards(named.records(loc), cache, prefix=named.task.name)
    except convert.OfflineError as e:
        raise ConfigError("dataset", f"{e} (for a job: --dataset <that file or dir>)") from None
    except shards.DataError as e:
        raise ConfigError("dataset", str(e)) from None
    return [str(cache)]


def scan_inputs(cfg: JobConfig) -> tuple[list[str], list, Any]:
    """The job's shard paths and rows, schema-checked; (paths, rows, duplicate policy). Writes nothing to the
    output directory, so a bad shard fails before the output directory is created or locked."""
    if cfg.dataset is not None:
        specs = dataset_shards(cfg.dataset, cfg.task)
    else:
        specs = embedded_shards(cfg.task) if cfg.shards == [EMBEDDED] else cfg.shards
    paths = resolve_shards(specs)
    rows, dup_accept = scan_shards(paths, cfg.limit)
    if not rows:
        raise ConfigError("shards", "the shards hold no rows")
    return paths, rows, dup_accept


def plan_job(cfg: JobConfig, store: OutputStore, inputs: tuple) -> tuple[list[str], Plan]:
    """Lock the output directory and plan what is missing in it. ``inputs``: ``scan_inputs(cfg)``."""
    paths, rows, dup_accept = inputs
    open_output_dir(store)
    existing = store.existing_keys(cfg.config_hash)
    return paths, make_plan(rows, cfg.methods, existing, dup_accept)


def open_output_dir(store: OutputStore) -> None:
    """Lock the output directory for this job, then clear what a killed writer left: stale temporaries,
    and parts that do not read back whole (moved to _corrupt/, so their rows are planned again)."""
    store.acquire()
    if store.remove_stale_temps():
        say(f"removed the temporary file(s) of an interrupted write in {store.root}")
    for name in store.set_aside_corrupt():
        say(f"part file {name} is corrupt or truncated: moved to {store.root / CORRUPT_DIR / name}; "
            "its rows will be computed again")


def resolve_calibration(cfg: JobConfig, inputs: tuple) -> calibration.CalibrationSpec | None:
    """InfiniGen's calibration for this job (``pipeline/run/calibration.py``), recorded in ``rcr.extra`` so
    that the config hash, the run record and MLflow carry it; a ConfigError naming the field if none."""
    try:
        cal = calibration.resolve(cfg, inputs[0], inputs[1])
    except calibration.CalibrationError as e:
        raise ConfigError("rcr.infinigen_calibration", str(e)) from None
    if cal is not None:
        cfg.rcr = {**cfg.rcr, "extra": {**cfg.rcr.get("extra", {}), "infinigen_calibration": cal.record()}}
        say(f"infinigen calibration: {cal.source} (sha256 {cal.sha256 or '-'})")
    return cal


# ---------------------------------------------------------------------- Ray stages


def _ray_init(cfg: JobConfig):
    if not cfg.ray_address and not os.environ.get("RAY_ADDRESS"):
        # a private cluster (below): Ray resolves 127.0.0.1 to the machine's network address, and binds its
        # GCS, raylet and workers there, unless this is 0 (read when ray is first imported)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # actors' lines reach the driver's log without ANSI colours
    # ... and without Ray's "(MapWorker(MapBatches(SampleEvaluator)) pid=...)" prefix: they are the job's own lines
    # (read when ray is first imported, as above)
    os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")
    import ray

    if ray.is_initialized():
        return ray
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, log_to_driver=True, logging_level=quiet.RAY_LOGGING_LEVEL)
    elif os.environ.get("RAY_ADDRESS"):  # inside `ray job submit`: the job's cluster
        ray.init(log_to_driver=True, logging_level=quiet.RAY_LOGGING_LEVEL)
    else:  # a plain `python jobs/x.py`: a private in-process cluster on 127.0.0.1
        if "RAY_AUTH_MODE" not in os.environ and not os.environ.get("RAY_AUTH_TOKEN"):
            # Ray >= 2.52 turns token auth on for a new local cluster and, without a token, writes one to
            # ~/.ray/auth_token, which silently switches every later `ray start` on the machine to token mode.
            # A token private to this process tree (workers inherit the environment) avoids that.
            import secrets

            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        ctx = ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=True,
                       logging_level=quiet.RAY_LOGGING_LEVEL, _temp_dir=ray_local.ray_temp_dir(),
                       runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                           p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}})
        ray_local.record_session(ctx.address_info["session_dir"])  # for `infra/local_cluster.sh clean`
    return ray


def _light_repartition(ds, rows: int, read: dict):
    """``ds.repartition(target_num_rows_per_block=rows)`` whose tasks ask for the read tasks' ``read`` resources
    (``placement.READER_CPUS`` and ``reader_memory``), not 1 CPU.

    Ray Data 2.60's ``repartition`` takes no resource arguments, and a map task without ``num_cpus`` asks for
    1 CPU: on nodes whose CPUs the actors hold in part (3 nodes of 1 CPU, an actor on each), no node has it,
    and the job waits forever. Set on the logical operator, the reader's request also lets Ray Data fuse the
    repartition into the read/select tasks (equal remote args)."""
    from ray.data._internal.logical.operators.map_operator import StreamingRepartition

    ds = ds.repartition(target_num_rows_per_block=rows)
    op = ds._logical_plan.dag
    if not isinstance(op, StreamingRepartition):  # a Ray upgrade changed the plan: fail here, not hang later
        raise TypeError(f"repartition(target_num_rows_per_block=) made a {type(op).__name__}")
    op.ray_remote_args.update(read)
    return ds


def reader_memory(cluster: dict[str, float]) -> int:
    """Bytes of memory each read/select task asks for (``READER_MEMORY``, at most a quarter of the cluster's)."""
    total = cluster.get("memory")
    return int(min(READER_MEMORY, total / 4)) if total else READER_MEMORY


def _build_dataset(ray, cfg: JobConfig, paths: list[str], plan: Plan, res: placement.ActorPlan,
                   calibration_payload: dict | None = None):
    ctx = ray.data.DataContext.get_current()
    ctx.max_errored_blocks = 0
    # Ray Data 2.60's Parquet reader V2 (its default) lists the files in a task of its own that asks for 1 CPU,
    # with no way to ask for less: with the actors on every node (3 nodes of 1 CPU) no node has a whole CPU
    # free and the job waits forever. V1 lists them on the driver and reads with the request given here.
    ctx.use_datasource_v2 = False
    quiet.quiet_ray_data(ctx)  # the job prints its own progress line (_Progress)
    # one read task and block per file, which Ray Data fuses with the select and the repartition below (that one
    # makes the batches); V1 would otherwise split each file into dozens of blocks first (72 per embedded shard)
    read = {"num_cpus": placement.READER_CPUS, "memory": reader_memory(ray.cluster_resources())}
    ds = ray.data.read_parquet(paths, columns=list(INPUT_SCHEMA.names), override_num_blocks=len(paths), **read)
    ds = ds.map_batches(select_planned, fn_kwargs={"todo": plan.todo, "dup_accept": plan.dup_accept},
                        batch_format="pyarrow", batch_size=None, **read)
    ds = _light_repartition(ds, cfg.batch_size, read)
    actor_cfg = cfg.to_dict()
    actor_cfg["torch_threads"] = res.torch_threads
    with quiet.actor_fault_tolerance():
        ds = ds.map_batches(
            SampleEvaluator,
            fn_constructor_kwargs={"config": actor_cfg, "config_hash": cfg.config_hash,
                                   "calibration": calibration_payload},
            batch_size=cfg.batch_size,
            batch_format="pyarrow",
            # one batch at a time per actor: a batch goes to whichever actor is free (a model batch takes
            # seconds, so nothing is gained by queueing more), and a lost node takes at most one batch per
            # actor with it, retried on the restarted actor
            compute=ray.data.ActorPoolStrategy(size=cfg.num_actors, max_tasks_in_flight_per_actor=1),
            num_gpus=res.num_gpus,
            num_cpus=res.num_cpus,
            max_restarts=cfg.max_restarts,
            max_task_retries=cfg.max_task_retries,
        )
    return ds


# ---------------------------------------------------------------------- the job


class _Progress:
    """The job's one progress line: on every part written when ``every_s`` has passed, and from a heartbeat
    thread (:meth:`heartbeat`) every ``every_s`` while the model stage runs, so the cadence stays steady
    when rows arrive in bursts."""

    def __init__(self, total_pairs: int, total_samples: int, every_s: float):
        self.total_pairs, self.total_samples, self.every_s = total_pairs, total_samples, every_s
        self.pairs = 0
        self.samples: set[str] = set()
        self.errors = 0
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def heartbeat(self):
        stop = threading.Event()

        def beat():
            while not stop.wait(self.every_s):
                self.report()

        t = threading.Thread(target=beat, name="rcr-progress", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()

    def update(self, table: pa.Table, force: bool = False) -> None:
        with self.lock:
            self.pairs += table.num_rows
            self.samples.update(table.column("sample_id").to_pylist())
            self.errors += table.num_rows - table.column("error").null_count
        self.report(force=force or self.pairs >= self.total_pairs)

    def report(self, force: bool = False) -> None:
        with self.lock:
            now = time.perf_counter()
            if not force and now - self.last < self.every_s * 0.99:
                return
            self.last = now
            el = now - self.t0
            if self.pairs == 0:
                say(f"progress: 0/{self.total_pairs} rows, waiting for the first batch (the actors load the "
                    f"model first), {el:.0f}s elapsed")
                return
            rate = len(self.samples) / el if el > 0 else 0.0
            left = self.total_samples - len(self.samples)
            eta = f", ETA {left / rate:.0f}s" if rate > 0 and left > 0 else ""
            say(f"progress: {self.pairs}/{self.total_pairs} rows, {len(self.samples)}/{self.total_samples} samples, "
                f"{self.errors} error rows, {rate:.2f} samples/s, {el:.0f}s elapsed{eta}")


class PartWriter:
    """Writes each result block of a run as one atomic part, each planned key exactly once.

    Rows whose key is already written or was never planned (a batch that Ray retried after its output had
    arrived) are dropped before the write."""

    def __init__(self, store: OutputStore, run_id: str, expected: set[tuple[str, str]], progress: _Progress,
                 t0: float):
        self.store, self.run_id, self.expected, self.progress = store, run_id, expected, progress
        self.t0 = t0  # time.perf_counter() at the start of the run
        self.written: set[tuple[str, str]] = set()
        self.seq = 0  # parts written
        self.write_times: list[float] = []  # seconds since the start of the run, one per part
        self.write_samples: list[int] = []  # distinct samples per part

    def write(self, table: pa.Table) -> None:
        keys = zip(table.column("sample_id").to_pylist(), table.column("method").to_pylist())
        mask, kept = [], set()
        for k in keys:
            mask.append(k in self.expected and k not in self.written and k not in kept)
            if mask[-1]:
                kept.add(k)
        dropped = len(mask) - sum(mask)
        if dropped:
            say(f"dropping {dropped} row(s) already written or not planned (a retried batch)")
            table = table.filter(pa.array(mask))
        if not table.num_rows:
            return
        self.store.write_part(table, self.run_id, self.seq)
        self.written.update(kept)  # only once the part is on disk: a failed write leaves its rows missing
        self.seq += 1
        self.write_times.append(time.perf_counter() - self.t0)
        self.write_samples.append(len(set(table.column("sample_id").to_pylist())))
        self.progress.update(table)

    def missing(self) -> list[tuple[str, str]]:
        return sorted(self.expected - self.written)


def _new_record(cfg: JobConfig, run_id: str, paths: list[str], plan: Plan) -> dict[str, Any]:
    """The run record as it is written before any model work (``status: running``)."""
    pending = {**plan.todo, **{r.key: plan.missing_for(r.key) for r in plan.driver_errors}}
    return {
        "run_id": run_id, "job_name": cfg.job_name, "config_hash": cfg.config_hash, "config": cfg.to_dict(),
        "shards": paths, "n_samples": len(plan.rows), "methods": plan.methods, "n_pairs": plan.n_pairs,
        "n_existing": plan.n_existing, "n_planned": plan.n_todo_pairs,
        "planned": sorted([k, m] for k, ms in pending.items() for m in ms),
        "status": "running", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _driver_error_table(cfg: JobConfig, plan: Plan) -> pa.Table:
    """Rows the driver rejects itself (duplicate / missing sample_id): error rows, no model work."""
    job = JobStamp(model=cfg.model, config_hash=cfg.config_hash, job_name=cfg.job_name, task=cfg.task)
    full_rows = read_rows(plan.driver_errors)
    rows = []
    for r in plan.driver_errors:
        rows.extend(error_rows(job, full_rows[(r.file, r.row)], plan.missing_for(r.key), r.error, key=r.key))
    return output_table(rows)


def _stream(cfg: JobConfig, paths: list[str], plan: Plan, writer: PartWriter,
            calibration_payload: dict | None = None) -> tuple[str, str | None]:
    """The model work, through Ray: every result block to ``writer``. Returns (status, error)."""
    ray = _ray_init(cfg)
    preflight.check_cluster(cfg, ray.cluster_resources())
    nodes = placement.alive_nodes(ray)
    res = placement.plan_actors(cfg, nodes)  # ConfigError (exit 2) if no node shape can hold the stages
    loss = "they fit on the others if a node is lost" if res.survives_node_loss else \
        "a lost node's actors wait for a new node"
    spread = f" spread over the nodes ({loss})" if len(nodes) > 1 else ""
    say(f"ray: {placement.describe(nodes)}; {cfg.num_actors} actor(s) x (num_gpus={res.num_gpus:g}, "
        f"num_cpus={res.num_cpus:g}, torch threads {res.torch_threads}){spread}; batch size {cfg.batch_size}")
    ds = _build_dataset(ray, cfg, paths, plan, res, calibration_payload)
    watch = placement.watch_nodes(ray, nodes, res, cfg.num_actors, say, ray.get_runtime_context().gcs_address,
                                  written=lambda: len(writer.written))
    try:
        with writer.progress.heartbeat(), watch:
            # prefetch_batches=0: with Ray Data's default of 1, the iterator asks for block k+1 before it yields
            # block k, so every finished batch waited on the next one (an 8-sample job showed 0 rows until the
            # end); the driver only writes blocks, so there is nothing for a prefetch to overlap
            for block in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
                writer.write(block)
    except PartWriteError as e:
        say(f"writing the output failed: {e}. Free space there, then rerun the same command: it computes "
            "only the missing rows")
        return "failed", str(e)
    except Exception as e:  # noqa: BLE001 - record, report, and exit non-zero below
        error = f"{type(e).__name__}: {e}"
        say(f"the Ray pipeline failed: {error}")
        return "failed", error
    return "ok", None


def run(cfg: JobConfig) -> dict[str, Any]:
    """Run one job to completion (or to the first unrecoverable failure). Returns a report dict.

    The job holds the output directory's lock from planning to the end (see ``OutputStore.acquire``)."""
    store = OutputStore(cfg.output_dir)
    try:
        return _run(cfg, store)
    finally:
        store.release()


def _run(cfg: JobConfig, store: OutputStore) -> dict[str, Any]:
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
    record = _new_record(cfg, run_id, paths, plan)
    store.write_run_record(run_id, record)

    progress = _Progress(plan.n_todo_pairs, n_samples_todo, cfg.progress_every_s)
    writer = PartWriter(store, run_id, {(k, m) for k, m in record["planned"]}, progress, t_start)
    if plan.driver_errors:
        writer.write(_driver_error_table(cfg, plan))
    payload = cal.actor_payload() if cal is not None else None
    try:
        status, error = _stream(cfg, paths, plan, writer, payload) if plan.todo else ("ok", None)
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
        out.update(summarize(cfg, store))
    say(f"Parquet: {cfg.output_dir}  (pandas: pd.read_parquet({cfg.output_dir!r}))")
    db = mlflow_ui.store_path(cfg.mlflow_uri)
    where = f"store: {db}" if db else "a tracking server: its own UI"
    say(f"MLflow runs: {cfg.mlflow_uri}  ({where})")
    return out


# ---------------------------------------------------------------------- summary


def summarize(cfg: JobConfig, store: OutputStore) -> dict[str, Any]:
    """The per-method summary of the whole output dir (this run and earlier ones), and MLflow logging."""
    table = store.read()
    if table is None:
        return {}
    df = table.to_pandas()
    df = df[(df["config_hash"] == cfg.config_hash) & (df["method"].isin(cfg.methods))]
    out: dict[str, Any] = {}
    text = None
    analysis = None
    try:
        analysis = analyze(df)
        text = report.format_summary(analysis)
    except Exception as e:  # noqa: BLE001 - the summary must never lose the outputs
        say(f"the statistics failed ({type(e).__name__}: {e}); printing the minimal summary")
    if text is None:
        text = report.minimal_summary(df)
    print(text, flush=True)
    out["summary"] = text
    try:
        tracking.check_tracking_server(cfg.mlflow_uri)
        info = tracking.log_job(df=df, config=cfg.to_dict(), analysis=analysis, tracking_uri=cfg.mlflow_uri,
                                experiment=cfg.experiment, output_dir=cfg.output_dir, job_name=cfg.job_name)
        out["mlflow"] = info
    except Exception as e:  # noqa: BLE001 - the rows are written: report, and exit with MLFLOW_FAILED_EXIT
        out["mlflow_error"] = mlflow_store.error_cause(e)
        when = "when the server answers again" if mlflow_ui.is_server(cfg.mlflow_uri) else "once that is fixed"
        say(f"MLflow logging failed ({out['mlflow_error']}); any run it started is marked FAILED, and the Parquet "
            f"output is complete. Log it {when}: python jobs/backfill_mlflow.py --output-dir {cfg.output_dir} "
            f"--tracking-uri {cfg.mlflow_uri}")
    return out


def main(task: str | None, argv: list[str] | None = None) -> int:
    """Entry point shared by jobs/*.py: parse + validate the config, run, exit non-zero on failure."""
    try:
        cfg = JobConfig.from_args(argv, task=task)
        with quiet.stderr_without(quiet.RAY_ACTOR_RESTART_NOTICE):
            result = run(cfg)
    except ConfigError as e:
        print(f"[rcr-job] {e}", file=sys.stderr, flush=True)
        return 2
    if result["status"] != "ok":
        return 1
    if result.get("mlflow_error"):
        return MLFLOW_FAILED_EXIT
    return 0
