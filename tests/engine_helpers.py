"""Helpers for engine tests: claim and report the way an agent does, without a process."""

from __future__ import annotations

from uuid import UUID

from django.db import connection

from jobs import transitions
from jobs.claim import ClaimedTask, NodeLimits, ServiceSpec, claim, service_spec
from jobs.sql import from_json
from workflows.models import Service

NODE = NodeLimits(name="node-t", slot_cap=20, cpu_budget=8, per_service={})


def spec(service: Service) -> ServiceSpec:
    return service_spec(service)


def claim_for(
    service: Service, n: int = 10, *, limits: NodeLimits = NODE, agent: str = "agent-t", now=None
) -> list[ClaimedTask]:
    return claim(spec(service), limits, agent_id=agent, free_slots=n, lease_seconds=60, now=now)


def run_ok(tasks: list[ClaimedTask], *, agent: str = "agent-t", results=None) -> transitions.ReportResult:
    return transitions.report(
        [transitions.Outcome(task_id=t.id, attempt=t.attempt, status="succeeded", results=results or {"ok": True})
         for t in tasks],
        started=[(t.id, t.attempt, 123) for t in tasks], agent_id=agent, source="agent:test",
    )


def run_fail(
    tasks: list[ClaimedTask], *, agent: str = "agent-t", status: str = "failed", error: str = "boom"
) -> transitions.ReportResult:
    return transitions.report(
        [transitions.Outcome(task_id=t.id, attempt=t.attempt, status=status, error=error, exit_code=1) for t in tasks],
        started=[(t.id, t.attempt, 123) for t in tasks], agent_id=agent, source="agent:test",
    )


def racing_builders(*, builders: int = 3, rounds: int, limit: int) -> list:
    """Run ``start_due_jobs`` in ``builders`` threads released at once; return every job id they admitted.

    Each thread uses its own database connection (the test needs a transactional database).
    """
    import threading

    from django.db import connections

    barrier = threading.Barrier(builders)
    admitted: list = []
    errors: list[BaseException] = []

    def builder() -> None:
        try:
            barrier.wait()
            for _ in range(rounds):
                admitted.extend(transitions.start_due_jobs(limit=limit))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=builder) for _ in range(builders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return admitted


# The keys whose kept held count (accs_limit_key_held, jobs.limit_keys) differs from their held tasks
# counted afresh: (service, key, kept, real); then the key rows whose marks (at the cap, at the rate)
# disagree with those counts and the starts. A drift either way would let a claim exceed a per-key
# cap or starve a key, so it must be empty after every step.
KEY_HELD_DRIFT_SQL = """
WITH real AS (
    -- Counted only for a service with a per-key cap on its key path (the only counts a claim reads):
    -- any other service's kept count must be absent or zero.
    SELECT t.service_id, t.limit_key AS key, count(*)::int AS held FROM accs_task t
      JOIN accs_service s ON s.id = t.service_id
     WHERE t.status IN ('starting', 'running') AND t.limit_key IS NOT NULL
       AND s.concurrency_key_limit > 0 AND s.concurrency_key = accs_limit_key_path(
               s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit, s.rate_key)
     GROUP BY 1, 2
)
SELECT coalesce(k.service_id, r.service_id), coalesce(k.key, r.key), k.held, r.held
  FROM accs_limit_key_held k FULL JOIN real r ON r.service_id = k.service_id AND r.key = k.key
 WHERE coalesce(k.held, 0) <> coalesce(r.held, 0)
UNION ALL
-- A key row marked at its cap whose held tasks do not fill it (the claim would never visit a key with
-- room), or one with room marked full (a cost only, but the marks are meant to be exact).
SELECT h.service_id, h.key, h.cap_full::int, coalesce(r.held >= x.cap, false)::int
  FROM accs_limit_key_head h
  JOIN (SELECT s.id, CASE WHEN s.concurrency_key_limit > 0 AND s.concurrency_key = accs_limit_key_path(
                        s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit, s.rate_key)
                     THEN s.concurrency_key_limit END AS cap FROM accs_service s) x ON x.id = h.service_id
  LEFT JOIN real r ON r.service_id = h.service_id AND r.key = h.key
 WHERE h.cap_full <> coalesce(r.held >= x.cap, false)
UNION ALL
-- A key row passed over for its rate while its starts in the window leave it room.
SELECT h.service_id, h.key, -1, (SELECT count(*)::int FROM accs_rate_start st
                                  WHERE st.service_id = h.service_id AND st.key = h.key COLLATE "default"
                                    AND st.at > now() - make_interval(secs => s.rate_period_seconds))
  FROM accs_limit_key_head h JOIN accs_service s ON s.id = h.service_id
 WHERE h.rate_until > now()
   AND (s.rate_key_limit = 0
        OR (SELECT count(*) FROM accs_rate_start st
             WHERE st.service_id = h.service_id AND st.key = h.key COLLATE "default"
               AND st.at > now() - make_interval(secs => s.rate_period_seconds)) < s.rate_key_limit)
"""


def previous_release_inputs(task_id: UUID) -> dict | None:
    """A task's inputs as the previous release's agents read them (``accs_step_context``, which built the
    object in the database; left in place for them): the read that replaced it must give the same."""
    with connection.cursor() as cur:
        cur.execute("SELECT inputs FROM accs_step_context(%s)", [task_id])
        row = cur.fetchone()
    return None if row is None else from_json(row[0])
