"""Every index of the engine's hot tables names the query that reads it, and the hot readers use theirs.

The table of readers is ``jobs.indexes.READERS``. An index missing from it costs every write and
serves nobody we know of; a listed index that no longer exists leaves its reader without one.
The plans are read with sequential scans off on a small table of mixed history (mostly finished
work): they show that each named index *can* serve its reader's statement as written, which a
change of the statement or of the index's condition would break.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from jobs.indexes import READERS

pytestmark = pytest.mark.django_db

# Every index of the listed tables and of their partitions, a partition's index named by its
# parent's (an index of a partition is attached to the partitioned table's index).
INDEXES_SQL = """
SELECT coalesce(pt.relname, t.relname), coalesce(pi.relname, i.relname)
  FROM pg_index x
  JOIN pg_class i ON i.oid = x.indexrelid
  JOIN pg_class t ON t.oid = x.indrelid
  LEFT JOIN pg_inherits ti ON ti.inhrelid = t.oid LEFT JOIN pg_class pt ON pt.oid = ti.inhparent
  LEFT JOIN pg_inherits ii ON ii.inhrelid = i.oid LEFT JOIN pg_class pi ON pi.oid = ii.inhparent
 WHERE coalesce(pt.relname, t.relname) = ANY(%s)
"""


def _indexes() -> set[tuple[str, str]]:
    with connection.cursor() as cur:
        cur.execute(INDEXES_SQL, [list(READERS)])
        return set(cur.fetchall())


def test_every_index_of_the_hot_tables_names_its_reader():
    unread = sorted(f"{table}.{index}" for table, index in _indexes() if index not in READERS[table])
    assert not unread, f"indexes no query is known to read (name the reader in jobs.indexes, or drop them): {unread}"


def test_every_named_index_exists():
    named = {(table, index) for table, indexes in READERS.items() for index in indexes}
    missing = sorted(f"{table}.{index}" for table, index in named - _indexes())
    assert not missing, f"jobs.indexes names indexes the database does not have: {missing}"


def test_every_reader_is_described():
    assert all(text.strip() for indexes in READERS.values() for text in indexes.values())


# --------------------------------------------------------------------------------------------
# The plans
# --------------------------------------------------------------------------------------------

N_JOBS = 4000
# Jobs by i % 10: six done and one in error (finished 40 days ago, due for retention), one queued
# (no tasks yet), one waiting (its task queued, waiting or a retry in backoff), one running (on one
# of 100 nodes, spread by job id whatever the sequences stand at: one node's held tasks are 1 in 100 of
# the fleet's, so reading every held task through the lease index is never the cheaper plan for the
# node's held counts; spread by order_seq over 20 nodes, n1 held half of them in some runs, and it was).
FILL_SQL = """
WITH j AS (
    INSERT INTO accs_job (id, tenant_id, service_id, status, progress, current_task_key, priority, options,
                          step_params, scheduled_at, error_code, error_message, source, source_ref, correlation_id,
                          approval_state, approved_by, created_at, updated_at, finished_at)
    SELECT gen_random_uuid(), %(tenant)s, %(svc)s,
           (ARRAY['done', 'done', 'done', 'done', 'done', 'done', 'error', 'queued', 'waiting',
                  'running'])[i %% 10 + 1],
           0, '', 0, '{}', '{}', now(), '', '', 'manual', '', '', 'not_required', '',
           now() - interval '41 days', now(), CASE WHEN i %% 10 < 7 THEN now() - interval '40 days' END
      FROM generate_series(1, %(n)s) AS i
    RETURNING id, status, order_seq
)
INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, exclusive, status, depends_on,
                       attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds, params,
                       assigned_node, claimed_by, node, lease_expires_at, error_code, error_message, created_at,
                       updated_at, finished_at)
