"""The admin as the operators' cockpit: job page, actions through transitions, validation errors per
field, tenant isolation, nodes / hosts / governor actions, the dashboard and ``accs_status``."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from django.contrib.messages import get_messages
from django.core.management import call_command
from django.urls import reverse

from events.models import Event
from jobs import api
from jobs.ids import short_id
from jobs.models import Job, Task, Trigger
from nodes.models import Host, Node
from tests.engine_helpers import claim_for
from tests.ops_helpers import failed_service_job, insert_done_tasks, make_user, pipeline_scene
from workflows.models import GovernorCondition, Service, Workflow

pytestmark = pytest.mark.django_db


def messages_of(response) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def job_url(job: Job) -> str:
    return reverse("admin:jobs_job_change", args=[job.pk])


# --------------------------------------------------------------------------------------------
# The job page
# --------------------------------------------------------------------------------------------

def test_job_page_shows_dag_with_states_tasks_attempts_and_timeline(client, root, tenants):
    scene = pipeline_scene(tenants)
    body = client.get(job_url(scene.failed)).content.decode()
    assert '<svg xmlns="http://www.w3.org/2000/svg" class="accs-dag"' in body
    # One box per step; the fan-out step is one box grouping its four host tasks.
    steps = dict(re.findall(r'data-step="([^"]+)" data-status="([^"]+)"', body))
    assert steps == {"fetch": "done", "render": "error", "package": "skipped", "notify": "skipped"}
    assert "render × 4 hosts" in body and "1 error · 3 done" in body
    assert body.count('class="accs-task ') == 7  # fetch + 4 renders + package + notify
    assert body.count('class="accs-attempt"') == 6  # fetch, 3 ok renders, the failed render twice
    assert "render crashed: exit 137 (out of memory)" in body
    assert 'data-level="error"' in body and 'data-level="info"' in body
    assert 'id="accs-job-retry"' in body, "a failed job offers Retry"
    assert 'id="accs-job-cancel"' not in body


def test_timeline_level_filter_keeps_that_level_and_above(client, root, tenants):
    job = failed_service_job(tenants.acme)
    body = client.get(job_url(job) + "?level=warn").content.decode()
    levels = set(re.findall(r'<tr class="accs-event" data-level="(\w+)"', body))
    assert levels == {"error"} or levels == {"warn", "error"}, levels
    assert "info" not in levels
    everything = set(re.findall(r'<tr class="accs-event" data-level="(\w+)"',
                                client.get(job_url(job)).content.decode()))
    assert "info" in everything


def test_retry_button_requeues_the_failed_task_through_the_transition(client, root, tenants):
    job = failed_service_job(tenants.acme)
    response = client.post(reverse("admin:jobs_job_act", args=[job.pk, "retry"]), follow=True)
    assert response.status_code == 200
    short = short_id(job.pk)
    assert f"Retry: job {short} (service flaky): job back to waiting; 1 task(s) reset" in messages_of(response)
    task = Task.objects.get(job=job)
    # The retry renews the budget; attempt numbers never go back (old attempts stay fenced).
    assert task.status == "queued" and task.max_attempts - task.attempt == task.service.max_attempts
    assert Event.objects.filter(job_id=job.pk, source="user:root", message__contains="(retry)").exists()
    body = response.content.decode()
    assert 'data-status="queued"' in body
    # The same button again no longer applies, and says why.
    again = client.post(reverse("admin:jobs_job_act", args=[job.pk, "retry"]), follow=True)
    assert any("only failed, partial or canceled jobs can be retried" in m for m in messages_of(again))


def test_act_view_refuses_get(client, root, tenants):
    job = failed_service_job(tenants.acme)
    assert client.get(reverse("admin:jobs_job_act", args=[job.pk, "retry"])).status_code == 405
    job.refresh_from_db()
    assert job.status == "error"


def test_task_button_retries_one_task_and_returns_to_the_job_page(client, root, tenants):
    job = failed_service_job(tenants.acme)
    task = Task.objects.get(job=job)
    response = client.post(reverse("admin:jobs_task_act", args=[task.pk, "retry"]), {"next": job_url(job)})
    assert response.status_code == 302 and response["Location"] == job_url(job)
    task.refresh_from_db()
    assert task.status == "queued"
    evil = client.post(reverse("admin:jobs_task_act", args=[task.pk, "cancel"]),
                       {"next": "https://evil.example/", "confirm": "yes"})
    assert evil["Location"] == job_url(job), "an off-site next is ignored"


# --------------------------------------------------------------------------------------------
# Bulk actions on the list
# --------------------------------------------------------------------------------------------

def _bulk(client, model: str, action: str, ids, *, confirm: bool = False) -> list[str]:
    data = {"action": action, "_selected_action": [str(i) for i in ids], **({"confirm": "yes"} if confirm else {})}
    response = client.post(reverse(f"admin:jobs_{model}_changelist"), data, follow=True)
    assert response.status_code == 200
    return messages_of(response)


def test_bulk_retry_reports_changed_and_unchanged_with_reasons(client, root, tenants):
    failed = failed_service_job(tenants.acme)
    queued = api.start_service("flaky", tenant=tenants.acme)
    msgs = _bulk(client, "job", "retry_jobs", [failed.pk, queued.pk])
    assert msgs == [f"Retry: job {short_id(failed.pk)} (service flaky): job back to waiting; 1 task(s) reset; "
                    f"unchanged: job {short_id(queued.pk)} (service flaky): job is waiting; only failed, partial or "
                    "canceled jobs can be retried"]
    assert Task.objects.get(job=failed).status == "queued"


def test_bulk_approve_and_reject(client, root, tenants, make_service):
    make_service("gated", requires_approval=True)
    a, b = (api.start_service("gated", tenant=tenants.acme) for _ in range(2))
    assert _bulk(client, "job", "approve_jobs", [a.pk]) == [
        f"Approve: job {short_id(a.pk)} (service gated): job approved"]
    assert _bulk(client, "job", "reject_jobs", [a.pk, b.pk], confirm=True) == [
        f"Reject: job {short_id(b.pk)} (service gated): job rejected and canceled; "
        f"unchanged: job {short_id(a.pk)} (service gated): job is not waiting for approval"]
    a.refresh_from_db(), b.refresh_from_db()
    assert (a.approval_state, b.approval_state, b.status) == ("approved", "rejected", "canceled")


def test_bulk_cancel_and_cancel_task(client, root, tenants, make_service):
    svc = make_service("work")
    jobs = [api.start_service("work", tenant=tenants.acme) for _ in range(3)]
    claim_for(svc, n=1)  # the first job's task is held by an agent
    msgs = _bulk(client, "job", "cancel_jobs", [j.pk for j in jobs], confirm=True)
    assert msgs[0].startswith("Cancel: 3 changed (job "), msgs
    held = Task.objects.get(job=jobs[0])
    assert held.status == "starting" and held.cancel_requested_at is not None, "a held task is told to stop"
    assert Task.objects.filter(job__in=jobs[1:], status="canceled").count() == 2


# --------------------------------------------------------------------------------------------
# Tenant isolation (tenants.scoping)
# --------------------------------------------------------------------------------------------

def test_tenant_admin_sees_only_own_jobs_tasks_events_and_tenants(client, tenants):
    mine = failed_service_job(tenants.acme, key="acme-svc")
    theirs = failed_service_job(tenants.globex, key="globex-svc")
    client.force_login(make_user("alice", tenants={tenants.acme: "admin"}))
    jobs = client.get(reverse("admin:jobs_job_changelist")).content.decode()
    assert short_id(mine.pk) in jobs and short_id(theirs.pk) not in jobs
    assert "globex" not in jobs, "the tenant filter offers only the user's tenants"
    tasks = client.get(reverse("admin:jobs_task_changelist")).content.decode()
    assert short_id(mine.pk) in tasks and short_id(theirs.pk) not in tasks
    events = client.get(reverse("admin:events_event_changelist")).content.decode()
    assert str(mine.pk) in events and str(theirs.pk) not in events
    assert client.get(reverse("admin:tenants_tenant_changelist")).status_code == 403, "no model permission on tenants"


def test_tenant_admin_cannot_open_or_act_on_another_tenants_job_by_url(client, tenants):
    theirs = failed_service_job(tenants.globex)
    client.force_login(make_user("alice", tenants={tenants.acme: "admin"}))
    page = client.get(job_url(theirs), follow=True)
    assert page.redirect_chain and page.redirect_chain[-1][0] == reverse("admin:index")
    assert "doesn’t exist" in page.content.decode() and 'class="accs-dag"' not in page.content.decode()
    client.post(reverse("admin:jobs_job_act", args=[theirs.pk, "retry"]))
    task = Task.objects.get(job=theirs)
    client.post(reverse("admin:jobs_task_act", args=[task.pk, "retry"]))
    # Even a forged bulk action naming the id finds nothing to act on.
    client.post(reverse("admin:jobs_job_changelist"), {"action": "retry_jobs", "_selected_action": [str(theirs.pk)]})
    theirs.refresh_from_db(), task.refresh_from_db()
    assert (theirs.status, task.status) == ("error", "error")


def test_viewer_sees_the_job_but_cannot_act(client, tenants):
    job = failed_service_job(tenants.acme)
    client.force_login(make_user("vic", tenants={tenants.acme: "viewer"}))
    body = client.get(job_url(job)).content.decode()
    assert "accs-dag" in body and 'id="accs-job-retry"' not in body and 'data-op="retry"' not in body
    assert client.post(reverse("admin:jobs_job_act", args=[job.pk, "retry"])).status_code == 403
    listing = client.get(reverse("admin:jobs_job_changelist")).content.decode()
    assert "retry_jobs" not in listing, "actions need the tenant-admin role"
    job.refresh_from_db()
    assert job.status == "error"


def test_tenant_admin_manages_triggers_of_own_tenant_only(client, tenants, make_service):
    make_service("sync")
    svc = Service.objects.get(key="sync")
    other = Trigger.objects.create(tenant=tenants.globex, label="theirs", trigger_type="event", event_name="x",
                                   service=svc)
    client.force_login(make_user("alice", tenants={tenants.acme: "admin"}))
    form = client.get(reverse("admin:jobs_trigger_add")).content.decode()
    assert ">acme<" in form and ">globex<" not in form
    response = client.post(reverse("admin:jobs_trigger_add"), {
        "tenant": tenants.acme.pk, "label": "nightly", "is_enabled": "on", "trigger_type": "schedule",
        "cron_expr": "0 2 * * *", "timezone": "Europe/Oslo", "missed_run_policy": "run_once", "service": svc.pk,
        "payload_template": "{}", "priority": 0, "dedupe_window_seconds": 300,
    })
    assert response.status_code == 302, response.content.decode()[:2000]
    created = Trigger.objects.get(label="nightly")
    assert created.tenant == tenants.acme and created.created_by.username == "alice"
    assert client.get(reverse("admin:jobs_trigger_change", args=[other.pk])).status_code == 302  # "doesn't exist"
    forged = client.post(reverse("admin:jobs_trigger_add"), {
        "tenant": tenants.globex.pk, "label": "sneaky", "trigger_type": "event", "event_name": "y",
        "missed_run_policy": "run_once", "service": svc.pk, "payload_template": "{}", "priority": 0,
        "dedupe_window_seconds": 300,
    })
    assert forged.status_code == 200 and not Trigger.objects.filter(label="sneaky").exists()


def test_trigger_form_names_the_wrong_field(client, root, tenants, make_service):
    svc = make_service("sync")
    response = client.post(reverse("admin:jobs_trigger_add"), {
        "tenant": tenants.acme.pk, "label": "bad", "trigger_type": "schedule", "cron_expr": "every day",
        "timezone": "Mars/Olympus", "missed_run_policy": "run_once", "service": svc.pk, "payload_template": "{}",
        "priority": 0, "dedupe_window_seconds": 300,
    })
    errors = response.context["adminform"].form.errors
    assert "not a valid cron expression" in errors["cron_expr"][0]
    assert "unknown IANA time zone" in errors["timezone"][0]
    assert not Trigger.objects.exists()


# --------------------------------------------------------------------------------------------
# Services and workflows: full validation, errors per field
# --------------------------------------------------------------------------------------------

SERVICE_FORM = {
    "key": "render", "description": "", "is_active": "on", "executor": "command",
    "executor_config": '{"argv": ["render", "{preset}"]}', "params_schema": '{"type": "object"}',
    "timeout_seconds": 600, "max_attempts": 3, "backoff_base_seconds": "", "backoff_cap_seconds": 3600,
    "cpu_weight": 1, "max_concurrent": 0, "base_priority": 0, "required_labels": "{}", "block_during": "",
    "priority_adjust_during": "{}", "rate_limit": 0, "rate_period_seconds": 60, "rate_key": "", "rate_key_limit": 0,
    "concurrency_key": "", "concurrency_key_limit": 0,
}


def test_service_form_shows_each_problem_under_its_field(client, root):
    response = client.post(reverse("admin:workflows_service_add"), {**SERVICE_FORM, "params_schema": '{"type": 7}'})
    errors = response.context["adminform"].form.errors
    assert any("placeholders ['preset'] are not properties" in e for e in errors["executor_config"]), errors
    assert any("not a valid JSON Schema" in e for e in errors["params_schema"]), errors
    assert "__all__" not in errors
    assert not Service.objects.filter(key="render").exists()
    ok = client.post(reverse("admin:workflows_service_add"), {
        **SERVICE_FORM, "params_schema": '{"type": "object", "properties": {"preset": {"type": "string"}}}'})
    assert ok.status_code == 302 and Service.objects.filter(key="render").exists()


def test_workflow_form_names_the_cycle_and_saves_nothing(client, root, make_service):
    make_service("a")
    steps = ('[{"key": "x", "service": "a", "depends_on": ["y"]}, {"key": "y", "service": "a", "depends_on": ["x"]},'
             ' {"key": "z", "service": "nope"}]')
    response = client.post(reverse("admin:workflows_workflow_add"), {
        "name": "loop", "version": 1, "description": "", "is_active": "on", "max_active_jobs": 0, "steps": steps})
    errors = response.context["adminform"].form.errors["steps"]
    assert any("dependency cycle: x → y → x" in e for e in errors), errors
    assert any("unknown service 'nope'" in e for e in errors), errors
    assert not Workflow.objects.exists()


def test_workflow_page_pictures_its_dag(client, root, make_service):
    make_service("a")
    wf = Workflow.objects.create(name="chain", version=1, steps=[
        {"key": "one", "service": "a", "depends_on": []}, {"key": "two", "service": "a", "depends_on": ["one"]}])
    body = client.get(reverse("admin:workflows_workflow_change", args=[wf.pk])).content.decode()
    assert 'data-step="one" data-status="pending"' in body and 'class="edge"' in body


# --------------------------------------------------------------------------------------------
# Nodes, hosts, governor conditions
# --------------------------------------------------------------------------------------------

def test_drain_and_undrain_nodes_through_transitions(client, root):
    Node.objects.create(name="n1")
    url = reverse("admin:nodes_node_changelist")
    drained = client.post(url, {"action": "drain", "_selected_action": ["n1"]}, follow=True)
    assert messages_of(drained) == ["Drain: node n1 is draining: it claims nothing new"]
    assert Node.objects.get(name="n1").state == "draining"
    again = client.post(url, {"action": "drain", "_selected_action": ["n1"]}, follow=True)
    assert messages_of(again) == ["unchanged: node n1 is draining; nothing to do"]
    client.post(url, {"action": "undrain", "_selected_action": ["n1"]})
    assert Node.objects.get(name="n1").state == "active"
    assert list(Event.objects.filter(type="node").order_by("id").values_list("message", flat=True)) == [
        "node n1 active → draining (by root)", "node n1 draining → active (by root)"]
    page = client.get(reverse("admin:nodes_node_change", args=["n1"])).content.decode()
    assert 'name="state"' not in page, "state is read-only: drain/undrain are actions"


def test_clear_host_quarantine_action(client, root):
    from django.utils import timezone

    host = Host.objects.create(name="h1", status="error", quarantined_at=timezone.now(), quarantine_reason="boom")
    response = client.post(reverse("admin:nodes_host_changelist"),
                           {"action": "clear_quarantine", "_selected_action": [host.pk]}, follow=True)
    assert messages_of(response) == ["Clear quarantine: host h1 is eligible again"]
    host.refresh_from_db()
    assert (host.status, host.quarantined_at) == ("ok", None)


def test_raise_condition_asks_reason_and_duration_then_clear(client, root):
    cond = GovernorCondition.objects.create(name="live_session")
    url = reverse("admin:workflows_governorcondition_changelist")
    ask = client.post(url, {"action": "raise_conditions", "_selected_action": [cond.pk]})
    assert ask.status_code == 200 and b'name="reason"' in ask.content
    done = client.post(url, {"action": "raise_conditions", "_selected_action": [cond.pk], "apply": "1",
                             "reason": "studio is live", "minutes": "30"}, follow=True)
    assert messages_of(done)[0].startswith("Raise: live_session raised until ")
    cond.refresh_from_db()
    assert cond.holds() and cond.raised_by == "root" and cond.expires_at is not None
    cleared = client.post(url, {"action": "clear_conditions", "_selected_action": [cond.pk]}, follow=True)
    assert messages_of(cleared) == ["Clear: live_session cleared"]
    cond.refresh_from_db()
    assert not cond.holds()
    assert Event.objects.filter(type="governor").count() == 2


def test_adding_a_condition_raises_it(client, root):
    response = client.post(reverse("admin:workflows_governorcondition_add"),
                           {"name": "maintenance", "reason": "db upgrade", "expires_at_0": "", "expires_at_1": ""})
    assert response.status_code == 302
    cond = GovernorCondition.objects.get(name="maintenance")
    assert cond.holds() and cond.raised_by == "root"
    assert Event.objects.filter(type="governor", message__contains="maintenance raised").exists()


# --------------------------------------------------------------------------------------------
# Dashboard
# --------------------------------------------------------------------------------------------

def test_dashboard_page_and_json_show_cards_nodes_and_conditions(client, root, tenants):
    pipeline_scene(tenants)
    page = client.get(reverse("ops:dashboard"))
    body = page.content.decode()
    assert page.status_code == 200
    # The page refreshes over its own time range (the default 6 h), whatever another tab picked since.
    assert 'id="accs-cards"' in body and 'data-live-url="/admin/dashboard/data.json?range=6h"' in body
    data = client.get(reverse("ops:dashboard_data")).json()
    by_tenant = {c["tenant"]: c for c in data["data"]["tenants"]}
    assert by_tenant["acme"]["dead_letter"] == 1 and by_tenant["globex"]["dead_letter"] == 1
    assert by_tenant["acme"]["failed_24h"] == 1
    assert by_tenant["acme"]["queued"] == 1 and by_tenant["globex"]["queued"] == 3  # notify jobs left
    assert by_tenant["acme"]["running"] == 1  # the claimed package task
    assert data["data"]["totals"]["queued"] == 4
    nodes = {n["name"]: n for n in data["data"]["nodes"]}
    assert nodes["edge-2"]["stale"] and not nodes["node-t"]["stale"]
    assert nodes["edge-2"]["disk_level"] == "critical" and nodes["gpu-3"]["state"] == "draining"
    assert [c["name"] for c in data["data"]["conditions"] if c["holds"]] == ["live_session"]
    stats = data["data"]["stats"]["overall"]
    assert stats["finished"] >= 7 and stats["failed"] == 3 and stats["run_p50"] is not None
    assert stats["latency_p95"] is not None
    assert 'data-node="edge-2" data-stale="1"' in data["html"]
    assert reverse("ops:dashboard") in client.get(reverse("admin:index")).content.decode()


def test_dashboard_for_tenant_admin_shows_only_their_tenant_and_no_nodes(client, tenants):
    pipeline_scene(tenants)
    client.force_login(make_user("alice", tenants={tenants.acme: "admin"}))
    data = client.get(reverse("ops:dashboard_data")).json()["data"]
    assert [c["tenant"] for c in data["tenants"]] == ["acme"]
    assert {f["tenant"] for f in data["failures"]} == {"acme"}
    assert data["nodes"] == [] and data["conditions"] == []


def test_dashboard_needs_a_staff_login(client):
    response = client.get(reverse("ops:dashboard_data"))
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


# --------------------------------------------------------------------------------------------
# Cheap at scale
# --------------------------------------------------------------------------------------------

def test_list_pages_count_exactly_only_up_to_a_limit(monkeypatch, client, root, tenants, make_service):
    from accs_site import admin_kit

    make_service("bulk")
    for _ in range(8):
        api.start_service("bulk", tenant=tenants.acme)
    monkeypatch.setattr(admin_kit, "EXACT_COUNT_LIMIT", 5)
    with CaptureSQL() as sql:
        response = client.get(reverse("admin:jobs_job_changelist"))
    assert response.status_code == 200
    counts = [q for q in sql.queries if "COUNT(" in q.upper()]
    assert counts and all("LIMIT 6" in q for q in counts), counts
    assert response.context["cl"].result_count >= 6
    # Beyond the limit, the planner's estimate of the filter's rows: the key alone is planned, not the
    # list's joins and annotations.
    explained = [q for q in sql.queries if q.startswith("EXPLAIN")]
    assert len(explained) == 1 and " JOIN " not in explained[0] and "run_interval" not in explained[0], explained


class CaptureSQL:
    def __enter__(self):
        from django.db import connection
        from django.test.utils import CaptureQueriesContext

        self._ctx = CaptureQueriesContext(connection)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def queries(self) -> list[str]:
        return [q["sql"] for q in self._ctx.captured_queries]


def test_overview_queries_read_partial_indexes_not_the_history(tenants, make_service):
    """With many finished tasks and attempts, the dashboard's queries avoid scanning them."""
    from datetime import timedelta

    from django.db import connection

    from jobs import attempt_rollup as rollup
    from ops import charts, overview, rates

    svc = make_service("hist")
    job = api.start_service("hist", tenant=tenants.acme)
    with connection.cursor() as cur:
        # 20,000 finished tasks with one attempt each: history the dashboard must not read.
        insert_done_tasks(cur, job_id=job.pk, tenant_id=tenants.acme.pk, service_id=svc.pk)
        cur.execute("INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, status, started_at, finished_at,"
                    " stdout_tail, stderr_tail, error_text)"
                    " SELECT id, 1, 'n', 'a', 'succeeded', now() - interval '1 day', now() - interval '1 day',"
                    " '', '', ''"
                    " FROM accs_task WHERE step_key = 'h'")  # the history: older than the window read
        cur.execute("ANALYZE accs_task; ANALYZE accs_attempt; ANALYZE accs_job")
        plans = {}
        # The last hour: nothing folded, every attempt of it read raw.
        window = {"since": job.created_at, "until": job.created_at + timedelta(hours=1), "sample": 1000,
                  **rollup.zone(job.created_at, job.created_at + timedelta(hours=1), rollup.NODE_GRID)}
        for name, sql, params in (
            ("active", overview.ACTIVE_TASKS_SQL.format(tenants="TRUE"), {"now": job.created_at}),
            ("waiting", overview.WAITING_TASKS_SQL.format(tenants="TRUE"), {}),
            ("failed", overview.FAILED_JOBS_SQL, {"since": job.created_at, "ids": [str(tenants.acme.pk)]}),
            ("dead", overview.DEAD_LETTER_SQL, {"ids": [str(tenants.acme.pk)]}),
            ("recent", overview.RECENT_STATS_SQL.format(tenants="TRUE"), {"sample": 1000, "since": job.created_at}),
            ("failures", overview.RECENT_FAILURES_SQL.format(tenants="TRUE"), {"sample": 1000, "limit": 10}),
            *((name, charts.chart_sql(source, "TRUE", "TRUE"), {**window, "bucket": 600, **rollup.fold_params()})
              for name, source in (("charts", charts.ATTEMPT_SOURCE), ("charts through tasks", charts.TASK_SOURCE))),
            *((name, rates.rates_sql(source, tenant_ids=None, node=False, service=False)[0], window)
              for name, source in (("rates", rates.ATTEMPT_REFS), ("rates through tasks", rates.TASK_REFS))),
        ):
            cur.execute("EXPLAIN " + sql, params)
            plans[name] = "\n".join(r[0] for r in cur.fetchall())
    for name, plan in plans.items():  # (the rollups of a test are a few rows: a seq scan of them is right)
        assert "Seq Scan on accs_task " not in plan and "Seq Scan on accs_attempt " not in plan, f"{name}:\n{plan}"
    assert "accs_attempt_pkey" in plans["recent"], plans["recent"]
    assert "attempt_started_idx" in plans["charts"] and "accs_task" not in plans["charts"], plans["charts"]
    assert "accs_task_pkey" in plans["charts through tasks"], plans["charts through tasks"]
    assert "attempt_started_idx" in plans["rates"] and "accs_task" not in plans["rates"], plans["rates"]
    assert "attempt_started" in plans["rates through tasks"] and "accs_task_pkey" in plans["rates through tasks"], \
        plans["rates through tasks"]


