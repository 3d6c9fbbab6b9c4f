"""A claim and a report read the rows they take, whatever the tables held when their statements were planned.

The claim, report and finalization functions plan each statement once per server connection. A plan
made while the tables were nearly empty (a connection's first claim on a young or just emptied
database, or statistics taken when it was) used to scan the task table for a primary-key lookup, join
the reported ids to a whole primary key, or read every unstarted or waiting task of every job, and kept
doing so as the tables grew. Here the plans are made on nearly empty tables, then thousands of other
jobs' tasks are queued and waiting, and the next claim's and report's plans (auto_explain, sent to this
connection, nested statements and triggers included) may read only about as many rows as they take.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db import connection

from jobs import api
from jobs.admission import start_due_jobs
from jobs.claim import NodeLimits, claim_many, service_spec
from jobs.reports import Outcome, report

pytestmark = pytest.mark.django_db

BACKLOG = 3000
BATCH = 32

# Other jobs' work: BACKLOG jobs each with a queued task and a waiting dependent (of another service).
BACKLOG_SQL = """
WITH j AS (
    INSERT INTO accs_job (id, tenant_id, service_id, status, progress, current_task_key, priority, options,
                          step_params, scheduled_at, error_code, error_message, source, source_ref, correlation_id,
                          approval_state, approved_by, created_at, updated_at)
    SELECT gen_random_uuid(), %(tenant)s, %(svc)s, 'waiting', 0, 'a', 0, '{}', '{}', now(), '', '', 'manual', '', '',
           'not_required', '', now(), now()
      FROM generate_series(1, %(n)s)
    RETURNING id, order_seq
)
INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, exclusive, status, depends_on,
                       attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds, params,
                       assigned_node, claimed_by, node, error_code, error_message, created_at, updated_at)
SELECT gen_random_uuid(), j.id, %(tenant)s, k.key, k.key, %(svc)s, false, k.status, k.deps, 0, 3, now(), 0,
       j.order_seq, 600, '{}', '', '', '', '', '', now(), now()
  FROM j CROSS JOIN (VALUES ('a', 'queued', '{}'::varchar[]), ('b', 'waiting', '{a}'::varchar[]))
       AS k(key, status, deps)
"""


def _start(spec, n: int) -> None:
    """Start ``n`` jobs of ``spec``'s service and admit them (their tasks queued)."""
    api.start_many([api.JobSpec(service=spec.key, params={"i": i}) for i in range(n)])
    start_due_jobs(limit=1000)


def _claim(spec, n: int) -> list:
    limits = NodeLimits("n-report", slot_cap=100, cpu_budget=10_000, per_service={})
    claimed = claim_many([spec], limits, agent_id="a-report", free_slots=n, lease_seconds=60)
    assert len(claimed) == n
    return claimed


def _report(claimed: list) -> int:
    """Report the claimed tasks succeeded (their starts with them); return how many were reported done."""
    result = report([Outcome(task_id=t.id, attempt=t.attempt, status="succeeded", results={}) for t in claimed],
                    started=[(t.id, t.attempt, None) for t in claimed], agent_id="a-report", source="test")
    return len(result.done)


def _nodes(plan: dict):
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


@contextmanager
def _reads() -> Iterator[list[tuple[str, str, int, str]]]:
    """Collect what each statement run inside reads of the engine's tables: (index or table, node, rows
    read, statement), from auto_explain's plans of every statement, nested ones included."""
    plans: list[dict] = []
    reads: list[tuple[str, str, int, str]] = []
    raw = connection.connection

    def keep(diag) -> None:
        text = diag.message_primary or ""
        if "plan:" in text:
            logged = json.loads(text.split("plan:", 1)[1])
            plans.append(dict(logged["Plan"], query=" ".join(logged.get("Query Text", "").split())[:160]))

    raw.add_notice_handler(keep)
    try:
        with connection.cursor() as cur:
            cur.execute("LOAD 'auto_explain'")
            for setting, value in (("log_min_duration", "0"), ("log_analyze", "on"), ("log_timing", "off"),
                                   ("log_nested_statements", "on"), ("log_format", "json")):
                cur.execute(f"SET auto_explain.{setting} = {value}")
            cur.execute("SET client_min_messages = log")
        yield reads
    finally:
        with connection.cursor() as cur:
            cur.execute("RESET client_min_messages")
            cur.execute("SET auto_explain.log_min_duration = -1")
        raw.remove_notice_handler(keep)
    reads += [(node.get("Index Name") or node["Relation Name"], node["Node Type"],
               (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"], plan["query"])
              for plan in plans for node in _nodes(plan)
              if node.get("Relation Name") in ("accs_job", "accs_task", "accs_job_step", "accs_attempt")]


def test_a_claim_and_a_report_read_the_rows_they_take_after_the_tables_grew(make_service, default_tenant):
    svc = make_service("reported", max_concurrent=100)
    other = make_service("other")
    spec = service_spec(svc)
    with connection.cursor() as cur:
        cur.execute("DISCARD PLANS")
        for table in ("accs_job", "accs_task", "accs_job_step", "accs_attempt"):
            cur.execute(f"ANALYZE {table}")
    # The plans are made now, on nearly empty tables.
    _start(spec, 2)
    assert _report(_claim(spec, 2)) == 2
    with connection.cursor() as cur:
        cur.execute(BACKLOG_SQL, {"tenant": default_tenant.id, "svc": other.id, "n": BACKLOG})
        cur.execute("SELECT count(*) FILTER (WHERE status = 'queued'), count(*) FILTER (WHERE status = 'waiting')"
                    " FROM accs_task WHERE service_id = %s", [other.id])
        assert cur.fetchone() == (BACKLOG, BACKLOG)
    _start(spec, BATCH)

    with _reads() as claim_reads:
        claimed = _claim(spec, BATCH)
    with _reads() as report_reads:
        assert _report(claimed) == BATCH

    # Each names BATCH tasks and their jobs; no read comes near the other jobs' 2 * BACKLOG tasks.
    for what, reads in (("claim", claim_reads), ("report", report_reads)):
        assert reads, f"auto_explain sent no plans of the {what}"
        wide = [r for r in reads if r[2] > 20 * BATCH]
        assert not wide, f"the {what}'s statements read beyond the rows it names: {wide}"
