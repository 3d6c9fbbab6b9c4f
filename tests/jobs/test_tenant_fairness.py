"""Tenants cannot starve each other: priority bands, turns at equal priority, a default in-flight cap."""

from __future__ import annotations

import pytest
from django.db import connection

from jobs import api, transitions
from jobs.models import Job, Task
from tenants.models import Tenant
from tests.engine_helpers import claim_for, run_ok

pytestmark = pytest.mark.django_db

INT32 = 2**31 - 1


@pytest.fixture
def tenants(db):
    return Tenant.objects.create(slug="flood", name="Flood"), Tenant.objects.create(slug="quiet", name="Quiet")


def test_a_jobs_priority_is_clamped_into_its_tenants_band_on_every_start_path(make_service, tenants):
    flood, _ = tenants
    make_service("work")
    flood.min_priority, flood.max_priority = -10, 10
    flood.save()
    fast = api.start_service("work", tenant=flood, priority=INT32)
    assert (fast.priority, Task.objects.get(job=fast).priority) == (10, 10)
    [bulk] = api.start_many([api.JobSpec(service="work", tenant=flood, priority=-INT32)])
    assert Job.objects.get(pk=bulk).priority == -10
    # A row written around the API (or before the band was narrowed) is clamped when admitted.
    with connection.cursor() as cur:
        cur.execute("UPDATE accs_job SET priority = %s WHERE id = %s", [INT32, bulk])
    assert transitions.start_due_jobs() == [bulk]
    assert Task.objects.get(job_id=bulk).priority == 10


@pytest.mark.parametrize("finish", [True, False], ids=["tasks-finish-at-once", "tasks-keep-running"])
def test_a_tenant_flooding_at_maximum_priority_does_not_delay_another_tenants_job(make_service, tenants, finish):
    """Tenant A queues 300 jobs at the highest priority it can ask for, then tenant B starts one job
    at the same (clamped) priority: an agent claiming one task at a time takes B's within 2 claims."""
    flood, quiet = tenants
    svc = make_service("work")
    api.start_many([api.JobSpec(service="work", tenant=flood, priority=INT32) for _ in range(300)])
    assert len(transitions.start_due_jobs(limit=1000)) == 300
    # A claim or two before B arrives, as on a busy site.
    for _ in range(2):
        run_ok(claim_for(svc, 1))
    quiet_job = api.start_service("work", tenant=quiet, priority=INT32)
    assert quiet_job.priority == flood.max_priority == 1000

    claims_until_quiet = None
    for n in range(1, 302):
        [task] = claim_for(svc, 1)
        if finish:
            run_ok([task])
        if task.job_id == quiet_job.id:
            claims_until_quiet = n
            break
    assert claims_until_quiet is not None and claims_until_quiet <= 2, (
        f"tenant B's task was claimed at claim {claims_until_quiet} behind tenant A's flood")


def test_tenants_take_turns_at_equal_priority_and_priority_still_wins(make_service, tenants):
    flood, quiet = tenants
    svc = make_service("work")
    api.start_many([api.JobSpec(service="work", tenant=flood, priority=5) for _ in range(6)]
                   + [api.JobSpec(service="work", tenant=quiet, priority=5) for _ in range(3)]
                   + [api.JobSpec(service="work", tenant=quiet, priority=1) for _ in range(2)])
    transitions.start_due_jobs()

    def claimed(n: int) -> list[tuple[str, int]]:
        tasks = claim_for(svc, n)
        run_ok(tasks)  # finished, so the node's CPU budget does not limit the next claim
        return sorted((j.tenant.slug, j.priority) for j in Job.objects.filter(
            pk__in=[t.job_id for t in tasks]).select_related("tenant"))

    # One claim of many: the tenants alternate while both have work at priority 5.
    assert claimed(6) == [("flood", 5)] * 3 + [("quiet", 5)] * 3
    # Then priority still wins: tenant A's last priority-5 tasks before B's priority-1 ones.
    assert claimed(3) == [("flood", 5)] * 3
    assert claimed(3) == [("quiet", 1)] * 2


