"""Build a cockpit-sized history in its own database: 1M jobs, ~1.5M tasks, ~10M timeline events.

The rows have the engine's real shapes (the statuses, status events and their ``data``, attempts,
step counters, dead letters, retries, cancels, running and queued work of today), written with
set-based ``INSERT ... SELECT FROM generate_series`` one batch of jobs per transaction, never
through the ORM, so the admin, the dashboard, the API and ``/metrics`` can be timed against a
large site (``bench/cockpit_pages.py``). The reference rows (tenants, services, a workflow, nodes)
are made once through the project's own functions.

    python bench/cockpit_data.py                         # 1M jobs, 10M events into accs_scale
    python bench/cockpit_data.py --jobs 200000 --events 2000000
    python bench/cockpit_data.py --db-url postgres://postgres@127.0.0.1:25329/accs_scale

The database (default: ``accs_scale`` on the local cluster of ``scripts/pg_local.sh``) is created
and migrated when missing; it is never the test database. A run refuses a database that already
holds jobs unless ``--append`` is given.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TENANTS = ("default", "acme", "globex", "initech", "umbrella")
SERVICES = ("fetch", "render", "package", "notify", "transcode", "backup", "report")
NODES = ("node-a", "node-b", "node-c", "gpu-1", "gpu-2", "edge-1")
ERRORS = (
    "render crashed: exit 137 (out of memory)",
    "disk full: /srv/scratch (no space left on device)",
    "timeout after 600 s",
    "connection refused: upstream 10.0.4.7:443",
    "ValueError: bad frame header at offset 4096",
)

#: One batch: the jobs ``lo..hi`` with their fate, then their tasks, attempts, steps and events.
#: Fates: done, retried (done on the second attempt), error (dead letter after 3 attempts),
#: canceled, and for the newest jobs queued (not started), waiting (task queued), running.
BATCH_SQL = """
CREATE TEMP TABLE bj ON COMMIT DROP AS
SELECT g, gen_random_uuid() AS id,
       %(t0)s::timestamptz + make_interval(secs => g * %(step)s) AS ts,
       (g * 2654435761) %% 1000 AS h,
       g %% 2 = 0 AS wf,
       (%(tenants)s::uuid[])[1 + (g / 7) %% array_length(%(tenants)s::uuid[], 1)] AS tenant_id,
       (%(services)s::bigint[])[1 + g %% array_length(%(services)s::bigint[], 1)] AS service_id,
       (%(services_keys)s::text[])[1 + g %% array_length(%(services_keys)s::text[], 1)] AS service_key,
       CASE WHEN g >= %(live_from)s THEN (ARRAY['queued', 'waiting', 'running'])[1 + g %% 3]
            WHEN (g * 2654435761) %% 1000 < 25 THEN 'error'
            WHEN (g * 2654435761) %% 1000 < 35 THEN 'canceled'
            WHEN (g * 2654435761) %% 1000 < 85 THEN 'retried'
            ELSE 'done' END AS fate
  FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g;

INSERT INTO accs_job (id, tenant_id, service_id, workflow_id, status, progress, current_task_key, priority, options,
                      step_params, scheduled_at, error_code, error_message, source, source_ref, correlation_id,
                      approval_state, approved_by, created_at, updated_at, started_at, finished_at)
SELECT id, tenant_id, CASE WHEN NOT wf THEN service_id END, CASE WHEN wf THEN %(workflow)s::uuid END,
       CASE fate WHEN 'retried' THEN 'done' ELSE fate END,
       CASE fate WHEN 'done' THEN 1 WHEN 'retried' THEN 1 WHEN 'running' THEN 0.3 ELSE 0 END,
       CASE WHEN wf THEN 'render' ELSE service_key END, 0, '{}', '{}', ts,
       CASE fate WHEN 'error' THEN 'failed' WHEN 'canceled' THEN 'canceled' ELSE '' END,
       CASE fate WHEN 'error' THEN 'task ' || CASE WHEN wf THEN 'render' ELSE service_key END || ': '
                                   || (%(errors)s::text[])[1 + h %% 5]
                 WHEN 'canceled' THEN 'canceled by alice' ELSE '' END,
       CASE WHEN g %% 10 = 0 THEN 'schedule' ELSE 'manual' END, '', 'corr-' || g, 'not_required', '',
       ts, ts + interval '40 s',
       CASE WHEN fate <> 'queued' THEN ts + interval '1 s' END,
       CASE WHEN fate IN ('done', 'retried', 'error', 'canceled') THEN ts + make_interval(secs => 20 + h %% 40) END
  FROM bj;

