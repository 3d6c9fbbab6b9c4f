"""Error answers: JSON everywhere under ``/api/``, 503 for transient database errors, 413 for big bodies.

A deadlock victim, a serialization failure or a connection lost mid-request changed nothing (its
transaction rolled back) and is worth retrying; saying so (503 with ``Retry-After``) lets clients
and load balancers do the right thing. A request body over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` is a
413 naming the limit, not Django's 400 page. API clients get every error as ``{"detail": ...}``,
whoever produced it (an unknown URL, a method the endpoint does not take, a middleware's 400);
every other path keeps Django's pages, or a short text page for the cases above, except the 503:
there, a page in the admin's look says what is wrong and what to do. A database that is reachable
but misses a migration (a table or column that does not exist yet) is a 503 too, naming the
migration, rather than a 500.

The middleware answers for views and rewrites other error responses under ``/api/``;
:func:`server_error` (the site's ``handler500``) answers for errors raised anywhere else, such as
a session middleware that cannot reach the database.
"""

from __future__ import annotations

import json
import logging
import sys

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import InterfaceError, OperationalError, ProgrammingError
from django.http import HttpRequest, HttpResponse
from django.template import TemplateDoesNotExist
from django.template.loader import render_to_string

from accs_site.daemon import database_address, database_not_ready

log = logging.getLogger("accs.http")

API_PREFIX = "/api/"
# Headers an error answer keeps when it is rewritten as JSON.
KEPT_HEADERS = ("Allow", "Retry-After", "WWW-Authenticate")


def transient_reason(exc: BaseException) -> str:
    """Return the first line of a database error, for a message a person can read."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def is_api(request: HttpRequest) -> bool:
    """Return whether the request is for the HTTP API (its clients read JSON only)."""
    return request.path.startswith(API_PREFIX)


def error_response(request: HttpRequest, status: int, detail: str) -> HttpResponse:
    """Return an error answer: ``{"detail": ...}`` under ``/api/``, the text alone elsewhere."""
    if is_api(request):
        return HttpResponse(json.dumps({"detail": detail}), status=status, content_type="application/json")
    return HttpResponse(detail, status=status, content_type="text/plain; charset=utf-8")


#: Seconds a client (and the 503 page, which reloads itself) waits before trying again.
UNAVAILABLE_RETRY_AFTER = 5


def unavailable_page(*, detail: str, what_to_do: str) -> HttpResponse:
    """Return the 503 page in the admin's look: ``detail`` says what is wrong, ``what_to_do`` what to do.

    Rendered without the request, so no context processor reads a user, session or message from the
    database that just failed.
    """
    from django.contrib import admin

    try:
        html = render_to_string("accs_site/unavailable.html", {
            "title": "The database cannot answer", "detail": detail, "what_to_do": what_to_do,
            "retry_after": UNAVAILABLE_RETRY_AFTER, "site_header": admin.site.site_header,
            "site_title": admin.site.site_title,
        })
        response = HttpResponse(html, status=503, content_type="text/html; charset=utf-8")
    except TemplateDoesNotExist:  # a site that uses this middleware without installing the accs_site app
        response = HttpResponse(f"{detail}\n{what_to_do}\n", status=503, content_type="text/plain; charset=utf-8")
    response["Retry-After"] = str(UNAVAILABLE_RETRY_AFTER)
    return response


def transient_api_response(request: HttpRequest, exc: BaseException) -> HttpResponse:
    """The API's 503 for a database that cannot answer now (an outage, a restart, a pooler's retry
    window, a deadlock victim): nothing was committed and the same request may succeed in a moment.

    Logged once as a warning: an outage is an expected condition, not an error of the application,
    so Django's own "Service Unavailable" error line is not written for it.
    """
    reason = transient_reason(exc)
    log.warning("transient database error on %s: %s", request.path, reason)
    response = error_response(request, 503, f"database temporarily unavailable, retry: {reason}")
    response["Retry-After"] = "1"
    response._has_been_logged = True  # type: ignore[attr-defined]  # django.utils.log.log_response skips it
    return response


def _transient_response(request: HttpRequest, exc: BaseException) -> HttpResponse:
    if is_api(request):
        return transient_api_response(request, exc)
    reason = transient_reason(exc)
    log.warning("transient database error on %s: %s", request.path, reason)
    response = unavailable_page(detail=f"PostgreSQL at {database_address()} could not answer: {reason}",
                                what_to_do="Start PostgreSQL (or correct ACC_DB_URL) and reload; nothing was "
                                           "changed by this request.")
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


def not_migrated_reason(exc: BaseException) -> str | None:
    """Return why the database cannot serve ACCS when ``exc`` may come from a missing migration, else None.

    A table or column that does not exist is either a database behind the code or a bug; the
    schema check tells them apart (the migrations it finds unapplied).
    """
    if not isinstance(exc, ProgrammingError):
        return None
    return database_not_ready()


def _not_migrated_response(request: HttpRequest, reason: str) -> HttpResponse:
    log.error("database not ready on %s: %s", request.path, reason)
    if not is_api(request):
        return unavailable_page(detail=reason, what_to_do="Run `manage.py migrate` on this database, then reload.")
    response = error_response(request, 503, reason)
    response["Retry-After"] = str(UNAVAILABLE_RETRY_AFTER)
    return response


def _declared_length(request: HttpRequest) -> int | None:
    try:
        return int(request.META.get("CONTENT_LENGTH") or "")
    except ValueError:
        return None


def too_big_detail(request: HttpRequest) -> str:
    """Say that the body is over the limit, and what the limit is."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    size = _declared_length(request)
    sent = f" ({size:,} bytes)" if size is not None else ""
    mib = f"{limit / 2**20:.1f} MiB, " if limit >= 2**20 else ""
    return f"request body too large{sent}: the limit is {limit:,} bytes ({mib}DATA_UPLOAD_MAX_MEMORY_SIZE)"


