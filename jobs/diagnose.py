"""The premise check: what RCR assumes of a model, measured on any supported family (``pipeline/diagnose``).

    python jobs/diagnose.py                                        # the embedded default: 40 samples, then 9 probed
    python jobs/diagnose.py --model Qwen/Qwen2-VL-7B-Instruct --shards /data/shards/detailcaps --device cuda

It takes the jobs' flags (``--help``); one table, a Parquet directory, one MLflow run. Installed: ``rcr-diagnose``.
"""

from pipeline.diagnose.run import main

if __name__ == "__main__":
    raise SystemExit(main())
