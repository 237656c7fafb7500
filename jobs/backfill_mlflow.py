"""Rebuild (or backfill) a job's MLflow runs from its Parquet output directory (``pipeline/analysis/backfill.py``;
``--help``). Installed: ``rcr-backfill-mlflow``.

    python jobs/backfill_mlflow.py --output-dir ~/rcr-runs/detailcaps-embedded
"""

from pipeline.analysis.backfill import main

if __name__ == "__main__":
    raise SystemExit(main())