# --------------------------------------------------------------------------------------------
# manage.py accs_status
# --------------------------------------------------------------------------------------------

def test_accs_status_prints_queues_nodes_and_failures(tenants):
    pipeline_scene(tenants)
    out = StringIO()
    call_command("accs_status", stdout=out, no_color=True)
    text = out.getvalue()
    assert "Queues per tenant" in text and "Nodes (an online node is SUSPECT after" in text
    assert "Recent failures" in text
    acme = next(line for line in text.splitlines() if line.startswith("acme "))
    # jobs: not started, approval, waiting, running, failed 24 h; tasks: waiting, queued
    assert acme.split()[1:8] == ["0", "0", "2", "0", "1", "0", "1"], acme
    assert re.search(r"^edge-2 +online SUSPECT", text, re.M), text
    assert re.search(r"render .* 2/2 DEAD .*out of memory", text), text
    assert "live_session: holds since" in text


def test_accs_status_json_and_tenant_filter(tenants):
    failed_service_job(tenants.acme)
    out = StringIO()
    call_command("accs_status", "--json", "--tenant", "globex", stdout=out)
    import json

    data = json.loads(out.getvalue())
    assert [t["tenant"] for t in data["tenants"]] == ["globex"] and data["failures"] == []
    with pytest.raises(Exception, match="no tenant nope"):
        call_command("accs_status", "--tenant", "nope", stdout=StringIO())


