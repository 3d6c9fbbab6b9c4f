"""Helpers for the operators' tests (admin, dashboard, metrics, browser): users and job states."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.contrib.auth import get_user_model
from django.utils import timezone

from jobs import api
from jobs.models import Job
from nodes.models import DiskSample, Host, Node
from tenants.models import Tenant, TenantMembership
from tests.engine_helpers import claim_for, run_fail, run_ok
from workflows.api import create_workflow, save_service
from workflows.models import Service

PASSWORD = "correct horse battery staple"


def make_user(username: str, *, superuser: bool = False, staff: bool = True,
              tenants: dict[Tenant, str] | None = None):
    """Create a user with the given tenant roles (``{tenant: "admin" | "viewer"}``)."""
    User = get_user_model()
    if superuser:
        user = User.objects.create_superuser(username, f"{username}@example.test", PASSWORD)
    else:
        user = User.objects.create_user(username, f"{username}@example.test", PASSWORD, is_staff=staff)
    for tenant, role in (tenants or {}).items():
        TenantMembership.objects.create(user=user, tenant=tenant, role=role)
    return user


@dataclass
class Tenants:
    acme: Tenant
    globex: Tenant


def two_tenants() -> Tenants:
    return Tenants(Tenant.objects.create(slug="acme", name="Acme"), Tenant.objects.create(slug="globex", name="Globex"))


def _service(key: str, **fields):
    fields.setdefault("executor", "python")
    fields.setdefault("executor_config", {"callable": "tests.callables:noop"})
    fields.setdefault("params_schema", {"type": "object"})
    return save_service(key=key, **fields)


def failed_service_job(tenant: Tenant, *, key: str = "flaky") -> Job:
    """Return a one-task job whose task failed for good (max_attempts 1): a dead letter."""
    service = _service(key, max_attempts=1)
    job = api.start_service(key, tenant=tenant)
    run_fail(claim_for(service), error="exit 3: disk full on /srv")
    job.refresh_from_db()
    assert job.status == "error", job.status
    return job


@dataclass
class Scene:
    """A realistic state for the dashboard and the job page (and their screenshots)."""

    failed: Job
    other_tenant_job: Job
    running: Job


def pipeline_scene(tenants: Tenants) -> Scene:
    """Build a 'publish' pipeline with a fan-out step that failed on one host, plus live traffic."""
    node = Node.objects.create(name="node-t", labels={"zone": "eu"}, version="0.1.0", services=["fetch", "render"],
                               last_seen=timezone.now(), awake_state="awake")
    Node.objects.create(name="edge-2", version="0.1.0", last_seen=timezone.now() - timedelta(minutes=9),
                        awake_state="awake")
    Node.objects.create(name="gpu-3", version="0.1.0", state="draining", last_seen=timezone.now(), awake_state="awake")
    for name, pct, level in (("node-t", 61.0, "ok"), ("edge-2", 91.5, "critical"), ("gpu-3", 86.0, "warning")):
        DiskSample.objects.create(node_id=name, path="/srv", total_bytes=100 << 30, used_bytes=int(pct * (1 << 30)),
                                  used_pct=pct, level=level)
    hosts = [Host.objects.create(name=f"studio-{i}", node=node) for i in range(1, 5)]
    svc = {k: _service(k, **extra) for k, extra in (
        ("fetch", {}), ("render", {"max_attempts": 2, "backoff_base_seconds": 0, "backoff_cap_seconds": 0}),
        ("package", {}), ("notify", {}),
    )}
    create_workflow(name="publish", steps=[
        {"key": "fetch", "service": "fetch", "depends_on": []},
        {"key": "render", "service": "render", "depends_on": ["fetch"], "fan_out": "hosts"},
        {"key": "package", "service": "package", "depends_on": ["render"]},
        {"key": "notify", "service": "notify", "depends_on": ["package"]},
    ])
    failed = api.start_workflow("publish", tenant=tenants.acme, options={"hosts": [h.name for h in hosts]})
    run_ok(claim_for(svc["fetch"]))
    renders = claim_for(svc["render"])
    assert len(renders) == 4, renders
    run_ok(renders[:3])
    run_fail(renders[3:], error="render crashed: exit 137 (out of memory)")
    again = claim_for(svc["render"])  # no backoff configured: the retry is due at once
    assert len(again) == 1, again
    run_fail(again, error="render crashed: exit 137 (out of memory)")
    failed.refresh_from_db()
    assert failed.status == "error", failed.status
    # Traffic in both tenants: some done, some queued, one running.
    # (Acme's claimed before Globex's are queued: tenants take turns in a claim.)
    for _ in range(3):
        api.start_service("notify", tenant=tenants.acme)
    run_ok(claim_for(svc["notify"], n=2))
    for _ in range(3):
        api.start_service("notify", tenant=tenants.globex)
    running = api.start_service("package", tenant=tenants.acme)
    claim_for(svc["package"])
    other = failed_service_job(tenants.globex, key="globex-sync")
    api.raise_condition("live_session", reason="studio A is live", by="alice")
    return Scene(failed=failed, other_tenant_job=other, running=running)


__all__ = ["PASSWORD", "Scene", "Tenants", "failed_service_job", "make_user", "pipeline_scene", "two_tenants"]


def insert_done_tasks(cur, *, job_id, tenant_id, service_id, n: int = 20_000) -> None:
    """Insert ``n`` finished tasks of one job: history that the live-row queries must not read."""
    cur.execute(
        "INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, exclusive, status,"
        " depends_on, attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds, params,"
        " assigned_node, claimed_by, node, finished_at, error_code, error_message, created_at, updated_at)"
        " SELECT gen_random_uuid(), %s, %s, 'h' || g, 'h', %s, false, 'done', '{}', 1, 3, now(), 0, g, 600, '{}',"
        " '', '', '', now(), '', '', now(), now() FROM generate_series(1, %s) g",
        [job_id, tenant_id, service_id, n])


def signed_in_session(base: str, username: str):
    """Return a ``requests`` session signed in to the admin of the server at ``base`` (the login form, with CSRF)."""
    import requests

    http = requests.Session()
    http.get(f"{base}/admin/login/", timeout=30)
    answer = http.post(f"{base}/admin/login/", data={"username": username, "password": PASSWORD, "next": "/admin/",
                                                      "csrfmiddlewaretoken": http.cookies["csrftoken"]},
                       headers={"Referer": f"{base}/admin/login/"}, timeout=30)
    assert answer.status_code == 200 and "sessionid" in http.cookies, answer.text[:300]
    return http


def system_scene(*, now: datetime) -> dict[str, object]:
    """Record what the system timeline shows, in the hour before ``now``: an outage of 50.5 s, two
    leadership terms (the second on another release: a deploy) and a service paused then resumed."""
    from jobs.models import LeaderTerm, Outage
    from workflows import governor

    began = now - timedelta(minutes=30)
    outage = Outage.objects.create(began_at=began, ended_at=began + timedelta(seconds=50.5), cause="restart")
    LeaderTerm.objects.create(fence=41, holder="build-a:11:aa0001 0.1.0", acquired_at=now - timedelta(hours=2),
                              expires_at=now - timedelta(minutes=50))
    LeaderTerm.objects.create(fence=42, holder="build-b:12:bb0002 0.2.0", acquired_at=now - timedelta(minutes=40),
                              expires_at=now + timedelta(seconds=30))
    if not Service.objects.filter(key="render").exists():
        _service("render")
    governor.pause_service("render", reason="disk swap on the render farm", by="alice",
                           now=now - timedelta(minutes=20))
    governor.resume_service("render", by="bob", now=now - timedelta(minutes=10))
    return {"outage": outage}


def redrive_page(client, url: str, data: dict) -> str:
    """Confirm a redrive from the admin and read its page to the end (the batches run as it is sent)."""
    answer = client.post(url, {**data, "confirm": "1"})
    assert answer.status_code == 200 and answer.streaming, answer.status_code
    return b"".join(answer.streaming_content).decode()


def redrive_summary_of(page: str) -> str:
    """The summary line of a finished redrive's page."""
    found = re.search(r'id="accs-redrive-summary"[^>]*><b>([^<]*)</b>', page)
    assert found, page[-1500:]
    return found.group(1)
