#!/usr/bin/env bash
# Start / stop / inspect a local Ray head and an MLflow server. Every socket they listen on is on 127.0.0.1.
#
#   infra/local_cluster.sh start     # Ray head (dashboard + job server on :8265) and MLflow (:5000)
#   source ~/rcr-runs/local-cluster/env  # RAY_ADDRESS, the Ray token and MLFLOW_TRACKING_URI for this shell
#   ray job submit --working-dir . -- python jobs/detailcaps.py --mlflow-uri "$MLFLOW_TRACKING_URI"
#   infra/local_cluster.sh status
#   infra/local_cluster.sh stop      # stops only the processes this script started (by their pid group)
#   infra/local_cluster.sh clean     # stop, then remove what the project wrote (infra/clean.py), each with its size
#
# Ray token authentication is on (RAY_AUTH_MODE=token) with a token private to this cluster, kept in
# $STATE/auth_token (mode 600). `stop` never calls `ray stop`, which would stop every Ray on the machine.
#
# Files. Ray's session directories (logs, sockets) go under RCR_RAY_TMP, never Ray's shared /tmp/ray; each one
# the project starts (this script's head, a plain `python jobs/...`'s private Ray) is listed in
# $RUNS/ray-sessions. `clean` removes exactly those sessions, $RUNS and the fused kernels' builds (infra/clean.py):
# not another session in RCR_RAY_TMP, nothing in /tmp/ray.
#
# Ports. Each one is checked free before start. One set in the environment must be free, else `start` fails
# naming it and its holder; one left unset takes its default if free, else any free port:
#   RCR_RAY_PORT (GCS, 6379)  RCR_DASHBOARD_PORT (dashboard + job server, 8265)  RCR_MLFLOW_PORT (5000)
#   RCR_AGENT_HTTP_PORT (52365)  RCR_AGENT_GRPC_PORT  RCR_METRICS_PORT  RCR_RUNTIME_ENV_PORT
#   RCR_CLIENT_PORT (ray client server, 10001)  RCR_NODE_MANAGER_PORT  RCR_OBJECT_MANAGER_PORT
#   RCR_DASHBOARD_METRICS_PORT (44227)  RCR_AUTOSCALER_METRICS_PORT (44217)
#   RCR_WORKER_PORTS (LO-HI, default: a free block of 200 ports from 20000 up)
# Other settings: RCR_RUNS_DIR (default ~/rcr-runs), RCR_NUM_CPUS / RCR_NUM_GPUS (default: detected),
# RCR_NO_MLFLOW=1 (Ray only), RCR_RAY_TMP (Ray's temp dir, default /tmp/rcr-ray-<uid>),
# RCR_READY_TIMEOUT (seconds to wait for the head to accept a job, 300).
#
# Ready means that a trivial job was accepted by the job agent and ran. Ray resolves --node-ip-address
# 127.0.0.1 to the machine's network address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (a single-node
# cluster): with it, the GCS, raylet, agent, client server and metrics servers all bind to 127.0.0.1.
set -euo pipefail

RUNS="$(realpath -m "${RCR_RUNS_DIR:-$HOME/rcr-runs}")"
STATE="$RUNS/local-cluster"
HOST=127.0.0.1
PY="${PYTHON:-python}"
RAY_TMP="${RCR_RAY_TMP:-/tmp/rcr-ray-$(id -u)}"   # short: Ray's unix socket paths must stay under 108 bytes
PORTS_PY="$(cd "$(dirname "$0")" && pwd)/ports.py"
CLEAN_PY="$(cd "$(dirname "$0")" && pwd)/clean.py"
MLFLOW_SH="$(cd "$(dirname "$0")" && pwd)/mlflow_server.sh"
READY_TIMEOUT="${RCR_READY_TIMEOUT:-300}"

say() { echo "[local-cluster] $*"; }
fail() { echo "[local-cluster] error: $*" >&2; exit 1; }