SELECT gen_random_uuid(), j.id, %(tenant)s, 't', 't', %(svc)s, false, s.status, '{}', 1, 3,
       now() + interval '1 minute', 0, j.order_seq, 600, '{}', '', s.agent, s.agent,
       CASE WHEN s.status = 'running' THEN now() - interval '1 minute' END, '', '', now(), now(),
       CASE WHEN s.status IN ('done', 'error') THEN now() - interval '40 days' END
  FROM j CROSS JOIN LATERAL (
       SELECT CASE WHEN j.status = 'waiting' THEN (ARRAY['queued', 'waiting', 'scheduled'])[j.order_seq %% 3 + 1]
                   ELSE j.status END AS status,
              CASE WHEN j.status = 'running' THEN 'n' || abs(hashtext(j.id::text)) %% 100 ELSE '' END AS agent) s
 WHERE j.status <> 'queued'
"""


# One attempt per task that ran, over twenty nodes, started a minute before it finished (or now).
# Attempts spread over a fleet of 100 nodes: one node's are 1 in 100, fewer than a list's page, so walking
# the newest attempts for them could never be the cheaper plan (with 20 nodes the planner sometimes took it).
ATTEMPTS_SQL = """
INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, status, started_at, finished_at,
                          stdout_tail, stderr_tail, error_text)
SELECT t.id, 1, 'n' || mod(t.order_seq, 100), '', CASE WHEN t.status = 'error' THEN 'failed' ELSE 'succeeded' END,
       coalesce(t.finished_at, now()) - interval '1 minute', coalesce(t.finished_at, now()), '', '', ''
  FROM accs_task t WHERE t.status IN ('done', 'error')
"""


@pytest.fixture
def history(make_service, default_tenant):
    """A small engine with mostly finished history; return the service and a running job's id."""
    from nodes.models import Host, Node

    svc = make_service("svc", max_concurrent=100)
    capped = make_service("capped", max_concurrent=10)  # none of its tasks held
    Node.objects.create(name="n1")
    host = Host.objects.create(name="h1", node_id="n1")
    with connection.cursor() as cur:
        cur.execute(FILL_SQL, {"tenant": default_tenant.id, "svc": svc.id, "n": N_JOBS})
        cur.execute(ATTEMPTS_SQL)
        for table in ("accs_job", "accs_task", "accs_tenant", "accs_job_step", "accs_workflow", "accs_attempt"):
            cur.execute(f"ANALYZE {table}")
        cur.execute("SELECT id FROM accs_job WHERE status = 'running' LIMIT 1")
        running = cur.fetchone()[0]
    return {"svc": svc, "capped": capped, "host": host, "tenant": default_tenant, "running": running}


def _plan(sql: str, params) -> str:
    """EXPLAIN ``sql`` with sequential scans off (rolled back)."""
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SET LOCAL enable_seqscan = off")
        cur.execute("EXPLAIN " + sql, params)
        plan = "\n".join(r[0] for r in cur.fetchall())
        transaction.set_rollback(True)
    return plan


def _claim(h, *, hosts):
    from jobs.claim import claim_statement, service_spec

    sql, params = claim_statement([(service_spec(h["svc"]), 10)], adjust={})
    params.update({"now": None, "hosts": hosts, "slots": 10, "cpu": 1000, "agent": "plan", "node": "n1",
                   "lease": 60.0, "pid": 1, "source": "plan", "exclude": []})
    return sql, params


def _claim_free(h):
    return _claim(h, hosts=[])


def _claim_host(h):
    return _claim(h, hosts=[h["host"].id])


def _held(h):
    from jobs.claim import HELD_SQL

    return HELD_SQL, {"node": "n1", "capped": [h["capped"].id]}


def _rescue(h):
    from jobs.rescue import CANDIDATES_SQL

    return CANDIDATES_SQL, {"now": timezone.now(), "default_lease": 60, "limit": 500}


def _rescue_lock(h):
    from jobs.rescue import LOCK_EXPIRED_SQL

    return LOCK_EXPIRED_SQL, {"ids": [h["running"]], "jobs": [h["running"]], "now": timezone.now(),
                              "default_lease": 60}


def _due(h):
    from jobs.admission import DUE_UNLIMITED_SQL

    return DUE_UNLIMITED_SQL, {"now": timezone.now(), "limit": 10}


