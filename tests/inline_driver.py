"""Run a job's driver without Ray, for the fault tests: the planned rows go through ``SampleEvaluator`` in
this process, in shard order, ``batch_size`` samples per call. Everything else (config, planning, lock,
resume, writes, run records, summary, MLflow) is the driver's own code.

    python tests/inline_driver.py detailcaps --model ... --engine tests.pipeline_helpers:FakeEngine ...

``install()`` does the same inside a test process. With ``RCR_TEST_HANG_AT_PART=k`` and
``RCR_TEST_SIGNAL=<path>``, the k-th part write (counting from 1) writes half its bytes, touches
``<path>`` and hangs there, so a test can SIGKILL the driver mid-write.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent


class _NoRay:
    @staticmethod
    def cluster_resources() -> dict[str, float]:
        return {"CPU": 2.0}


class InlineDataset:
    def __init__(self, cfg, paths, plan, res):
        self.cfg, self.paths, self.plan, self.res = cfg, paths, plan, res

    def iter_batches(self, batch_size=None, batch_format="pyarrow"):
        from pipeline import run as R
        from pipeline.actor import SampleEvaluator
        from pipeline.schema import INPUT_SCHEMA

        actor_cfg = self.cfg.to_dict()
        actor_cfg["torch_threads"] = self.res["torch_threads"]
        ev = SampleEvaluator(actor_cfg, config_hash=self.cfg.config_hash)
        bs = self.cfg.batch_size
        for path in self.paths:
            table = R._select(pq.read_table(path, columns=list(INPUT_SCHEMA.names)), self.plan.todo,
                              self.plan.dup_accept)
            for i in range(0, table.num_rows, bs):
                yield ev(table.slice(i, bs))


def install(patch=None) -> None:
    """Replace the driver's two Ray calls (``patch`` is pytest's ``monkeypatch.setattr``, else plain setattr)."""
    from pipeline import run as R

    set_ = patch or setattr
    set_(R, "_ray_init", lambda cfg: _NoRay)
    set_(R, "_build_dataset", lambda ray, cfg, paths, plan, res: InlineDataset(cfg, paths, plan, res))


def _hang_at_part(k: int, signal_path: str) -> None:
    from pipeline import io

    real = io.atomic_write_table
    calls = [0]

    def write(table, path):
        calls[0] += 1
        if calls[0] < k:
            return real(table, path)
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        data = sink.getvalue().to_pybytes()
        with io.atomic_path(path) as fh:
            fh.write(data[: len(data) // 2])
            fh.flush()
            Path(signal_path).touch()
            while True:  # wait here for the test's SIGKILL
                time.sleep(1)

    io.atomic_write_table = write


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))
    install()
    if os.environ.get("RCR_TEST_HANG_AT_PART"):
        _hang_at_part(int(os.environ["RCR_TEST_HANG_AT_PART"]), os.environ["RCR_TEST_SIGNAL"])
    from pipeline import run as R

    return R.main(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
