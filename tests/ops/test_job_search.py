"""The jobs list's search: a task id finds its job, a part of an error (the job's or one of its tasks')
finds the job in any case, within the viewer's tenants, through indexes only (pg_trgm), never by
reading every job or task."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.db import connection
from django.test import RequestFactory

from jobs.admin import ERROR_SEARCH_LIMIT, jobs_with_error
from jobs.models import Job, Task
from tests.ops_helpers import failed_service_job, make_user

pytestmark = pytest.mark.django_db

JOBS = "/admin/jobs/job/"


def found(client, term: str) -> set:
    response = client.get(JOBS, {"q": term})
    assert response.status_code == 200, response.content[:300]
    return {job.pk for job in response.context["cl"].result_list}


def test_a_task_id_or_a_part_of_an_error_finds_the_job_in_the_viewers_tenants(client, root, tenants):
    acme = failed_service_job(tenants.acme, key="encode")
    globex = failed_service_job(tenants.globex, key="resize")
    task = Task.objects.get(job=acme)
    # A task's last error that the job's own message does not repeat.
    Task.objects.filter(pk=task.pk).update(error_message="stderr: Quota exceeded on bucket media-7")
    assert "quota" not in Job.objects.get(pk=acme.pk).error_message.lower()

    assert found(client, str(task.pk)) == {acme.pk}
    assert found(client, "quota EXCEEDED") == {acme.pk}, "a part of a task's error, any case"
    assert found(client, "DISK FULL") == {acme.pk, globex.pk}, "a part of the jobs' errors"
    assert found(client, "di") == set(), "under three characters, errors are not searched"
    assert found(client, "no such words anywhere") == set()

    client.force_login(make_user("ann", tenants={tenants.acme: "viewer"}))
    assert found(client, "disk full") == {acme.pk}, "another tenant's job stays out of a tenant's search"


def test_error_search_reads_the_trigram_indexes_not_every_job_or_task(tenants):
    acme = failed_service_job(tenants.acme, key="encode")
    with connection.cursor() as cur:
        # History: 20,000 finished jobs with two tasks each, a tenth of them failed with some error.
        cur.execute(
            "INSERT INTO accs_job (id, status, progress, current_task_key, priority, options, step_params,"
            " scheduled_at, error_code, error_message, source, source_ref, correlation_id, approval_state,"
            " approved_by, created_at, finished_at, updated_at, service_id, tenant_id)"
            " SELECT gen_random_uuid(), CASE WHEN g %% 10 = 0 THEN 'error' ELSE 'done' END, 1, '', 0, '{}', '{}',"
            " now(), '', CASE WHEN g %% 10 = 0 THEN 'task failed: exit ' || g ELSE '' END, 'manual', '', 'c-' || g,"
            " 'not_required', '', now(), now(), now(), %s, %s FROM generate_series(1, 20000) g",
            [acme.service_id, tenants.acme.pk])
        cur.execute(
            "INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, exclusive, status,"
            " depends_on, attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds, params,"
            " assigned_node, claimed_by, node, finished_at, error_code, error_message, created_at, updated_at)"
            " SELECT gen_random_uuid(), j.id, j.tenant_id, 't' || k, 't', j.service_id, false, 'done', '{}', 1, 3,"
            " now(), 0, 0, 600, '{}', '', '', '', now(), '', CASE WHEN k = 1 THEN j.error_message ELSE '' END,"
            " now(), now() FROM accs_job j, generate_series(1, 2) k WHERE j.id <> %s",
            [acme.pk])
        cur.execute("ANALYZE accs_job; ANALYZE accs_task")
    lookup = jobs_with_error("disk full", tenant_ids=None)[:ERROR_SEARCH_LIMIT + 1].explain()
    assert "job_error_trgm_idx" in lookup and "task_error_trgm_idx" in lookup, lookup
    assert "Seq Scan" not in lookup, lookup
    request = RequestFactory().get(JOBS)
    request.user = make_user("root", superuser=True)
    queryset, _ = admin.site._registry[Job].get_search_results(request, Job.objects.all(), "disk full")
    plan = queryset.order_by("-created_at")[:100].explain()
    assert "Seq Scan on accs_job" not in plan and "Seq Scan on accs_task" not in plan, plan
    for index in ("job_external_id_idx", "job_dedupe_key_idx", "job_correlation_id_idx", "accs_job_pkey"):
        assert index in plan, f"{index} not in\n{plan}"
    assert set(queryset.values_list("pk", flat=True)) == {acme.pk}


def test_a_text_in_more_errors_than_the_limit_lists_some_and_says_to_search_a_longer_part(
        client, root, tenants, monkeypatch):
    from jobs import admin as jobs_admin

    failed = [failed_service_job(tenants.acme, key=f"svc-{n}") for n in range(3)]
    monkeypatch.setattr(jobs_admin, "ERROR_SEARCH_LIMIT", 2)
    response = client.get(JOBS, {"q": "disk full"})
    assert 0 < len(response.context["cl"].result_list) <= 2
    shown = [str(m) for m in response.context["messages"]]
    assert any("'disk full' is in the errors of more than 2 jobs or tasks" in m for m in shown), shown
    assert len(failed) == 3
