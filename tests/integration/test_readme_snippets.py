"""Every ```python block of the README runs, as written, taken from README.md itself (so the two cannot drift
apart): the library snippet on the embedded model, and the results snippet on a small job's output; and so does
docs/pipeline.md's pandas walk-through, on the same output.

The one substitution: a results snippet's `OUT = ...` line (the job's output directory) is pointed at the small
job's output directory. The small job runs the embedded model through the
driver in this process (tests/inline_driver.py, no Ray); its rows have the layer the README says is never
re-selected (the embedded model's layer 0), which is what the snippets must handle. Torch runs on one thread here
(README: one thread per CPU actor; two threads on two shared cores are many times slower).
"""

from __future__ import annotations

import contextlib
import io
import re

import numpy as np
import pandas as pd
import pytest
import torch

from tests.fault_helpers import run_inline
from tests.pipeline_helpers import REPO, synthetic_records, write_shard

pytestmark = pytest.mark.timeout(900)

OUT_LINE = re.compile(r"^OUT = .*$", re.M)


def python_blocks(doc: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (REPO / doc).read_text(), re.M | re.S)


def readme_python_blocks() -> list[str]:
    return python_blocks("README.md")


def results_blocks() -> list[tuple[str, str]]:
    """(name, code): the README's results snippet, then docs/pipeline.md's pandas walk-through."""
    readme = [b for b in readme_python_blocks() if OUT_LINE.search(b)]
    docs = [b for b in python_blocks("docs/pipeline.md") if OUT_LINE.search(b)]
    assert len(readme) == 1 and len(docs) == 1
    return [("README.md (results snippet)", readme[0]), ("docs/pipeline.md (pandas walk-through)", docs[0])]


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def job_out(tmp_path_factory) -> str:
    """A small detailcaps job on the embedded model: 3 samples x full, bacon, rcr."""
    tmp = tmp_path_factory.mktemp("readme-job")
    write_shard(tmp / "shards" / "s0.parquet", synthetic_records("detailcaps", 3))
    out = tmp / "out"
    r = run_inline(["--model", "embedded", "--shards", str(tmp / "shards"), "--methods", "full,bacon,rcr",
                    "--max-new-tokens", "48", "--batch-size", "3", "--output-dir", str(out), "--no-summary",
                    "--mlflow-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--progress-every-s", "1000"])
    assert r["status"] == "ok" and r["n_written"] == 9, r
    return str(out)


def _run(code: str, ns: dict, name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), ns)  # the README's own snippets
    return out.getvalue()


def test_every_readme_python_snippet_is_run_here():
    blocks = readme_python_blocks()
    lib = [b for b in blocks if 'load("embedded")' in b]
    results = [b for b in blocks if OUT_LINE.search(b)]
    assert len(lib) == 1 and len(results) == 1 and len(blocks) == 2, "a README snippet this test does not run"


def test_readme_library_snippet_runs_on_the_embedded_model(one_thread):
    (code,) = [b for b in readme_python_blocks() if 'load("embedded")' in b]
    ns: dict = {}
    printed = _run(code, ns, "README.md (library snippet)")
    s = ns["s"]
    assert np.isnan(s["trigger"][0]).all()  # layer 0 is never re-selected: the case the snippet handles
    refresh = float(printed.strip().splitlines()[-1])
    assert 0 <= refresh <= 1 and refresh == pytest.approx(float(np.nanmean(s["trigger"])))
    assert set(ns["res"]) == {"full", "bacon", "exact", "fixed", "rcr", "rcr@rho=0.3"}
    # the label's knob took effect: a lower target rate refreshes less on the same prefill
    assert np.nanmean(ns["res"]["rcr@rho=0.3"].sample(0)["trigger"]) < refresh


def test_results_snippets_run_on_a_small_jobs_output(job_out):
    df = pd.read_parquet(job_out)
    assert df[df.method == "rcr"].trigger.map(lambda t: t[0] is None).all()  # the never re-selected layer 0
    printed = {}
    for name, code in results_blocks():
        assert len(OUT_LINE.findall(code)) == 1
        ns: dict = {}
        printed[name] = _run(OUT_LINE.sub(f"OUT = {job_out!r}", code), ns, name)
        if name.startswith("docs"):
            assert set(ns["per_method"].index) == {"full", "bacon", "rcr"}
            assert ns["per_method"].loc["full", "fidelity"] == 1.0
            per_step = ns["per_step"]
            assert len(per_step) and per_step["mean"].between(0, 1).all() and per_step["mean"].notna().all()
    for text in printed.values():
        assert "fidelity [95% CI]" in text  # format_summary's table
