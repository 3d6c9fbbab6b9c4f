"""The system timeline (outages, leader changes, deploys, pauses) on the dashboard and the job page, the
outages' and terms' read-only admin pages, and an attempt stopped by an outage labelled so."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.urls import reverse
from django.utils import timezone
from hypothesis import given, strategies as st

from jobs.models import Attempt, LeaderTerm, Outage, Task
from jobs.outcomes import attempt_status_words
from jobs.pulse import outage_words
from ops import system_timeline as st_mod
from tests.ops_helpers import failed_service_job, make_user, system_scene, two_tenants

pytestmark = pytest.mark.django_db


def test_the_timeline_lists_the_outage_the_leader_change_the_deploy_and_the_pause_each_linked(root):
    now = timezone.now()
    outage = system_scene(now=now)["outage"]
    entries = st_mod.system_timeline(since=now - timedelta(hours=1), until=now)
    kinds = [e.kind for e in entries]
    assert kinds == ["resume", "pause", "outage", "leader", "deploy"], kinds
    assert [e.at for e in entries] == sorted((e.at for e in entries), reverse=True), "newest first"
    said = {e.kind: e for e in entries}
    assert said["outage"].text == "PostgreSQL out of reach (restart): database reachable again after 50.5 s"
    assert said["outage"].url == reverse("admin:jobs_outage_change", args=[outage.pk])
    assert said["deploy"].text == "builders run ACCS 0.2.0 (was 0.1.0)", "the term before the window tells the release"
    assert said["leader"].url == reverse("admin:jobs_leaderterm_change", args=[42])
    assert said["pause"].text == "service render paused by alice: disk swap on the render farm"
    assert said["resume"].text == "service render resumed after 10 min"
    # The term of two hours ago began before the window: not listed as a change within it.
    assert not any("term 41" in e.text for e in entries)
    assert st_mod.system_timeline(since=now - timedelta(hours=5), until=now - timedelta(hours=4)) == []


def test_a_window_that_ends_before_it_begins_is_refused():
    now = timezone.now()
    with pytest.raises(ValueError, match="must not end"):
        st_mod.system_timeline(since=now, until=now - timedelta(seconds=1))


@given(ms=st.integers(min_value=0, max_value=10**9))
def test_outage_words_say_the_length_to_a_tenth_of_a_second(ms):
    began = datetime(2026, 1, 1, tzinfo=UTC)
    said = outage_words(began_at=began, ended_at=began + timedelta(milliseconds=ms))
    assert said == f"database reachable again after {ms / 1000:.1f} s"


def test_the_dashboard_and_the_outage_admin_show_the_outage_and_its_length(root, client):
    system_scene(now=timezone.now())
    page = client.get(reverse("ops:dashboard")).content.decode()
    rows = re.findall(r'<tr class="accs-system-event" data-kind="(\w+)">', page)
    # The last 6 h: both terms (the first one's release change is unknown: nothing before it).
    assert sorted(rows) == ["deploy", "leader", "leader", "outage", "pause", "resume"], rows
    assert "database reachable again after 50.5 s" in page
    listing = client.get(reverse("admin:jobs_outage_changelist")).content.decode()
    assert "database reachable again after 50.5 s" in listing
    assert client.get(reverse("admin:jobs_outage_add")).status_code == 403, "the engine's record: read-only"
    outage = Outage.objects.get()
    change = client.post(reverse("admin:jobs_outage_change", args=[outage.pk]), {"cause": "gap"})
    assert change.status_code == 403 and Outage.objects.get().cause == "restart"
    term = client.get(reverse("admin:jobs_leaderterm_change", args=[42])).content.decode()
    assert "build-b:12:bb0002 0.2.0" in term


def test_operators_without_the_infrastructure_do_not_see_it(client):
    tenants = two_tenants()
    system_scene(now=timezone.now())
    job = failed_service_job(tenants.acme)
    from tenants.models import TenantMembership

    user = make_user("acme-op")
    TenantMembership.objects.create(user=user, tenant=tenants.acme, role="admin")
    client.force_login(user)
    assert "accs-system-timeline" not in client.get(reverse("ops:dashboard")).content.decode()
    assert "accs-system-timeline" not in client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()


def test_the_job_page_shows_what_happened_to_the_system_while_the_job_ran(root, client):
    tenants = two_tenants()
    job = failed_service_job(tenants.acme)
    now = timezone.now()
    Outage.objects.create(began_at=now - timedelta(seconds=5), ended_at=now - timedelta(seconds=1), cause="gap")
    Outage.objects.create(began_at=now - timedelta(days=2), ended_at=now - timedelta(days=2) + timedelta(seconds=9),
                          cause="gap")  # long before the job: not its concern
    job.created_at, job.finished_at = now - timedelta(seconds=30), now
    job.save(update_fields=["created_at", "finished_at"])
    page = client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
    assert "System timeline" in page and "while this job ran" in page
    assert re.findall(r'data-kind="outage"', page) == ['data-kind="outage"'], "only the outage during the job"
    assert "database reachable again after 4.0 s" in page


@pytest.mark.parametrize(("error", "said"), [
    ("outage: the database was unreachable, so the agent could not renew the lease", "interrupted: database outage"),
    ("lease_lost: the agent could not renew the lease (TTL 30s)", "interrupted: database outage"),
    ("interrupted: the agent shut down and stopped the attempt", "interrupted: agent shut down"),
])
def test_an_interrupted_attempt_says_what_interrupted_it_in_the_attempts_list(root, client, error, said):
    tenants = two_tenants()
    failed_service_job(tenants.acme)
    task = Task.objects.get()
    Attempt.objects.create(task=task, attempt_no=7, status="interrupted", error_text=error,
                           finished_at=timezone.now())
    listing = client.get(reverse("admin:jobs_attempt_changelist")).content.decode()
    assert f'<span class="accs-pill accs-interrupted">{said}</span>' in listing
    assert "the agent shut down" not in listing or said.endswith("shut down")
    assert attempt_status_words("failed", error) == "failed", "only interrupted attempts are relabelled"


def test_the_timeline_queries_read_their_indexes(transactional_db):
    """At any history length: outages by outage_ended_idx, leadership terms by leader_term_acquired_idx."""
    now = timezone.now()
    with connection.cursor() as cur:
        cur.execute("INSERT INTO accs_outage (began_at, ended_at, cause) SELECT now() - g * interval '1 hour',"
                    " now() - g * interval '1 hour' + interval '5 s', 'gap' FROM generate_series(1, 20000) g")
        cur.execute("INSERT INTO accs_leader_term (fence, holder, acquired_at, expires_at, writes)"
                    " SELECT g, 'b:1:x 0.2.0', now() - g * interval '1 minute', now(), 0"
                    " FROM generate_series(1, 20000) g")
        cur.execute("ANALYZE accs_outage; ANALYZE accs_leader_term")
        window = {"since": now - timedelta(hours=6), "until": now, "limit": 50}
        plans = {}
        for name, sql in (("outages", st_mod.OUTAGES_SQL), ("terms", st_mod.TERMS_SQL)):
            cur.execute("EXPLAIN " + sql, window)
            plans[name] = "\n".join(r[0] for r in cur.fetchall())
    assert "outage_ended_idx" in plans["outages"] and "Seq Scan" not in plans["outages"], plans["outages"]
    assert "leader_term_acquired_idx" in plans["terms"] and "Seq Scan" not in plans["terms"], plans["terms"]
    assert LeaderTerm.objects.count() == 20000
