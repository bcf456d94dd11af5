#!/usr/bin/env bash
# `make serve`: a local Prefect server, the `relay-pool` process work pool, a Kaggle emulator holding the
# demo data, the deployments of deploy/prefect.yaml and a worker, all in the foreground; Ctrl-C stops them.
# Then, in another terminal (the script prints it):
#   export PREFECT_API_URL=http://127.0.0.1:4200/api
#   .venv/bin/prefect deployment run 'relay/price-model-demo' --watch
#
# Settings (environment): RELAY_PREFECT_PORT (4200), RELAY_EMULATOR_PORT (8765), PREFECT_HOME (.prefect/),
# RELAY_SERVE_KEEP=1 keeps the emulator's state (runs/serve/) from the last time instead of starting fresh.
# Several workers on PostgreSQL: RELAY_SERVE_DB=postgres (a local PostgreSQL from the `server` extra's wheel in
# runs/serve-postgres on RELAY_POSTGRES_PORT, 5433; or the database PREFECT_API_DATABASE_CONNECTION_URL names,
# when set), RELAY_SERVE_WORKERS=N process workers in the one pool (1). See docs/prefect.md.
# RELAY_SERVE_RETENTION_DAYS (30): finished flow runs older than this are deleted by Prefect's vacuum.
set -euo pipefail
set -m  # each background job in its own process group: SIGINT/SIGTERM reach them, and we can stop a whole group

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BIN="$ROOT/.venv/bin"
[ -x "$BIN/prefect" ] || { echo "serve: $BIN/prefect not found: run 'make setup' first" >&2; exit 1; }
PY="$BIN/python"
export PATH="$BIN:$PATH"

PORT="${RELAY_PREFECT_PORT:-4200}"
EMU_PORT="${RELAY_EMULATOR_PORT:-8765}"
DB="${RELAY_SERVE_DB:-sqlite}"
WORKERS="${RELAY_SERVE_WORKERS:-1}"
PG_PORT="${RELAY_POSTGRES_PORT:-5433}"
case "$DB" in sqlite|postgres) ;; *) echo "serve: RELAY_SERVE_DB=$DB: expected sqlite or postgres" >&2; exit 2;; esac
[[ "$WORKERS" =~ ^[1-9][0-9]*$ ]] || { echo "serve: RELAY_SERVE_WORKERS=$WORKERS: expected a whole number >= 1" >&2; exit 2; }
STATE="$ROOT/runs/serve"
LOGS="$STATE/logs"
export PREFECT_HOME="${PREFECT_HOME:-$ROOT/.prefect}"
export PREFECT_API_URL="http://127.0.0.1:$PORT/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 PREFECT_CLI_PROMPT=false
[[ "${RELAY_SERVE_RETENTION_DAYS:-30}" =~ ^[1-9][0-9]*$ ]] || { echo "serve: RELAY_SERVE_RETENTION_DAYS=$RELAY_SERVE_RETENTION_DAYS: expected a whole number of days >= 1" >&2; exit 2; }
# A relay ticked by a schedule is a flow run per tick: Prefect's own vacuum deletes finished flow runs (their
# logs, artifacts) older than RELAY_SERVE_RETENTION_DAYS (30), so the database and the runs list stay bounded.
export PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED="${PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED:-events,flow_runs}"
export PREFECT_SERVER_SERVICES_DB_VACUUM_RETENTION_PERIOD="${PREFECT_SERVER_SERVICES_DB_VACUUM_RETENTION_PERIOD:-$(( ${RELAY_SERVE_RETENTION_DAYS:-30} * 86400 ))}"
unset PREFECT_API_KEY PREFECT_API_AUTH_STRING

for p in "$PORT" "$EMU_PORT" $([ "$DB" = postgres ] && [ -z "${PREFECT_API_DATABASE_CONNECTION_URL:-}" ] && echo "$PG_PORT"); do
  if "$PY" -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $p)) != 0)"; then
    echo "serve: something already listens on 127.0.0.1:$p (another 'make serve'?)." \
         "Stop it, or set RELAY_PREFECT_PORT / RELAY_EMULATOR_PORT / RELAY_POSTGRES_PORT." >&2
    exit 1
  fi
done

[ "${RELAY_SERVE_KEEP:-0}" = 1 ] || rm -rf "$STATE"
mkdir -p "$STATE/home" "$STATE/tmp" "$LOGS" "$PREFECT_HOME"