def test_a_list_row_s_action_checkbox_is_the_markup_django_s_widget_renders(tenants):
    from django.contrib import admin

    from accs_site.admin_kit import TenantScopedAdmin
    from tenants.models import Tenant

    job = failed_service_job(tenants.acme)
    task = Task.objects.filter(job=job).first()
    odd = Tenant(slug='<b>"&\' x', name="odd")  # a name the label escapes
    assert "<b>" in str(odd)
    for obj in (job, task, odd):
        fast = TenantScopedAdmin.action_checkbox(None, obj)
        assert fast == admin.ModelAdmin.action_checkbox(None, obj), obj
        assert 'class="action-select"' in fast and f'value="{obj.pk}"' in fast


@pytest.mark.parametrize("url", ["/admin/jobs/task/0190a1b2-aaaa/change/", "/admin/jobs/job/5/change/?_to_field=id",
                                 "/admin/jobs/job/", "/admin/jobs/job/5/history/", "/admin/jobs/job/5/change/#x"])
@pytest.mark.parametrize("filters", ["", "_changelist_filters=status__exact%3Derror%26q%3Da%2Bb%26p%3D500",
                                     "_changelist_filters=range%3Dcustom%26from%3D2026-11-28T13%253A05"])
@pytest.mark.parametrize("popup", [False, True])
def test_a_row_link_keeps_the_list_s_filters_as_django_writes_it(url, filters, popup):
    from django.contrib.admin.templatetags import admin_urls

    from accs_site.admin_kit import add_preserved_filters

    context = {"preserved_filters": filters, "opts": Job._meta}
    assert add_preserved_filters(context, url, popup) == admin_urls.add_preserved_filters(context, url, popup)
