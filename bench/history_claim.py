"""History benchmark (``make bench-history``): does a claim slow down as the finished history grows?

The claim of ``--claim`` (64) tasks with ``--queued`` (100,000) tasks queued (``bench.fixtures``,
claimed with ``jobs.claim.claim_many`` as ``bench/run.py``'s ``claim_cost`` does), timed in two
databases of the local cluster: one holding only the queue ("fresh"), one where ``--events``
(10,000,000) timeline events of finished work were written first, with the jobs, tasks, attempts
and step rows they belong to ("history": one-task jobs, done, eight events each, spread over the
last ``--days`` (30) days). The history is written with set-based ``INSERT ... SELECT FROM
generate_series``, one transaction per ``--batch`` jobs.

Ids are made as the engine makes them: time-ordered (``--id-scheme v7``, ``jobs.ids.uuid7``, in
SQL from the row's time), or random (``--id-scheme v4``, the engine's ids before) to build the old
history for an A/B; ``--id-scheme both`` builds the two. The queued tasks take ids of the same
scheme, made now. Each claim commits (its updates, attempts and events are written as in
production). The databases take turns, ``--round`` (5) claims each, after a warm-up claim on each
switch, until every database has had ``--claims`` (60); the figures are p50 and p95 per database,
the WAL written and the blocks read from outside shared buffers per timed claim, and the ratio
history ÷ fresh of the p50s (the target: at most 1.1).

    python bench/history_claim.py                                  # v7, 10M events
    python bench/history_claim.py --id-scheme both --events 2000000
    python bench/history_claim.py --reuse --explain                # keep the databases, EXPLAIN the claim

Databases: ``accs_hist_fresh_<scheme>`` and ``accs_hist_<events>_<scheme>``, created and migrated
when missing; the history is rebuilt unless ``--reuse`` (then only the queue is refilled).
``--explain`` prints ``EXPLAIN (ANALYZE, BUFFERS)`` of each statement of one claim beside the
history (rolled back). Output: the table on stdout and ``bench/results/history_claim.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
os.environ.setdefault("ACC_ALLOWED_CALLABLES", "bench")  # the benchmarks' services call bench.tasks
os.environ.setdefault("ACC_LOG_LEVEL", "WARNING")

#: A version 7 id made in SQL for the time ``{ts}``: a random (version 4) id whose first 48 bits
#: become the milliseconds since the epoch and whose version becomes 7 (the layout of jobs.ids).
V7_SQL = ("encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) placing"
          " substring(int8send((extract(epoch FROM {ts}) * 1000)::bigint) FROM 3) FROM 1 FOR 6), 52, 1), 53, 1),"
          " 'hex')::uuid")


def new_id_sql(scheme: str, ts: str) -> str:
    """Return the SQL expression that makes an id of ``scheme`` for a row made at ``ts``."""
    return V7_SQL.format(ts=ts) if scheme == "v7" else "gen_random_uuid()"


#: One batch of finished history: jobs ``lo..hi``, each one task, one attempt, one step row and
#: eight status events (four of the job, four of its task), ``step`` seconds apart from ``t0``.
HISTORY_SQL = """
CREATE TEMP TABLE hj ON COMMIT DROP AS
SELECT g, ts, {job_id} AS id, {task_id} AS task_id
  FROM (SELECT g, %(t0)s::timestamptz + make_interval(secs => g * %(step)s) AS ts
          FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g) s;

INSERT INTO accs_job (id, tenant_id, service_id, status, progress, current_task_key, priority, options, step_params,
                      scheduled_at, error_code, error_message, source, source_ref, correlation_id, approval_state,
                      approved_by, created_at, updated_at, started_at, finished_at)
SELECT id, %(tenant)s, %(svc)s, 'done', 1, 'bench', 0, '{{}}', '{{}}', ts, '', '', 'manual', '', '', 'not_required',
       '', ts, ts + interval '5 s', ts + interval '1 s', ts + interval '5 s'
  FROM hj;

INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, exclusive, status, depends_on, attempt,
                       max_attempts, next_attempt_at, priority, order_seq, timeout_seconds, progress, params, results,
                       assigned_node, claimed_by, node, claimed_at, started_at, finished_at, error_code,
                       error_message, created_at, updated_at)
SELECT task_id, id, %(tenant)s, 'bench', 'bench', %(svc)s, false, 'done', '{{}}', 1, 3, ts, 0, g, 600, 1,
       jsonb_build_object('n', g), '{{"ok": true}}', '', '', 'bench-history', ts + interval '1 s',
       ts + interval '1 s', ts + interval '4 s', '', '', ts, ts + interval '4 s'
  FROM hj;

INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, pid, status, started_at, finished_at, exit_code,
                          stdout_tail, stderr_tail, error_text)
SELECT task_id, 1, 'bench-history', 'agent-bench-history:1', 1000, 'succeeded', ts + interval '1 s',
       ts + interval '4 s', 0, '', '', ''
  FROM hj;

INSERT INTO accs_job_step (job_id, step_key, position, total, done, error, skipped, canceled, blocked, released,
                           poisoned, always, on_failure)
SELECT id, 'bench', 0, 1, 1, 0, 0, 0, 0, true, false, false, 'fail_job'
  FROM hj;

INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
SELECT hj.ts + e.after, hj.id, CASE WHEN e.of_task THEN hj.task_id END, e.attempt, e.source, 'info', 'status',
       e.msg, jsonb_build_object('from', e.frm, 'to', e.too)
  FROM hj CROSS JOIN (VALUES
    (interval '0 s', false, NULL::int, 'api', 'job created queued', 'created', 'queued'),
    (interval '0.1 s', false, NULL, 'builder', 'job queued → waiting', 'queued', 'waiting'),
    (interval '0.1 s', true, NULL, 'builder', 'task created queued', 'created', 'queued'),
    (interval '1 s', true, 1, 'agent', 'task queued → starting', 'queued', 'starting'),
    (interval '1.1 s', false, NULL, 'agent', 'job waiting → running', 'waiting', 'running'),
    (interval '1.2 s', true, 1, 'agent', 'task starting → running', 'starting', 'running'),
    (interval '4 s', true, 1, 'agent', 'task running → done', 'running', 'done'),
    (interval '5 s', false, NULL, 'agent', 'job running → done', 'running', 'done')
  ) AS e(after, of_task, attempt, source, msg, frm, too);
"""
EVENTS_PER_JOB = 8


def _cluster_url(name: str) -> str:
    base = subprocess.run([str(ROOT / "scripts" / "pg_local.sh"), "url"], check=True, capture_output=True,
                          text=True).stdout.strip()
    return base.rsplit("/", 1)[0] + "/" + name


def _ensure_database(name: str) -> None:
    import psycopg

    with psycopg.connect(_cluster_url("postgres"), autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def _use(name: str) -> None:
    """Point Django's connection at the database ``name`` (the next query connects)."""
    from django.db import connection

    connection.close()
    connection.settings_dict["NAME"] = name


def _reference() -> dict:
    """Make (or find) the tenant, the service and another node's host the rows point at."""
    from nodes.models import Host, Node
    from tenants.models import DEFAULT_TENANT_SLUG, Tenant
    from workflows.api import save_service
    from workflows.models import Service

    tenant = Tenant.objects.get_or_create(slug=DEFAULT_TENANT_SLUG, defaults={"name": "Default"})[0]
    svc = Service.objects.filter(key="bench-noop").first() or save_service(
        key="bench-noop", executor="python", executor_config={"callable": "bench.tasks:noop"},
        params_schema={"type": "object"})
    Node.objects.get_or_create(name="bench-other")
    host = Host.objects.get_or_create(name="fan-h-other", defaults={"node_id": "bench-other"})[0]
    return {"tenant": tenant.id, "svc": svc.id, "host": host.id}


def _empty(cur) -> None:
    cur.execute("TRUNCATE accs_job, accs_task, accs_attempt, accs_event, accs_artifact CASCADE")