load_ports() {  # the ports of the running cluster (written by start), else none
  RAY_PORT= DASH_PORT= MLFLOW_PORT=
  # shellcheck disable=SC1091
  [ -s "$STATE/ports" ] && . "$STATE/ports"
  return 0
}

pick_ports() {  # choose every port (see the header), or fail in one line naming the port and its holder
  local out
  out=$("$PY" "$PORTS_PY" pick gcs=RCR_RAY_PORT:6379 dashboard=RCR_DASHBOARD_PORT:8265 \
        mlflow=RCR_MLFLOW_PORT:5000 agent_http=RCR_AGENT_HTTP_PORT:52365 agent_grpc=RCR_AGENT_GRPC_PORT:- \
        metrics=RCR_METRICS_PORT:- runtime_env=RCR_RUNTIME_ENV_PORT:- client=RCR_CLIENT_PORT:10001 \
        node_manager=RCR_NODE_MANAGER_PORT:- object_manager=RCR_OBJECT_MANAGER_PORT:- \
        dashboard_metrics=RCR_DASHBOARD_METRICS_PORT:44227 autoscaler_metrics=RCR_AUTOSCALER_METRICS_PORT:44217 \
        workers=RCR_WORKER_PORTS:+200 2>&1) || fail "$out"
  echo "$out" | sed -e 's/^\([a-z_]*\)=/P_\1=/' > "$STATE/ports.all"
  # shellcheck disable=SC1091
  . "$STATE/ports.all"
  RAY_PORT=$P_gcs DASH_PORT=$P_dashboard MLFLOW_PORT=$P_mlflow
}

holder_of() { "$PY" "$PORTS_PY" holder "$1"; }

ready_check() {  # [seconds]: submit a trivial job until one runs (a busy machine is slow); prints why not
  local secs=${1:-$READY_TIMEOUT} t0=$SECONDS sub out=""
  while :; do
    sub="rcr-ready-$(date +%s)-$$"
    if out=$(timeout 120 ray job submit --address "http://$HOST:$DASH_PORT" --submission-id "$sub" \
             -- python -c "print('rcr-ready')" 2>&1) && echo "$out" | grep -q "rcr-ready"; then
      return 0
    fi
    if ! alive "$STATE/ray.pid" || ((SECONDS - t0 >= secs)); then break; fi
    sleep 3
  done
  out=$(echo "$out" | grep -Eo "No available agent[^.]*|Request failed with status code [0-9]+|Connection refused|Job '[^']*' failed|timed out" | head -1)
  alive "$STATE/ray.pid" || out="the head exited${out:+; $out}"
  echo "${out:-no answer}"
  return 1
}

