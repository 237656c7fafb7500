#!/usr/bin/env bash
# Start / stop / inspect a local Ray head and an MLflow server, both bound to 127.0.0.1.
#
#   infra/local_cluster.sh start     # Ray head (dashboard + job server on :8265) and MLflow (:5000)
#   source ~/rcr-runs/local-cluster/env  # RAY_ADDRESS, the Ray token and MLFLOW_TRACKING_URI for this shell
#   ray job submit --working-dir . -- python jobs/detailcaps.py --mlflow-uri "$MLFLOW_TRACKING_URI"
#   infra/local_cluster.sh status
#   infra/local_cluster.sh stop      # stops only the processes this script started (by their pid group)
#
# Ray token authentication is on (RAY_AUTH_MODE=token) with a token private to this cluster, kept in
# $STATE/auth_token (mode 600). `stop` never calls `ray stop`, which would stop every Ray on the machine.
#
# Settings (environment): RCR_RUNS_DIR (default ~/rcr-runs), RCR_RAY_PORT (6379), RCR_DASHBOARD_PORT (8265),
# RCR_MLFLOW_PORT (5000), RCR_NUM_CPUS / RCR_NUM_GPUS (default: detected), RCR_NO_MLFLOW=1 (Ray only),
# RCR_RAY_TMP (Ray's temp dir, default /tmp/rcr-ray-<uid>).
set -euo pipefail

RUNS="${RCR_RUNS_DIR:-$HOME/rcr-runs}"
STATE="$RUNS/local-cluster"
RAY_PORT="${RCR_RAY_PORT:-6379}"
DASH_PORT="${RCR_DASHBOARD_PORT:-8265}"
MLFLOW_PORT="${RCR_MLFLOW_PORT:-5000}"
HOST=127.0.0.1
PY="${PYTHON:-python}"
RAY_TMP="${RCR_RAY_TMP:-/tmp/rcr-ray-$(id -u)}"   # short: Ray's unix socket paths must stay under 108 bytes

say() { echo "[local-cluster] $*"; }

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_http() {  # url seconds: any HTTP answer counts (the dashboard answers 401 without the token)
  local url=$1 secs=$2 i
  for ((i = 0; i < secs; i++)); do
    if "$PY" - "$url" <<'PYEOF' 2>/dev/null; then return 0; fi
import sys, urllib.request, urllib.error
try:
    urllib.request.urlopen(sys.argv[1], timeout=2).close()
except urllib.error.HTTPError:
    pass
PYEOF
    sleep 1
  done
  return 1
}

stop_group() {  # pidfile name
  local pidfile=$1 name=$2 pid i
  if ! alive "$pidfile"; then rm -f "$pidfile"; return 0; fi
  pid=$(cat "$pidfile")
  say "stopping $name (process group $pid); waiting up to 20 s for it to exit"
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 20; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$pidfile"
}

start() {
  mkdir -p "$STATE" "$RUNS"
  command -v ray >/dev/null || { say "ray is not on PATH (activate the venv: . .venv/bin/activate)"; exit 1; }
  if [ ! -s "$STATE/auth_token" ]; then
    (umask 077; "$PY" -c 'import secrets; print(secrets.token_hex(32))' > "$STATE/auth_token")
  fi
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$STATE/auth_token" RAY_USAGE_STATS_ENABLED=0
  unset RAY_AUTH_TOKEN RAY_ADDRESS

  if alive "$STATE/ray.pid"; then
    say "Ray head already running (pid $(cat "$STATE/ray.pid"))"
  else
    local extra=()
    [ -n "${RCR_NUM_CPUS:-}" ] && extra+=(--num-cpus "$RCR_NUM_CPUS")
    [ -n "${RCR_NUM_GPUS:-}" ] && extra+=(--num-gpus "$RCR_NUM_GPUS")
    say "starting the Ray head on $HOST:$RAY_PORT, dashboard/jobs on http://$HOST:$DASH_PORT (log: $STATE/ray.log)"
    setsid nohup ray start --head --block --node-ip-address "$HOST" --port "$RAY_PORT" \
      --dashboard-host "$HOST" --dashboard-port "$DASH_PORT" --include-dashboard true \
      --temp-dir "$RAY_TMP" --disable-usage-stats "${extra[@]}" > "$STATE/ray.log" 2>&1 < /dev/null &
    echo $! > "$STATE/ray.pid"
    say "waiting for the Ray head to answer (up to 120 s)"
    if ! wait_http "http://$HOST:$DASH_PORT/api/version" 120; then
      say "the Ray head did not come up; last lines of $STATE/ray.log:"; tail -20 "$STATE/ray.log"; exit 1
    fi
    for _ in $(seq 60); do ray job list --address "http://$HOST:$DASH_PORT" >/dev/null 2>&1 && break; sleep 1; done
  fi

  if [ "${RCR_NO_MLFLOW:-0}" = 1 ]; then
    say "MLflow server not started (RCR_NO_MLFLOW=1); jobs default to sqlite:///$RUNS/mlflow.db"
  elif alive "$STATE/mlflow.pid"; then
    say "MLflow server already running (pid $(cat "$STATE/mlflow.pid"))"
  else
    say "starting MLflow on http://$HOST:$MLFLOW_PORT, store sqlite:///$RUNS/mlflow.db (log: $STATE/mlflow.log)"
    setsid nohup mlflow server --host "$HOST" --port "$MLFLOW_PORT" \
      --backend-store-uri "sqlite:///$RUNS/mlflow.db" --artifacts-destination "$RUNS/mlartifacts" \
      --workers 1 > "$STATE/mlflow.log" 2>&1 < /dev/null &
    echo $! > "$STATE/mlflow.pid"
    say "waiting for MLflow to answer (up to 120 s)"
    if ! wait_http "http://$HOST:$MLFLOW_PORT/health" 120; then
      say "MLflow did not come up; last lines of $STATE/mlflow.log:"; tail -20 "$STATE/mlflow.log"; exit 1
    fi
  fi

  local mlflow_uri="http://$HOST:$MLFLOW_PORT"
  [ "${RCR_NO_MLFLOW:-0}" = 1 ] && mlflow_uri="sqlite:///$RUNS/mlflow.db"
  cat > "$STATE/env" <<ENVEOF
export RAY_ADDRESS=http://$HOST:$DASH_PORT
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$STATE/auth_token
export MLFLOW_TRACKING_URI=$mlflow_uri
ENVEOF
  say "ready. In your shell:  source $STATE/env"
  say "  then: ray job submit --working-dir . -- python jobs/detailcaps.py --mlflow-uri \$MLFLOW_TRACKING_URI"
  say "  Ray dashboard http://$HOST:$DASH_PORT   MLflow UI $mlflow_uri"
}

stop() {
  stop_group "$STATE/mlflow.pid" "MLflow server"
  stop_group "$STATE/ray.pid" "Ray head"
  say "stopped"
}

status() {
  if alive "$STATE/ray.pid"; then say "Ray head: running (pid $(cat "$STATE/ray.pid")), http://$HOST:$DASH_PORT"
  else say "Ray head: not running"; fi
  if alive "$STATE/mlflow.pid"; then say "MLflow: running (pid $(cat "$STATE/mlflow.pid")), http://$HOST:$MLFLOW_PORT"
  else say "MLflow: not running"; fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
