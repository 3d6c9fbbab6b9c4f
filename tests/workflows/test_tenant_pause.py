"""Pausing a tenant: one governor condition with who, when and why, honoured by the claim itself (host-bound
tasks, the general path and the server function alike), until resumed or its expiry; only an operator who may
change the tenant pauses it; the dashboard, the stuck panel, /metrics, accs_status and the system timeline say so."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from hypothesis import HealthCheck, given, settings, strategies as st

from events.models import Event
from jobs import api
from jobs.claim import claim_many
from jobs.models import Task
from nodes.models import Host, Node
from ops.overview import overview
from ops.status import status_lines
from ops.system_timeline import system_timeline
from tests.engine_helpers import NODE, claim_for, spec
from tests.ops_helpers import make_user
from workflows import governor
from workflows.api import create_workflow
from workflows.models import GovernorCondition
from workflows.validation import DefinitionError

pytestmark = pytest.mark.django_db


def _queued(tenant) -> list[str]:
    return list(Task.objects.filter(tenant=tenant).values_list("status", flat=True))


# --------------------------------------------------------------------------------------------
# The Python API and the claim
# --------------------------------------------------------------------------------------------

def test_a_paused_tenants_tasks_are_not_claimed_while_another_tenants_are(make_service, tenants):
    svc = make_service("resize")
    for tenant in (tenants.acme, tenants.globex):
        for _ in range(3):
            api.start_service("resize", tenant=tenant)
    governor.pause_tenant(tenants.acme, reason="invoice dispute", by="alice")

    claimed = claim_for(svc, 10)
    assert {Task.objects.get(pk=t.id).tenant_id for t in claimed} == {tenants.globex.id}
    assert len(claimed) == 3
    assert _queued(tenants.acme) == ["queued"] * 3, "a paused tenant's tasks stay queued"
    assert claim_for(svc, 10) == [], "nothing else is claimable while acme is paused"

    assert governor.resume_tenant("acme", by="bob") is True
    assert governor.resume_tenant(tenants.acme.pk, by="bob") is False, "resuming twice changes nothing"
    assert len(claim_for(svc, 10)) == 3, "resumed: the next claim takes them"
    messages = list(Event.objects.filter(type="governor").order_by("id").values_list("message", "data"))
    name = f"tenant-pause-{tenants.acme.pk}"
    assert [m for m, _ in messages] == [f"governor condition {name} raised by alice until cleared: invoice dispute",
                                        f"governor condition {name} cleared by bob"]
    assert all(d["tenant"] == "acme" and d["tenant_id"] == str(tenants.acme.pk) for _, d in messages), messages


def test_a_pause_holds_until_its_expiry_and_then_the_claim_takes_the_tasks(make_service, tenants):
    svc = make_service("resize")
    api.start_service("resize", tenant=tenants.acme)
    now = timezone.now()
    governor.pause_tenant(tenants.acme, reason="maintenance window", by="alice",
                          expires_at=now + timedelta(minutes=10))
    assert claim_for(svc, 5, now=now + timedelta(minutes=9)) == []
    [task] = claim_for(svc, 5, now=now + timedelta(minutes=10, seconds=1))
    assert Task.objects.get(pk=task.id).tenant_id == tenants.acme.id


def test_host_bound_tasks_of_a_paused_tenant_are_not_claimed(make_service, tenants):
    svc = make_service("ping")
    create_workflow(name="fan", steps=[{"key": "ping", "service": "ping", "depends_on": [], "fan_out": "hosts"}])
    Node.objects.get_or_create(name=NODE.name)
    for name in ("h1", "h2"):
        Host.objects.create(name=name, node_id=NODE.name)
    for tenant in (tenants.acme, tenants.globex):
        api.start_workflow("fan", tenant=tenant, options={"hosts": ["h1", "h2"]})
    governor.pause_tenant(tenants.globex, reason="audit", by="alice")
    claimed = claim_for(svc, 10)
    assert {Task.objects.get(pk=t.id).tenant_id for t in claimed} == {tenants.acme.id}
    assert sorted(t.host for t in claimed) == ["h1", "h2"]
    assert _queued(tenants.globex) == ["queued", "queued"]


@pytest.mark.parametrize("kinds", ["c", "r", "cr"])
def test_the_keyed_claim_skips_a_paused_tenant_too(make_service, tenants, kinds):
    """The services with a per-key limit are claimed by the general path's statement: same filter."""
    limits = {"c": {"concurrency_key": "customer", "concurrency_key_limit": 5},
              "r": {"rate_key": "customer", "rate_key_limit": 5, "rate_period_seconds": 60}}
    fields = {k: v for kind in kinds for k, v in limits[kind].items()}
    svc = make_service("keyed", **fields)
    for tenant in (tenants.acme, tenants.globex):
        api.start_service("keyed", tenant=tenant, params={"customer": "c1"})
    governor.pause_tenant(tenants.acme, reason="audit", by="alice")
    claimed = claim_many([spec(svc)], NODE, agent_id="agent-k", free_slots=5, lease_seconds=60)
    assert [Task.objects.get(pk=t.id).tenant_id for t in claimed] == [tenants.globex.id]