diagnose() {  # one line: why the head does not accept jobs
  local logs port who why
  logs=$(ls "$RAY_TMP"/session_latest/logs/dashboard_agent*.log "$RAY_TMP"/session_latest/logs/runtime_env_agent*.log \
         "$STATE/ray.log" 2>/dev/null || true)
  port=$( (grep -hEo "[0-9.]+:[0-9]+[^\n]*(address already in use|Errno 98)|Failed to bind to [0-9.]+:[0-9]+|port[^\n]{0,40}(in use|already)" $logs 2>/dev/null || true) \
          | grep -Eo ":[0-9]{2,5}" | head -1 | tr -d :)
  if [ -n "$port" ]; then
    who=$(holder_of "$port")
    echo "port $port is in use${who:+ by $who}"
  else
    why=$(grep -hoE "Check failed: .{0,160}" "$RAY_TMP"/session_latest/logs/raylet.out 2>/dev/null | head -1 || true)
    echo "${why:+raylet: $why; }see $RAY_TMP/session_latest/logs/"
  fi
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_http() {  # url seconds [pidfile]: any HTTP answer counts (the dashboard answers 401 without the token)
  local url=$1 secs=$2 pidfile=${3:-} i
  for ((i = 0; i < secs; i++)); do
    if [ -n "$pidfile" ] && ! alive "$pidfile"; then return 1; fi  # the process exited: no point waiting
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
  # return only once no member of the group runs (SIGKILL cannot be ignored, but its members exit as the kernel
  # gets to them); a zombie counts as gone: it waits for a parent that may not reap it (a container's init)
  for ((i = 0; i < 300; i++)); do
    ps -e -o pgid=,stat= | awk -v g="$pid" '$1 == g && $2 !~ /^Z/ {found = 1} END {exit !found}' || break
    sleep 0.2
  done
  rm -f "$pidfile"
}

record_session() {  # the head's session directory (its GCS server's --session-dir), for `clean`
  local dir
  dir=$(ps -e -ww -o pgid=,args= | awk -v g="$(cat "$STATE/ray.pid")" '$1 == g' \
        | grep -o -- '--session-dir=[^ ]*' | head -1 || true)
  dir=${dir#--session-dir=}
  if [ -n "$dir" ]; then echo "$dir" >> "$RUNS/ray-sessions"; fi
}

start_head() {  # sets HEAD_ERROR and returns 1 on failure
  pick_ports
  local extra=() lo hi why
  [ -n "${RCR_NUM_CPUS:-}" ] && extra+=(--num-cpus "$RCR_NUM_CPUS")
  [ -n "${RCR_NUM_GPUS:-}" ] && extra+=(--num-gpus "$RCR_NUM_GPUS")
  lo=${P_workers%-*} hi=${P_workers#*-}
  say "starting the Ray head on $HOST:$RAY_PORT, dashboard/jobs on http://$HOST:$DASH_PORT (log: $STATE/ray.log)"
  DASHBOARD_METRIC_PORT=$P_dashboard_metrics AUTOSCALER_METRIC_PORT=$P_autoscaler_metrics \
  setsid nohup ray start --head --block --node-ip-address "$HOST" --port "$RAY_PORT" \
    --dashboard-host "$HOST" --dashboard-port "$DASH_PORT" --include-dashboard true \
    --dashboard-agent-listen-port "$P_agent_http" --dashboard-agent-grpc-port "$P_agent_grpc" \
    --metrics-export-port "$P_metrics" --runtime-env-agent-port "$P_runtime_env" \
    --ray-client-server-port "$P_client" --node-manager-port "$P_node_manager" \
    --object-manager-port "$P_object_manager" --min-worker-port "$lo" --max-worker-port "$hi" \
    --temp-dir "$RAY_TMP" --disable-usage-stats "${extra[@]}" > "$STATE/ray.log" 2>&1 < /dev/null &
  echo $! > "$STATE/ray.pid"
  printf 'RAY_PORT=%s\nDASH_PORT=%s\nMLFLOW_PORT=%s\n' "$RAY_PORT" "$DASH_PORT" "$MLFLOW_PORT" > "$STATE/ports"
  say "waiting for the Ray head to answer (up to 120 s)"
  local up=0
  wait_http "http://$HOST:$DASH_PORT/api/version" 120 "$STATE/ray.pid" && up=1
  record_session  # also a head that fails from here on has made its session directory
  if [ "$up" = 0 ]; then
    why=$(grep -hE "Error|error:" "$STATE/ray.log" | tail -1 | cut -c1-300)
    stop_group "$STATE/ray.pid" "Ray head" >/dev/null
    HEAD_ERROR="the Ray head did not come up (${why:-no error in the log}; $(diagnose)). Log: $STATE/ray.log. Run: $0 start again, or set the named port's RCR_*_PORT"
    return 1
  fi
  if ! why=$(ready_check); then
    why="$why; $(diagnose)"
    stop_group "$STATE/ray.pid" "Ray head" >/dev/null
    HEAD_ERROR="the Ray head started but its job agent does not accept jobs ($why). It was stopped. Run: $0 start again, or set RCR_AGENT_HTTP_PORT to a free port"
    return 1
  fi
}

start() {
  mkdir -p "$STATE" "$RUNS"
  command -v ray >/dev/null || { say "ray is not on PATH (activate the venv: . .venv/bin/activate)"; exit 1; }
  if [ ! -s "$STATE/auth_token" ]; then
    (umask 077; "$PY" -c 'import secrets; print(secrets.token_hex(32))' > "$STATE/auth_token")
  fi
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$STATE/auth_token" RAY_USAGE_STATS_ENABLED=0
  unset RAY_AUTH_TOKEN RAY_ADDRESS

  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # see the header: keeps every Ray socket on 127.0.0.1
  # a busy machine can take Ray's agents longer to start than the raylet waits for them by default
  export RAY_agent_register_timeout_ms="${RAY_agent_register_timeout_ms:-300000}"
  export RAY_raylet_start_wait_time_s="${RAY_raylet_start_wait_time_s:-300}"

  if alive "$STATE/ray.pid"; then
    load_ports
    local why
    if ! why=$(ready_check 60); then
      fail "the Ray head (pid $(cat "$STATE/ray.pid")) is running but does not accept jobs ($why; $(diagnose)). Run: $0 stop && $0 start"
    fi
    say "Ray head already running (pid $(cat "$STATE/ray.pid")) and accepting jobs"
  else
    local attempt
    for attempt in 1 2 3; do  # a busy machine can make Ray's own startup time out: start it again
      start_head && break
      [ "$attempt" = 3 ] && fail "$HEAD_ERROR"
      say "$HEAD_ERROR -- starting it again ($((attempt + 1))/3)"
    done
  fi

  if [ "${RCR_NO_MLFLOW:-0}" = 1 ]; then
    say "MLflow server not started (RCR_NO_MLFLOW=1); jobs default to sqlite:///$RUNS/mlflow.db"
  elif alive "$STATE/mlflow.pid"; then
    say "MLflow server already running (pid $(cat "$STATE/mlflow.pid"))"
    wait_http "http://$HOST:$MLFLOW_PORT/health" 5 || fail "the MLflow server (pid $(cat "$STATE/mlflow.pid")) does not answer on $HOST:$MLFLOW_PORT$(w=$(holder_of "$MLFLOW_PORT"); [ -n "$w" ] && echo " (port held by $w)"). Run: $0 stop && $0 start"
  else
    say "starting MLflow on http://$HOST:$MLFLOW_PORT, store sqlite:///$RUNS/mlflow.db (log: $STATE/mlflow.log)"
    # the store's layout and the server's flags: infra/mlflow_server.sh
    setsid nohup "$MLFLOW_SH" "$RUNS" "$MLFLOW_PORT" > "$STATE/mlflow.log" 2>&1 < /dev/null &
    echo $! > "$STATE/mlflow.pid"
    say "waiting for MLflow to answer (up to 120 s)"
    if ! wait_http "http://$HOST:$MLFLOW_PORT/health" 120 "$STATE/mlflow.pid"; then
      stop_group "$STATE/mlflow.pid" "MLflow server" >/dev/null
      fail "MLflow did not come up on $HOST:$MLFLOW_PORT ($(grep -hE "Error|error" "$STATE/mlflow.log" | tail -1 | cut -c1-200)). Log: $STATE/mlflow.log. Run: $0 stop, then set RCR_MLFLOW_PORT to a free port and start again"
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
  rm -f "$STATE/ports" "$STATE/ports.all"
  say "stopped"
}

clean() {  # what stop stops, then the Ray sessions listed in $RUNS/ray-sessions, $RUNS itself, the kernels' builds
  stop
  "$PY" "$CLEAN_PY" "$RUNS"
}

status() {
  load_ports
  if alive "$STATE/ray.pid"; then say "Ray head: running (pid $(cat "$STATE/ray.pid")), http://$HOST:$DASH_PORT"
  else say "Ray head: not running"; fi
  if alive "$STATE/mlflow.pid"; then say "MLflow: running (pid $(cat "$STATE/mlflow.pid")), http://$HOST:$MLFLOW_PORT"
  else say "MLflow: not running"; fi
  say "runs directory: $RUNS; Ray sessions under $RAY_TMP"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  clean) clean ;;
  *) echo "usage: $0 start|stop|status|clean" >&2; exit 2 ;;
esac
