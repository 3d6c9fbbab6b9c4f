"""Answer transient database errors with 503 instead of a 500 page.

A deadlock victim, a serialization failure or a connection lost mid-request changed nothing (its
transaction rolled back) and is worth retrying; saying so (503 with ``Retry-After``) lets clients
and load balancers do the right thing. API paths get JSON, every other path a short text page.
"""

from __future__ import annotations

import json
import logging

from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse

log = logging.getLogger("accs.http")


def transient_reason(exc: BaseException) -> str:
    """Return the first line of a database error, for a message a person can read."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


class TransientDatabaseErrorMiddleware:
    """Turn OperationalError/InterfaceError raised by a view into a 503 answer."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        if not isinstance(exc, (OperationalError, InterfaceError)):
            return None
        reason = transient_reason(exc)
        log.warning("transient database error on %s: %s", request.path, reason)
        detail = f"database temporarily unavailable, retry: {reason}"
        if request.path.startswith("/api/"):
            response = HttpResponse(json.dumps({"detail": detail}), status=503, content_type="application/json")
        else:
            response = HttpResponse(detail, status=503, content_type="text/plain; charset=utf-8")
        response["Retry-After"] = "1"
        return response
