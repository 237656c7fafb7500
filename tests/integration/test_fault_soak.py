"""The fault soak's CI smoke (benchmarks/fault_soak.py; docs/cluster.md, "Faults"): two fixed seeds, run as the
soak runs them, to keep the script working. The soak itself (40 trials) is a benchmark, not a test.

Seed 42 draws SIGKILL of a plain job's driver and seed 67 SIGINT to a plain job's process group (a terminal's
Ctrl-C), both early in the job's life: neither needs a cluster started first nor a tmpfs (root), and each trial is a
short first run and one whole rerun, so the two cost about three lives of a 2-sample job with the reference. Each
trial's fault lands at a moment drawn from the reference job's life, so the moment varies with the machine's speed;
what must hold whatever the moment is what the soak checks: the same command again ends the job with every row once,
equal to the fault-free run, nothing left half-written, an honest MLflow store, and every failed exit said in one
line.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.pipeline_helpers import PY, REPO

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

SEEDS = (42, 67)


def test_two_soak_trials_pass(tmp_path):
    argv = [PY, "-m", "benchmarks.fault_soak", "--samples", "2", "--max-new-tokens", "4", "--work", str(tmp_path)]
    for s in SEEDS:
        argv += ["--seed", str(s)]
    proc = subprocess.Popen(argv, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=850)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the soak then stops every process it started (a SIGKILL would not)
        stdout, stderr = proc.communicate()
    print(stdout[-3000:])
    assert proc.returncode == 0, stdout[-6000:] + stderr[-3000:]
    trials = [ln for ln in stdout.splitlines() if ln.startswith("seed ")]
    assert [ln.split()[1] for ln in trials] == [str(s) for s in SEEDS], stdout
    assert "kill_driver" in trials[0] and "sigint_driver" in trials[1]
    # each fault landed (a trial whose job ended first would test nothing) and every invariant held
    assert all(" at " in ln and "never landed" not in ln for ln in trials), stdout
    assert all(ln.rstrip().endswith("ok") for ln in trials), stdout
