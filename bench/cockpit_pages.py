"""Time every cockpit page, the API's read endpoints and ``/metrics`` against a big database.

Starts a FRESH web process (gunicorn, one worker, as ``scripts/serve.sh`` runs it) on the database
``bench/cockpit_data.py`` filled, logs in as its ``bench`` superuser, takes an API token, then
requests each page ``--runs`` times in turns and prints the first request's time and p50/p95 per
page. ``/metrics`` is scraped first of all, so its first figure is a fresh process's first scrape.

    python bench/cockpit_pages.py                      # accs_scale on the local cluster, 15 runs
    python bench/cockpit_pages.py --runs 30 --json bench/results/cockpit_pages.json

Targets: every page and API call under 300 ms p95; ``/metrics`` under 1 s, the first scrape included.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jobs.ids import short_id  # noqa: E402  (plain Python, no Django)

PAGE_TARGET_MS = 300.0
METRICS_TARGET_MS = 1000.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_url() -> str:
    base = subprocess.run([str(ROOT / "scripts" / "pg_local.sh"), "url"], check=True, capture_output=True,
                          text=True).stdout.strip()
    return base.rsplit("/", 1)[0] + "/accs_scale"


def _ids(db_url: str) -> dict[str, str]:
    """Pick the rows whose pages are timed: the job with the most events, a task, a node."""
    with psycopg.connect(db_url) as conn:
        big = conn.execute("SELECT job_id FROM accs_event WHERE type = 'log' AND source = 'agent:stdout'"
                           " AND message LIKE 'frame %' ORDER BY id DESC LIMIT 1").fetchone()
        if big is None:
            big = conn.execute("SELECT id FROM accs_job ORDER BY created_at DESC LIMIT 1").fetchone()
        task = conn.execute("SELECT id FROM accs_task WHERE job_id = %s LIMIT 1", [big[0]]).fetchone()
        failed = conn.execute("SELECT id FROM accs_task WHERE status = 'error' ORDER BY id LIMIT 1").fetchone()
        node = conn.execute("SELECT name FROM accs_node ORDER BY name LIMIT 1").fetchone()
        wf = conn.execute("SELECT name, version FROM accs_workflow ORDER BY name LIMIT 1").fetchone()
        service = conn.execute("SELECT id FROM accs_service ORDER BY key LIMIT 1").fetchone()
    return {"job": str(big[0]), "task": str(task[0]), "failed_task": str(failed[0]) if failed else str(task[0]),
            "node": node[0], "workflow": f"{wf[0]}/{wf[1]}" if wf else "",
            "service": str(service[0]) if service else "0"}


def _pages(ids: dict[str, str]) -> list[tuple[str, str, str]]:
    """(name, path, kind) for each timed request; kind is admin, ranged (an admin page in a session of its
    own), api or metrics."""
    return [
        ("dashboard", "/admin/dashboard/", "admin"),
        ("dashboard data.json", "/admin/dashboard/data.json", "admin"),
        ("job list", "/admin/jobs/job/", "admin"),
        ("job list, failed filter", "/admin/jobs/job/?status__exact=error", "admin"),
        ("job list, search", f"/admin/jobs/job/?q={ids['job'][:8]}", "admin"),
        ("job list, short id search", f"/admin/jobs/job/?q={short_id(ids['job'])}", "admin"),
        ("job page (2k events)", f"/admin/jobs/job/{ids['job']}/change/", "admin"),
        ("job page data.json", f"/admin/job/{ids['job']}/data.json", "admin"),
        ("task list", "/admin/jobs/task/", "admin"),
        ("task list page 500", "/admin/jobs/task/?p=500", "admin"),
        ("task list, dead letters", "/admin/jobs/task/?status__exact=error", "admin"),
        ("task page", f"/admin/jobs/task/{ids['task']}/change/", "admin"),
        ("task page (dead letter)", f"/admin/jobs/task/{ids['failed_task']}/change/", "admin"),
        ("attempt list", "/admin/jobs/attempt/", "admin"),
        ("attempt list, one service", f"/admin/jobs/attempt/?service={ids['service']}", "admin"),
        # Its own session: a range given is remembered, and would then be every other page's.
        ("dashboard, 7 d", "/admin/dashboard/?range=7d", "ranged"),
        ("redrive form (dead letters)", "/admin/jobs/task/redrive/", "admin"),
        ("event list", "/admin/events/event/", "admin"),
        ("node list", "/admin/nodes/node/", "admin"),
        ("node page", f"/admin/nodes/node/{ids['node']}/change/", "admin"),
        ("services", "/admin/workflows/service/", "admin"),
        ("workflows", "/admin/workflows/workflow/", "admin"),
        ("triggers", "/admin/jobs/trigger/", "admin"),
        ("API jobs", "/api/v1/jobs", "api"),
        ("API jobs, failed", "/api/v1/jobs?status=error", "api"),
        ("API jobs summary", "/api/v1/jobs/summary", "api"),
        ("API job", f"/api/v1/jobs/{ids['job']}", "api"),
        ("API job attempts", f"/api/v1/jobs/{ids['job']}/attempts", "api"),
        ("API services", "/api/v1/services", "api"),
        ("API workflows", "/api/v1/workflows", "api"),
        ("API triggers", "/api/v1/jobs/triggers", "api"),
        ("metrics", "/metrics", "metrics"),
    ]


def _token(db_url: str) -> str:
    """Make an API token for the bench user (through the project's own function) and return it."""
    code = ("import django; django.setup();"
            "from django.contrib.auth import get_user_model; from tenants.auth import create_token;"
            "print(create_token(get_user_model().objects.get(username='bench'), 'cockpit-pages')[1])")
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT, env={**os.environ, "ACC_DB_URL": db_url, "DJANGO_SETTINGS_MODULE": "accs_site.settings"},
        check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def _catch_up_metrics(db_url: str) -> None:
    """Fold every settled event into /metrics' stored totals before timing.

    The loader writes ten million events at once; a live system's scrapes fold them as they come. Left
    behind, the timed scrapes would each fold their half-second budget of the load's backlog and time
    that instead of a scrape.
    """
    code = ("import django; django.setup();"
            "from ops.metrics import TimelineCounters;"
            "c = TimelineCounters(budget_seconds=3600.0); print(c.fold())")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True,
                   env={**os.environ, "ACC_DB_URL": db_url, "DJANGO_SETTINGS_MODULE": "accs_site.settings"})


