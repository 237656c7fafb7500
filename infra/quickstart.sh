#!/usr/bin/env bash
# One command on a fresh machine: install, start a local Ray head (+ MLflow) on 127.0.0.1, and submit the
# DetailCaps job to it (infra/submit.py, Ray's job submission API). The job streams its progress and ends with the
# per-method summary (fidelity, refresh fraction), the Parquet output, the MLflow UI's URLs and the MLflow store.
#
#   bash infra/quickstart.sh                  # embedded model + embedded synthetic shards, first 8 samples
#   bash infra/quickstart.sh --limit 50 --num-actors 2 --max-new-tokens 256   # any jobs/detailcaps.py flag
#   infra/local_cluster.sh stop               # when done
#   infra/local_cluster.sh clean              # stop, then remove what the project wrote, printing each with its size
#
# Environment: PYTHON (default python3), RCR_SKIP_INSTALL=1 (use the active environment as is),
# RCR_RUNS_DIR (default ~/rcr-runs), and the ports of infra/local_cluster.sh (RCR_*_PORT, see its header and
# docs/cluster.md). `local_cluster.sh start` exits non-zero with one line saying what is wrong (a busy port
# and its holder, a head that does not accept jobs) and what to run; quickstart stops there.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${RCR_SKIP_INSTALL:-0}" != 1 ]; then
  if [ ! -x .venv/bin/python ]; then
    echo "[quickstart] creating .venv"
    "${PYTHON:-python3}" -m venv .venv
  fi
  . .venv/bin/activate
  echo "[quickstart] checking the installed packages (importing torch, ray, mlflow takes ~10 s)"
  # from /, so that the repo's own folders on the path cannot stand in for the installed packages that
  # `python jobs/...` imports (an install made before a package was added lacks it)
  if ! (cd / && python -c "import torch, torchvision, ray, mlflow, rcr, pipeline, embedded") 2>/dev/null; then
    echo "[quickstart] installing (torch 2.14.1 + torchvision 0.29.1, then this repo with the pipeline extras)"
    python -m pip install -q --upgrade pip
    python -m pip install -q torch==2.14.1 torchvision==0.29.1
    python -m pip install -q -e ".[pipeline]"
  fi
elif [ -x .venv/bin/python ]; then
  . .venv/bin/activate
fi

RUNS="${RCR_RUNS_DIR:-$HOME/rcr-runs}"
echo "[quickstart] starting a local Ray head and MLflow server on 127.0.0.1 (~20-30 s)"
infra/local_cluster.sh start
# shellcheck disable=SC1091
source "$RUNS/local-cluster/env"

args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--limit 8)
echo "[quickstart] submitting: python jobs/detailcaps.py ${args[*]} --mlflow-uri $MLFLOW_TRACKING_URI (to $RAY_ADDRESS)"
# infra/submit.py: what `ray job submit --working-dir .` does, printing only the job's own log (not the CLI's banner
# and status lines). `.rayignore` names what the working directory is packaged with: the project's packages only
# (with the override below, Ray's own default list, which prints a notice per directory, is off).
if ! RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES='' python infra/submit.py --address "$RAY_ADDRESS" \
  -- python jobs/detailcaps.py "${args[@]}" --mlflow-uri "$MLFLOW_TRACKING_URI"; then
  echo "[quickstart] error: the job failed (its log is above). Rerunning the same command computes only the missing rows; cluster: infra/local_cluster.sh status" >&2
  exit 1
fi
echo "[quickstart] done. MLflow store: $RUNS/mlflow.db (artifacts in $RUNS/mlartifacts), served at $MLFLOW_TRACKING_URI"
echo "[quickstart] stop the local cluster: infra/local_cluster.sh stop; remove everything this project wrote: infra/local_cluster.sh clean"