CREATE TEMP TABLE bt ON COMMIT DROP AS
SELECT bj.g, bj.id AS job_id, bj.tenant_id, bj.ts, bj.h, bj.fate, k, gen_random_uuid() AS id,
       CASE WHEN bj.wf THEN %(wf_services)s::bigint[] ELSE ARRAY[bj.service_id] END AS svc_pair,
       CASE WHEN bj.wf THEN (ARRAY['fetch', 'render'])[k] ELSE bj.service_key END AS step_key,
       k = CASE WHEN bj.wf THEN 2 ELSE 1 END AS last,
       (%(nodes)s::text[])[1 + (bj.g + k) %% array_length(%(nodes)s::text[], 1)] AS node,
       CASE WHEN bj.fate IN ('done', 'retried', 'error', 'canceled') AND NOT (k = CASE WHEN bj.wf THEN 2 ELSE 1 END)
                 THEN 'done'
            WHEN bj.fate IN ('done', 'retried') THEN 'done'
            WHEN bj.fate = 'error' THEN 'error'
            WHEN bj.fate = 'canceled' THEN 'canceled'
            WHEN k = 1 AND bj.fate = 'waiting' THEN 'queued'
            WHEN k = 1 AND bj.fate = 'running' THEN 'running'
            ELSE 'waiting' END AS status,
       -- lognum: the task's info lines, so the timeline reaches the asked size.
       floor(%(logs)s)::int + CASE WHEN ((bj.g * 31 + k) * 2654435761) %% 1000 < 1000 * (%(logs)s - floor(%(logs)s))
                                   THEN 1 ELSE 0 END AS lognum
  FROM bj CROSS JOIN LATERAL generate_series(1, CASE WHEN bj.fate = 'queued' THEN 0 WHEN bj.wf THEN 2 ELSE 1 END) AS k;

ALTER TABLE bt ADD COLUMN attempt int, ADD COLUMN service_id bigint, ADD COLUMN t_start timestamptz,
                ADD COLUMN t_end timestamptz;
UPDATE bt SET service_id = svc_pair[least(k, array_length(svc_pair, 1))],
              attempt = CASE WHEN status = 'error' THEN 3 WHEN fate = 'retried' AND last THEN 2
                             WHEN status IN ('queued', 'waiting') THEN 0 ELSE 1 END,
              t_start = ts + make_interval(secs => 2 + (k - 1) * 10),
              t_end = CASE WHEN status IN ('done', 'error', 'canceled')
                           THEN ts + make_interval(secs => least(19 + h %% 40, 2 + (k - 1) * 10 + 8)) END;

INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, exclusive, status, depends_on, attempt,
                       max_attempts, next_attempt_at, priority, order_seq, timeout_seconds, progress, params, results,
                       assigned_node, claimed_by, node, claimed_at, lease_expires_at, heartbeat_at, started_at,
                       finished_at, error_code, error_message, created_at, updated_at)
SELECT id, job_id, tenant_id, step_key, step_key, service_id, false, status,
       CASE WHEN k = 2 THEN '{fetch}'::varchar[] ELSE '{}'::varchar[] END, attempt, 3, t_start - interval '1 s',
       0, g, 600,
       CASE status WHEN 'done' THEN 1 WHEN 'running' THEN 0.35 END,
       jsonb_build_object('n', g), CASE WHEN status = 'done' THEN '{"ok": true}'::jsonb END, '',
       CASE WHEN status = 'running' THEN 'agent-' || node || ':1' ELSE '' END,
       CASE WHEN attempt > 0 THEN node ELSE '' END,
       CASE WHEN attempt > 0 THEN t_start END,
       CASE WHEN status = 'running' THEN now() + interval '10 min' END,
       CASE WHEN status = 'running' THEN now() END,
       CASE WHEN attempt > 0 THEN t_start END, t_end,
       CASE status WHEN 'error' THEN 'failed' WHEN 'canceled' THEN 'canceled' ELSE '' END,
       CASE status WHEN 'error' THEN (%(errors)s::text[])[1 + h %% 5] WHEN 'canceled' THEN 'canceled by alice'
                   ELSE '' END,
       ts + interval '1 s', coalesce(t_end, ts + interval '1 s')
  FROM bt;

INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, pid, status, started_at, finished_at, exit_code,
                          stdout_tail, stderr_tail, error_text)
SELECT bt.id, a, bt.node, 'agent-' || bt.node || ':1', 1000 + bt.g %% 30000,
       CASE WHEN a < bt.attempt THEN 'failed' WHEN bt.status = 'done' THEN 'succeeded'
            WHEN bt.status = 'error' THEN 'failed' WHEN bt.status = 'canceled' THEN 'canceled' ELSE 'running' END,
       bt.t_start + make_interval(secs => a - 1),
       CASE WHEN bt.status <> 'running' OR a < bt.attempt THEN coalesce(bt.t_end, bt.t_start + make_interval(secs => a))
                                                                - make_interval(secs => bt.attempt - a) END,
       CASE WHEN bt.status = 'running' AND a = bt.attempt THEN NULL WHEN a = bt.attempt AND bt.status = 'done' THEN 0
            ELSE 1 END,
       '', CASE WHEN a < bt.attempt OR bt.status = 'error' THEN (%(errors)s::text[])[1 + (bt.h + a) %% 5] ELSE '' END,
       CASE WHEN a < bt.attempt OR bt.status = 'error' THEN (%(errors)s::text[])[1 + (bt.h + a) %% 5] ELSE '' END
  FROM bt CROSS JOIN LATERAL generate_series(1, bt.attempt) AS a;

INSERT INTO accs_job_step (job_id, step_key, position, total, done, error, skipped, canceled, blocked, released,
                           poisoned, always, on_failure)
SELECT job_id, step_key, k - 1, 1, (status = 'done')::int, (status = 'error')::int, 0, (status = 'canceled')::int, 0,
       status <> 'waiting', status = 'error', false, 'fail_job'
  FROM bt;

-- The job's own status events, then each task's: created, each attempt's claim, start and end, and info lines.
INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
SELECT e.ts, bj.id, NULL, NULL, e.source, e.level, 'status', e.msg, e.data
  FROM bj CROSS JOIN LATERAL (VALUES
    (bj.ts, 'api', 'info', 'job created queued',
     '{"from": "created", "to": "queued", "approval": "not_required"}'::jsonb, true),
    (bj.ts + interval '1 s', 'builder', 'info', 'job queued → waiting', '{"from": "queued", "to": "waiting"}'::jsonb,
     bj.fate <> 'queued'),
    (bj.ts + interval '2 s', 'agent', 'info', 'job waiting → running', '{"from": "waiting", "to": "running"}'::jsonb,
     bj.fate NOT IN ('queued', 'waiting')),
    (bj.ts + make_interval(secs => 20 + bj.h %% 40), 'agent',
     CASE bj.fate WHEN 'error' THEN 'error' WHEN 'canceled' THEN 'warn' ELSE 'info' END,
     'job running → ' || CASE bj.fate WHEN 'retried' THEN 'done' ELSE bj.fate END,
     jsonb_build_object('from', 'running', 'to', CASE bj.fate WHEN 'retried' THEN 'done' ELSE bj.fate END),
     bj.fate IN ('done', 'retried', 'error', 'canceled'))
  ) AS e(ts, source, level, msg, data, keep)
 WHERE e.keep;

INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
SELECT e.ts, bt.job_id, bt.id, e.attempt, e.source, e.level, e.type, e.msg, e.data
  FROM bt CROSS JOIN LATERAL (
    SELECT bt.ts + interval '1 s', NULL::int, 'builder', 'info', 'status',
           'task created ' || CASE WHEN bt.k = 2 THEN 'waiting' ELSE 'queued' END,
           jsonb_build_object('from', 'created', 'to', CASE WHEN bt.k = 2 THEN 'waiting' ELSE 'queued' END,
                              'task_key', bt.step_key)
    UNION ALL
    SELECT bt.t_start - interval '1 s', NULL, 'builder', 'info', 'status', 'task waiting → queued',
           '{"from": "waiting", "to": "queued"}'::jsonb
     WHERE bt.k = 2 AND bt.attempt > 0
    UNION ALL
    SELECT bt.t_start + make_interval(secs => a - 1), a, 'agent', 'info', 'status', 'task queued → starting',
           jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', 'agent-' || bt.node || ':1')
      FROM generate_series(1, bt.attempt) AS a
    UNION ALL
    SELECT bt.t_start + make_interval(secs => a - 1) + interval '0.2 s', a, 'agent', 'info', 'status',
           'task starting → running', '{"from": "starting", "to": "running"}'::jsonb
      FROM generate_series(1, bt.attempt) AS a
    UNION ALL
    SELECT bt.t_start + make_interval(secs => a - 1) + interval '0.5 s', a, 'agent', 'warn', 'retry',
           'task running → queued: attempt ' || a || '/3 failed, retry in 0.0s',
           jsonb_build_object('from', 'running', 'to', 'queued', 'error', (%(errors)s::text[])[1 + (bt.h + a) %% 5],
                              'delay_seconds', 0)
      FROM generate_series(1, bt.attempt - 1) AS a
    UNION ALL
    SELECT bt.t_end, bt.attempt, 'agent', CASE bt.status WHEN 'error' THEN 'error' WHEN 'canceled' THEN 'warn'
                                                ELSE 'info' END, 'status',
           CASE bt.status WHEN 'error' THEN 'task running → error (final after 3/3 attempts): '
                                          || (%(errors)s::text[])[1 + bt.h %% 5]
                          ELSE 'task running → ' || bt.status END,
           CASE bt.status WHEN 'error' THEN jsonb_build_object('from', 'running', 'to', 'error', 'dead_letter', true,
                                                               'error', (%(errors)s::text[])[1 + bt.h %% 5],
                                                               'error_code', 'failed')
                          ELSE jsonb_build_object('from', 'running', 'to', bt.status) END
     WHERE bt.t_end IS NOT NULL
    UNION ALL
    SELECT bt.t_start + make_interval(secs => 1) + make_interval(secs => i * 0.01), bt.attempt, 'agent:stdout', 'info',
           'log', 'step ' || bt.step_key || ': processed chunk ' || i || ' of ' || bt.lognum, '{}'::jsonb
      FROM generate_series(1, CASE WHEN bt.attempt > 0 THEN bt.lognum ELSE 0 END) AS i
  ) AS e(ts, attempt, source, level, type, msg, data);
"""


def _default_url() -> str:
    base = subprocess.run([str(ROOT / "scripts" / "pg_local.sh"), "url"], check=True, capture_output=True,
                          text=True).stdout.strip()
    return base.rsplit("/", 1)[0] + "/accs_scale"


def _ensure_database(url: str) -> None:
    import psycopg

    base, name = url.rsplit("/", 1)
    if name.startswith("test_"):
        raise SystemExit(f"cockpit_data: refusing {name!r}: the generator never writes into a test database")
    with psycopg.connect(base + "/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def _setup_django(url: str) -> None:
    os.environ["ACC_DB_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
    os.environ.setdefault("ACC_ALLOWED_CALLABLES", "bench")  # the benchmarks' services call bench.tasks
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)


def _reference_rows() -> dict:
    """Make (or find) the tenants, services, workflow and nodes the bulk rows point at."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from nodes.models import Node
    from tenants.models import Tenant
    from workflows.api import create_workflow, save_service
    from workflows.models import Service, Workflow

    tenants = [Tenant.objects.get_or_create(slug=s, defaults={"name": s.title()})[0] for s in TENANTS]
    services = []
    for key in SERVICES:
        svc = Service.objects.filter(key=key).first() or save_service(
            key=key, executor="python", executor_config={"callable": "bench.task_funcs:noop"},
            params_schema={"type": "object"}, max_attempts=3)
        services.append(svc)
    wf = Workflow.objects.filter(name="pipeline").first() or create_workflow(name="pipeline", steps=[
        {"key": "fetch", "service": "fetch", "depends_on": []},
        {"key": "render", "service": "render", "depends_on": ["fetch"]},
    ])
    now = timezone.now()
    for name in NODES:
        Node.objects.get_or_create(name=name, defaults={"version": "0.1.0", "last_seen": now, "awake_state": "awake",
                                                        "presence": "online", "services": list(SERVICES)})
    user_model = get_user_model()
    if not user_model.objects.filter(username="bench").exists():
        user_model.objects.create_superuser("bench", "bench@example.org", "bench")
    by_key = {s.key: s.id for s in services}
    return {"tenants": [str(t.id) for t in tenants], "services": [s.id for s in services],
            "services_keys": [s.key for s in services], "workflow": str(wf.id),
            "wf_services": [by_key["fetch"], by_key["render"]], "nodes": list(NODES)}


