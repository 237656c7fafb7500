"""docs/extending.md, walked through once: a toy method and a toy task (``tests/extending_toys.py``), each one
definition plus one registration, go through the method contract suite and a one-sample job."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

import rcr
from pipeline.run import driver
from pipeline.run.cli import job_config
from pipeline.tasks import TASKS
from tests import inline_driver
from tests.extending_toys import TOY_TASK, Recent
from tests.pipeline_helpers import REPO, synthetic_records, write_shard


def test_the_toy_method_goes_through_every_contract():
    """Loaded as a plugin before collection, the registered toy method is parametrized into every contract, and
    keeps them all."""
    args = ["-p", "no:cacheprovider", "-p", "tests.extending_toys", "tests/rcr/test_method_contracts.py", "-k",
            "toy_recent"]
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args], cwd=REPO,
                             capture_output=True, text=True, timeout=600, check=True).stdout
    collected = [line for line in listing.splitlines() if "toy_recent" in line]
    for contract in ("test_a_decode_step_makes_no_host_sync", "test_a_compiled_decode_is_one_graph_and_equals_eager",
                     "test_every_input_of_the_compiled_step_is_a_static_address",
                     "test_a_budget_over_the_prefix_equals_full",
                     "test_a_padded_batch_equals_its_samples_decoded_alone",
                     "test_the_reads_of_a_row_are_the_methods_cost_model"):
        assert any(f"{contract}[" in line for line in collected), contract
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=1200, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].startswith(f"{len(collected)} passed"), r.stdout[-500:]


def test_a_one_sample_job_runs_the_toy_method_on_the_toy_task(tmp_path, monkeypatch):
    monkeypatch.setitem(rcr.METHODS, Recent.name, Recent)
    monkeypatch.setitem(TASKS, TOY_TASK.name, TOY_TASK)
    rec = {**synthetic_records("detailcaps", 1)[0], "task": TOY_TASK.name, "prompt": TOY_TASK.prompt}
    shard = write_shard(tmp_path / "in.parquet", [rec])
    monkeypatch.setenv("RCR_RUNS_DIR", str(tmp_path / "runs"))
    inline_driver.install(monkeypatch.setattr)
    cfg = job_config(["--task", TOY_TASK.name, "--shards", str(shard), "--no-summary",
                      "--methods", "bacon,toy_recent,toy_recent@end=first"])
    assert cfg.max_new_tokens == TOY_TASK.max_new_tokens  # the task's own default
    assert driver.run(cfg)["status"] == "ok"
    df = pd.read_parquet(cfg.output_dir).set_index("method")
    assert df.error.isna().all() and set(df.task) == {TOY_TASK.name}
    assert set(df.index) == {"full", "bacon", "toy_recent", "toy_recent@end=first"}
    assert (df.n_steps <= TOY_TASK.max_new_tokens).all()
    assert df.loc["toy_recent", "refresh_fraction"] == 1.0  # a scorer refreshes every re-selected layer-step
    assert df.loc["toy_recent", "keys_read_per_step"] == 32  # its cost model: S keys per step


def test_a_bad_knob_of_the_toy_method_is_one_line(monkeypatch):
    monkeypatch.setitem(rcr.METHODS, Recent.name, Recent)
    with pytest.raises(rcr.ConfigError, match="field 'toy_recent.end': must be 'last' or 'first', got 'middle'"):
        rcr.parse_method("toy_recent@end=middle")
    with pytest.raises(rcr.ConfigError, match="already registered"):
        rcr.methods.register(type("Other", (Recent,), {"name": "bacon"}))
