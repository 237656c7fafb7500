"""Run a job's driver without Ray, for the fault tests: the planned rows go through ``SampleEvaluator`` in
this process, in shard order, ``batch_size`` samples per call. Everything else (config, planning, lock,
resume, writes, run records, summary, MLflow) is the driver's own code.

    python -m tests.inline_driver detailcaps --model ... --engine tests.pipeline_helpers:FakeEngine ...

``install()`` does the same inside a test process. With ``RCR_TEST_HANG_AT_PART=k`` and
``RCR_TEST_SIGNAL=<path>``, the k-th part write (counting from 1) writes half its bytes, touches
``<path>`` and hangs there, so a test can SIGKILL the driver mid-write.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.run import driver, ray_stages, store
from pipeline.run.actor import SampleEvaluator
from pipeline.run.select import select_planned
from pipeline.schema import INPUT_SCHEMA


class _NoRay:
    """What the driver asks of Ray about the cluster: one node of 2 CPUs."""

    @staticmethod
    def cluster_resources() -> dict[str, float]:
        return {"CPU": 2.0}

    @staticmethod
    def get_runtime_context():
        return SimpleNamespace(gcs_address=None)  # no head to watch

    @staticmethod
    def nodes() -> list[dict]:
        return [{"NodeID": "inline", "NodeManagerAddress": "127.0.0.1", "Alive": True, "Resources": {"CPU": 2.0}}]


class InlineDataset:
    """What the driver reads from Ray Data's dataset (``iter_batches``), computed in this process."""

    def __init__(self, cfg, paths, plan, res, calibration_payload=None):
        self.cfg, self.paths, self.plan, self.res = cfg, paths, plan, res
        self.calibration_payload = calibration_payload  # InfiniGen's, as the driver resolved it

    def iter_batches(self, batch_size=None, batch_format="pyarrow", prefetch_batches=1):
        """Each batch is yielded as soon as it is computed, which is what ``prefetch_batches=0`` gives."""
        actor_cfg = self.cfg.to_dict()
        actor_cfg["torch_threads"] = self.res.torch_threads
        ev = SampleEvaluator(actor_cfg, config_hash=self.cfg.config_hash, calibration=self.calibration_payload)
        bs = self.cfg.batch_size
        for path in self.paths:
            table = select_planned(pq.read_table(path, columns=list(INPUT_SCHEMA.names)), self.plan.todo,
                                   self.plan.dup_accept)
            for i in range(0, table.num_rows, bs):
                yield ev(table.slice(i, bs))


def install(patch=None) -> None:
    """Replace the driver's two Ray calls (``patch`` is pytest's ``monkeypatch.setattr``, else plain setattr)."""
    set_ = patch or setattr
    set_(ray_stages, "init_ray", lambda cfg: _NoRay)
    set_(ray_stages, "build_dataset", lambda ray, cfg, paths, plan, res, calibration_payload=None:
         InlineDataset(cfg, paths, plan, res, calibration_payload))


def _hang_at_part(k: int, signal_path: str) -> None:
    real = store.atomic_write_table
    calls = [0]

    def write(table, path):
        calls[0] += 1
        if calls[0] < k:
            return real(table, path)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        data = sink.getvalue().to_pybytes()
        with store.atomic_path(path) as fh:
            fh.write(data[: len(data) // 2])
            fh.flush()
            Path(signal_path).touch()
            threading.Event().wait()  # here until the test's SIGKILL

    store.atomic_write_table = write


def main(argv: list[str]) -> int:
    install()
    if os.environ.get("RCR_TEST_HANG_AT_PART"):
        _hang_at_part(int(os.environ["RCR_TEST_HANG_AT_PART"]), os.environ["RCR_TEST_SIGNAL"])
    return driver.main(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
