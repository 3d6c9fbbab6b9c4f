"""Why isn't it moving? The stuck reasons of the overview, the dashboard and ``accs_status``; the
dashboard's figures linking to the lists they count; node presence in the admin and its retire action."""

from __future__ import annotations

import html
import json
import re
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.messages import get_messages
from django.core.management import call_command
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from jobs import api, transitions
from jobs.models import Job, Task
from nodes import verbs
from nodes.api import register_node, sign_off
from nodes.models import Host, Node
from ops.overview import HELD_BY_SERVICE_SQL, STUCK_QUEUED_SQL, overview
from tests.engine_helpers import claim_for, run_fail, run_ok
from tests.ops_helpers import failed_service_job, insert_done_tasks, two_tenants
from workflows.api import create_workflow

pytestmark = pytest.mark.django_db


def reasons(**kwargs) -> list[tuple[str, str, int]]:
    """Return the overview's stuck reasons as (service, reason, count)."""
    return [(r.service, r.reason, r.count) for r in overview(**kwargs).stuck]


def only(reason: str) -> dict:
    found = [r for r in overview().as_json()["stuck"] if r["reason"] == reason]
    assert len(found) == 1, found
    return found[0]


def online(name: str, *services: str) -> Node:
    return register_node(name, labels={}, services=list(services), agent_id=f"h:{name}:1")


# --------------------------------------------------------------------------------------------
# The reasons, each appearing while its condition holds and gone once it is fixed
# --------------------------------------------------------------------------------------------

def test_queued_tasks_without_a_live_agent_name_the_absent_nodes_until_one_comes_online(make_service, default_tenant):
    make_service("resize")
    for _ in range(3):
        api.start_service("resize")
    assert reasons() == [("resize", "no_agent", 3)]
    first = only("no_agent")
    assert first["message"] == "3 tasks queued for 'resize' and no live agent serves it"
    assert "no node serves it; start one with manage.py runagent --services resize" in first["detail"]
    assert first["tenant"] == "default"

    online("old", "resize")
    sign_off("old", agent_id="h:old:1")
    online("gone", "resize")
    Node.objects.filter(name="gone").update(presence="lost", last_seen=timezone.now() - timedelta(minutes=12))
    online("elsewhere", "thumbnail")  # online, but serving something else
    detail = only("no_agent")["detail"]
    assert detail.startswith("nodes serving it: ")
    assert "gone (lost, seen 12 min ago)" in detail and "old (offline, seen " in detail
    assert "elsewhere" not in detail

    online("fresh", "resize")
    assert reasons() == [], "a live agent serves it now"


def test_every_serving_node_draining_is_its_own_reason_until_one_is_undrained(make_service, default_tenant):
    make_service("resize")
    api.start_service("resize")
    api.start_service("resize")
    online("n1", "resize")
    assert reasons() == []
    verbs.drain_node("n1", by="ops")
    assert reasons() == [("resize", "draining", 2)]
    assert only("draining")["message"] == "2 tasks queued for 'resize' and every node serving it is draining"
    verbs.undrain_node("n1", by="ops")
    assert reasons() == []


def test_a_holding_governor_condition_blocks_the_services_it_names(make_service, default_tenant):
    make_service("backup", block_during=["live_session"])
    make_service("resize")
    api.start_service("backup")
    api.start_service("resize")
    online("n1", "backup", "resize")
    assert reasons() == []
    api.raise_condition("live_session", reason="studio A is live", by="alice")
    assert reasons() == [("backup", "governor", 1)], "only the service blocked during the condition"
    stuck = only("governor")
    assert stuck["message"] == "1 task queued for 'backup' held back by governor condition 'live_session'"
    assert stuck["detail"] == "raised by alice, until cleared: studio A is live"
    api.clear_condition("live_session", by="alice")
    assert reasons() == []


def test_a_service_at_its_global_cap_with_queued_tasks(make_service, default_tenant):
    svc = make_service("encode", max_concurrent=1)
    for _ in range(3):
        api.start_service("encode")
    online("n1", "encode")
    held = claim_for(svc, n=5)
    assert len(held) == 1, "the cap lets one run"
    assert reasons() == [("encode", "at_cap", 2)]
    assert only("at_cap")["message"] == "2 tasks queued for 'encode', which is at its global cap (1/1 running)"
    run_ok(held)
    assert reasons() == [], "room again: the queued tasks can be claimed"


