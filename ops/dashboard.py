"""The operators' dashboard inside the admin (OPS2): a page and the JSON it refreshes itself from.

``/admin/dashboard/`` renders :func:`ops.overview.overview` for the viewer's tenants (all of
them for superusers); ``/admin/dashboard/data.json`` returns the same figures plus the rendered
body, which the page fetches every few seconds. Both are mounted on the admin site by
:mod:`events.admin`, so they need a staff login like every admin page.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string
from django.template.response import TemplateResponse

from ops.overview import Overview, group_by_tenant, overview
from jobs.scoping import tenant_ids_for

#: Seconds between refreshes of the dashboard page.
REFRESH_SECONDS = 5


def refresh_seconds(request: HttpRequest) -> int:
    """Return the refresh interval: ``?refresh=N`` (1-300 s) or :data:`REFRESH_SECONDS`."""
    try:
        return min(300, max(1, int(request.GET.get("refresh", REFRESH_SECONDS))))
    except ValueError:
        return REFRESH_SECONDS


def sees_infrastructure(user) -> bool:
    """Whether the viewer may see nodes, disks and governor conditions (shared by every tenant)."""
    return user.is_superuser or user.has_perm("nodes.view_node")


def build(request: HttpRequest) -> tuple[Overview, dict[str, Any]]:
    """Collect the figures for this viewer and the template context around them."""
    data = overview(tenant_ids=tenant_ids_for(request.user), include_infra=sees_infrastructure(request.user))
    by_tenant = group_by_tenant(data.services)
    stages = ("waiting", "queued", "running", "dead_letter")
    context = {
        "ov": data,
        "by_tenant": by_tenant,
        "bars": [
            {"tenant": card.tenant, "total": sum(getattr(card, s) for s in stages),
             "parts": [(s, getattr(card, s)) for s in stages]}
            for card in data.tenants
        ],
        "infra": sees_infrastructure(request.user),
        "refresh_seconds": refresh_seconds(request),
    }
    return data, context


def dashboard_view(request: HttpRequest) -> HttpResponse:
    """Render the dashboard page (the body refreshes itself from :func:`dashboard_data_view`)."""
    _data, context = build(request)
    context.update(admin.site.each_context(request), title="Operations dashboard")
    return TemplateResponse(request, "admin/accs/dashboard.html", context)


def dashboard_data_view(request: HttpRequest) -> JsonResponse:
    """Return the dashboard's figures as JSON, with the rendered body for the page's refresh."""
    data, context = build(request)
    html = render_to_string("admin/accs/_dashboard_body.html", context, request=request)
    return JsonResponse({"generated_at": data.generated_at.isoformat(), "html": html, "data": data.as_json()})
