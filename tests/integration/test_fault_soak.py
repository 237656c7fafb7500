"""The fault soak's CI smoke (benchmarks/fault_soak.py; docs/pipeline.md, "Faults"): two fixed seeds, run as the
soak runs them, to keep the script working. The soak itself (40 trials) is a benchmark, not a test.

Seed 4 draws SIGINT to a plain job's process group (a terminal's Ctrl-C) and seed 6 `ray stop` of its private Ray:
neither needs a cluster started first nor a tmpfs (root). Each trial's fault lands at a moment drawn from the
reference job's life, so the moment varies with the machine's speed; what must hold whatever the moment is what the
soak checks: the same command again ends the job with every row once, equal to the fault-free run, nothing left
half-written, an honest MLflow store, and every failed exit said in one line.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.pipeline_helpers import PY, REPO

pytestmark = [pytest.mark.ray, pytest.mark.timeout(1800)]

SEEDS = (4, 6)


def test_two_soak_trials_pass(tmp_path):
    argv = [PY, "-m", "benchmarks.fault_soak", "--samples", "4", "--max-new-tokens", "8", "--work", str(tmp_path)]
    for s in SEEDS:
        argv += ["--seed", str(s)]
    r = subprocess.run(argv, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                       timeout=1700, check=False)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    trials = [ln for ln in r.stdout.splitlines() if ln.startswith("seed ")]
    assert [ln.split()[1] for ln in trials] == [str(s) for s in SEEDS], r.stdout
    assert "sigint_driver" in trials[0] and "ray_stop" in trials[1]
    assert all(ln.rstrip().endswith("ok") for ln in trials), r.stdout