def test_tasks_bound_to_a_quarantined_host(make_service, default_tenant):
    make_service("flash")
    node = online("n-hosts", "flash")
    for name in ("rig-1", "rig-2", "rig-3"):
        Host.objects.create(name=name, node=node)
    create_workflow(name="flash-all",
                    steps=[{"key": "flash", "service": "flash", "depends_on": [], "fan_out": "hosts"}])
    api.start_workflow("flash-all", options={"hosts": ["rig-1", "rig-2", "rig-3"]})
    assert Task.objects.filter(status="queued", host__isnull=False).count() == 3
    assert reasons() == []
    Host.objects.filter(name="rig-2").update(status="error", quarantined_at=timezone.now(),
                                             quarantine_reason="final failure")
    assert reasons() == [("flash", "quarantined_host", 1)]
    stuck = only("quarantined_host")
    assert stuck["message"] == "1 task queued for 'flash' bound to quarantined hosts"
    assert "rig-2" in stuck["detail"] and "rig-1" not in stuck["detail"]
    assert verbs.clear_quarantine(Host.objects.get(name="rig-2").pk, by="ops").changed
    assert reasons() == []


def test_live_agents_lacking_the_required_labels_do_not_count(make_service, default_tenant):
    make_service("train", required_labels={"gpu": "true"})
    api.start_service("train")
    online("cpu-1", "train")
    assert reasons() == [("train", "labels", 1)]
    assert "it requires gpu=true; live: cpu-1" == only("labels")["detail"]
    register_node("gpu-1", labels={"gpu": "true"}, services=["train"], agent_id="h:gpu-1:1")
    assert reasons() == []


def test_reasons_split_by_tenant_and_scoped_to_the_viewers_tenants(make_service):
    tenants = two_tenants()
    make_service("resize")
    api.start_service("resize", tenant=tenants.acme)
    for _ in range(2):
        api.start_service("resize", tenant=tenants.globex)
    stuck = overview().stuck
    assert [(r.tenant, r.count) for r in stuck] == [("", 3)]
    assert stuck[0].detail.endswith("(acme 1 · globex 2)")
    scoped = overview(tenant_ids={tenants.acme.pk}, include_infra=False).stuck
    assert [(r.tenant, r.count, r.detail) for r in scoped] == [
        ("acme", 1, "ask an operator to start an agent serving it")], "no node names for tenant viewers"


def test_stuck_queries_read_the_live_rows_through_partial_indexes(make_service, default_tenant):
    svc = make_service("hist")
    job = api.start_service("hist")
    with connection.cursor() as cur:
        # 20,000 finished tasks: history the stuck reasons must not read.
        insert_done_tasks(cur, job_id=job.pk, tenant_id=default_tenant.pk, service_id=svc.pk)
        cur.execute("ANALYZE accs_task")
        plans = {}
        for name, sql in (("queued", STUCK_QUEUED_SQL.format(tenants="TRUE")), ("held", HELD_BY_SERVICE_SQL)):
            cur.execute("EXPLAIN " + sql)
            plans[name] = "\n".join(r[0] for r in cur.fetchall())
    # Every index these plans read is partial on unfinished tasks: the ones named for each branch,
    # or the job's open tasks (task_job_open_idx), which the planner may take as a small index of
    # live rows too. None of them holds the finished history.
    live = {"task_claim_idx", "task_claim_host_idx", "task_scheduled_idx", "task_held_service_idx",
            "task_held_node_idx", "task_lease_idx", "task_job_open_idx"}
    for name, plan in plans.items():
        assert "Seq Scan on accs_task" not in plan, f"{name}:\n{plan}"
        assert "task_job_key_unique" not in plan and "accs_task_pkey" not in plan, f"{name}:\n{plan}"
        used = set(re.findall(r"task_\w+_idx", plan))
        assert used and used <= live, f"{name} reads {sorted(used - live)}:\n{plan}"


# --------------------------------------------------------------------------------------------
# Where the reasons show: accs_status, its JSON, the dashboard
# --------------------------------------------------------------------------------------------

