"""The evaluation job: every method on every sample of a task, one Parquet row per (sample, method), the statistics
to MLflow (``pipeline/run/driver.py``). With no arguments it runs the embedded model on the embedded synthetic
DetailCaps shards::

    python jobs/eval.py --task detailcaps --limit 8
    ray job submit --working-dir . -- python jobs/eval.py --task textcaps --model Qwen/Qwen2-VL-7B-Instruct \
        --shards /data/shards/textcaps --num-actors 8 --device cuda

``--help`` lists every option; ``--config job.yaml`` takes them from a file. Installed, it is also ``rcr-eval``.
"""

from pipeline.run import interrupt

with interrupt.while_starting():  # a Ctrl-C while the job's modules load: one line, no traceback
    from pipeline.run.driver import main

if __name__ == "__main__":
    raise SystemExit(main())
