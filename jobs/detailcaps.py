"""``python jobs/eval.py --task detailcaps``: the evaluation job on the detailcaps task (see jobs/eval.py)."""

from pipeline.run.driver import main

if __name__ == "__main__":
    raise SystemExit(main("detailcaps"))
