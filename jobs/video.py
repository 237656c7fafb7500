"""``python jobs/eval.py --task video``: the evaluation job on the video task (see jobs/eval.py)."""

from pipeline.run.driver import main

if __name__ == "__main__":
    raise SystemExit(main("video"))