def _due_capped(h):
    from jobs.admission import DUE_LIMITED_SQL

    return DUE_LIMITED_SQL, {"now": timezone.now(), "limit": 10}


def _retention(h):
    from jobs.retention import _DEAD_CUTOFF, _DONE_CUTOFF, CANDIDATES_SQL, _settled

    sql = CANDIDATES_SQL.format(kept="", settled_done=_settled(_DONE_CUTOFF), settled_dead=_settled(_DEAD_CUTOFF))
    return sql, {"now": timezone.now(), "days": 30, "dead_days": 30, "limit": 500}


def _promote_retries(h):
    from jobs.reports import PROMOTE_SCHEDULED_SQL

    return PROMOTE_SCHEDULED_SQL, {"now": timezone.now(), "services": None, "limit": 500, "source": "plan"}


def _promote_dependents(h):
    from jobs.finalize import PROMOTE_SQL

    return PROMOTE_SQL, {"job_ids": [h["running"]], "steps": ["t"], "roots": [], "now": timezone.now(),
                         "source": "plan"}


def _settle(h):
    from jobs.finalize import FINISH_SQL

    return FINISH_SQL, {"jobs": [h["running"]], "now": timezone.now(), "source": "plan", "moves": "[]",
                        "job_moves": "[]"}


def _job_held_count(h):
    from jobs.models import TASK_HELD, Task

    return _orm(Task.objects.filter(job_id=h["running"], status__in=TASK_HELD).values("id"))


def _job_tasks(h):
    from jobs.models import Task

    return _orm(Task.objects.filter(job_id=h["running"]).values("id"))


def _waiting_tasks(h):
    from ops.overview import WAITING_TASKS_SQL

    return WAITING_TASKS_SQL.format(tenants="TRUE"), {}


def _dead_letters(h):
    from ops.overview import DEAD_LETTER_SQL

    return DEAD_LETTER_SQL, {"ids": [str(h["tenant"].id)]}


def _jobs_of_service(h):
    from jobs.models import Job

    return _orm(Job.objects.filter(service_id__in=[h["capped"].id]).order_by().values("id"))


def _jobs_of_workflow(h):
    from jobs.models import Job

    return _orm(Job.objects.filter(workflow_id__in=[1, 2]).order_by().values("id"))


def _rates(h, *, node: str = ""):
    from jobs.attempt_rollup import NODE_GRID, zone
    from ops.rates import ATTEMPT_REFS, rates_sql

    sql, params = rates_sql(ATTEMPT_REFS, tenant_ids={h["tenant"].id}, node=bool(node), service=False)
    since, until = timezone.now() - timedelta(days=7), timezone.now()
    return sql, {"since": since, "until": until, "sample": 50_000, "node": node, **zone(since, until, NODE_GRID),
                 **params}


def _rates_of_node(h):
    return _rates(h, node="n3")


def _rates_of_every_node(h):
    return _rates(h)


def _charts(h):
    from jobs.attempt_rollup import SERVICE_GRID, fold_params, zone
    from ops.charts import ATTEMPT_SOURCE, chart_sql

    until = timezone.now()
    since = until - timedelta(days=7)
    return chart_sql(ATTEMPT_SOURCE, "TRUE", "TRUE"), {"since": since, "until": until, "sample": 50_000,
                                                       "bucket": 16800, **zone(since, until, SERVICE_GRID),
                                                       **fold_params()}


def _fold(h):
    from jobs.attempt_rollup import EPOCH, FOLD_SQL, NODE_GRID, SERVICE_GRID, fold_params

    return FOLD_SQL, {"start": timezone.now() - timedelta(hours=1), "end": timezone.now(), "pending": [1, 2],
                      "service_grid": SERVICE_GRID, "node_grid": NODE_GRID, "epoch": EPOCH, **fold_params()}


def _attempts_of_service(h):
    from jobs.models import Attempt

    return _orm(Attempt.objects.filter(service=h["capped"]).order_by("-id")[:100])


def _attempts_of_node(h):
    from jobs.models import Attempt

    return _orm(Attempt.objects.filter(node="n3").order_by("-id").values("id")[:100])


