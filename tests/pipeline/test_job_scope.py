"""A later job on the same output directory, as a user meets it: each job's summary and MLflow runs cover its own
samples (its --limit), it says which, and nothing an earlier job showed (its parent run and links) disappears. The
driver runs in this process (tests/inline_driver.py), with MLflow in a temporary SQLite store."""

from __future__ import annotations

from mlflow import MlflowClient

from tests.fault_helpers import METHODS, N, make_job, run_inline


def _parents(uri: str) -> list:
    c = MlflowClient(uri)
    runs = [r for e in c.search_experiments() for r in c.search_runs([e.experiment_id], max_results=1000)]
    return [r for r in runs if r.data.tags.get("rcr.role") == "parent"]


def test_a_smaller_limit_after_a_job_gets_its_own_table_and_runs_and_the_first_stays(tmp_path, capsys):
    job = make_job(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert run_inline(job["argv"]())["status"] == "ok"  # every sample (N)
    first = capsys.readouterr().out
    assert f"summary of this job's {N} sample(s)" in first and "every sample of this config in the output dir" in first
    (whole,) = _parents(uri)

    rep = run_inline(job["argv"]("--limit", "2"))
    out = capsys.readouterr().out
    assert rep["status"] == "ok" and rep["n_written"] == 0  # nothing to compute
    ids = sorted(job["ids"][:2])
    assert (f"summary of this job's 2 sample(s) ({ids[0]} … {ids[1]}): the output dir holds {N} sample(s) of this "
            "config, and covers only these") in out
    assert "job already logged" not in out and "(new)" in out
    parents = {p.info.run_id: p for p in _parents(uri)}
    assert len(parents) == 2 and whole.info.run_id in parents  # the first job's parent (its printed links) stays
    assert {p.info.status for p in parents.values()} == {"FINISHED"}
    assert not any("rcr.superseded_by" in p.data.tags for p in parents.values())
    small = next(p for rid, p in parents.items() if rid != whole.info.run_id)
    assert small.data.params["n_samples"] == "2" and whole.data.params["n_samples"] == str(N)  # what each table covers
    assert small.data.metrics["n_samples"] == 2 and small.data.metrics["n_rows"] == 2 * len(METHODS)

    run_inline(job["argv"]())  # the first command again: its own runs, already logged
    again = capsys.readouterr().out
    assert f"job already logged (parent run {whole.info.run_id}" in again
    assert len(_parents(uri)) == 2 and len(METHODS) * 2 == sum(
        1 for e in MlflowClient(uri).search_experiments()
        for r in MlflowClient(uri).search_runs([e.experiment_id]) if r.data.tags.get("rcr.role") == "method")
