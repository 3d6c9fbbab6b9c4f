#!/usr/bin/env bash
# Project-local S3-compatible server for development, demos and tests.
#   scripts/s3_local.sh start|stop|status|url|env
# Runs MinIO when a `minio` binary is on PATH, otherwise moto's S3 server from the project's
# virtualenv (moto[server] is pinned in requirements.txt). Listens on 127.0.0.1:$ACC_S3_PORT only
# (default 9100); pid, log and MinIO's data live in .local/s3 (git-ignored). The credentials are
# fixed development values: this server never leaves loopback.
#   `env` prints the ACC_MINIO_* lines that point ACCS at this server.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="${ACC_S3_DIR:-$ROOT/.local/s3}"
# ACC_S3_PORT, else the port this server was started on ($BASE/port), else 9100; a start that finds
# the port taken moves to the next free one and remembers it (url/env read it back).
PORT="${ACC_S3_PORT:-$(cat "$BASE/port" 2>/dev/null || echo 9100)}"
PIDFILE="$BASE/server.pid"
LOG="$BASE/server.log"
ACCESS_KEY="accs-dev"
SECRET_KEY="accs-dev-secret"  # MinIO wants at least 8 characters

url() { echo "http://127.0.0.1:$PORT"; }

python_bin() {
  # The test fixture passes its own interpreter, which is the one that has moto installed.
  if [ -n "${ACC_S3_PYTHON:-}" ]; then echo "$ACC_S3_PYTHON"
  elif [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"
  else command -v python3
  fi
}

port_answers() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }

our_pid_alive() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

is_running() { our_pid_alive && port_answers; }

start() {
  mkdir -p "$BASE"
  # Several test sessions may start at once; one of them starts the server, the others find it.
  exec 9>"$BASE/start.lock"
  flock -w 60 9 || { echo "s3_local: another start holds $BASE/start.lock" >&2; exit 1; }
  if is_running; then
    echo "s3_local: already up at $(url)" >&2
    return
  fi
  if port_answers; then
    if [ -n "${ACC_S3_PORT:-}" ]; then
      echo "s3_local: port $PORT is in use by another process; set ACC_S3_PORT to a free port" >&2
      exit 1
    fi
    while port_answers; do PORT=$((PORT + 2)); done  # +2: MinIO also takes PORT+1 for its console
    echo "s3_local: the default port is taken; using $PORT" >&2
  fi
  echo "$PORT" >"$BASE/port"
  local kind cmd
  if command -v minio >/dev/null 2>&1; then
    kind=minio
    mkdir -p "$BASE/data"
    cmd="export MINIO_ROOT_USER='$ACCESS_KEY' MINIO_ROOT_PASSWORD='$SECRET_KEY' MINIO_BROWSER=off;"
    cmd+=" exec minio server --quiet --address 127.0.0.1:$PORT --console-address 127.0.0.1:$((PORT + 1)) '$BASE/data'"
  else
    kind=moto
    local py
    py="$(python_bin)"
    if ! "$py" -c "import moto.server, flask" >/dev/null 2>&1; then
      echo "s3_local: neither a minio binary nor moto[server] for $py; run 'make install'" >&2
      exit 1
    fi
    cmd="exec '$py' -m moto.server -H 127.0.0.1 -p $PORT"
  fi
  rm -f "$PIDFILE"  # a stale file from a crashed server would read as "died at start"
  echo "--- $(date -u +%FT%TZ) starting $kind on 127.0.0.1:$PORT" >>"$LOG"
  # setsid: the server outlives this shell and ignores Ctrl-C sent to the test run's terminal.
  # The inner shell writes its own pid and then execs, so the pid file names the server itself.
  # 9>&-: the server must not inherit the start lock, or it would hold it for its lifetime.
  setsid bash -c "echo \$\$ >'$PIDFILE'; $cmd" </dev/null >>"$LOG" 2>&1 9>&- &
  local waited=0
  until port_answers; do
    if [ "$waited" -ge 300 ] || { [ -f "$PIDFILE" ] && ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }; then
      echo "s3_local: $kind did not start on port $PORT; last log lines:" >&2
      tail -20 "$LOG" >&2
      exit 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
  echo "s3_local: $kind up at $(url)" >&2
}

stop() {
  if our_pid_alive; then
    local pid
    pid="$(cat "$PIDFILE")"
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  rm -f "$PIDFILE"
  echo "s3_local: stopped" >&2
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) is_running && echo running || { echo stopped; exit 3; } ;;
  url) url ;;
  env)
    echo "ACC_MINIO_ENDPOINT=$(url)"
    echo "ACC_MINIO_ACCESS_KEY=$ACCESS_KEY"
    echo "ACC_MINIO_SECRET_KEY=$SECRET_KEY"
    ;;
  *) echo "usage: $0 start|stop|status|url|env" >&2; exit 2 ;;
esac
