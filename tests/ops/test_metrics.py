"""The Prometheus endpoint: token-protected (open only with DEBUG), gauges from the live queue, counters and
histograms from the timeline (correct whichever process made the change), moving under real agents."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from accs_site import conf
from accs_site.version import VERSION
from events.models import Event
from jobs import api
from jobs.models import Job
from nodes.models import DiskSample, Node
from ops import metrics
from tests.daemons import wait_for
from tests.engine_helpers import claim_for, run_fail, run_ok
from workflows.models import GovernorCondition


@pytest.fixture
def fresh_collector(monkeypatch):
    """A collector as a new web process has it: nothing folded yet, no settling delay."""
    monkeypatch.setattr(metrics, "_collector", None)
    monkeypatch.setattr(metrics, "_registry", None)
    collector = metrics.collector()
    collector.counters.settle_seconds = 0.0
    return collector


SCRAPE_TOKEN = "test-scrape-token"


@pytest.fixture(autouse=True)
def scrape_token(monkeypatch):
    """The token Prometheus is given, as in production."""
    monkeypatch.setenv("ACC_METRICS_TOKEN", SCRAPE_TOKEN)
    conf.reload()
    yield SCRAPE_TOKEN
    monkeypatch.delenv("ACC_METRICS_TOKEN", raising=False)
    conf.reload()


def scrape(client, **headers) -> dict[tuple[str, tuple], float]:
    """Return ``{(sample name, sorted labels): value}`` from /metrics."""
    response = client.get("/metrics", **{"HTTP_AUTHORIZATION": f"Bearer {SCRAPE_TOKEN}", **headers})
    assert response.status_code == 200, response.content[:500]
    assert response["Content-Type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples, metric: str, /, **labels) -> float:
    return samples.get((metric, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.django_db
def test_metrics_need_the_bearer_token_and_are_closed_without_one_unless_debug(client, monkeypatch, settings,
                                                                             fresh_collector):
    denied = client.get("/metrics")
    assert denied.status_code == 401 and denied["WWW-Authenticate"].startswith("Bearer")
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Basic test-scrape-token").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer test-scrape-token").status_code == 200
    monkeypatch.delenv("ACC_METRICS_TOKEN")
    conf.reload()
    # No token set: tenant names and queue depths are not for anyone who asks.
    closed = client.get("/metrics")
    assert closed.status_code == 401 and b"set ACC_METRICS_TOKEN" in closed.content
    settings.DEBUG = True
    assert client.get("/metrics").status_code == 200, "a development site is open"
    settings.DEBUG = False
    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.create_superuser("root-metrics", "r@example.test", None))
    assert client.get("/metrics").status_code == 200, "a superuser's session may read them"


@pytest.mark.django_db
def test_gauges_show_queue_depth_dead_letters_nodes_and_conditions(client, make_service, default_tenant,
                                                                    fresh_collector):
    svc = make_service("work")
    flaky = make_service("flaky", max_attempts=1)
    for _ in range(3):
        api.start_service("work")
    claim_for(svc, n=1)
    api.start_service("flaky")
    run_fail(claim_for(flaky))
    Node.objects.create(name="fresh", last_seen=timezone.now(), awake_state="awake")
    Node.objects.create(name="old", last_seen=timezone.now() - timedelta(hours=1), awake_state="awake",
                        state="draining")
    DiskSample.objects.create(node_id="fresh", path="/", total_bytes=100, used_bytes=91, used_pct=91.0,
                              level="critical")
    GovernorCondition.objects.create(name="live_session", raised_at=timezone.now())
    s = scrape(client)
    assert value(s, "accs_tasks", tenant="default", service="work", status="queued") == 2
    assert value(s, "accs_tasks", tenant="default", service="work", status="starting") == 1
    assert value(s, "accs_tasks_dead_letter", tenant="default", service="flaky") == 1
    assert value(s, "accs_jobs", tenant="default", status="failed_24h") == 1
    assert value(s, "accs_queue_oldest_age_seconds", tenant="default", service="work") >= 0
    assert value(s, "accs_node_up", node="fresh") == 1 and value(s, "accs_node_up", node="old") == 0
    assert value(s, "accs_node_draining", node="old") == 1
    assert value(s, "accs_node_disk_used_ratio", node="fresh", level="critical") == pytest.approx(0.91)
    assert value(s, "accs_governor_condition_active", name="live_session") == 1


@pytest.mark.django_db
@pytest.mark.parametrize("narrow", [False, True], ids=["wide starts", "narrow starts"])
def test_counters_and_histograms_come_from_the_timeline(client, make_service, default_tenant, fresh_collector,
                                                         monkeypatch, narrow):
    """The same counts whether each job's creation has a row of its own or rides on its claim's row
    (a narrow start widened by the claim that takes it, jobs.narrow)."""
    svc = make_service("work", max_attempts=2, backoff_base_seconds=0, backoff_cap_seconds=0)
    monkeypatch.setenv("ACC_NARROW_STARTS", "1" if narrow else "0")
    conf.reload()
    try:
        for _ in range(4):
            api.start_service("work")
    finally:
        monkeypatch.delenv("ACC_NARROW_STARTS")
        conf.reload()
    batch = claim_for(svc, n=4)
    run_ok(batch[:3])
    run_fail(batch[3:])  # retried
    run_fail(claim_for(svc))  # second attempt fails for good
    before = scrape(client)
    assert value(before, "accs_task_claims_total", service="work") == 5
    assert value(before, "accs_task_attempts_finished_total", service="work", outcome="done") == 3
    assert value(before, "accs_task_retries_total", service="work") == 1
    assert value(before, "accs_task_dead_letters_total", service="work") == 1
    assert value(before, "accs_jobs_started_total", tenant="default") == 4
    assert value(before, "accs_jobs_finished_total", tenant="default", status="done") == 3
    assert value(before, "accs_jobs_finished_total", tenant="default", status="error") == 1
    assert value(before, "accs_task_queue_latency_seconds_count", service="work") >= 4
    assert value(before, "accs_task_run_seconds_count", service="work") == 5
    assert value(before, "accs_task_run_seconds_bucket", service="work", le="+Inf") == 5
    # A second scrape with nothing new changes no counter: events are folded exactly once.
    again = scrape(client)
    assert value(again, "accs_task_claims_total", service="work") == 5
    assert value(again, "accs_task_run_seconds_count", service="work") == 5


@pytest.mark.django_db
def test_a_new_process_reports_the_same_totals(client, make_service, default_tenant, fresh_collector, monkeypatch):
    svc = make_service("work")
    for _ in range(3):
        api.start_service("work")
    run_ok(claim_for(svc))
    first = scrape(client)
    monkeypatch.setattr(metrics, "_collector", None)  # as if another web process answered the scrape
    metrics.collector().counters.settle_seconds = 0.0
    metrics.collector().counters.chunk = 2  # and caught up in many small chunks
    # Events of earlier tests keep their ids (sequences do not roll back): start just before ours,
    # so the walk in chunks of 2 fits the fold's time budget however long the suite has run.
    metrics.collector().counters.watermark = Event.objects.order_by("id").values_list("id", flat=True).first() - 1
    second = scrape(client)
    for name in ("accs_task_claims_total", "accs_task_run_seconds_count"):
        assert value(second, name, service="work") == value(first, name, service="work") == 3


@pytest.mark.django_db(transaction=True)
def test_counters_move_while_a_real_agent_runs(client, make_service, default_tenant, daemons, fresh_collector):
    make_service("tick")
    first = [api.start_service("tick") for _ in range(5)]
    proc = daemons.agent("metrics-node", "tick", "--poll-interval", "0.1")
    wait_for(lambda: Job.objects.filter(pk__in=[j.pk for j in first], status="done").count() == 5, timeout=60,
             message=f"the agent finishes the first 5 jobs; log: {proc.log_path}")
    before = wait_for(lambda: (s := scrape(client)) and value(s, "accs_task_claims_total", service="tick") >= 5 and s,
                      timeout=30, message="the first scrape sees the first claims")
    assert value(before, "accs_node_up", node="metrics-node") == 1
    second = [api.start_service("tick") for _ in range(7)]
    wait_for(lambda: Job.objects.filter(pk__in=[j.pk for j in second], status="done").count() == 7, timeout=60,
             message=f"the agent finishes 7 more jobs; log: {proc.log_path}")
    after = wait_for(lambda: (s := scrape(client)) and value(s, "accs_task_claims_total", service="tick") >= 12 and s,
                     timeout=30, message="the counters move by the new claims")
    for name, labels in (("accs_task_claims_total", {"service": "tick"}),
                         ("accs_task_attempts_finished_total", {"service": "tick", "outcome": "done"}),
                         ("accs_task_run_seconds_count", {"service": "tick"}),
                         ("accs_jobs_finished_total", {"tenant": "default", "status": "done"})):
        assert value(after, name, **labels) - value(before, name, **labels) == 7, name
    assert value(after, "accs_tasks", tenant="default", service="tick", status="queued") == 0



@pytest.mark.django_db
def test_the_build_and_each_nodes_release_are_exported(client, fresh_collector):
    Node.objects.create(name="old-agent", version="0.1.0", last_seen=timezone.now(), awake_state="awake")
    Node.objects.create(name="new-agent", version=VERSION, last_seen=timezone.now(), awake_state="awake")
    s = scrape(client)
    assert value(s, "accs_build_info", version=VERSION) == 1
    assert value(s, "accs_node_version_info", node="old-agent", version="0.1.0") == 1
    assert value(s, "accs_node_version_info", node="new-agent", version=VERSION) == 1
    assert [k for k in s if k[0] == "accs_build_info"] == [("accs_build_info", (("version", VERSION),))]