def test_a_new_tenant_gets_the_sites_default_in_flight_cap(make_service, monkeypatch):
    from accs_site.conf import reload
    from tenants.accounts import AccountError, create_tenant

    make_service("work")
    monkeypatch.setenv("ACC_TENANT_MAX_IN_FLIGHT", "2")
    reload()
    try:
        tenant, created = create_tenant("capped", min_priority=0, max_priority=10)
        assert created and (tenant.max_in_flight, tenant.min_priority, tenant.max_priority) == (2, 0, 10)
        assert create_tenant("capped", max_in_flight=5)[0].max_in_flight == 5, "an explicit cap wins"
        assert create_tenant("capped")[0].max_in_flight == 5, "updating other fields keeps the cap"
        with pytest.raises(AccountError, match="min priority 20 is above max priority 10"):
            create_tenant("capped", min_priority=20)
        other = Tenant.objects.create(slug="other", name="Other")
        jobs = [api.start_service("work", tenant=other) for _ in range(3)]
        transitions.start_due_jobs()
        assert sorted(Job.objects.get(pk=j.id).status for j in jobs) == ["queued", "waiting", "waiting"]
    finally:
        monkeypatch.delenv("ACC_TENANT_MAX_IN_FLIGHT")
        reload()


@pytest.mark.django_db(transaction=True)
def test_with_a_real_agent_another_tenants_job_waits_about_one_claim_behind_a_flood(make_service, daemons):
    """A real agent with one slot drains tenant A's 300 top-priority jobs; tenant B's one job, started
    once the agent is busy with the flood, is claimed within 2 claims of being queued."""
    from accs_site.clock import db_now
    from jobs.models import Attempt
    from tests.daemons import wait_for

    flood, quiet = Tenant.objects.create(slug="flood", name="Flood"), Tenant.objects.create(slug="quiet", name="Quiet")
    make_service("work")
    api.start_many([api.JobSpec(service="work", tenant=flood, priority=INT32) for _ in range(300)])
    assert len(transitions.start_due_jobs(limit=1000)) == 300
    daemons.agent("fair-node", "work", "--max-concurrent", "1")
    wait_for(lambda: Job.objects.filter(tenant=flood, status="done").count() >= 5, timeout=60,
             message="the agent draining tenant A's flood")
    quiet_job = api.start_service("work", tenant=quiet, priority=INT32)
    # From when B's task was surely visible: once the start returned, its transaction had committed. (Its
    # rows' created_at is the transaction's start, which on a loaded machine came a few claims earlier.)
    with connection.cursor() as cur:
        visible_at = db_now(cur)
    wait_for(lambda: Job.objects.get(pk=quiet_job.id).status == "done", timeout=60, message="tenant B's job done")

    claimed_at = Attempt.objects.get(task__job=quiet_job).started_at
    flood_claims_between = Attempt.objects.filter(task__tenant=flood, started_at__gt=visible_at,
                                                  started_at__lt=claimed_at).count()
    flood_left = Task.objects.filter(tenant=flood).exclude(attempts__started_at__lte=claimed_at).count()
    from_created = Attempt.objects.filter(task__tenant=flood, started_at__gt=Task.objects.get(job=quiet_job).created_at,
                                          started_at__lt=claimed_at).count()
    assert flood_claims_between <= 2, (f"{flood_claims_between} of tenant A's tasks were claimed before B's "
                                       f"({from_created} from B's task's created_at)")
    assert flood_left > 100, "tenant A still had most of its flood queued: the measure means something"


def test_turns_never_give_a_service_more_than_its_room(make_service, tenants):
    """Each tenant's scan reads up to the service's room; the claim still takes no more than the room."""
    flood, quiet = tenants
    capped = make_service("capped", max_concurrent=2)
    rated = make_service("rated", rate_limit=1, rate_period_seconds=3600)
    for key in ("capped", "rated"):
        api.start_many([api.JobSpec(service=key, tenant=t) for t in (flood, quiet, flood, quiet)])
    transitions.start_due_jobs()
    first = claim_for(capped, 10)
    assert len(first) == 2 and {Job.objects.get(pk=t.job_id).tenant_id for t in first} == {flood.id, quiet.id}
    assert claim_for(capped, 10) == [], "the global cap holds across tenants"
    assert len(claim_for(rated, 10)) == 1 and claim_for(rated, 10) == [], "so does the rate limit"