def _attempts_in_range(h):
    from jobs.models import Attempt

    since = timezone.now() - timedelta(days=7)
    return _orm(Attempt.objects.filter(started_at__gte=since, started_at__lt=since + timedelta(hours=1))
                .order_by("started_at").values("id")[:100])


def _jobs_created_in_range(h):
    from jobs.models import Job

    since = timezone.now() - timedelta(days=2)
    return _orm(Job.objects.filter(created_at__gte=since, created_at__lt=since + timedelta(hours=1))
                .order_by("-created_at").values("id")[:100])


def _tasks_in_range(h):
    from jobs.ids import id_range
    from jobs.models import Task

    lo, hi = id_range(timezone.now() - timedelta(hours=1), timezone.now())
    return _orm(Task.objects.filter(pk__gte=lo, pk__lte=hi).order_by("-pk").values("id")[:100])


def _orm(queryset) -> tuple[str, list]:
    sql, params = queryset.query.sql_with_params()
    return sql, list(params)


# (reader, its statement, the indexes its plan must name): the claim, the rescue, the due jobs,
# retention, promotion and settlement, and the readers of the indexes that were made partial. A
# tuple names indexes either of which serves the reader, reading its rows only: the due scans may
# read each tenant's queued jobs in job_tenant_status_created_idx (the planner takes the filter
# on the workflow's cap, after the outer join, to keep 0.5 % of the rows, so it sees no gain in
# reading job_due_idx in order).
PLANS = [
    ("claim of free tasks", _claim_free, ["task_claim_idx"]),
    ("claim of host-bound tasks", _claim_host, ["task_claim_host_idx"]),
    ("held counts before a claim", _held, ["task_held_node_idx", "task_held_service_idx"]),
    ("rescue: expired leases", _rescue, ["task_lease_idx"]),
    ("rescue: lock the expired", _rescue_lock, ["accs_task_pkey"]),
    ("due jobs", _due, [("job_due_idx", "job_tenant_status_created_idx")]),
    ("due jobs under a cap", _due_capped, [("job_due_idx", "job_tenant_status_created_idx")]),
    ("retention candidates", _retention, ["job_prune_idx", "job_prune_dead_idx", "task_job_key_unique"]),
    ("promotion of retries", _promote_retries, ["task_scheduled_idx"]),
    ("promotion of dependents", _promote_dependents, ["task_job_open_idx"]),
    ("settlement of jobs", _settle, ["task_job_open_idx"]),
    ("job page's held count", _job_held_count, ["task_job_open_idx"]),
    ("a job's tasks of any status", _job_tasks, ["task_job_key_unique"]),
    ("dashboard's waiting tasks", _waiting_tasks, ["task_job_open_idx"]),
    ("dashboard's dead letters", _dead_letters, ["task_dead_letter_count_idx"]),
    ("jobs of a service (search, delete)", _jobs_of_service, ["job_service_idx"]),
    ("jobs of a workflow (search, delete)", _jobs_of_workflow, ["job_workflow_idx"]),
    ("rates of one node", _rates_of_node, [("attempt_started_idx", "attempt_node_idx")]),
    ("rates of every node", _rates_of_every_node, ["attempt_started_idx", "accs_attempt_pkey"]),
    ("charts", _charts, ["attempt_started_idx", "accs_attempt_pkey"]),
    ("the rollup's fold", _fold, ["attempt_started_idx", "accs_attempt_pkey"]),
    ("attempts list by service", _attempts_of_service, ["attempt_service_idx"]),
    ("attempts list by node", _attempts_of_node, ["attempt_node_idx"]),
    ("attempts list by time range", _attempts_in_range, [("attempt_started_idx",)]),
    ("tasks list by time range", _tasks_in_range, ["accs_task_pkey"]),
]


@pytest.mark.parametrize(("reader", "statement", "indexes"), PLANS, ids=[p[0] for p in PLANS])
def test_the_reader_uses_its_index(history, reader, statement, indexes):
    sql, params = statement(history)
    plan = _plan(sql, params)
    used = {word for line in plan.splitlines() for word in line.split()}
    for wanted in indexes:
        either = wanted if isinstance(wanted, tuple) else (wanted,)
        assert used & set(either), f"{reader}: {' or '.join(either)} not in\n{plan}"
        assert all(any(index in table for table in READERS.values()) for index in either), either
    # The job list's newest-first index holds every job: a hot reader walking it reads history.
    assert "job_created_idx" not in used, f"{reader}:\n{plan}"


