"""The job's plan and run record: which (sample, method) rows are missing from the output directory, the rows the
driver rejects itself, and the record of each run (``<output_dir>/_runs/<run_id>.json``)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.quiet import say
from pipeline.run.config import JobConfig
from pipeline.run.inputs import ShardRow, read_rows
from pipeline.run.store import CORRUPT_DIR, OutputStore
from pipeline.schema import JobStamp, error_rows, output_table


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


@dataclass
class Plan:
    rows: list[ShardRow]  # input rows in scope (after limit), shard order
    methods: list[str]
    todo: dict[str, list[str]] = field(default_factory=dict)  # sample_id -> methods to compute (model work)
    driver_errors: list[ShardRow] = field(default_factory=list)  # rows rejected by the driver, needing rows
    dup_accept: dict[str, str] = field(default_factory=dict)  # duplicated sample_id -> fingerprint kept
    n_existing: int = 0

    @property
    def n_pairs(self) -> int:
        return len(self.rows) * len(self.methods)

    @property
    def n_todo_pairs(self) -> int:
        return sum(len(v) for v in self.todo.values()) + sum(len(self.missing_for(r.key)) for r in self.driver_errors)

    def missing_for(self, key: str) -> list[str]:
        return self._missing.get(key, [])

    _missing: dict[str, list[str]] = field(default_factory=dict)


def make_plan(rows: list[ShardRow], methods: list[str], existing: set[tuple[str, str]],
              dup_accept: dict[str, str]) -> Plan:
    plan = Plan(rows=rows, methods=list(methods), dup_accept=dup_accept)
    for r in rows:
        missing = [m for m in methods if (r.key, m) not in existing]
        plan.n_existing += len(methods) - len(missing)
        if not missing:
            continue
        plan._missing[r.key] = missing
        if r.error is not None:
            plan.driver_errors.append(r)
        else:
            plan.todo[r.key] = missing
    return plan


def plan_job(cfg: JobConfig, store: OutputStore, inputs: tuple) -> tuple[list[str], Plan]:
    """Lock the output directory and plan what is missing in it. ``inputs``: ``scan_inputs(cfg)``."""
    paths, rows, dup_accept = inputs
    open_output_dir(store)
    existing = store.existing_keys(cfg.config_hash)
    return paths, make_plan(rows, cfg.methods, existing, dup_accept)


def open_output_dir(store: OutputStore) -> None:
    """Lock the output directory for this job, then clear what a killed writer left: run records left ``running``
    (marked ``died``), stale temporaries, and parts that do not read back whole (moved to _corrupt/, so their rows
    are planned again)."""
    store.acquire()
    dead = store.mark_dead_runs()
    if dead:
        say(f"run(s) {', '.join(dead)} ended without updating their record (killed, or the node or cluster was lost): "
            "marked died")
    if store.remove_stale_temps():
        say(f"removed the temporary file(s) of an interrupted write in {store.root}")
    for name in store.set_aside_corrupt():
        say(f"part file {name} is corrupt or truncated: moved to {store.root / CORRUPT_DIR / name}; "
            "its rows will be computed again")


def new_record(cfg: JobConfig, run_id: str, paths: list[str], plan: Plan) -> dict[str, Any]:
    """The run record as it is written before any model work (``status: running``)."""
    pending = {**plan.todo, **{r.key: plan.missing_for(r.key) for r in plan.driver_errors}}
    return {
        "run_id": run_id, "job_name": cfg.job_name, "config_hash": cfg.config_hash, "config": cfg.record(),
        "shards": paths, "n_samples": len(plan.rows), "methods": plan.methods, "n_pairs": plan.n_pairs,
        "n_existing": plan.n_existing, "n_planned": plan.n_todo_pairs,
        "planned": sorted([k, m] for k, ms in pending.items() for m in ms),
        "status": "running", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def driver_error_table(cfg: JobConfig, plan: Plan) -> pa.Table:
    """Rows the driver rejects itself (duplicate / missing sample_id): error rows, no model work."""
    job = JobStamp(model=cfg.model, config_hash=cfg.config_hash, job_name=cfg.job_name, task=cfg.task)
    full_rows = read_rows(plan.driver_errors)
    rows = []
    for r in plan.driver_errors:
        rows.extend(error_rows(job, full_rows[(r.file, r.row)], plan.missing_for(r.key), r.error, key=r.key))
    return output_table(rows)
