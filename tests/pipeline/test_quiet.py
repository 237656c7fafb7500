"""pipeline.quiet.stderr_without: the one Ray line is dropped from the driver's stderr, every other line comes
through, written by Python or straight to file descriptor 2 (as Ray's C++ core worker writes), also when the
process is killed right after writing it."""

from __future__ import annotations

import subprocess
import sys

from pipeline.quiet import RAY_ACTOR_RESTART_NOTICE

RAY_LINE = ("[2026-01-01 00:00:00,000 E 1 1] core_worker.cc:2465: Actor with class name: 'MapWorker(MapBatches(X))' "
            f"and ID: 'ab' {RAY_ACTOR_RESTART_NOTICE}. If the arguments in the object store go out of scope ...")


def _run(inside: list[str], after: list[str] = (), unsaid: str | None = None) -> subprocess.CompletedProcess:
    """A fresh interpreter runs the statements ``inside`` in ``stderr_without(RAY_ACTOR_RESTART_NOTICE,
    unsaid=unsaid)``, then ``after``."""
    code = "\n".join([
        "import os, signal, sys",
        "from pipeline.quiet import stderr_without, RAY_ACTOR_RESTART_NOTICE",
        f"RAY_LINE = {RAY_LINE!r}",
        'print("out before", flush=True)',
        f"with stderr_without(RAY_ACTOR_RESTART_NOTICE, unsaid={unsaid!r}):",
        *(f"    {line}" for line in inside), *after])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)


def test_drops_only_the_actor_restart_line():
    r = _run(['os.write(2, (RAY_LINE + "\\n").encode())',  # what the C++ core worker writes
              'os.write(2, b"[E core_worker.cc:1] a real Ray error\\n")',
              'print("Traceback (most recent call last): a Python error", file=sys.stderr)',
              "print(RAY_LINE, file=sys.stderr)",
              'print("out inside", flush=True)'],
             ['print("after", file=sys.stderr)'])
    assert r.returncode == 0, r.stderr
    assert RAY_ACTOR_RESTART_NOTICE not in r.stderr
    assert r.stderr.splitlines() == ["[E core_worker.cc:1] a real Ray error",
                                     "Traceback (most recent call last): a Python error", "after"]
    assert r.stdout.splitlines() == ["out before", "out inside"]


def test_an_error_written_just_before_the_process_is_killed_still_comes_out():
    r = _run(['print("the last error before the crash", file=sys.stderr, flush=True)',
              "os.kill(os.getpid(), signal.SIGKILL)"])
    assert r.returncode == -9
    assert r.stderr.splitlines() == ["the last error before the crash"]


def test_a_process_that_dies_without_a_word_gets_its_line():
    """The fault soak's `ray stop` of a plain job's private Ray: Ray's core worker ended the driver at once (its
    plasma store gone, exit 1), where Python could say nothing. The filter says the driver's line for it; a block
    that ends in Python, normally or by an exception, leaves it unsaid."""
    unsaid = "[rcr-job] the job's driver ended without a word"
    killed = _run(['os.write(2, b"a line without its end")', "os._exit(1)"], unsaid=unsaid)  # as Ray's C++ exit
    assert killed.returncode == 1
    assert killed.stderr.splitlines() == ["a line without its end", unsaid]
    normal = _run(['os.write(2, b"a line without its end")'], ['print("after", file=sys.stderr)'], unsaid=unsaid)
    assert normal.returncode == 0 and normal.stderr.splitlines() == ["a line without its end", "after"]
    raised = _run(['raise SystemExit("the job said why")'], unsaid=unsaid)
    assert raised.returncode == 1 and unsaid not in raised.stderr and "the job said why" in raised.stderr


def test_the_read_stage_function_imports_no_torch():
    """Ray Data's read tasks import the module of the function they run: pipeline.run.select must stay light
    (a worker that imports torch holds ~0.45 GiB more, which Ray Data's memory detector reported)."""
    from pipeline.run import ray_stages, select

    assert ray_stages.select_planned is select.select_planned
    code = ("import sys, pipeline.run.select; "
            "print(sorted(m for m in ('torch', 'transformers', 'rcr') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert r.stdout.strip() == "[]", r.stdout


def test_the_read_stage_memory_figure_stays_schedulable():
    """The read tasks' memory figure, capped at a quarter of the cluster's memory (a small node still runs them)."""
    from pipeline.run.ray_stages import READER_MEMORY, reader_memory

    assert reader_memory({}) == READER_MEMORY == reader_memory({"memory": 64 * 2**30})
    assert reader_memory({"memory": 2 * 2**30}) == 2**29