def _too_big_response(request: HttpRequest) -> HttpResponse:
    log.warning("request body over the limit on %s (Content-Length %s)", request.path,
                request.META.get("CONTENT_LENGTH") or "unknown")
    return error_response(request, 413, too_big_detail(request))


def server_error(request: HttpRequest) -> HttpResponse:
    """The 500 handler: a transient database error anywhere (a middleware included) is a 503.

    Django calls it while handling the exception, so the exception is at hand. Under ``/api/``
    every other error is answered in JSON too.
    """
    exc = sys.exc_info()[1]
    if isinstance(exc, (OperationalError, InterfaceError)):
        return _transient_response(request, exc)
    if exc is not None and (reason := not_migrated_reason(exc)):
        return _not_migrated_response(request, reason)
    if is_api(request):
        return error_response(request, 500, "internal error")
    from django.views.defaults import server_error as django_server_error

    return django_server_error(request)


def _is_json(response: HttpResponse) -> bool:
    return "json" in response.get("Content-Type", "")


def _as_json(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    """Rewrite a non-JSON error answer under ``/api/`` as ``{"detail": ...}`` with the same status."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    size = _declared_length(request)
    if response.status_code == 400 and limit is not None and size is not None and size > limit:
        # Django answers an oversized body read outside a view (by a middleware) with a plain 400.
        return _too_big_response(request)
    status = response.status_code
    detail = (response.reason_phrase or "error").lower()
    if status == 404:
        detail = f"not found: {request.method} {request.path}"
    elif status == 405 and response.has_header("Allow"):
        detail = f"method {request.method} not allowed; allowed: {response['Allow']}"
    answer = error_response(request, status, detail)
    for header in KEPT_HEADERS:
        if response.has_header(header):
            answer[header] = response[header]
    return answer


class ErrorResponseMiddleware:
    """Answer transient database errors with 503 and oversized bodies with 413; JSON under ``/api/``.

    Placed first in ``MIDDLEWARE``, it sees every response, so an error produced by Django or
    another middleware under ``/api/`` is rewritten as JSON too.
    """

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if response.status_code >= 400 and is_api(request) and not _is_json(response):
            return _as_json(request, response)
        return response

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        if isinstance(exc, (OperationalError, InterfaceError)):
            return _transient_response(request, exc)
        if isinstance(exc, RequestDataTooBig):
            return _too_big_response(request)
        if reason := not_migrated_reason(exc):
            return _not_migrated_response(request, reason)
        return None
