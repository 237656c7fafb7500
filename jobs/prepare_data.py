"""Write input shards from a real dataset, local videos or the synthetic generator (``pipeline/data/prepare.py``;
``--help``). Installed: ``rcr-prepare-data``.

    python jobs/prepare_data.py detailcaps --limit 300 --seed 0 --out data/detailcaps
    python jobs/prepare_data.py video --local-path /data/my_videos --frames 8 --out data/video
"""

from pipeline.data.prepare import main

if __name__ == "__main__":
    raise SystemExit(main())