def _big_job(cur, *, events: int) -> str:
    """Give the newest finished service job ``events`` log lines (the job page's worst case); return its id."""
    cur.execute("SELECT j.id, t.id, t.started_at FROM accs_job j JOIN accs_task t ON t.job_id = j.id"
                " WHERE j.status = 'done' AND j.service_id IS NOT NULL ORDER BY j.created_at DESC LIMIT 1")
    job_id, task_id, started = cur.fetchone()
    cur.execute("INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)"
                " SELECT %s + make_interval(secs => i * 0.001), %s, %s, 1, 'agent:stdout',"
                " CASE WHEN i %% 50 = 0 THEN 'warn' ELSE 'info' END, 'log', 'frame ' || i || ' rendered', '{}'"
                " FROM generate_series(1, %s) AS i", [started, job_id, task_id, events])
    return str(job_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db-url", default=None, help="target database (default: accs_scale on the local cluster)")
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--events", type=int, default=10_000_000, help="about this many timeline events in all")
    parser.add_argument("--batch", type=int, default=25_000, help="jobs per transaction")
    parser.add_argument("--days", type=float, default=30.0, help="the history reaches this far back")
    parser.add_argument("--append", action="store_true", help="add to a database that already holds jobs")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.batch < 1 or args.days <= 0:
        parser.error("--jobs, --batch and --days must be positive")
    url = args.db_url or _default_url()
    _ensure_database(url)
    _setup_django(url)
    from django.db import connection, transaction

    ref = _reference_rows()
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM (SELECT 1 FROM accs_job LIMIT 1) x")
        if cur.fetchone()[0] and not args.append:
            raise SystemExit("cockpit_data: the database already holds jobs; pass --append to add more")
        cur.execute("SELECT now() - make_interval(secs => %s)", [args.days * 86400.0])
        t0 = cur.fetchone()[0]
        cur.execute("SELECT coalesce(max(order_seq), 0) FROM accs_job")
    # Per job: its own 3-4 status events, per task 4 (created, claim, start, end) plus a retry's 3,
    # so the info lines per task make up the rest of --events.
    tasks = args.jobs * 1.5
    base = args.jobs * 3.9 + tasks * 4.2
    logs = max(0.0, (args.events - base) / tasks)
    step = args.days * 86400.0 / args.jobs
    live_from = max(1, args.jobs - max(30, args.jobs // 2000))
    started = time.monotonic()
    for lo in range(1, args.jobs + 1, args.batch):
        hi = min(args.jobs, lo + args.batch - 1)
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SET LOCAL synchronous_commit = off")
            cur.execute(BATCH_SQL, {**ref, "t0": t0, "step": step, "lo": lo, "hi": hi, "live_from": live_from,
                                    "logs": logs, "errors": list(ERRORS)})
        done = hi / args.jobs
        spent = time.monotonic() - started
        print(f"jobs {hi:,}/{args.jobs:,} ({done:.0%}) in {spent:.0f} s, about {spent / done - spent:.0f} s left",
              flush=True)
    with connection.cursor() as cur:
        big = _big_job(cur, events=2000)
        cur.execute("INSERT INTO accs_artifact (job_id, task_id, attempt, kind, bucket, key, size_bytes, content_type,"
                    " checksum, created_at) SELECT t.job_id, t.id, 1, 'output', 'accs', 'out/' || t.id || '.json', 512,"
                    " 'application/json', '', t.finished_at FROM accs_task t WHERE t.status = 'done'"
                    " ORDER BY t.finished_at DESC LIMIT 1000")
        cur.execute("ANALYZE")
        cur.execute("SELECT (SELECT count(*) FROM accs_job), (SELECT count(*) FROM accs_task),"
                    " (SELECT count(*) FROM accs_event), pg_size_pretty(pg_database_size(current_database()))")
        jobs, tasks_n, events, size = cur.fetchone()
    print(f"cockpit_data: {jobs:,} jobs, {tasks_n:,} tasks, {events:,} events, {size} in {url.rsplit('/', 1)[1]};"
          f" the job with 2,000 extra events: {big}; login bench/bench; {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