SERVER_PID="" EMU_PID="" WORKER_PIDS=() LOCAL_PG=""
stop_group() {  # stop_group PID SECONDS: SIGTERM the process group, SIGKILL it if still there after SECONDS
  local pid="$1" n
  [ -n "$pid" ] || return 0
  kill -TERM -- "-$pid" 2>/dev/null || return 0
  for ((n = 0; n < $2 * 5; n++)); do
    kill -0 -- "-$pid" 2>/dev/null || return 0
    sleep 0.2
  done
  kill -KILL -- "-$pid" 2>/dev/null || true
}
stop_all() {
  trap - INT TERM EXIT
  echo
  echo "serve: stopping the workers, the emulator and the Prefect server..."
  # In this order: the workers deregister while the server still answers; the emulator stops its kernels;
  # the database outlives the server that writes to it.
  local pid stoppers=()
  for pid in "${WORKER_PIDS[@]}"; do stop_group "$pid" 20 & stoppers+=($!); done  # all at once
  [ "${#stoppers[@]}" = 0 ] || wait "${stoppers[@]}" 2>/dev/null || true
  stop_group "$EMU_PID" 15
  stop_group "$SERVER_PID" 15
  wait 2>/dev/null || true
  [ -z "$LOCAL_PG" ] || "$PY" deploy/local_postgres.py stop --data "$LOCAL_PG" || true
  echo "serve: stopped (server, emulator and deploy logs in $LOGS)"
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap 'stop_all' EXIT

# 1. Prefect server (SQLite in $PREFECT_HOME, or PostgreSQL): healthy in 7-25 s here.
if [ "$DB" = postgres ] && [ -z "${PREFECT_API_DATABASE_CONNECTION_URL:-}" ]; then
  # its own folder beside runs/serve: a fresh emulator (no RELAY_SERVE_KEEP) does not wipe the server's history
  LOCAL_PG="$ROOT/runs/serve-postgres"
  PREFECT_API_DATABASE_CONNECTION_URL="$("$PY" deploy/local_postgres.py start --data "$LOCAL_PG" --port "$PG_PORT")" \
    || exit 1
  export PREFECT_API_DATABASE_CONNECTION_URL
  echo "serve: PostgreSQL on 127.0.0.1:$PG_PORT (data $LOCAL_PG)"
elif [ "$DB" = sqlite ]; then
  unset PREFECT_API_DATABASE_CONNECTION_URL
fi
echo "serve: Prefect server on http://127.0.0.1:$PORT (database: $DB, PREFECT_HOME=$PREFECT_HOME, log $LOGS/server.log)"
"$BIN/prefect" server start --host 127.0.0.1 --port "$PORT" >"$LOGS/server.log" 2>&1 &
SERVER_PID=$!
"$PY" - "$PREFECT_API_URL/health" "$SERVER_PID" <<'EOF' || { tail -n 30 "$LOGS/server.log" >&2; exit 1; }
import os, sys, time, urllib.request
url, pid, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + 120
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("serve: the Prefect server exited")
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit("serve: the Prefect server was not healthy after 120 s")
EOF
echo "serve: server healthy"

# 2. The process work pool (kept in the server's database across restarts).
"$BIN/prefect" work-pool inspect relay-pool >/dev/null 2>&1 \
  || "$BIN/prefect" work-pool create relay-pool --type process >/dev/null
echo "serve: work pool relay-pool (process)"

# 3. The Kaggle emulator, user `demo` (the owner of demo/price-data in examples/price-demo.yaml), a fresh key.
KEY="$("$PY" -c 'import secrets; print(secrets.token_hex(16))')"
printf '{"kernel_env": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}}\n' \
  >"$STATE/emulator.json"
# HOME/TMPDIR inside runs/serve: the kaggle client keeps upload state in $TMPDIR and reads ~/.kaggle.
unset KAGGLE_API_TOKEN KAGGLE_CONFIG_DIR
export HOME="$STATE/home" TMPDIR="$STATE/tmp"
export RELAY_KAGGLE_ENDPOINT="http://127.0.0.1:$EMU_PORT" KAGGLE_USERNAME=demo KAGGLE_KEY="$KEY"
"$PY" -m relay.emulator serve --port "$EMU_PORT" --state "$STATE/emulator" --config "$STATE/emulator.json" \
  --user demo --key "$KEY" >"$LOGS/emulator.log" 2>&1 &
EMU_PID=$!
"$PY" deploy/seed_emulator.py --data "$STATE/data" || { tail -n 30 "$LOGS/emulator.log" >&2; exit 1; }
echo "serve: Kaggle emulator on $RELAY_KAGGLE_ENDPOINT (state $STATE/emulator, log $LOGS/emulator.log)"

# 4. The deployments (relay/price-model-demo, relay/price-model-kaggle, relay/price-model-tick).
"$BIN/prefect" deploy --all --no-prompt --prefect-file deploy/prefect.yaml >"$LOGS/deploy.log" 2>&1 \
  || { cat "$LOGS/deploy.log" >&2; exit 1; }
echo "serve: deployed $(grep -c '^  - name:' deploy/prefect.yaml) deployments from deploy/prefect.yaml"

# 5. The workers, printing here (their flow runs' logs too); they inherit the emulator's endpoint and account.
# Each takes flow runs from the one pool; a relay's steps stay one at a time through its step lock.
export OMP_NUM_THREADS=1 PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-5}"
for ((i = 1; i <= WORKERS; i++)); do
  name=relay-local-worker; [ "$WORKERS" = 1 ] || name="relay-local-worker-$i"
  "$BIN/prefect" worker start --pool relay-pool --name "$name" &
  WORKER_PIDS+=($!)
done

cat <<EOF

================================================================================
 Prefect UI:  http://127.0.0.1:$PORT
 In another terminal, from $ROOT:

   export PREFECT_API_URL=$PREFECT_API_URL
   .venv/bin/prefect deployment run 'relay/price-model-demo' --watch

 (a whole relay of several emulated Kaggle sessions; re-running it on the same emulator finds the relay
  done: restart 'make serve' for a fresh one). Ctrl-C here stops the workers, the emulator and the server.
================================================================================

EOF

# Until Ctrl-C, or until one of them dies (then stop the others too).
set +e
wait -n "$SERVER_PID" "$EMU_PID" "${WORKER_PIDS[@]}"
status=$?
echo "serve: a process exited (status $status); stopping the rest" >&2
exit 1