def test_the_previous_releases_call_of_the_claim_function_honours_a_pause(make_service, tenants):
    """Agents of the previous release call the function with today's arguments: its signature is kept,
    and the pause is read inside it, so they skip a paused tenant without knowing of pauses."""
    svc = make_service("resize")
    api.start_service("resize", tenant=tenants.acme)
    api.start_service("resize", tenant=tenants.globex)
    governor.pause_tenant(tenants.acme, reason="audit", by="alice")
    with connection.cursor() as cur:
        # The call as release 0.2 writes it (jobs/claim.py PLAIN_CLAIM_CALL of that release).
        cur.execute("SELECT id FROM accs_claim_plain(%s::bigint[], '{1}'::int[], '{0}'::int[], '{0}'::int[],"
                    " '{accs_resize}'::text[], 'old-node', 'old-agent', 1, 'agent:old-node', NULL, 5, 20, 8, 60,"
                    " '{}'::bigint[], '{}'::uuid[], 100, false)", [[svc.id]])
        ids = [r[0] for r in cur.fetchall() if r[0] is not None]
    assert [Task.objects.get(pk=i).tenant_id for i in ids] == [tenants.globex.id]


def test_a_pause_names_what_is_wrong_with_its_input(tenants):
    with pytest.raises(DefinitionError, match="say why the tenant is paused"):
        governor.pause_tenant(tenants.acme, reason=" \n", by="alice")
    with pytest.raises(DefinitionError, match="unknown tenant 'nope'"):
        governor.pause_tenant("nope", reason="x", by="alice")
    with pytest.raises(DefinitionError, match="expires_at"):
        governor.pause_tenant(tenants.acme, reason="x", by="alice", expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(DefinitionError, match="at most 500 characters"):
        governor.pause_tenant(tenants.acme, reason="x" * 501, by="alice")
    assert governor.active_conditions() == set()


def test_a_condition_named_like_a_pause_by_hand_never_breaks_the_claim(make_service, tenants):
    svc = make_service("resize")
    api.start_service("resize", tenant=tenants.acme)
    governor.raise_condition("tenant-pause-not-a-uuid", reason="typed by hand", by="alice")
    assert governor.paused_tenant_id("tenant-pause-not-a-uuid") is None
    assert len(claim_for(svc, 5)) == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reason=st.text(max_size=520), minutes=st.one_of(st.none(), st.integers(min_value=-5, max_value=10**6)))
def test_any_reason_and_expiry_is_stored_as_given_or_refused_naming_the_field(tenants, reason, minutes):
    now = timezone.now()
    expires = None if minutes is None else now + timedelta(minutes=minutes)
    text = reason.strip()
    valid_reason = bool(text) and len(text) <= governor.MAX_REASON and "\x00" not in text and not any(
        0xD800 <= ord(ch) <= 0xDFFF for ch in text)
    valid = valid_reason and (expires is None or expires > now)
    try:
        governor.pause_tenant(tenants.acme, reason=reason, by="alice", expires_at=expires, now=now)
    except DefinitionError as exc:
        assert not valid, exc
        assert {p.where for p in exc.problems} <= {"reason", "expires_at"}
        return
    assert valid
    row = GovernorCondition.objects.get(name=governor.tenant_pause_name(tenants.acme.pk))
    assert (row.reason, row.expires_at, row.raised_by) == (text, expires, "alice")
    assert row.holds(now) and governor.resume_tenant(tenants.acme, by="alice")


# --------------------------------------------------------------------------------------------
# The admin: who may pause which tenant
# --------------------------------------------------------------------------------------------

def _operator(username: str, roles: dict) -> Client:
    user = make_user(username, tenants=roles)
    user.user_permissions.add(*Permission.objects.filter(codename__in=["view_tenant", "change_tenant"]))
    browser = Client()
    browser.force_login(user)
    return browser


def _pause(browser: Client, tenant, reason: str = "invoice dispute"):
    return browser.post(reverse("admin:tenants_tenant_changelist"),
                        {"action": "pause_tenants", "_selected_action": [tenant.pk], "apply": "1", "reason": reason},
                        follow=True)


