"""Who reads each index of the tables the engine writes on every task.

Every claim, report, promotion and settlement writes rows of these tables, and each write
maintains their indexes: a task's status change is not a HOT update (status is in the partial
indexes' conditions), so it adds an entry to every index whose condition the new row meets. An
index earns that cost only if a query reads it, so each one is listed here with its readers, and
``tests/jobs/test_index_readers.py`` fails on an index missing from this table (add its reader, or
drop it) and on a listed index that no longer exists; it also runs EXPLAIN on the hot readers to
show the index serves them.

The indexes the hot path reads are partial on the statuses their readers ask for (queued, held,
scheduled, not final), so finished work leaves them and their size follows the backlog, not the
history. Only the primary keys, ``task_job_key_unique`` and the admin's list orderings
(``job_tenant_status_created_idx``, ``job_created_idx``) hold every row; retention bounds them.

An index of a partition of ``accs_event`` is listed under its parent's index.
"""

from __future__ import annotations

READERS: dict[str, dict[str, str]] = {
    "accs_job": {
        "accs_job_pkey": "every lookup of a job by id: jobs.locks.lock_jobs, jobs.finalize.FINISH_SQL, the API's "
                         "and the admin's job pages, retention's delete",
        "job_due_idx": "the builder's due-job scans, queued jobs only: jobs.admission.DUE_UNLIMITED_SQL (in its "
                       "order) and DUE_LIMITED_SQL (the due rows sorted by order_seq); ops.overview.QUEUED_JOBS_SQL",
        "job_tenant_status_created_idx": "the API's jobs summary (one descent per tenant and status), the admin's "
                                         "and the API's job lists filtered by status, newest first; "
                                         "jobs.admission's admitted count per tenant",
        "job_workflow_admitted_idx": "jobs.admission's admitted count per workflow (max_active_jobs); "
                                     "ops.overview.ADMITTED_JOBS_SQL and WAITING_TASKS_SQL",
        "job_created_idx": "the admin's job list over every tenant, newest first (JobAdmin.ordering)",
        "job_short_id_idx": "the admin's job and task search by a job's short id (jobs.admin.ids_ending)",
        "job_workflow_idx": "the admin's job search by workflow name (JobAdmin.get_search_results); deleting a "
                            "workflow (PROTECT looks for its jobs)",
        "job_service_idx": "the admin's job search by service key; deleting a service (PROTECT); "
                           "nodes.wake.NEEDED_LABELS_SQL (queued jobs of a service)",
        "job_failed_idx": "jobs.redrive: failed jobs in id order",
        "job_prune_idx": "jobs.retention.CANDIDATES_SQL: each tenant's finished jobs, oldest first",
        "job_prune_dead_idx": "jobs.retention.CANDIDATES_SQL (dead letters' own retention); "
                              "ops.overview.FAILED_JOBS_SQL (the dashboard's failed jobs of the last day)",
        "job_error_trgm_idx": "the admin's job search by error text (jobs.admin.jobs_with_error)",
        "job_external_id_idx": "the admin's job search by external id over every tenant",
        "job_dedupe_key_idx": "the admin's job search by dedupe key, finished jobs included",
        "job_correlation_id_idx": "the admin's job search by correlation id",
        "job_external_id_per_tenant": "jobs.enqueue: a repeated external_id returns the tenant's existing job "
                                      "(the unique rule and its lookup)",
        "job_active_dedupe_key_per_tenant": "jobs.enqueue: at most one active job per tenant and dedupe key "
                                            "(the unique rule and its lookup)",
    },
    "accs_task": {
        "accs_task_pkey": "every lookup of a task by id: the claim's update, reports, heartbeats, "
                          "jobs.rescue.LOCK_EXPIRED_SQL, jobs.locks.lock_tasks",
        "task_claim_idx": "the claim (jobs.claim._FREE_SCAN): queued tasks bound to no host; the tenants with "
                          "queued work of a service (every claim)",
        "task_limit_key_idx": "the keyed claim (jobs.claim._free_keyed, _KEY_ROWS_MOVE): a key's first queued tasks; "
                              "the service's rekey and jobs.limit_keys.SETTLE_SQL",
        "task_claim_host_idx": "the claim of host-bound tasks (jobs.claim)",
        "task_scheduled_idx": "promotion of retries whose backoff is over (jobs.reports.PROMOTE_SCHEDULED_SQL); "
                              "ops.overview.ACTIVE_TASKS_SQL",
        "task_held_node_idx": "jobs.claim.HELD_SQL: a node's held tasks (its slots and CPU); "
                              "ops.overview's held tasks per node",
        "task_lease_idx": "jobs.rescue.CANDIDATES_SQL: held tasks by lease expiry",
        "task_held_service_idx": "jobs.claim.HELD_SQL: held tasks of the capped services; "
                                 "ops.overview.HELD_BY_SERVICE_SQL",
        "task_job_open_idx": "a job's tasks that are not final: jobs.finalize.FINISH_SQL (is one running), "
                             "PROMOTE_SQL (its waiting dependents), REWAIT_ALWAYS_SQL, the job page's held count, "
                             "ops.overview.WAITING_TASKS_SQL and a job's flow limits",
        "task_job_key_unique": "one task per key in a job (the rule); a job's tasks of any status: retention's "
                               "settled check and delete, the job list's progress, operator verbs (retry, cancel)",
        "task_one_held_per_exclusive_host": "the rule: one held task per exclusive host; the claim's check that "
                                            "the host has none",
        "task_dead_letter_idx": "jobs.redrive: dead letters in id order",
        "task_dead_letter_count_idx": "ops.overview.DEAD_LETTER_SQL: dead letters per tenant and service, "
                                      "index-only",
        "task_short_id_idx": "the admin's task search by a task's short id (jobs.admin.ids_ending)",
        "task_error_trgm_idx": "the admin's job search by a task's last error (jobs.admin.jobs_with_error)",
    },
    "accs_attempt": {
        "accs_attempt_pkey": "the newest attempts first: ops.overview.RECENT_STATS_SQL, RECENT_FAILURES_SQL; "
                             "the attempts a fold left running (jobs.attempt_rollup: FOLD_SQL, the readers' RAW_SQL)",
        "attempt_task_no_unique": "one row per attempt of a task (the rule); the report's and the failure "
                                  "path's update of the attempt (task_id, attempt_no); retention's delete",
        "attempt_started_idx": "the part of a range not rolled up yet (jobs.attempt_rollup.RAW_SQL: "
                               "ops.rates.RATES_SQL, ops.charts.CHART_SQL) and the fold's window (FOLD_SQL); the "
                               "attempts list's time range (ops.timerange.TimeRangeFilter)",
        "attempt_node_idx": "the attempts list filtered by node, newest first (ops.admin.AttemptNodeFilter)",
        "attempt_service_idx": "the attempts list filtered by service, newest first (ops.admin.AttemptServiceFilter)",
        "attempt_refs_missing_idx": "jobs.attempt_refs: whether any attempt lacks its copy, and the fill's batches "
                                    "(empty once filled)",
    },
    "accs_job_step": {
        "accs_job_step_pkey": "the row's identity (the ORM); no query reads it by id",
        "job_step_unique": "one row per step of a job (the rule); jobs.finalize (counts per job), the step "
                           "counter trigger and the failure path (job_id, step_key)",
    },
    "accs_event": {
        "accs_event_pkey": "the row's identity and partition key (id, ts); events.partitions' archive",
        "event_job_ts_idx": "a job's timeline, newest first (the job page, the API's job events)",
        "event_task_ts_idx": "a task's timeline (the task page, the attempt's log lines)",
    },
    "accs_limit_key_head": {
        "accs_limit_key_head_pkey": "the claim's move and removal of the key rows it read (jobs.claim._KEY_ROWS_MOVE)",
        "limit_key_head_order_idx": "the keyed claim: each tenant's keys in the claim order (jobs.claim._free_keyed)",
        "limit_key_head_key_idx": "the queueing trigger's look for a row that covers the task (jobs.limit_keys); "
                                  "the service's rekey; a key's rows following its held count and its starts",
        "limit_key_head_emptied_idx": "jobs.limit_keys.SETTLE_SQL: the rows the claim found empty",
        "limit_key_head_rate_until_idx": "the keyed claim function's clearing of rate blocks that ran out "
                                         "(jobs.claim.keyed_claim_function_sql)",
    },
    "accs_start": {
        "accs_start_pkey": "a narrow start widened by id (jobs.narrow.widen: reads and verbs by job id) and by "
                           "age, oldest first (jobs.narrow.widen_aged, the builder)",
        "start_claim_idx": "the claim's widening of each service's and tenant's first starts (accs_widen_starts, "
                           "its skip scan of the tenants)",
    },
    "accs_rate_start": {
        "accs_rate_start_pkey": "the row's identity (the ORM); no query reads it by id",
        "rate_start_service_at_idx": "jobs.claim.STARTED_SQL: a rate-limited service's starts in its period",
        "rate_start_key_at_idx": "the keyed claim: a rate key's starts in its period (jobs.claim._USED)",
    },
}


def reader_of(table: str, index: str) -> str | None:
    """Return who reads ``index`` of ``table`` (a partition's index is named by its parent's), or None."""
    return READERS.get(table, {}).get(index)