def test_the_jobs_list_by_creation_time_reads_its_range_of_the_creation_index(history):
    sql, params = _jobs_created_in_range(history)
    plan = _plan(sql, params)
    assert "job_created_idx" in plan and "Index Cond" in plan, plan


def test_finished_work_is_not_in_the_hot_indexes(history):
    """The indexes the claim, the rescue, promotion and settlement read hold the backlog only."""
    hot = ["task_claim_idx", "task_claim_host_idx", "task_scheduled_idx", "task_lease_idx", "task_held_node_idx",
           "task_held_service_idx", "task_job_open_idx", "job_due_idx", "job_workflow_admitted_idx"]
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM accs_task WHERE status NOT IN ('done', 'error')")
        open_tasks = cur.fetchone()[0]
        cur.execute("SELECT count(*) FROM accs_job WHERE status IN ('queued', 'waiting', 'running')")
        open_jobs = cur.fetchone()[0]
        cur.execute("SELECT c.relname, c.reltuples FROM pg_class c WHERE c.relname = ANY(%s)", [hot])
        sizes = dict(cur.fetchall())
    assert set(sizes) == set(hot)
    # ANALYZE counts an index's entries: none of the 2,800 finished jobs nor of their tasks.
    assert all(0 <= n <= max(open_tasks, open_jobs) for n in sizes.values()), (sizes, open_tasks, open_jobs)
    assert sizes["task_job_open_idx"] == open_tasks


def test_a_task_that_finishes_adds_no_entry_to_the_open_index_and_one_to_the_full_ones(make_service,
                                                                                    default_tenant):
    """A status change is not a HOT update: the new row version enters every index whose condition it meets."""
    svc = make_service("svc")
    with connection.cursor() as cur:
        try:
            with transaction.atomic():
                cur.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")  # rolled back with the test
        except Exception as exc:  # noqa: BLE001 - a server without the contrib module
            pytest.skip(f"pageinspect is not available: {exc}")
        # Empty indexes (TRUNCATE gives new files, and is undone with the test's transaction), so
        # each is one leaf page and nothing earlier tests left in them moves the counts.
        cur.execute("TRUNCATE accs_job, accs_task CASCADE")
        cur.execute(FILL_SQL, {"tenant": default_tenant.id, "svc": svc.id, "n": 10})
        cur.execute("SELECT id FROM accs_task WHERE status = 'running'")
        (task_id,) = cur.fetchone()
        names = ("task_job_open_idx", "task_job_key_unique", "accs_task_pkey")
        before = {name: _entries(cur, name) for name in names}
        cur.execute("UPDATE accs_task SET status = 'done', finished_at = now() WHERE id = %s", [task_id])
        done = {name: _entries(cur, name) for name in names}
        cur.execute("UPDATE accs_task SET status = 'running', finished_at = NULL WHERE id = %s", [task_id])
        again = {name: _entries(cur, name) for name in names}
    assert done == {"task_job_open_idx": before["task_job_open_idx"],
                    "task_job_key_unique": before["task_job_key_unique"] + 1,
                    "accs_task_pkey": before["accs_task_pkey"] + 1}, (before, done)
    assert again["task_job_open_idx"] == before["task_job_open_idx"] + 1, (before, again)


def _entries(cur, index: str) -> int:
    """Count the heap pointers in a one-page btree index (dead ones too; a posting list holds several)."""
    cur.execute("SELECT pg_relation_size(%s::regclass) / current_setting('block_size')::int", [index])
    assert cur.fetchone()[0] == 2, f"{index} is not one meta page and one leaf"
    cur.execute("SELECT sum(coalesce(cardinality(tids), 1)) FROM bt_page_items(%s, 1)", [index])
    return int(cur.fetchone()[0] or 0)
