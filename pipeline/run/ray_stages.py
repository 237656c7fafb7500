"""The job's Ray stages, and every Ray workaround the job needs, in one place: starting or joining Ray, the Ray
Data pipeline (read -> select -> repartition -> the model actors), and streaming its result blocks to the writer
while the node watch reports lost nodes.

Ray Data 2.60 specifics are explained where they are handled: the V1 Parquet reader (V2 lists files in a 1-CPU
task), the repartition's resource request, one read task per file, ``prefetch_batches=0``.
"""

from __future__ import annotations

import os

from pipeline import quiet
from pipeline.quiet import say
from pipeline.run import interrupt, placement, preflight, ray_local
from pipeline.run.actor import SampleEvaluator
from pipeline.run.config import REPO_ROOT, JobConfig
from pipeline.run.plan import Plan
from pipeline.run.select import select_planned
from pipeline.run.store import PartWriteError
from pipeline.run.writer import PartWriter, write_failed_line
from pipeline.schema import INPUT_SCHEMA

# Memory a read/select task asks for. Ray Data's high-memory detector warns when a stage's workers use more than
# they asked for (asked for nothing, a 0.25-CPU task counts as asking for 0.6 GiB) or, at the end, more than 4/5 of
# it. Measured: up to 0.88 GiB (USS, the object-store pages it wrote included) per read worker on the embedded
# shards (files of 123 MiB), with the read function in a module that does not import torch (pipeline/run/select.py;
# importing torch adds 0.45 GiB). Capped at a quarter of the cluster's memory, so that it stays schedulable.
READER_MEMORY = 1536 * 2**20


def init_ray(cfg: JobConfig):
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
    with interrupt.kept():  # ray.init's own SIGTERM handlers would end the driver before it says what it left
        _init(ray, cfg)
    return ray


def _init(ray, cfg: JobConfig) -> None:
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


def light_repartition(ds, rows: int, read: dict):
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


def build_dataset(ray, cfg: JobConfig, paths: list[str], plan: Plan, res: placement.ActorPlan,
                   calibration_payload: dict | None = None):
    ctx = ray.data.DataContext.get_current()
    ctx.max_errored_blocks = 0
    # Ray Data 2.60's Parquet reader V2 (its default) lists the files in a task of its own that asks for 1 CPU,
    # with no way to ask for less: with the actors on every node (3 nodes of 1 CPU) no node has a whole CPU
    # free and the job waits forever. V1 lists them on the driver and reads with the request given here.
    ctx.use_datasource_v2 = False
    # A model batch may take longer than Ray Data lets a dataset go without output (30 min by default): one batch of
    # every method at a published model's size on a CPU does. The job watches its own liveness (progress lines,
    # the node watch, actor restarts), so Ray Data's no-progress timeout is off (tests/integration/test_slow_batch.py)
    ctx.execution_no_progress_timeout_s = -1
    quiet.quiet_ray_data(ctx)  # the job prints its own progress line (_Progress)
    # one read task and block per file, which Ray Data fuses with the select and the repartition below (that one
    # makes the batches); V1 would otherwise split each file into dozens of blocks first (72 per embedded shard)
    read = {"num_cpus": placement.READER_CPUS, "memory": reader_memory(ray.cluster_resources())}
    ds = ray.data.read_parquet(paths, columns=list(INPUT_SCHEMA.names), override_num_blocks=len(paths), **read)
    ds = ds.map_batches(select_planned, fn_kwargs={"todo": plan.todo, "dup_accept": plan.dup_accept},
                        batch_format="pyarrow", batch_size=None, **read)
    ds = light_repartition(ds, cfg.batch_size, read)
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


def stream(cfg: JobConfig, paths: list[str], plan: Plan, writer: PartWriter,
            calibration_payload: dict | None = None) -> tuple[str, str | None]:
    """The model work, through Ray: every result block to ``writer``. Returns (status, error)."""
    try:
        ray = init_ray(cfg)
    except Exception as e:  # noqa: BLE001 - e.g. Ray's own start-up timeout on a busy machine: one line, exit 1
        interrupt.unwrap(e)
        error = f"{type(e).__name__}: {' '.join(str(e).split())}"
        say(f"could not start or join Ray ({error}); rerun the same command: it computes only the missing rows")
        return "failed", error
    preflight.check_cluster(cfg, ray.cluster_resources())
    nodes = placement.alive_nodes(ray)
    res = placement.plan_actors(cfg, nodes)  # ConfigError (exit 2) if no node shape can hold the stages
    loss = "they fit on the others if a node is lost" if res.survives_node_loss else \
        "a lost node's actors wait for a new node"
    spread = f" spread over the nodes ({loss})" if len(nodes) > 1 else ""
    say(f"ray: {placement.describe(nodes)}; {cfg.num_actors} actor(s) x (num_gpus={res.num_gpus:g}, "
        f"num_cpus={res.num_cpus:g}, torch threads {res.torch_threads}){spread}; batch size {cfg.batch_size}")
    watch = placement.watch_nodes(ray, nodes, res, cfg.num_actors, say, ray.get_runtime_context().gcs_address,
                                  written=lambda: len(writer.written))
    try:
        with writer.progress.heartbeat(), watch:
            # built under the watch: Ray Data's read of the inputs waits on the cluster too, and a head lost
            # there (a private Ray stopped while the actors load) must be said before Ray ends the driver
            ds = build_dataset(ray, cfg, paths, plan, res, calibration_payload)
            # prefetch_batches=0: with Ray Data's default of 1, the iterator asks for block k+1 before it yields
            # block k, so every finished batch waited on the next one (an 8-sample job showed 0 rows until the
            # end); the driver only writes blocks, so there is nothing for a prefetch to overlap
            for block in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
                writer.write(block)
    except PartWriteError as e:
        say(write_failed_line(e))
        return "failed", str(e)
    except Exception as e:  # noqa: BLE001 - record, report, and exit non-zero below
        interrupt.unwrap(e)
        error = f"{type(e).__name__}: {e}"
        say(f"the Ray pipeline failed: {error}")
        return "failed", error
    return "ok", None
