"""When retention last pruned and how much: each batch that deletes updates one row in its transaction
(jobs.models.RetentionMark), and the dashboard shows it to those who see the infrastructure."""

from __future__ import annotations

import pytest
from django.db import connection

from jobs import api
from jobs.models import Job, RetentionMark
from jobs.retention import MARK_NAME, prune_finished_jobs
from tests.engine_helpers import claim_for, run_ok
from tests.ops_helpers import make_user, two_tenants

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("retention_defaults")]

DASHBOARD = "/admin/dashboard/"


def old_done_jobs(service, tenant, n: int) -> list[Job]:
    """Run ``n`` one-task jobs to done, then move their finish 40 days back (past the 30 days kept)."""
    jobs = [api.start_service(service.key, tenant=tenant) for _ in range(n)]
    run_ok(claim_for(service))
    with connection.cursor() as cur:
        for table, column in (("accs_job", "id"), ("accs_task", "job_id")):
            cur.execute(f"UPDATE {table} SET finished_at = now() - interval '40 days' WHERE {column} = ANY(%s)",
                        [[j.pk for j in jobs]])
    return jobs


def test_each_batch_that_prunes_records_when_and_how_much_and_the_dashboard_shows_it(client, make_service):
    tenants = two_tenants()
    service = make_service("ret-mark")
    root = make_user("root", superuser=True)
    client.force_login(root)
    page = client.get(DASHBOARD).content.decode()
    assert 'id="accs-retention-last"' in page and "Retention has pruned nothing yet" in page

    old_done_jobs(service, tenants.acme, 3)
    assert prune_finished_jobs(limit=2).jobs == 2
    first = RetentionMark.objects.get(name=MARK_NAME)
    assert (first.jobs, first.tasks, first.total_jobs, first.total_tasks) == (2, 2, 2, 2)
    assert prune_finished_jobs(limit=2).jobs == 1
    assert prune_finished_jobs(limit=2).jobs == 0, "nothing left"
    mark = RetentionMark.objects.get(name=MARK_NAME)
    assert (mark.jobs, mark.total_jobs, mark.total_tasks) == (1, 3, 3), "the last batch, and every batch since"
    assert mark.last_pruned_at >= first.last_pruned_at and mark.since == first.since
    with connection.cursor() as cur:
        cur.execute("SELECT now() - %s < interval '1 minute'", [mark.last_pruned_at])
        assert cur.fetchone()[0], "stamped by PostgreSQL's clock"

    page = client.get(DASHBOARD).content.decode()
    assert "1 job(s) with 1 task(s) and 0 artifact(s)" in page and "3 job(s) and 3 task(s) since" in page, page
    assert "finished jobs kept 30 days, failed ones 90 days" in page

    client.force_login(make_user("ann", tenants={tenants.acme: "admin"}))
    assert 'id="accs-retention' not in client.get(DASHBOARD).content.decode(), "infrastructure, like the nodes"
