"""docs/extending.md's promise, as a user meets it: a method and a task from a package of one's own (installed: a
dist-info with entry points in the groups rcr.methods and rcr.tasks, on PYTHONPATH), input shards for the task
written with `write_shards`, and a plain `python jobs/eval.py` with its private Ray. The driver and the Ray workers
(read tasks, actors) each find the method and the task; the method's knob `rank` is named like rcr's, with its own
default; the summary fits 120 columns and says that 2 samples are too few for its CIs."""

from __future__ import annotations

import os
import shutil
import subprocess

import pandas as pd
import pytest

from pipeline.data.shards import write_shards
from pipeline.tasks import TASKS
from tests.extending_toys import forget_plugin, install_plugin
from tests.pipeline_helpers import PY, REPO, synthetic_records
from tests.ray_head import free_port

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


def test_a_packages_method_and_task_run_in_a_job(tmp_path, monkeypatch):
    install_plugin(tmp_path / "site")
    forget_plugin(monkeypatch)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))  # this process writes the shards: it knows the task too
    from rcr_toy_plugin.tasks import TOY_PLUGIN_TASK

    monkeypatch.setitem(TASKS, TOY_PLUGIN_TASK.name, TOY_PLUGIN_TASK)
    records = [{**r, "task": "toy_plugin_task"} for r in synthetic_records("detailcaps", 2)]
    write_shards(records, tmp_path / "shards")  # validated against the input schema, whose tasks include the toy's
    runs, ray_tmp = tmp_path / "runs", f"/tmp/rcrp{os.getpid()}_{free_port()}"
    env = dict(os.environ, RCR_RUNS_DIR=str(runs), RCR_RAY_TMP=ray_tmp,
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
               PATH=f"{os.path.dirname(PY)}:{os.environ.get('PATH', '')}")
    env.pop("RAY_ADDRESS", None)
    try:
        r = subprocess.run([PY, "jobs/eval.py", "--task", "toy_plugin_task", "--shards", str(tmp_path / "shards"),
                            "--methods", "bacon,rcr,toy_plugin,toy_plugin@rank=2", "--num-actors", "1",
                            "--mlflow-uri", f"sqlite:///{runs / 'mlflow.db'}"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=800, check=False)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    df = pd.read_parquet(runs / "toy_plugin_task-embedded")
    assert df.error.isna().all() and set(df.task) == {"toy_plugin_task"}
    assert sorted(df.method.unique()) == ["bacon", "full", "rcr", "toy_plugin", "toy_plugin@rank=2"]
    assert (df.n_steps <= 8).all()  # the task's own max_new_tokens
    summary = out[out.index("== model: embedded =="):out.index("refresh = realised")]
    assert max(map(len, summary.splitlines())) <= 120, summary
    assert "n = 2 samples (< 10): the bootstrap CIs are not to be trusted" in summary
