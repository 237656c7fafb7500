#!/usr/bin/env bash
# The project's MLflow server on a runs directory's store, on 127.0.0.1 (infra/local_cluster.sh starts it):
#
#   infra/mlflow_server.sh RUNS_DIR PORT
#
# The store (pipeline/analysis/mlflow_store.py, docs/cluster.md "The MLflow store"): the database
# RUNS_DIR/mlflow.db and the artifact directory RUNS_DIR/mlartifacts. An experiment this server makes keeps its
# artifacts there as plain files (--default-artifact-root file://...), where a job writing to the database directly
# puts them too, and from where `mlflow ui` serves them once this server is stopped. --artifacts-destination: the
# same directory for an experiment a proxying server made (artifact location mlflow-artifacts:/<id>).
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 RUNS_DIR PORT" >&2
  exit 2
fi
RUNS="$(realpath -m "$1")"  # absolute: the artifact root is a file:// URI
mkdir -p "$RUNS/mlartifacts"
exec mlflow server --host 127.0.0.1 --port "$2" --backend-store-uri "sqlite:///$RUNS/mlflow.db" \
  --default-artifact-root "file://$RUNS/mlartifacts" --artifacts-destination "$RUNS/mlartifacts" --workers 1
