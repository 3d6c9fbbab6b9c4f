"""The operators' dashboard inside the admin: a page and the JSON it refreshes itself from.

``/admin/dashboard/`` renders :func:`ops.overview.overview` for the viewer's tenants (all of
them for superusers); ``/admin/dashboard/data.json`` returns the same figures plus the rendered
body, which the page fetches every few seconds. Both are routed by :mod:`ops.urls` (which the site
includes under ``admin/``) through ``admin.site.admin_view``, so they need a staff login like every admin page.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.http import urlencode

from accs_site.conf import accs
from jobs.models import RetentionMark
from jobs.retention import MARK_NAME
from ops.charts import chart_data, chart_rows, chart_span
from ops.overview import FAILED_WINDOW, Overview, group_by_tenant, overview
from ops.rates import rates
from ops.system_timeline import system_timeline
from ops.timerange import ALL_ONCE, current_range, picker
from tenants.scoping import tenant_ids_for

#: Seconds between refreshes of the dashboard page.
REFRESH_SECONDS = 5
#: The range the dashboard's charts and rates cover until the operator picks one (ops.timerange).
DASHBOARD_RANGE = "6h"


def query_int(request: HttpRequest, name: str, *, default: int, low: int, high: int) -> int:
    """Return the whole number ``?name=N`` clamped to ``low``..``high``, or ``default`` when absent or not one."""
    try:
        return min(high, max(low, int(request.GET.get(name, default))))
    except ValueError:
        return default


def refresh_seconds(request: HttpRequest, default: int = REFRESH_SECONDS) -> int:
    """Return a self-refreshing page's interval: ``?refresh=N`` (1-300 s) or ``default``."""
    return query_int(request, "refresh", default=default, low=1, high=300)


def sees_infrastructure(user) -> bool:
    """Whether the viewer may see nodes, disks and governor conditions (shared by every tenant)."""
    return user.is_superuser or user.has_perm("nodes.view_node")


def resumable_tenants(user, tenant_ids: list[str]) -> set[str]:
    """Return which of the paused ``tenant_ids`` the viewer may resume (the tenants admin's own rule:
    the ``tenants.change_tenant`` permission and the admin role in the tenant)."""
    if not tenant_ids or not user.has_perm("tenants.change_tenant"):
        return set()
    allowed = tenant_ids_for(user, write=True)
    return set(tenant_ids) if allowed is None else {t for t in tenant_ids if UUID(t) in allowed}


def list_links(*, tenant_id: str = "", now: datetime) -> dict[str, str]:
    """Return the admin list each figure links to, filtered the way the figure counts.

    The parameters are those of the jobs and tasks lists' filters (``status__exact``,
    ``approval_state__exact``, ``tenant``) plus plain field lookups for what a filter cannot say
    (several statuses, retries, the failure window).
    """
    jobs, tasks = reverse("admin:jobs_job_changelist"), reverse("admin:jobs_task_changelist")
    scope = {"tenant": tenant_id} if tenant_id else {}

    def url(base: str, **params: str) -> str:
        # A card counts what is there now, whatever its age: its list opens on every time, not on the
        # range the charts were last looked at over (ops.timerange remembers that one for the lists).
        return f"{base}?{urlencode({**params, **scope, 'range': ALL_ONCE})}"

    return {
        "jobs": url(jobs),
        "jobs_queued": url(jobs, status__exact="queued"),
        "awaiting_approval": url(jobs, status__exact="queued", approval_state__exact="pending"),
        "jobs_waiting": url(jobs, status__exact="waiting"),
        "jobs_running": url(jobs, status__exact="running"),
        "jobs_in_flight": url(jobs, status__in="waiting,running"),
        "failed_24h": url(jobs, status__exact="error", finished_at__gte=(now - FAILED_WINDOW).isoformat()),
        "waiting": url(tasks, status__exact="waiting"),
        "queued": url(tasks, status__in="queued,scheduled"),
        "running": url(tasks, status__in="starting,running"),
        "retrying": url(tasks, status__in="queued,scheduled", attempt__gt="0"),
        "dead_letter": url(tasks, status__exact="error"),
    }


def build(request: HttpRequest) -> tuple[Overview, dict[str, Any]]:
    """Collect the figures for this viewer and the template context around them."""
    data = overview(tenant_ids=tenant_ids_for(request.user), include_infra=sees_infrastructure(request.user))
    by_tenant = group_by_tenant(data.services)
    stages = ("waiting", "queued", "running", "dead_letter")
    context = {
        "ov": data,
        "links": list_links(now=data.generated_at),
        "tenant_rows": [
            {"card": card, "links": list_links(tenant_id=card.tenant_id, now=data.generated_at),
             "total": sum(getattr(card, s) for s in stages), "parts": [(s, getattr(card, s)) for s in stages]}
            for card in data.tenants
        ],
        "by_tenant": by_tenant,
        "infra": sees_infrastructure(request.user),
        "resumable_tenants": resumable_tenants(request.user, [p.tenant_id for p in data.paused_tenants]),
        "refresh_seconds": refresh_seconds(request),
    }
    chosen = current_range(request, default=DASHBOARD_RANGE, now=data.generated_at)
    since, until = chosen.bounded(now=data.generated_at)
    span, bucket = chart_span(since, until)
    charts = chart_data(tenant_ids=tenant_ids_for(request.user), now=until, span=span, bucket=bucket)
    window = rates(since=since, until=until, tenant_ids=tenant_ids_for(request.user), range_params=chosen.params())
    context.update(charts=charts, chart_rows=chart_rows(charts), rates=window, time_range=chosen,
                   picker=picker(request, chosen, path=reverse("ops:dashboard")))
    if context["infra"]:
        context["retention"] = last_prune(now=data.generated_at)
        # The chosen range (the charts'), so an outage shows where its bars dip.
        context.update(system_events=system_timeline(since=since, until=until), system_window=chosen.label)
    return data, context


def last_prune(*, now: datetime) -> dict[str, Any]:
    """Return what retention last pruned (its one row, jobs.retention's mark) and the retention periods."""
    mark = RetentionMark.objects.filter(name=MARK_NAME).first()
    return {"mark": mark, "ago": (now - mark.last_pruned_at).total_seconds() if mark else None,
            "days": accs.retention_days, "dead_days": accs.retention_dead_days}


def dashboard_view(request: HttpRequest) -> HttpResponse:
    """Render the dashboard page (the body refreshes itself from :func:`dashboard_data_view`)."""
    _data, context = build(request)
    context.update(admin.site.each_context(request), title="Operations dashboard")
    return TemplateResponse(request, "admin/accs/dashboard.html", context)


def dashboard_data_view(request: HttpRequest) -> JsonResponse:
    """Return the dashboard's figures as JSON, with the rendered body for the page's refresh."""
    data, context = build(request)
    html = render_to_string("admin/accs/_dashboard_body.html", context, request=request)
    window = context["rates"]
    figures = {**data.as_json(), "time_range": context["time_range"].params(),
               "rates": {"since": window.since.isoformat(), "until": window.until.isoformat(),
                         "partial": window.partial, "nodes": [r.as_json() for r in window.nodes],
                         "services": [r.as_json() for r in window.services]}}
    return JsonResponse({"generated_at": data.generated_at.isoformat(), "html": html, "data": figures})