def test_accs_status_prints_the_reasons_and_its_json_holds_them(make_service, default_tenant):
    make_service("resize")
    api.start_service("resize")
    out = StringIO()
    call_command("accs_status", stdout=out, no_color=True)
    text = out.getvalue()
    section = text.split("Why isn't it moving?\n", 1)[1].split("\n\n", 1)[0]
    assert section.startswith("1 task queued for 'resize' and no live agent serves it — no node serves it"), section
    out = StringIO()
    call_command("accs_status", "--json", stdout=out)
    stuck = json.loads(out.getvalue())["stuck"]
    assert [(r["service"], r["reason"], r["count"], r["tenant"]) for r in stuck] == [
        ("resize", "no_agent", 1, "default")]

    online("n1", "resize")
    out = StringIO()
    call_command("accs_status", stdout=out, no_color=True)
    assert "(nothing stuck: every service with queued tasks has a live agent and room)" in out.getvalue()


def test_dashboard_shows_the_reasons_at_the_top_and_in_its_json(client, root, make_service, default_tenant):
    make_service("resize")
    api.start_service("resize")
    body = client.get(reverse("ops:dashboard")).content.decode()
    assert body.index('id="accs-stuck"') < body.index('id="accs-cards"'), "the warning comes first"
    assert 'data-reason="no_agent" data-service="resize" data-count="1"' in body
    data = client.get(reverse("ops:dashboard_data")).json()
    assert [r["reason"] for r in data["data"]["stuck"]] == ["no_agent"]
    online("n1", "resize")
    data = client.get(reverse("ops:dashboard_data")).json()
    assert data["data"]["stuck"] == [] and 'id="accs-stuck"' not in data["html"]


# --------------------------------------------------------------------------------------------
# Figures link to the lists they count; job waiting is counted
# --------------------------------------------------------------------------------------------

def test_waiting_tasks_of_a_waiting_job_are_counted(make_service, default_tenant):
    make_service("fetch")
    make_service("render")
    create_workflow(name="two", steps=[{"key": "fetch", "service": "fetch", "depends_on": []},
                                       {"key": "render", "service": "render", "depends_on": ["fetch"]}])
    job = api.start_workflow("two")
    job.refresh_from_db()
    assert job.status == "waiting"
    totals = overview().totals
    assert (totals.jobs_waiting, totals.jobs_running, totals.waiting, totals.queued) == (1, 0, 1, 1)


def _cards(body: str) -> dict[str, tuple[str, int]]:
    """Return each linked card of the dashboard: name → (URL, value)."""
    found = re.findall(r'<a class="accs-card[^"]*" data-card="(\w+)" href="([^"]+)">.*?<div class="value">(\d+)</div>',
                       body, re.S)
    return {name: (html.unescape(url), int(value)) for name, url, value in found}


def test_dashboard_cards_link_to_lists_showing_exactly_what_they_count(client, root, make_service):
    tenants = two_tenants()
    acme, globex = tenants.acme, tenants.globex
    retry = make_service("retry-me", max_attempts=3, backoff_base_seconds=0, backoff_cap_seconds=0)
    make_service("gated", requires_approval=True)
    make_service("plain")
    make_service("later")
    api.start_service("gated", tenant=acme)  # awaiting approval
    api.start_service("later", tenant=acme, scheduled_at=timezone.now() + timedelta(hours=2))  # not started
    api.start_service("plain", tenant=acme)
    api.start_service("plain", tenant=globex)
    api.start_service("retry-me", tenant=acme)
    run_fail(claim_for(retry))  # queued again: retrying
    running = api.start_service("plain", tenant=globex)
    claimed = [t for t in claim_for(Task.objects.get(job=running).service, n=1)]
    transitions.report([], started=[(t.id, t.attempt, 42) for t in claimed], agent_id="agent-t", source="test")
    failed_service_job(acme)  # a failed job and a dead-letter task

    body = client.get(reverse("ops:dashboard")).content.decode()
    cards = _cards(body)
    assert set(cards) == {"jobs_in_flight", "jobs_queued", "awaiting_approval", "queued", "running", "retrying",
                          "failed", "dead_letter"}
    expected_statuses = {
        "jobs_in_flight": {"waiting", "running"}, "jobs_queued": {"queued"}, "awaiting_approval": {"queued"},
        "failed": {"error"}, "queued": {"queued", "scheduled"}, "running": {"starting", "running"},
        "retrying": {"queued", "scheduled"}, "dead_letter": {"error"},
    }
    for name, (url, value) in cards.items():
        response = client.get(url)
        assert response.status_code == 200, (name, url)
        cl = response.context["cl"]
        rows = list(cl.result_list)
        assert cl.result_count == value == len(rows), (name, url, value, rows)
        assert value >= 1, f"the scene has something for {name}"
        assert {r.status for r in rows} <= expected_statuses[name], (name, [r.status for r in rows])
    assert cards["awaiting_approval"][1] == 1 and cards["jobs_queued"][1] == 2
    assert cards["retrying"][1] == 1 and cards["running"][1] == 1
    failed_card = body.split('data-card="failed"')[1].split("</a>")[0]
    assert "Failed jobs (24 h)" in failed_card and "approval" not in failed_card, "failures and approvals apart"

    # The per-tenant row's figures: acme's queued tasks, and only acme's.
    row = body.split('<tr data-tenant="acme">')[1].split("</tr>")[0]
    queued_urls = [html.unescape(u) for u in re.findall(r'href="([^"]+)"', row) if "status__in=queued" in u]
    assert len(queued_urls) == 2, row  # queued and retrying
    rows = list(client.get(min(queued_urls, key=len)).context["cl"].result_list)
    assert rows and {t.tenant_id for t in rows} == {acme.pk} and {t.status for t in rows} <= {"queued", "scheduled"}
    assert Task.objects.filter(status="queued", tenant=globex).exists(), "globex has queued tasks the link leaves out"


