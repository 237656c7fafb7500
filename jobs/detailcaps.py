"""The detailcaps evaluation job: DetailCaps-style long descriptions (up to 512 new tokens).

Every method on every sample, one Parquet row per (sample, method). With no arguments it runs the
embedded model on the embedded synthetic shards::

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/detailcaps.py

Real runs name a checkpoint and converted shards, e.g.
``--model Qwen/Qwen2-VL-7B-Instruct --shards /data/detailcaps/*.parquet --num-actors 8``.
``python jobs/detailcaps.py --help`` lists every option; ``--config job.yaml`` takes them from a file.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.run.driver import main

if __name__ == "__main__":
    sys.exit(main("detailcaps"))
