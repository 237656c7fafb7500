"""docs/extending.md, walked through once: a toy method and a toy task (``tests/extending_toys.py``), each one
definition plus one registration, go through the method contract suite and a one-sample job."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys

import pandas as pd
import pytest

import rcr
from pipeline.run import driver
from pipeline.run.cli import job_config
from pipeline.tasks import TASKS
from rcr.methods import knob
from tests import inline_driver
from tests.extending_toys import TOY_TASK, Recent, forget_plugin, install_plugin
from tests.pipeline_helpers import REPO, synthetic_records, write_shard

CONTRACTS = "tests/rcr/test_method_contracts.py"


def _collect(*args: str) -> list[str]:
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args], cwd=REPO,
                             capture_output=True, text=True, timeout=600, check=True).stdout
    return [line for line in listing.splitlines() if "::" in line]


def test_one_methods_contracts_are_selected_exactly(capsys):
    """docs/extending.md's selector picks one method's contracts and no other's: `-k rcr` matches every test of
    tests/rcr/, `-m "method(name='rcr')"` rcr's alone (not rcr_layer's)."""
    def collect(*args: str) -> list[str]:
        assert pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", CONTRACTS, *args]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if "::" in line]

    rcr_ids, every = collect("-m", "method(name='rcr')"), collect()
    assert rcr_ids and all(re.search(r"\[rcr(-\w+)?\]$", i) for i in rcr_ids), rcr_ids
    assert len(every) == len(rcr_ids) * len(rcr.METHODS)  # every method has as many


def test_the_toy_method_goes_through_every_contract():
    """Loaded as a plugin before collection, the registered toy method is parametrized into every contract, and
    keeps them all."""
    args = ["-p", "no:cacheprovider", "-p", "tests.extending_toys", CONTRACTS, "-m", "method(name='toy_recent')"]
    collected = _collect(*args)
    assert collected and all("toy_recent" in line for line in collected)
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


def test_a_knob_named_like_another_methods_is_its_own(tmp_path, monkeypatch):
    """A new method's knob `rank` (default 4) beside rcr's `rank` (8): the job starts, its record keeps both by
    method, a changed default re-keys the jobs that run the method, and registering it re-keys no other job."""
    monkeypatch.setenv("RCR_RUNS_DIR", str(tmp_path))

    def ranked(default: int) -> type:
        return dataclasses.make_dataclass("Ranked", [("rank", int, knob(default, "rank of the toy"))],
                                          bases=(Recent,), namespace={"name": "toy_ranked"})

    others = ["--methods", "full,bacon,rcr"]
    before = job_config(others).config_hash
    monkeypatch.setitem(rcr.METHODS, "toy_ranked", ranked(4))
    assert job_config(others).config_hash == before
    cfg = job_config(["--methods", "bacon,toy_ranked@end=first,rcr"])
    key, knobs = cfg.config_hash, cfg.record()["method_knobs"]
    assert knobs["toy_ranked"] == {"end": "last", "rank": 4} and knobs["rcr"]["rank"] == 8
    assert rcr.parse_method("toy_ranked@rank=2").rank == 2 and rcr.parse_method("rcr").rank == 8
    monkeypatch.setitem(rcr.METHODS, "toy_ranked", ranked(5))
    assert cfg.config_hash != key


def test_an_installed_packages_method_and_task_reach_every_process(tmp_path):
    """A package that declares entry points in the groups rcr.methods and rcr.tasks: a new process that imports the
    pipeline (as a job's driver and its Ray workers do) has its method and task registered, whichever it imports
    first. The job itself: tests/integration/test_plugin_job.py."""
    install_plugin(tmp_path / "site")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]))
    probe = ("import pipeline.schema, rcr; from pipeline.tasks import TASKS; m = rcr.parse_method('toy_plugin@rank=2');"
             "print(type(m).__module__, m.rank, TASKS['toy_plugin_task'].max_new_tokens)")
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["rcr_toy_plugin.methods", "2", "8"]


def test_an_entry_point_that_fails_names_itself(tmp_path, monkeypatch):
    """An entry point that does not load, or names something that is not a method, is an error naming it and its
    package; one that names a module registers what the module registers."""
    group = "rcr.test_methods"
    install_plugin(tmp_path, f"[{group}]\nbroken = rcr_toy_plugin.methods:Missing\n")
    forget_plugin(monkeypatch)  # this test's package, not one another test imported from its own directory
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"entry point broken = rcr_toy_plugin.methods:Missing \(group "
                                          r"rcr.test_methods, package rcr-toy-plugin\) does not load: AttributeError"):
        rcr.methods.load_entry_points(group)
    info = tmp_path / "rcr_toy_plugin-0.1.dist-info" / "entry_points.txt"
    info.write_text(f"[{group}]\nwrong = rcr_toy_plugin.tasks:TOY_PLUGIN_TASK\n")
    with pytest.raises(rcr.ConfigError, match="wrong = rcr_toy_plugin.tasks:TOY_PLUGIN_TASK .* it must name a "
                                              "Method subclass or a module"):
        rcr.methods.load_entry_points(group)
    (tmp_path / "rcr_toy_plugin" / "registers.py").write_text(
        "from rcr.methods import register\nfrom rcr_toy_plugin.methods import Newest\nregister(Newest)\n")
    importlib.invalidate_caches()  # the package's directory was listed when it was first imported, maybe this second
    info.write_text(f"[{group}]\nby_import = rcr_toy_plugin.registers\n")
    monkeypatch.setitem(rcr.METHODS, "toy_plugin", None)  # removed again after the test
    del rcr.METHODS["toy_plugin"]
    assert rcr.methods.load_entry_points(group) == ["by_import"] and rcr.METHODS["toy_plugin"].__name__ == "Newest"
