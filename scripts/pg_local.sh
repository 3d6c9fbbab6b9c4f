#!/usr/bin/env bash
# Project-local PostgreSQL cluster for development, demos and tests.
#   scripts/pg_local.sh start|stop|status|url|psql
# The cluster lives in .local/pg (git-ignored), listens on 127.0.0.1:$ACC_PG_PORT only and
# trusts loopback connections. initdb refuses to run as root, so under root the cluster is
# owned and run by the 'postgres' OS user (created if missing). When 'postgres' cannot reach the
# checkout (a clone in root's home, mode 700), the data, socket and log go to a folder of their own
# under /var/tmp, named by a hash of the checkout's path, and $BASE/datadir remembers it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="${ACC_PG_DIR:-$ROOT/.local/pg}"
case "$BASE" in /*) ;; *) BASE="$ROOT/$BASE" ;; esac  # .env.example writes it relative to the checkout
# The port: ACC_PG_PORT, else the one this cluster was started on (remembered in $BASE/port), else
# 25329 (below Linux's ephemeral port range, so no client socket can hold it). A cluster's first start
# that finds the port taken by another server (say, a second checkout's cluster), or claimed by another
# cluster that is stopped for a while, moves to the next free port and remembers it, so `url` keeps
# telling the truth. Every first start claims its port in $PORT_CLAIMS (machine-wide), so no other
# cluster takes it while this one is stopped; a restart keeps its port, and fails naming the port when
# another server holds it (clients and daemons were told that port).
PORT="${ACC_PG_PORT:-$(cat "$BASE/port" 2>/dev/null || echo 25329)}"
DBNAME="${ACC_PG_DBNAME:-accs}"
PORT_CLAIMS="${ACC_PG_PORT_CLAIMS:-/tmp/accs-pg-ports}"

set_paths() {
  RUN_BASE="$1"
  DATA="$RUN_BASE/data"
  SOCK="$RUN_BASE/run"
  LOG="$RUN_BASE/server.log"
}
set_paths "$(cat "$BASE/datadir" 2>/dev/null || echo "$BASE")"

find_pgbin() {
  if command -v pg_config >/dev/null 2>&1 && [ -x "$(pg_config --bindir)/initdb" ]; then
    pg_config --bindir; return
  fi
  local d
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    [ -x "$d/initdb" ] && { echo "$d"; return; }
  done
  return 1
}

PGBIN="$(find_pgbin || true)"
if [ -z "$PGBIN" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "pg_local: no PostgreSQL server found; installing it with apt-get" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) >&2
    PGBIN="$(find_pgbin)"
  else
    echo "pg_local: no PostgreSQL server binaries (initdb) found; install PostgreSQL 15+" >&2
    exit 1
  fi
fi

if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
  PG_USER=postgres
  # From /: postgres may not be allowed into the caller's working directory.
  as_pg() { (cd / && runuser -u "$PG_USER" -- "$@"); }
else
  PG_USER="$(id -un)"
  as_pg() { "$@"; }
fi

url() { echo "postgres://postgres@127.0.0.1:$PORT/$DBNAME"; }

is_running() { [ -f "$DATA/PG_VERSION" ] && as_pg "$PGBIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; }

# True when the server's OS user can enter folder $1 (every parent must be traversable).
pg_can_reach() { [ "$PG_USER" = "$(id -un)" ] || as_pg test -x "$1" 2>/dev/null; }

choose_run_base() {
  if [ ! -f "$DATA/PG_VERSION" ] && [ "$RUN_BASE" = "$BASE" ] && ! pg_can_reach "$BASE"; then
    local elsewhere="/var/tmp/accs-pg-$(printf '%s' "$BASE" | sha256sum | cut -c1-16)"
    install -d -m 755 -o "$PG_USER" "$elsewhere"
    echo "$elsewhere" >"$BASE/datadir"
    echo "pg_local: $PG_USER cannot enter $BASE; keeping the cluster in $elsewhere" >&2
    set_paths "$elsewhere"
  fi
}

port_answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# True when another cluster's folder claims port $1 and still remembers it as its own.
claimed_by_other() {
  local owner
  owner="$(cat "$PORT_CLAIMS/$1" 2>/dev/null)" || return 1
  [ "$owner" != "$BASE" ] && [ "$(cat "$owner/port" 2>/dev/null)" = "$1" ]
}

# A cluster's first start: the first port from $PORT that no server answers on and no other cluster
# claims, claimed for this one (under a lock, so clusters started at once take different ports).
choose_first_port() {
  mkdir -p "$PORT_CLAIMS" && chmod 1777 "$PORT_CLAIMS" 2>/dev/null || true
  exec 8>>"$PORT_CLAIMS/.lock"
  flock -w 60 8 || { echo "pg_local: another start holds $PORT_CLAIMS/.lock" >&2; exit 1; }
  while port_answers "$PORT" || claimed_by_other "$PORT"; do
    echo "pg_local: port $PORT is taken or claimed by another cluster; trying $((PORT + 1))" >&2
    PORT=$((PORT + 1))
  done
  echo "$BASE" >"$PORT_CLAIMS/$PORT"
  echo "$PORT" >"$BASE/port"
  exec 8>&-
}

start() {
  mkdir -p "$BASE"
  chmod 755 "$BASE"
  choose_run_base
  # A port named by ACC_PG_PORT wins over the one a running cluster was started on.
  if [ -n "${ACC_PG_PORT:-}" ] && is_running && [ "$(cat "$BASE/port" 2>/dev/null)" != "$PORT" ]; then
    echo "pg_local: restarting on port $PORT (ACC_PG_PORT)" >&2
    as_pg "$PGBIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null
  fi
  if [ ! -f "$DATA/PG_VERSION" ]; then
    install -d -m 700 -o "$PG_USER" "$DATA"
    install -d -m 755 -o "$PG_USER" "$SOCK"
    as_pg "$PGBIN/initdb" -D "$DATA" -U postgres -A trust -E UTF8 --locale=C >"$BASE/initdb.log" 2>&1 \
      || { cat "$BASE/initdb.log" >&2; exit 1; }
  fi
  install -d -m 755 -o "$PG_USER" "$SOCK"
  touch "$LOG" && chown "$PG_USER" "$LOG"
  if ! is_running && [ -z "${ACC_PG_PORT:-}" ]; then
    if [ -f "$BASE/port" ]; then
      port_answers "$PORT" && {
        echo "pg_local: port $PORT, where this cluster ($BASE) listens, is taken by another server; stop" \
          "that server, or move this cluster with ACC_PG_PORT=<port> (its clients must then be told)" >&2
        exit 1
      }
    else
      choose_first_port
    fi
  fi
  echo "$PORT" >"$BASE/port"
  if ! is_running; then
    as_pg "$PGBIN/pg_ctl" -D "$DATA" -l "$LOG" -w -t 60 start -o \
      "-p $PORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$SOCK -c max_connections=300 -c shared_buffers=256MB -c max_wal_size=2GB -c fsync=on -c synchronous_commit=on" >/dev/null \
      || { tail -20 "$LOG" >&2; exit 1; }
  fi
  if ! "$PGBIN/psql" -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -tAc "select 1 from pg_database where datname='$DBNAME'" | grep -q 1; then
    "$PGBIN/createdb" -h 127.0.0.1 -p "$PORT" -U postgres "$DBNAME"
  fi
  echo "pg_local: PostgreSQL $("$PGBIN/postgres" --version | awk '{print $3}') up at $(url)" >&2
}

stop() {
  if is_running; then as_pg "$PGBIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null; fi
  echo "pg_local: stopped" >&2
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) is_running && echo running || { echo stopped; exit 3; } ;;
  url) url ;;
  psql) shift; exec "$PGBIN/psql" -h 127.0.0.1 -p "$PORT" -U postgres -d "$DBNAME" "$@" ;;
  *) echo "usage: $0 start|stop|status|url|psql" >&2; exit 2 ;;
esac
