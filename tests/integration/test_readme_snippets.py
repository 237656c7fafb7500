"""Every ```python block of the README runs, as written, taken from README.md itself (so the two cannot drift
apart): the library snippet on the embedded model, and the pandas snippets, in order, on a small job's output.

The one substitution: the pandas snippets' `OUT = ...` line (the README says "Set OUT to the job's output
directory") is pointed at the small job's output directory. The small job runs the embedded model through the
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


def readme_python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S)


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
    pandas_blocks = blocks[blocks.index(next(b for b in blocks if OUT_LINE.search(b))):]
    assert len(lib) == 1 and len(lib) + len(pandas_blocks) == len(blocks), "a README snippet this test does not run"


def test_readme_library_snippet_runs_on_the_embedded_model(one_thread):
    (code,) = [b for b in readme_python_blocks() if 'load("embedded")' in b]
    ns: dict = {}
    printed = _run(code, ns, "README.md (library snippet)")
    s = ns["s"]
    assert np.isnan(s["trigger"][0]).all()  # layer 0 is never re-selected: the case the snippet handles
    refresh = float(printed.strip().splitlines()[-1])
    assert 0 <= refresh <= 1 and refresh == pytest.approx(float(np.nanmean(s["trigger"])))
    assert set(ns["res"]) == {"full", "bacon", "exact", "fixed", "rcr"}


def test_readme_pandas_snippets_run_on_a_small_jobs_output(job_out):
    blocks = readme_python_blocks()
    first = next(i for i, b in enumerate(blocks) if OUT_LINE.search(b))
    assert len(OUT_LINE.findall(blocks[first])) == 1
    df = pd.read_parquet(job_out)
    assert df[df.method == "rcr"].trigger.map(lambda t: t[0] is None).all()  # the never re-selected layer 0
    ns: dict = {}
    printed = []
    for i, code in enumerate(blocks[first:]):
        if i == 0:
            code = OUT_LINE.sub(f"OUT = {job_out!r}", code)
        printed.append(_run(code, ns, f"README.md (pandas snippet {i + 1})"))
    assert set(ns["per_method"].index) == {"full", "bacon", "rcr"}
    assert ns["per_method"].loc["full", "fidelity"] == 1.0
    per_step = ns["per_step"]
    assert len(per_step) and per_step["mean"].between(0, 1).all() and per_step["mean"].notna().all()
    assert "fidelity [95% CI]" in printed[-1]  # format_summary's table
