"""Answer transient database errors with 503 instead of a 500 page.

A deadlock victim, a serialization failure or a connection lost mid-request changed nothing (its
transaction rolled back) and is worth retrying; saying so (503 with ``Retry-After``) lets clients
and load balancers do the right thing. API paths get JSON, every other path a short text page.
The middleware answers for views; :func:`server_error` (the site's ``handler500``) for errors
raised anywhere else, such as a session middleware that cannot reach the database.
"""

from __future__ import annotations

import json
import logging
import sys

from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse

log = logging.getLogger("accs.http")


def transient_reason(exc: BaseException) -> str:
    """Return the first line of a database error, for a message a person can read."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _transient_response(request: HttpRequest, exc: BaseException) -> HttpResponse:
    reason = transient_reason(exc)
    log.warning("transient database error on %s: %s", request.path, reason)
    detail = f"database temporarily unavailable, retry: {reason}"
    if request.path.startswith("/api/"):
        response = HttpResponse(json.dumps({"detail": detail}), status=503, content_type="application/json")
    else:
        response = HttpResponse(detail, status=503, content_type="text/plain; charset=utf-8")
    response["Retry-After"] = "1"
    return response


def server_error(request: HttpRequest) -> HttpResponse:
    """The 500 handler: a transient database error anywhere (a middleware included) is a 503.

    Django calls it while handling the exception, so the exception is at hand. Under ``/api/``
    every other error is answered in JSON too.
    """
    exc = sys.exc_info()[1]
    if isinstance(exc, (OperationalError, InterfaceError)):
        return _transient_response(request, exc)
    if request.path.startswith("/api/"):
        return HttpResponse(json.dumps({"detail": "internal error"}), status=500, content_type="application/json")
    from django.views.defaults import server_error as django_server_error

    return django_server_error(request)


class TransientDatabaseErrorMiddleware:
    """Turn OperationalError/InterfaceError raised by a view into a 503 answer."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        if not isinstance(exc, (OperationalError, InterfaceError)):
            return None
        return _transient_response(request, exc)