def test_the_admin_action_asks_a_reason_then_pauses_and_shows_it_everywhere(root, client, tenants, make_service):
    make_service("resize")
    api.start_service("resize", tenant=tenants.acme)
    changelist = reverse("admin:tenants_tenant_changelist")
    asked = client.post(changelist, {"action": "pause_tenants", "_selected_action": [tenants.acme.pk]})
    assert asked.status_code == 200 and b'name="reason"' in asked.content, "the action asks why first"
    blank = client.post(changelist, {"action": "pause_tenants", "_selected_action": [tenants.acme.pk],
                                     "apply": "1", "reason": ""})
    assert blank.status_code == 200 and governor.active_conditions() == set(), "no reason, no pause"
    done = client.post(changelist, {"action": "pause_tenants", "_selected_action": [tenants.acme.pk], "apply": "1",
                                    "reason": "invoice dispute", "minutes": "90"}, follow=True)
    page = done.content.decode()
    assert "Pause: tenant acme paused until" in page and ": invoice dispute" in page, page[-3000:]
    assert "paused</span> by root" in page, "the list shows who paused it"

    data = client.get(reverse("ops:dashboard_data")).json()["data"]
    assert [(p["tenant"], p["reason"], p["raised_by"]) for p in data["paused_tenants"]] == [
        ("acme", "invoice dispute", "root")]
    stuck = [r for r in data["stuck"] if r["reason"] == "paused"]
    assert [r["message"] for r in stuck] == ["1 task queued for 'resize' of tenant acme, which is paused"], stuck
    dashboard = client.get(reverse("ops:dashboard")).content.decode()
    assert 'data-paused-tenant="acme"' in dashboard and 'data-resume-tenant="acme"' in dashboard
    metrics = client.get("/metrics").content.decode()
    assert re.search(r'^accs_tenant_paused\{tenant="acme"\} 1\.0$', metrics, re.M), metrics[-2000:]
    lines = status_lines(overview(), took=0.01)
    assert any(line.startswith("acme: paused by root") and line.endswith(": invoice dispute") for line in lines)
    timeline = system_timeline(since=timezone.now() - timedelta(hours=1), until=timezone.now())
    assert [(e.kind, e.text) for e in timeline] == [("pause", "tenant acme paused by root: invoice dispute")]

    client.post(changelist, {"action": "resume_tenants", "_selected_action": [tenants.acme.pk]})
    assert governor.active_conditions() == set()
    metrics = client.get("/metrics").content.decode()
    assert re.search(r'^accs_tenant_paused\{tenant="acme"\} 0\.0$', metrics, re.M)
    timeline = system_timeline(since=timezone.now() - timedelta(hours=1), until=timezone.now())
    # (One test transaction: PostgreSQL's now() is the same instant for the pause and the resume.)
    assert [e.text for e in timeline if e.kind == "resume"] == ["tenant acme resumed after 0 ms"], timeline


def test_a_tenant_admin_pauses_their_own_tenant_and_no_other(tenants):
    alice = _operator("alice", {tenants.acme: "admin", tenants.globex: "viewer"})
    refused = _pause(alice, tenants.globex).content.decode()
    assert "only tenants you are an admin of" in refused, refused[-2000:]
    assert governor.active_conditions() == set(), "a viewer of globex cannot pause it"
    _pause(alice, tenants.acme)
    assert governor.active_conditions() == {governor.tenant_pause_name(tenants.acme.pk)}


def test_an_operator_of_another_tenant_cannot_pause_or_resume_it_even_with_a_forged_selection(tenants):
    governor.pause_tenant(tenants.globex, reason="audit", by="root")
    bob = _operator("bob", {tenants.acme: "admin"})
    _pause(bob, tenants.globex, reason="mine now")
    bob.post(reverse("admin:tenants_tenant_changelist"),
             {"action": "resume_tenants", "_selected_action": [tenants.globex.pk]})
    row = GovernorCondition.objects.get(name=governor.tenant_pause_name(tenants.globex.pk))
    assert (row.holds(), row.reason, row.raised_by) == (True, "audit", "root")
    dashboard = bob.get(reverse("ops:dashboard")).content.decode()
    assert "data-paused-tenant" not in dashboard, "another tenant's pause is not shown to bob"


def test_staff_without_the_change_permission_are_not_offered_the_action(tenants):
    carol = make_user("carol", tenants={tenants.acme: "admin"})
    carol.user_permissions.add(Permission.objects.get(codename="view_tenant"))
    browser = Client()
    browser.force_login(carol)
    page = browser.get(reverse("admin:tenants_tenant_changelist")).content.decode()
    assert "pause_tenants" not in page
    _pause(browser, tenants.acme)
    assert governor.active_conditions() == set()