WEB_LOG = Path("/tmp/cockpit_pages_web.log")


def _start_web(db_url: str, port: int, env_extra: dict[str, str]) -> subprocess.Popen:
    """Start gunicorn (one worker, one thread) on ``port``; its errors go to :data:`WEB_LOG`."""
    env = {**os.environ, "ACC_DB_URL": db_url, "ACC_METRICS_TOKEN": "bench-metrics", "ACCS_WEB_PORT": str(port),
           "ACCS_WEB_WORKERS": "1", "ACCS_WEB_THREADS": "1", **env_extra}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "accs_site.wsgi:application", "--bind", f"127.0.0.1:{port}",
         "--workers", "1", "--threads", "1", "--timeout", "300"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=WEB_LOG.open("w"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            requests.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=10)
            return proc
        except requests.RequestException:
            if proc.poll() is not None:
                raise SystemExit(f"cockpit_pages: the web process died; see {WEB_LOG}") from None
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("cockpit_pages: the web process did not answer within 60 s")


def _login(base: str) -> requests.Session:
    s = requests.Session()
    page = s.get(f"{base}/admin/login/", timeout=30).text
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    r = s.post(f"{base}/admin/login/?next=/admin/", data={"username": "bench", "password": "bench",
               "csrfmiddlewaretoken": token}, headers={"Referer": f"{base}/admin/login/"}, timeout=30)
    if "/admin/login/" in r.url:
        raise SystemExit("cockpit_pages: could not log in as bench/bench (run bench/cockpit_data.py first)")
    return s


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db-url", default=None)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--read-db-url", default=None, help="set ACC_READ_DB_URL for the web process")
    args = parser.parse_args(argv)
    db_url = args.db_url or _default_url()
    ids = _ids(db_url)
    api_token = _token(db_url)
    _catch_up_metrics(db_url)
    port = _free_port()
    extra = {"ACC_READ_DB_URL": args.read_db_url} if args.read_db_url else {}
    web = _start_web(db_url, port, extra)
    base = f"http://127.0.0.1:{port}"
    times: dict[str, list[float]] = {}
    status: dict[str, int] = {}
    try:
        sessions = {"admin": _login(base), "ranged": _login(base)}
        pages = _pages(ids)
        # The metrics first: the first scrape of a fresh process is the one that used to recount history.
        pages.sort(key=lambda p: p[2] != "metrics")
        for _ in range(args.runs):
            for name, path, kind in pages:
                headers = {"Authorization": f"Bearer {api_token}"} if kind == "api" else (
                    {"Authorization": "Bearer bench-metrics"} if kind == "metrics" else {})
                client = sessions.get(kind, requests)
                t = time.perf_counter()
                r = client.get(base + path, headers=headers, timeout=300)
                times.setdefault(name, []).append((time.perf_counter() - t) * 1000)
                status[name] = r.status_code
    finally:
        web.terminate()
        web.wait(timeout=30)
    load = os.getloadavg()
    rows = []
    print(f"{'page':32} {'status':>6} {'first':>8} {'p50':>8} {'p95':>8}  target")
    for name, path, kind in _pages(ids):
        v = times[name]
        target = METRICS_TARGET_MS if kind == "metrics" else PAGE_TARGET_MS
        worst = max(v[0], _pct(v, 0.95)) if kind == "metrics" else _pct(v, 0.95)
        ok = "ok" if worst < target and status[name] == 200 else "MISSED"
        rows.append({"page": name, "path": path, "status": status[name], "first_ms": round(v[0], 1),
                     "p50_ms": round(statistics.median(v), 1), "p95_ms": round(_pct(v, 0.95), 1), "target_ms": target,
                     "ok": ok == "ok"})
        print(f"{name:32} {status[name]:>6} {v[0]:>8.0f} {statistics.median(v):>8.0f} {_pct(v, 0.95):>8.0f}  "
              f"{ok} (< {target:.0f} ms)")
    print(f"load average after the run: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"runs": args.runs, "load": load, "pages": rows}, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
