"""The cockpit at scale: /metrics never recounts the timeline, deep list pages skip their offset over
the keys only, the API's summary estimates the history instead of counting it.

The timings themselves are measured on 1M jobs / 10M events by bench/cockpit_data.py and
bench/cockpit_pages.py (docs/performance.md); these tests pin the mechanisms.
"""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.db import connection
from django.test.utils import CaptureQueriesContext
from prometheus_client.parser import text_string_to_metric_families

from accs_site import admin_kit, conf, counting
from events.models import Event, MetricTotals
from jobs import api
from jobs.models import Job, Task
from ops import metrics
from tests.api_helpers import client_for, user_with_token
from tests.engine_helpers import claim_for, run_ok
from tests.ops_helpers import make_user

TOKEN = "scale-scrape-token"


@pytest.fixture(autouse=True)
def scrape_token(monkeypatch):
    monkeypatch.setenv("ACC_METRICS_TOKEN", TOKEN)
    conf.reload()
    yield
    monkeypatch.delenv("ACC_METRICS_TOKEN", raising=False)
    conf.reload()


def new_process(monkeypatch) -> metrics.AccsCollector:
    """Forget this process's collector, as a newly started web worker has none."""
    monkeypatch.setattr(metrics, "_collector", None)
    monkeypatch.setattr(metrics, "_registry", None)
    collector = metrics.collector()
    collector.counters.settle_seconds = 0.0
    return collector


def claims(client) -> float:
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content[:300]
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            if sample.name == "accs_task_claims_total" and sample.labels.get("service") == "work":
                return sample.value
    return 0.0


@pytest.mark.django_db
def test_a_new_web_process_does_not_recount_the_timeline(client, make_service, default_tenant, monkeypatch):
    svc = make_service("work")
    for _ in range(3):
        api.start_service("work")
    run_ok(claim_for(svc))
    # The site upgraded now: the stored totals start at the newest event, as the migration leaves them.
    newest = Event.objects.order_by("-id").values_list("id", flat=True).first()
    MetricTotals.objects.update_or_create(id=1, defaults={"watermark": newest, "totals": {}})
    new_process(monkeypatch)
    assert claims(client) == 0  # the 3 claims before the upgrade are history, not recounted
    for _ in range(2):
        api.start_service("work")
    run_ok(claim_for(svc))
    assert claims(client) == 2
    stored = MetricTotals.objects.get(id=1)
    assert stored.watermark > newest and ["claim", "work", "", 2] in stored.totals["counts"]
    # Another web process reads the stored totals: the same figure, and nothing folded twice.
    with CaptureQueriesContext(connection) as queries:
        new_process(monkeypatch)
        assert claims(client) == 2
    assert not any("WITH e AS" in q["sql"] for q in queries.captured_queries), "the second process refolded events"


@pytest.mark.django_db
def test_deep_list_pages_pick_their_keys_before_their_rows(client, make_service, default_tenant, monkeypatch):
    svc = make_service("work")
    for _ in range(7):
        api.start_service("work")
    client.force_login(make_user("root", superuser=True))
    task_admin = admin.site._registry[Task]
    monkeypatch.setattr(task_admin, "list_per_page", 2)
    shallow = client.get("/admin/jobs/task/?p=3").context["cl"].result_list
    expected = [t.pk for t in Task.objects.filter(service=svc).order_by("-pk")[4:6]]
    assert [t.pk for t in shallow] == expected
    monkeypatch.setattr(admin_kit, "DEFERRED_OFFSET", 2)
    with CaptureQueriesContext(connection) as queries:
        deep = client.get("/admin/jobs/task/?p=3").context["cl"].result_list
    assert [t.pk for t in deep] == expected  # the same rows, in the same order
    page_sql = [q["sql"] for q in queries.captured_queries if q["sql"].startswith('SELECT "accs_task"."id", "accs')]
    assert page_sql and all(' IN (SELECT U0."id"' in sql and "OFFSET 4" in sql for sql in page_sql), page_sql


@pytest.mark.django_db
def test_the_api_summary_estimates_finished_jobs_and_says_so(make_service, default_tenant, monkeypatch):
    svc = make_service("work")
    for _ in range(4):
        api.start_service("work")
    run_ok(claim_for(svc))
    for _ in range(3):
        api.start_service("work")  # not finished (its task queued)
    _user, token = user_with_token("ops", superuser=True)
    http = client_for(token)
    exact = http.get("/api/v1/jobs/summary").json()
    unfinished = ("queued", "waiting", "running")
    assert exact["counts"]["done"] == 4 and sum(exact["counts"][s] for s in unfinished) == 3
    assert exact["estimated"] == []
    monkeypatch.setattr(counting, "EXACT_COUNT_LIMIT", 2)
    guessed = http.get("/api/v1/jobs/summary").json()
    assert guessed["estimated"] == ["done"]  # more than the limit: the planner's figure, and named
    assert guessed["counts"]["done"] >= 3  # never below the rows counted before stopping
    assert sum(guessed["counts"][s] for s in unfinished) == 3  # unfinished: exact whatever the limit
    assert guessed["counts"]["error"] == 0
    assert Job.objects.filter(status="done").count() == 4
