"""A job's own output is quiet and truthful: no warning or deprecation line from the project's calls, no Ray
informational lines or Ray Data progress blocks, one progress display (`--help`: tests/pipeline/test_job_help.py)."""

from __future__ import annotations

import re

import pytest

from tests.pipeline_helpers import LocalRayHead, synthetic_records, write_shard


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_small_job_output_is_quiet(tmp_path):
    """The quickstart's path: `ray job submit` to a local head (private ports, like the other Ray tests)."""
    shards = tmp_path / "shards"
    write_shard(shards / "part-0.parquet", synthetic_records("detailcaps", 2))
    out_dir = tmp_path / "out"
    head = LocalRayHead(tmp_path / "head", num_cpus=2)
    (tmp_path / "head").mkdir()
    head.start()
    try:
        r = head.submit(["jobs/detailcaps.py", "--shards", str(shards), "--methods", "full,bacon",
                         "--max-new-tokens", "8", "--output-dir", str(out_dir),
                         "--mlflow-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--progress-every-s", "2"])
    finally:
        head.stop()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    lines = out.splitlines()
    noisy = [ln for ln in lines if re.search(r"Warning|Deprecat|\bWARNING\b", ln)]
    assert not noisy, "\n".join(noisy)
    # the CLI keeps its submission lines (address, "Next steps"), but not a notice per packaged file or directory
    packaging = [ln for ln in lines if re.search(r"Ignoring upload|ignored by default|packaging\.py", ln)]
    assert not packaging, "\n".join(packaging)
    # the job's own log (stdout, from its first line on): no Ray/Ray Data INFO lines, progress blocks or bars
    job = r.stdout.splitlines()
    job = job[next(i for i, ln in enumerate(job) if ln.startswith("[rcr-job] job ")):]
    chatter = [ln for ln in job if re.search(r"\tINFO |logging_progress|Running Dataset|Loading weights", ln)]
    assert not chatter, "\n".join(chatter)
    progress = [ln for ln in job if ln.startswith("[rcr-job] progress: ")]
    assert progress and progress[-1].startswith("[rcr-job] progress: 4/4 rows, 2/2 samples")
    assert any(ln.startswith(f"[rcr-job] Parquet: {out_dir}") for ln in job)
