#!/usr/bin/env bash
# A streaming read replica of the project-local cluster (scripts/pg_local.sh), for ACC_READ_DB_URL.
#   scripts/pg_replica_local.sh start|stop|status|url|psql|promote
# start takes a base backup of the running local cluster (pg_basebackup -R: it writes
# standby.signal and primary_conninfo, so the copy starts as a hot standby streaming the primary's
# WAL) and starts it on its own port. The local cluster already allows it: PostgreSQL's defaults
# are wal_level=replica and max_wal_senders=10, and initdb's trust pg_hba.conf has a
# "host replication all 127.0.0.1/32" line. The copy lives in .local/pg-replica (ACC_PG_REPLICA_DIR),
# listens on 127.0.0.1 only, on ACC_PG_REPLICA_PORT or the first free port after the primary's + 100.
# `url` prints the replica's URL for the same database name as pg_local.sh's (ACC_PG_DBNAME).
# `promote` makes the replica a primary of its own (pg_ctl promote: a failover, for the failover test).
# A `start` of a stopped replica takes a fresh base backup (a stopped copy may lack WAL the primary
# has recycled since, or be the copy of another cluster on the same path).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PRIMARY_BASE="${ACC_PG_DIR:-$ROOT/.local/pg}"
case "$PRIMARY_BASE" in /*) ;; *) PRIMARY_BASE="$ROOT/$PRIMARY_BASE" ;; esac
BASE="${ACC_PG_REPLICA_DIR:-$PRIMARY_BASE-replica}"
case "$BASE" in /*) ;; *) BASE="$ROOT/$BASE" ;; esac
DBNAME="${ACC_PG_DBNAME:-accs}"
DATA="$BASE/data"
SOCK="$BASE/run"
LOG="$BASE/server.log"

PGBIN=""
for d in "$(pg_config --bindir 2>/dev/null || true)" $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
  [ -n "$d" ] && [ -x "$d/pg_basebackup" ] && { PGBIN="$d"; break; }
done
[ -n "$PGBIN" ] || { echo "pg_replica_local: no PostgreSQL server binaries (pg_basebackup) found" >&2; exit 1; }

if [ "$(id -u)" = 0 ]; then
  PG_USER=postgres
  as_pg() { (cd / && runuser -u "$PG_USER" -- "$@"); }
else
  PG_USER="$(id -un)"
  as_pg() { "$@"; }
fi

primary_port() { cat "$PRIMARY_BASE/port" 2>/dev/null || echo 25329; }
port() { cat "$BASE/port" 2>/dev/null || echo "${ACC_PG_REPLICA_PORT:-$(( $(primary_port) + 100 ))}"; }
url() { echo "postgres://postgres@127.0.0.1:$(port)/$DBNAME"; }
is_running() { [ -f "$DATA/PG_VERSION" ] && as_pg "$PGBIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; }

start() {
  "$ROOT/scripts/pg_local.sh" status >/dev/null 2>&1 \
    || { echo "pg_replica_local: the local cluster is not running (scripts/pg_local.sh start)" >&2; exit 1; }
  local pport; pport="$(primary_port)"
  mkdir -p "$BASE" && chmod 755 "$BASE"
  if is_running; then echo "pg_replica_local: replica up at $(url)" >&2; return; fi
  # A stopped copy is never reused: the primary may have recycled the WAL it needs since, or be
  # another cluster by now (a test worker's cluster takes a new port each run), and the copy would
  # stream nothing. A fresh base backup each start.
  rm -rf "$DATA"
  install -d -m 700 -o "$PG_USER" "$DATA"
  # -X stream: the WAL written during the copy comes with it; -R: start as a standby of this primary.
  as_pg "$PGBIN/pg_basebackup" -h 127.0.0.1 -p "$pport" -U postgres -D "$DATA" -R -X stream -c fast \
    >"$BASE/basebackup.log" 2>&1 || { cat "$BASE/basebackup.log" >&2; exit 1; }
  local p="${ACC_PG_REPLICA_PORT:-$(( pport + 100 ))}"
  if [ -z "${ACC_PG_REPLICA_PORT:-}" ]; then
    while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; do p=$((p + 1)); done
  fi
  echo "$p" >"$BASE/port"
  install -d -m 755 -o "$PG_USER" "$SOCK"
  touch "$LOG" && chown "$PG_USER" "$LOG"
  as_pg "$PGBIN/pg_ctl" -D "$DATA" -l "$LOG" -w -t 120 start -o \
    "-p $p -c listen_addresses=127.0.0.1 -c unix_socket_directories=$SOCK -c max_connections=300 -c hot_standby=on -c hot_standby_feedback=on" \
    >/dev/null || { tail -20 "$LOG" >&2; exit 1; }
  echo "pg_replica_local: replica of 127.0.0.1:$pport up at $(url)" >&2
}

promote() {
  is_running || { echo "pg_replica_local: the replica is not running" >&2; exit 1; }
  as_pg "$PGBIN/pg_ctl" -D "$DATA" -w -t 60 promote >/dev/null
  echo "pg_replica_local: promoted; $(url) is a primary now" >&2
}

stop() {
  if is_running; then as_pg "$PGBIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null; fi
  echo "pg_replica_local: stopped" >&2
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) is_running && echo running || { echo stopped; exit 3; } ;;
  url) url ;;
  promote) promote ;;
  psql) shift; exec "$PGBIN/psql" -h 127.0.0.1 -p "$(port)" -U postgres -d "$DBNAME" "$@" ;;
  *) echo "usage: $0 start|stop|status|url|psql|promote" >&2; exit 2 ;;
esac