def test_job_waiting_status_and_node_presences_have_pill_colours(client, root):
    page = client.get(reverse("ops:dashboard")).content.decode()
    rules = dict(re.findall(r"^([^{\n]+)\{([^}]*)\}", page, re.M))

    def colour(status: str) -> str:
        found = [body for selectors, body in rules.items()
                 if f".accs-{status}" in [s.strip() for s in selectors.split(",")]]
        assert found and "background: #" in found[0], f"no colour for {status}"
        return found[0]

    assert colour("waiting") != colour("running") != colour("queued")
    assert len({colour("online"), colour("offline"), colour("lost")}) == 3


# --------------------------------------------------------------------------------------------
# Nodes: presence in the dashboard and the admin; retiring
# --------------------------------------------------------------------------------------------

def test_dashboard_nodes_show_presence_and_last_seen(client, root):
    online("up", "resize")
    online("stopped", "resize")
    sign_off("stopped", agent_id="h:stopped:1")
    Node.objects.create(name="silent", presence="lost", last_seen=timezone.now() - timedelta(minutes=30))
    html_body = client.get(reverse("ops:dashboard_data")).json()["html"]
    for name, presence in (("up", "online"), ("stopped", "offline"), ("silent", "lost")):
        row = html_body.split(f'data-node="{name}"')[1].split("</tr>")[0]
        assert f'data-presence="{presence}"' in row and f'accs-pill accs-{presence}">{presence}<' in row, row
    assert "30 min ago" in html_body.split('data-node="silent"')[1].split("</tr>")[0]
    assert "awake" not in html_body.split('id="accs-nodes"')[1].split('id="accs-governor"')[0]


def test_nodes_admin_filters_by_presence_and_retires_only_what_may_go(client, root, make_service):
    online("idle", "resize")
    sign_off("idle", agent_id="h:idle:1")
    online("busy", "resize")
    url = reverse("admin:nodes_node_changelist")
    page = client.get(url, {"presence__exact": "offline"})
    assert [n.name for n in page.context["cl"].result_list] == ["idle"]
    assert 'accs-pill accs-offline">offline<' in page.content.decode()
    response = client.post(url, {"action": "retire", "_selected_action": ["idle", "busy"]}, follow=True)
    assert [str(m) for m in get_messages(response.wsgi_request)] == [
        "Retired: idle; kept busy: it is online (stop its agent first)"]
    assert list(Node.objects.values_list("name", flat=True)) == ["busy"]
    offered = [name for name, _ in client.get(url).context["action_form"].fields["action"].choices]
    assert "retire" in offered and "delete_selected" not in offered, "nodes go through the retire rules only"


def test_failed_job_count_matches_the_job_list_window(client, root, default_tenant):
    old = failed_service_job(default_tenant, key="old-fail")
    Job.objects.filter(pk=old.pk).update(finished_at=timezone.now() - timedelta(days=2))
    new = failed_service_job(default_tenant, key="new-fail")
    url, value = _cards(client.get(reverse("ops:dashboard")).content.decode())["failed"]
    assert value == 1, "failed in the last 24 h only"
    assert [j.pk for j in client.get(url).context["cl"].result_list] == [new.pk]
