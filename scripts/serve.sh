#!/usr/bin/env bash
# Serve ACCS (admin, dashboard, HTTP API, /metrics) with gunicorn, the production WSGI server.
#   scripts/serve.sh [gunicorn options]   (`make serve` migrates, then runs this)
# Settings, from the environment:
#   ACCS_WEB_HOST     address to listen on (default 127.0.0.1: this machine only; put a TLS proxy
#                     in front to serve others, docs/deploy.md)
#   ACCS_WEB_PORT     port (default 8000)
#   ACCS_WEB_WORKERS  processes (default 2)
#   ACCS_WEB_THREADS  threads per process (default 4): each serves one request at a time and
#                     keeps one database connection, so plan WORKERS × THREADS connections
# Threads, not only processes: a burst of slow clients (a hundred webhooks at once) waits in the
# listen backlog and is answered, never reset. Static files come from the app itself
# (WhiteNoise), so there is nothing to collect first. deploy/gunicorn.conf.py: workers that answer
# every accepted connection when told to stop, so `kill -HUP` reloads the code without refusing one.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3)"; fi

exec "$PY" -m gunicorn accs_site.wsgi:application -c "$ROOT/deploy/gunicorn.conf.py" \
  --bind "${ACCS_WEB_HOST:-127.0.0.1}:${ACCS_WEB_PORT:-8000}" \
  --workers "${ACCS_WEB_WORKERS:-2}" \
  --threads "${ACCS_WEB_THREADS:-4}" \
  --access-logfile - "$@"
