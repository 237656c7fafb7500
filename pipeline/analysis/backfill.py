"""Rebuild (or backfill) a job's MLflow runs from its Parquet output directory.

    python jobs/backfill_mlflow.py --output-dir ~/rcr-runs/detailcaps-embedded \
        [--tracking-uri sqlite:///$HOME/rcr-runs/mlflow.db] [--experiment rcr-eval]

For a job that ran while MLflow was unreachable, or a lost store. Idempotent: the runs are keyed on
(output dir, config hash), so running it twice leaves one set of runs (the second call finds a complete
parent with the same data fingerprint and skips it; changed rows replace the old set).

One parent run per config hash found in the directory. The job config comes from the run records the
pipeline writes (``<output_dir>/_runs/*.json``, latest record of that config hash), else from a
``config.json`` / ``config.yaml`` in the directory, else from the rows (job name, model, config hash).
The tracking URI and experiment default to the config's (``mlflow_uri``, ``experiment``), else the jobs'
default store (``~/rcr-runs/mlflow.db``, or under ``$RCR_RUNS_DIR``) and ``rcr-eval``.

Exit status: 0 logged (or already up to date); 2 no such directory, or no rows in it; 3 MLflow logging failed
(one line says why; the runs it started are marked FAILED, and running it again replaces them).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

MLFLOW_FAILED_EXIT = 3  # as the jobs' (pipeline/run/driver.py)

def _load_configs(out: Path) -> tuple[dict[str, dict], dict]:
    """(config by config_hash from run records, a directory-level config or {})."""
    by_hash: dict[str, tuple[str, dict]] = {}
    runs = out / "_runs"
    if runs.is_dir():
        for p in sorted(runs.glob("*.json")):
            try:
                rec = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            cfg, ch = rec.get("config"), rec.get("config_hash")
            if isinstance(cfg, dict) and ch:
                stamp = str(rec.get("started", "")) + p.name
                if ch not in by_hash or stamp >= by_hash[ch][0]:
                    by_hash[ch] = (stamp, cfg)
    top: dict = {}
    for name in ("config.json", "job_config.json", "config.yaml", "config.yml"):
        p = out / name
        if p.is_file():
            try:
                if p.suffix == ".json":
                    top = json.loads(p.read_text())
                else:
                    import yaml

                    top = yaml.safe_load(p.read_text()) or {}
                break
            except Exception:  # noqa: BLE001
                continue
    return {k: v for k, (_, v) in by_hash.items()}, (top if isinstance(top, dict) else {})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-dir", required=True, help="the job's Parquet output directory")
    ap.add_argument("--tracking-uri", help="MLflow tracking URI (default: the job config's, else "
                    "sqlite:///<runs dir>/mlflow.db, the jobs' default store)")
    ap.add_argument("--experiment", help="experiment name (default: the job config's, else rcr-eval)")
    ap.add_argument("--bootstrap-resamples", type=int, default=None, help="default 10000")
    ap.add_argument("--seed", type=int, default=None, help="bootstrap seed (default 0)")
    ap.add_argument("--artifacts-dir", help="keep the plots and tables here (default: a temporary directory)")
    ap.add_argument("--force", action="store_true", help="replace the runs even if they are up to date")
    ap.add_argument("--no-summary", action="store_true", help="do not print the summary table")
    args = ap.parse_args(argv)

    import pandas as pd

    from pipeline.analysis import mlflow_client, mlflow_store, report, tracking
    from pipeline.analysis.analyze import analyze
    from pipeline.paths import default_tracking_uri

    out = Path(args.output_dir).expanduser().resolve()
    if not out.is_dir():
        print(f"no such output directory: {out}", file=sys.stderr)
        return 2
    try:
        df = pd.read_parquet(out)
    except Exception as e:  # noqa: BLE001
        print(f"cannot read Parquet output in {out}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if df.empty:
        print(f"{out} holds no rows", file=sys.stderr)
        return 2
    configs, top = _load_configs(out)
    hashes = sorted(set(df["config_hash"].dropna().astype(str))) if "config_hash" in df else [""]
    ids = []
    for ch in hashes:
        part = df[df["config_hash"].astype(str) == ch] if ch else df
        cfg = dict(configs.get(ch) or top or {})
        if not cfg:
            cfg = {"job_name": mlflow_client.joined_unique(part, "job_name"),
                   "model": mlflow_client.joined_unique(part, "model")}
        cfg.setdefault("config_hash", ch)
        uri = tracking.resolve_tracking_uri(args.tracking_uri or cfg.get("mlflow_uri") or default_tracking_uri())
        exp = args.experiment or cfg.get("experiment") or tracking.DEFAULT_EXPERIMENT
        job_name = cfg.get("job_name") or mlflow_client.joined_unique(part, "job_name") or out.name
        n_res = args.bootstrap_resamples or int(cfg.get("bootstrap_resamples", 10_000))
        seed = args.seed if args.seed is not None else int(cfg.get("bootstrap_seed", 0) or 0)
        print(f"[backfill] {out}: config {ch or '?'}: {len(part)} rows, "
              f"{part['sample_id'].nunique()} samples -> {uri} (experiment '{exp}')")
        analysis = None
        if not args.no_summary:
            analysis = analyze(part, bootstrap_resamples=n_res, seed=seed)
            print(report.format_summary(analysis))
        art = Path(args.artifacts_dir) / (ch or "job") if args.artifacts_dir else None
        try:
            tracking.check_tracking_server(uri)
            pid = tracking.log_job(part, cfg, tracking_uri=uri, experiment=exp, job_name=job_name,
                                   artifacts_dir=art, analysis=analysis, output_dir=str(out), bootstrap_resamples=n_res,
                                   seed=seed, force=args.force)
        except Exception as e:  # noqa: BLE001 - one line and exit 3, not a traceback
            again = shlex.join(["python", "jobs/backfill_mlflow.py", *(sys.argv[1:] if argv is None else argv)])
            print(f"[backfill] MLflow logging failed ({mlflow_store.error_cause(e)}); any run it started is marked "
                  f"FAILED. Run it again once that is fixed: {again}", file=sys.stderr)
            return MLFLOW_FAILED_EXIT
        ids.append(pid)
    print("[backfill] parent run(s): " + ", ".join(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
