"""Large queues made straight in SQL, for the claim benchmark and the claim plan test."""

from __future__ import annotations

FILL_QUEUE_SQL = """
-- n one-task jobs; every 10th task is bound to another node's host and every 10th (another) is
-- a retry waiting out its backoff, both at the head of the claim order (priority 10), so a claim
-- that scanned them would pay for them.
WITH j AS (
    INSERT INTO accs_job (id, tenant_id, service_id, status, progress, current_task_key, priority, options,
                          step_params, scheduled_at, error_code, error_message, source, source_ref, correlation_id,
                          approval_state, approved_by, created_at, updated_at, started_at)
    SELECT gen_random_uuid(), %(tenant)s, %(svc)s, 'waiting', 0, 'bench', 0, '{}', '{}', now(), '', '', 'manual', '',
           '', 'not_required', '', now(), now(), now()
      FROM generate_series(1, %(n)s)
    RETURNING id, order_seq
)
INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, host_id, exclusive, status, depends_on,
                       attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds, params,
                       assigned_node, claimed_by, node, error_code, error_message, created_at, updated_at)
SELECT gen_random_uuid(), j.id, %(tenant)s, 'bench', 'bench', %(svc)s,
       CASE WHEN j.order_seq %% 10 = 1 THEN %(host)s END, false,
       CASE WHEN j.order_seq %% 10 = 2 THEN 'scheduled' ELSE 'queued' END, '{}', 0, 3,
       CASE WHEN j.order_seq %% 10 = 2 THEN now() + interval '1 hour' ELSE now() END,
       CASE WHEN j.order_seq %% 10 IN (1, 2) THEN 10 ELSE 0 END, j.order_seq, 600, '{}', '', '', '', '', '',
       now(), now()
  FROM j
"""


def fill_queue(cur, *, n: int, tenant_id, service_id: int, other_host_id: int, new_id: str | None = None) -> None:
    """Queue ``n`` one-task jobs of ``service_id`` (see :data:`FILL_QUEUE_SQL`) on ``cur``.

    ``new_id`` is the SQL expression that makes a job's or task's id (random ids by default).
    """
    sql = FILL_QUEUE_SQL if new_id is None else FILL_QUEUE_SQL.replace("gen_random_uuid()", new_id)
    cur.execute(sql, {"n": n, "tenant": tenant_id, "svc": service_id, "host": other_host_id})