def _build_history(ref: dict, *, scheme: str, events: int, days: float, batch: int) -> None:
    from django.db import connection, transaction

    jobs = max(1, events // EVENTS_PER_JOB)
    sql = HISTORY_SQL.format(job_id=new_id_sql(scheme, "ts"), task_id=new_id_sql(scheme, "ts"))
    with connection.cursor() as cur:
        # The history ends an hour ago: the queue made now is the newest work.
        cur.execute("SELECT now() - make_interval(secs => %s)", [days * 86400.0 + 3600])
        t0 = cur.fetchone()[0]
    step = days * 86400.0 / jobs
    started = time.monotonic()
    for lo in range(1, jobs + 1, batch):
        hi = min(jobs, lo + batch - 1)
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SET LOCAL synchronous_commit = off")
            cur.execute(sql, {"t0": t0, "step": step, "lo": lo, "hi": hi, "tenant": ref["tenant"], "svc": ref["svc"]})
        spent = time.monotonic() - started
        print(f"  history ({scheme}): jobs {hi:,}/{jobs:,} in {spent:.0f} s", flush=True)


def _refill_queue(ref: dict, *, scheme: str, queued: int) -> None:
    """Drop the queued and claimed work of earlier runs, queue ``queued`` tasks anew, then settle."""
    from django.db import connection

    from bench.fixtures import fill_queue

    with connection.cursor() as cur:
        # Everything newer than the history (it ends an hour ago) is an earlier run's queue and claims.
        cur.execute("DELETE FROM accs_event WHERE ts > now() - interval '30 min'")
        cur.execute("DELETE FROM accs_attempt WHERE task_id IN (SELECT id FROM accs_task WHERE status <> 'done')")
        cur.execute("DELETE FROM accs_job_step WHERE job_id IN (SELECT id FROM accs_job WHERE status <> 'done')")
        cur.execute("DELETE FROM accs_task WHERE status <> 'done'")
        cur.execute("DELETE FROM accs_job WHERE status <> 'done'")
        fill_queue(cur, n=queued, tenant_id=ref["tenant"], service_id=ref["svc"], other_host_id=ref["host"],
                   new_id=new_id_sql(scheme, "clock_timestamp()"))
        for table in ("accs_task", "accs_job", "accs_attempt", "accs_job_step"):
            cur.execute(f"VACUUM ANALYZE {table}")
        cur.execute("CHECKPOINT")


def _sizes() -> dict:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT (SELECT count(*) FROM accs_event), pg_size_pretty(pg_database_size(current_database()))")
        events, size = cur.fetchone()
    return {"events": events, "size": size}


def _io_mark() -> tuple[str, int]:
    """Return the WAL position and the blocks this database has read from outside shared buffers."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT pg_stat_force_next_flush()")  # this backend's counts, up to now
        cur.execute("SELECT pg_current_wal_lsn()::text, blks_read FROM pg_stat_database"
                    " WHERE datname = current_database()")
        return cur.fetchone()


def _io_since(mark: tuple[str, int]) -> tuple[int, int]:
    """Return the WAL bytes written and the blocks read since ``mark``."""
    from django.db import connection

    now = _io_mark()
    with connection.cursor() as cur:
        cur.execute("SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)", [now[0], mark[0]])
        return int(cur.fetchone()[0]), now[1] - mark[1]


def _claim_once(spec, limits, claim: int) -> float:
    from jobs.claim import claim_many

    start = time.perf_counter()
    got = claim_many([spec], limits, agent_id="bench-history", free_slots=claim, lease_seconds=600)
    ms = (time.perf_counter() - start) * 1000
    assert len(got) == claim, f"claimed {len(got)} of {claim}: is the queue too short?"
    return ms


def _explain(spec, limits, claim: int) -> None:
    """Print EXPLAIN (ANALYZE, BUFFERS) of each statement of one claim, then roll it all back."""
    from django.db import connection, transaction

    from jobs.claim import claim_many

    seen: list[tuple[str, object]] = []

    def record(execute, sql, params, many, context):
        seen.append((sql, params))
        return execute(sql, params, many, context)

    class Undo(Exception):
        pass

    try:
        with transaction.atomic(), connection.execute_wrapper(record):
            claim_many([spec], limits, agent_id="bench-history", free_slots=claim, lease_seconds=600)
            raise Undo
    except Undo:
        pass
    try:
        with transaction.atomic(), connection.cursor() as cur:
            for sql, params in seen:
                if not sql.lstrip().upper().startswith(("SELECT", "WITH", "UPDATE", "INSERT", "DELETE")):
                    cur.execute(sql, params)
                    continue
                cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
                plan = [r[0] for r in cur.fetchall()]
                print("\n-- " + " ".join(sql.split())[:160])
                print("\n".join(plan))
            raise Undo
    except Undo:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=10_000_000, help="timeline events of finished history")
    parser.add_argument("--id-scheme", choices=("v7", "v4", "both"), default="v7")
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--claim", type=int, default=64, help="tasks per claim")
    parser.add_argument("--claims", type=int, default=60, help="timed claims per database")
    parser.add_argument("--round", type=int, default=5, help="claims in a row before the next database's turn")
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--batch", type=int, default=25_000, help="history jobs per transaction")
    parser.add_argument("--reuse", action="store_true", help="keep a history built before (refill the queue only)")
    parser.add_argument("--explain", action="store_true", help="EXPLAIN (ANALYZE, BUFFERS) one claim beside history")
    args = parser.parse_args(argv)
    schemes = ["v4", "v7"] if args.id_scheme == "both" else [args.id_scheme]
    if args.round < 1 or args.claims < 1:
        parser.error("--round and --claims must be positive")
    warm_ups = -(-args.claims // args.round)
    if (args.claims + warm_ups) * args.claim > args.queued * 0.8:  # a tenth of the queue is not claimable here
        parser.error("--queued is too short for that many claims")
    label = f"{args.events // 1_000_000}m" if args.events >= 1_000_000 else f"{args.events // 1000}k"
    dbs = [(scheme, kind, f"accs_hist_fresh_{scheme}" if kind == "fresh" else f"accs_hist_{label}_{scheme}")
           for scheme in schemes for kind in ("fresh", "history")]
    for _, _, name in dbs:
        _ensure_database(name)
    os.environ["ACC_DB_URL"] = _cluster_url(dbs[0][2])
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from jobs.claim import NodeLimits, service_spec
    from workflows.models import Service

    refs: dict[str, dict] = {}
    sizes: dict[str, dict] = {}
    for scheme, kind, name in dbs:
        _use(name)
        call_command("migrate", interactive=False, verbosity=0)
        ref = refs[name] = _reference()
        if not (kind == "history" and args.reuse):
            with connection.cursor() as cur:
                _empty(cur)
            if kind == "history":
                print(f"{name}: writing {args.events:,} events of history", flush=True)
                _build_history(ref, scheme=scheme, events=args.events, days=args.days, batch=args.batch)
        _refill_queue(ref, scheme=scheme, queued=args.queued)
        sizes[name] = _sizes()
        print(f"{name}: {sizes[name]['events']:,} events, {sizes[name]['size']}, {args.queued:,} queued", flush=True)

    limits = NodeLimits("bench-history", slot_cap=100_000, cpu_budget=1_000_000, per_service={})
    times: dict[str, list[float]] = {name: [] for _, _, name in dbs}
    # Per database: WAL bytes and blocks read by its timed claims (the cluster is the bench's own:
    # nothing else writes while a round runs).
    io: dict[str, list[int]] = {name: [0, 0] for _, _, name in dbs}
    while any(len(t) < args.claims for t in times.values()):
        for _, _, name in dbs:
            _use(name)
            spec = service_spec(Service.objects.get(key="bench-noop"))
            _claim_once(spec, limits, args.claim)  # warm-up: a new connection, cold caches
            mark = _io_mark()
            for _ in range(min(args.round, args.claims - len(times[name]))):
                times[name].append(_claim_once(spec, limits, args.claim))
            wal, read = _io_since(mark)
            io[name][0] += wal
            io[name][1] += read

    results: dict[str, object] = {"queued": args.queued, "claim": args.claim, "claims": args.claims,
                                  "events": args.events}
    print(f"\nclaim of {args.claim} with {args.queued:,} queued, {args.claims} claims per database (ms)")
    print(f"{'scheme':<8}{'database':<28}{'events':>12}{'size':>10}{'p50':>9}{'p95':>9}"
          f"{'WAL kB/claim':>14}{'reads/claim':>13}")
    for scheme in schemes:
        p50 = {}
        for s, kind, name in dbs:
            if s != scheme:
                continue
            ms = sorted(times[name])
            p50[kind] = statistics.median(ms)
            p95 = ms[max(0, round(0.95 * len(ms)) - 1)]
            wal_kb, reads = io[name][0] / 1024 / len(ms), io[name][1] / len(ms)
            results[f"{scheme}_{kind}"] = {"database": name, "p50_ms": round(p50[kind], 2), "p95_ms": round(p95, 2),
                                           "wal_kb_per_claim": round(wal_kb, 1), "reads_per_claim": round(reads, 1),
                                           **sizes[name]}
            print(f"{scheme:<8}{name:<28}{sizes[name]['events']:>12,}{sizes[name]['size']:>10}"
                  f"{p50[kind]:>9.2f}{p95:>9.2f}{wal_kb:>14.1f}{reads:>13.1f}")
        ratio = p50["history"] / p50["fresh"]
        results[f"{scheme}_ratio"] = round(ratio, 3)
        print(f"{scheme:<8}history ÷ fresh (p50): {ratio:.2f} (target ≤ 1.1)")
    out = ROOT / "bench" / "results" / "history_claim.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    if args.explain:
        for _, kind, name in dbs:
            if kind == "history":
                _use(name)
                print(f"\n==== {name}: EXPLAIN (ANALYZE, BUFFERS) of one claim (rolled back)")
                _explain(service_spec(Service.objects.get(key="bench-noop")), limits, args.claim)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
