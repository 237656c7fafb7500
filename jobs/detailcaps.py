"""``python jobs/eval.py --task detailcaps``: the evaluation job on the detailcaps task (see jobs/eval.py)."""

from pipeline.run import interrupt

with interrupt.while_starting():  # a Ctrl-C while the job's modules load: one line, no traceback
    from pipeline.run.driver import main

if __name__ == "__main__":
    raise SystemExit(main("detailcaps"))
