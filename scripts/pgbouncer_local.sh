#!/usr/bin/env bash
# A project-local PgBouncer in transaction mode in front of the local PostgreSQL (scripts/pg_local.sh),
# on loopback only, the setup docs/deploy.md describes and the fleet test runs through.
#   scripts/pgbouncer_local.sh start|stop|status|url [DBNAME]
# Its config, log and pid live in .local/pgbouncer (ACC_PGBOUNCER_DIR); it forwards every database
# name to 127.0.0.1:<the local cluster's port> (ACC_PGBOUNCER_TARGET_PORT to point it elsewhere).
# The port: ACC_PGBOUNCER_PORT, else the one it was started on, else the first free one from 64320.
# PgBouncer is a Debian package: installed here with apt-get when missing (root or sudo), the way
# scripts/browser_deps.sh installs chromium.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${ACC_PGBOUNCER_DIR:-$ROOT/.local/pgbouncer}"
case "$DIR" in /*) ;; *) DIR="$ROOT/$DIR" ;; esac
DBNAME="${2:-${ACC_PG_DBNAME:-accs}}"
# PgBouncer refuses to run as root: under root it runs as 'postgres', and when that user cannot
# enter $DIR (a folder under root's mode-700 home or pytest's tmp) its files go to /var/tmp.
# The folder exists before that choice, so that start and stop choose alike (a start that found no
# folder chose /var/tmp, then made the folder, and the next stop looked for the pid in the folder).
mkdir -p "$DIR"
RUN="$DIR"
if [ "$(id -u)" = 0 ] && id postgres >/dev/null 2>&1 \
  && ! (cd / && runuser -u postgres -- test -x "$DIR") 2>/dev/null; then
  RUN="/var/tmp/accs-pgbouncer-$(printf '%s' "$DIR" | sha256sum | cut -c1-16)"
fi

port() { echo "${ACC_PGBOUNCER_PORT:-$(cat "$DIR/port" 2>/dev/null || echo 64320)}"; }
url() { echo "postgres://postgres@127.0.0.1:$(port)/$DBNAME"; }

install_if_missing() {
  command -v pgbouncer >/dev/null 2>&1 && return 0
  [ -x /usr/sbin/pgbouncer ] && return 0
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "pgbouncer_local: pgbouncer is missing and apt-get is not here; install PgBouncer 1.18+" >&2
    return 1
  fi
  if [ "$(id -u)" = 0 ]; then as_root=(); elif sudo -n true 2>/dev/null; then as_root=(sudo -n); else
    echo "pgbouncer_local: run 'sudo apt-get install pgbouncer'" >&2
    return 1
  fi
  echo "installing pgbouncer (apt-get)" >&2
  "${as_root[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq pgbouncer >/dev/null
}

bin() { command -v pgbouncer 2>/dev/null || echo /usr/sbin/pgbouncer; }

is_running() { [ -f "$RUN/pgbouncer.pid" ] && kill -0 "$(cat "$RUN/pgbouncer.pid")" 2>/dev/null; }

port_free() { ! (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

target_port() {
  if [ -n "${ACC_PGBOUNCER_TARGET_PORT:-}" ]; then echo "$ACC_PGBOUNCER_TARGET_PORT"; return; fi
  "$ROOT/scripts/pg_local.sh" url | sed -E 's#.*:([0-9]+)/.*#\1#'
}

write_config() {
  local listen="$1" target="$2"
  # transaction pooling; no prepared statements survive a transaction (the daemons turn them off);
  # startup parameters other than the tracked ones are refused, hence ACC_DB_POOLER=pgbouncer.
  cat >"$RUN/pgbouncer.ini" <<EOF
[databases]
* = host=127.0.0.1 port=$target

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $listen
unix_socket_dir =
auth_type = trust
auth_file = $RUN/userlist.txt
admin_users = postgres
pool_mode = transaction
max_client_conn = 5000
default_pool_size = ${ACC_PGBOUNCER_POOL_SIZE:-20}
reserve_pool_size = 0
max_db_connections = 0
server_reset_query =
server_check_delay = 1
server_login_retry = 1
query_wait_timeout = 120
idle_transaction_timeout = 60
ignore_startup_parameters = extra_float_digits
logfile = $RUN/pgbouncer.log
pidfile = $RUN/pgbouncer.pid
EOF
  echo '"postgres" ""' >"$RUN/userlist.txt"
}

start() {
  install_if_missing
  mkdir -p "$DIR" "$RUN"
  if is_running; then
    echo "pgbouncer_local: PgBouncer up at $(url)"
    return 0
  fi
  local listen
  listen="$(port)"
  while ! port_free "$listen"; do listen=$((listen + 1)); done
  echo "$listen" >"$DIR/port"
  write_config "$listen" "$(target_port)"
  local as_user=()
  if [ "$(id -u)" = 0 ]; then  # PgBouncer refuses to run as root
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    chown -R postgres "$RUN"
    chmod 755 "$RUN"
    as_user=(-u postgres)
  fi
  "$(bin)" -d "${as_user[@]}" "$RUN/pgbouncer.ini" >/dev/null
  for _ in $(seq 1 50); do
    if ! port_free "$listen"; then
      echo "pgbouncer_local: PgBouncer up at $(url)"
      return 0
    fi
    sleep 0.1
  done
  echo "pgbouncer_local: PgBouncer did not start; see $RUN/pgbouncer.log" >&2
  tail -5 "$RUN/pgbouncer.log" >&2 || true
  return 1
}

stop() {
  if is_running; then
    local pid
    pid="$(cat "$RUN/pgbouncer.pid")"
    kill "$pid"
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  echo "pgbouncer_local: stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) if is_running; then echo "up at $(url)"; else echo "down"; exit 1; fi ;;
  url) url ;;
  install) install_if_missing ;;
  *) echo "usage: $0 start|stop|status|url [DBNAME]|install" >&2; exit 2 ;;
esac
