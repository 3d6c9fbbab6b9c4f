"""The HTTP API under /api/v1/ (django-ninja; OpenAPI at /api/v1/openapi.json).

Every endpoint needs ``Authorization: Bearer <token>`` (see :mod:`tenants.auth`) unless it says
``auth=None``; a staff user signed in to the admin may instead use the API from that browser
(the session cookie, and the ``X-CSRFToken`` header on POST, PATCH and DELETE), scoped to their
tenants. Errors are JSON ``{"detail": ..., "problems": [...]}`` with 400 (unreadable or
unstorable input), 401 (no or bad token), 403 (not allowed), 404 (not found or not visible to
you), 405 (method not allowed), 409 (conflict: state or dedupe key), 413 (body over the size
limit, which the message names), 422 (invalid fields, each named), 429 (too many requests with
this token in the current window; ``Retry-After`` says when to come back) or 503 (the database was
briefly unavailable or chose this request as a deadlock victim: nothing was written, retry).
Swagger UI at /api/v1/docs.
"""

from __future__ import annotations

import json
from typing import Any

from django.apps import apps as django_apps
from django.core.exceptions import PermissionDenied, ValidationError as DjangoValidationError
from django.db import DataError, IntegrityError, OperationalError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from ninja import Field, NinjaAPI, Schema, Status, Swagger
from ninja.errors import Throttled, ValidationError as NinjaValidationError
from ninja.openapi.docs import _csrf_needed

from accs_site.conf import accs
from accs_site.daemon import database_not_ready
from accs_site.http import MarkdownDescriptions
from accs_site.middleware import transient_api_response
from jobs.api import JobConflict, NotFound
from jobs.http import router as jobs_router
from jobs.http_events import router as events_router
from tenants.auth import BearerToken, StaffSession
from tenants.throttle import TokenThrottle
from workflows.http import router as workflows_router
from workflows.validation import DefinitionError


class BundledSwagger(Swagger):
    """Swagger UI from django-ninja's bundled files whenever its templates are installed.

    django-ninja serves its bundled copy only when the literal ``"ninja"`` is in ``INSTALLED_APPS``
    and the CDN's otherwise; :class:`accs_site.ninja_assets.NinjaAssetsConfig` installs the same
    templates and static files under the label ``ninja`` (without importing django-ninja at every
    process start), so the label is what decides here.
    """

    def render_page(self, request: HttpRequest, api: NinjaAPI, **kwargs: Any) -> HttpResponse:
        if "ninja" not in {config.label for config in django_apps.get_app_configs()}:
            return super().render_page(request, api, **kwargs)  # the CDN's copy, as django-ninja does
        self.settings["url"] = self.get_openapi_url(api, kwargs)
        context = {"swagger_settings": json.dumps(self.settings, indent=1), "api": api,
                   "add_csrf": _csrf_needed(api)}
        return render(request, self.template, context)


# Swagger UI at /api/v1/docs comes from django-ninja's bundled files (its templates and static files
# are installed, see BundledSwagger), so the page works without network access; no online validator
# badge calls out either.
api = MarkdownDescriptions(title="ACCS API", version="1.0.0", urls_namespace="api-v1",
                           auth=[BearerToken(), StaffSession()], throttle=TokenThrottle(),
                           description=__doc__.split("\n\n", 1)[1],
                           docs=BundledSwagger(settings={"validatorUrl": None}))


@api.get("/health", auth=None, summary="Liveness probe")
def health(request) -> dict:
    return {"status": "ok"}


class Readiness(Schema):
    status: str = Field(description='"ready", or "not ready" with the reason in detail')
    detail: str | None = None


@api.get("/ready", auth=None, response={200: Readiness, 503: Readiness},
         summary="Readiness probe: the database answers and has every migration")
def ready(request, response: HttpResponse):
    """Answer 200 when this process can serve (PostgreSQL answers, no ACCS migration missing), else 503 saying why.

    ``/health`` says the process is alive; a load balancer sends traffic only where ``/ready`` is 200.
    """
    problem = database_not_ready()
    if problem is not None:
        response["Retry-After"] = "5"
        return Status(503, Readiness(status="not ready", detail=problem))
    return Status(200, Readiness(status="ready"))


api.add_router("/jobs", jobs_router)
api.add_router("/events", events_router)
api.add_router("/", workflows_router)


def _error(request: HttpRequest, status: int, detail: str, **extra) -> HttpResponse:
    return api.create_response(request, {"detail": detail, **extra}, status=status)


@api.exception_handler(DefinitionError)
def _definition_error(request: HttpRequest, exc: DefinitionError) -> HttpResponse:
    problems = [str(p) for p in exc.problems]
    return _error(request, 422, "; ".join(problems) or "invalid", problems=problems)


@api.exception_handler(DjangoValidationError)
def _django_validation_error(request: HttpRequest, exc: DjangoValidationError) -> HttpResponse:
    problems = [str(m) for m in exc.messages]
    return _error(request, 422, "; ".join(problems) or "invalid", problems=problems)


@api.exception_handler(NinjaValidationError)
def _validation_error(request: HttpRequest, exc: NinjaValidationError) -> HttpResponse:
    # Pydantic's error dicts may carry exception objects in "ctx"; keep the readable parts only.
    problems = []
    for err in exc.errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        problems.append(f"{where or 'request'}: {err.get('msg', 'invalid')}")
    return _error(request, 422, "; ".join(problems) or "invalid request", problems=problems)


@api.exception_handler(Throttled)
def _throttled(request: HttpRequest, exc: Throttled) -> HttpResponse:
    return _error(request, 429, f"too many requests with this token: at most {accs.api_rate_limit} per "
                                f"{accs.api_rate_window_sec} s (ACC_API_RATE_LIMIT); "
                                "retry after the Retry-After seconds")


@api.exception_handler(NotFound)
def _not_found(request: HttpRequest, exc: NotFound) -> HttpResponse:
    return _error(request, 404, str(exc))


@api.exception_handler(JobConflict)
def _conflict(request: HttpRequest, exc: JobConflict) -> HttpResponse:
    return _error(request, 409, str(exc), job_id=str(exc.job_id))


@api.exception_handler(PermissionDenied)
def _forbidden(request: HttpRequest, exc: PermissionDenied) -> HttpResponse:
    return _error(request, 403, str(exc) or "forbidden")


@api.exception_handler(DataError)
def _data_error(request: HttpRequest, exc: DataError) -> HttpResponse:
    # Input the database cannot store (caught by validation first; this is the safety net).
    return _error(request, 400, f"value not storable: {str(exc).splitlines()[0][:300]}")


@api.exception_handler(IntegrityError)
def _integrity_error(request: HttpRequest, exc: IntegrityError) -> HttpResponse:
    # A concurrent request created the same thing first (unique constraints decide races).
    return _error(request, 409, f"conflicts with existing data: {str(exc).splitlines()[0][:300]}")


@api.exception_handler(OperationalError)
def _transient_error(request: HttpRequest, exc: OperationalError) -> HttpResponse:
    # A deadlock victim, a serialization failure or a lost connection: nothing was committed,
    # and the same request may well succeed in a moment.
    return transient_api_response(request, exc)
