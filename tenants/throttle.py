"""Throttling of the HTTP API per bearer token (per user for the admin's session), counted in
PostgreSQL so every web process shares it.

A fixed window per token or session user: ``ACC_API_RATE_LIMIT`` requests per ``ACC_API_RATE_WINDOW_SEC`` seconds
(0 turns it off). A request over the limit is answered 429 with ``Retry-After`` (the seconds left
in the window). One upsert per request, on the token's own row, so tokens never wait for each other.
"""

from __future__ import annotations

import threading

from django.db import connection
from django.http import HttpRequest
from ninja.throttling import BaseThrottle

from accs_site.conf import accs
from tenants.tokens import digest

COUNT_SQL = """
-- One row per token: the window it counts in and the requests made in it. A request in a new
-- window starts the count again. Times from PostgreSQL's clock, so every web process agrees.
INSERT INTO accs_api_throttle AS a (digest, window_start, hits)
VALUES (%(digest)s, to_timestamp(floor(extract(epoch FROM now()) / %(window)s) * %(window)s), 1)
ON CONFLICT (digest) DO UPDATE
   SET hits = CASE WHEN a.window_start = EXCLUDED.window_start THEN a.hits + 1 ELSE 1 END,
       window_start = EXCLUDED.window_start
RETURNING a.hits, extract(epoch FROM a.window_start + make_interval(secs => %(window)s) - now())
"""


def throttle_key(request: HttpRequest) -> str | None:
    """Return what a request is counted by: its bearer token's digest, or for the admin's session
    its user (every session and browser tab of a user shares one count); None for an unauthenticated request."""
    auth = getattr(request, "auth", None)
    if auth is None:
        return None
    scheme, _, raw = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and raw.strip():
        return digest(raw.strip())
    # A token digest is 64 hex characters; this key cannot be one.
    return f"session-user:{auth.pk}"


class TokenThrottle(BaseThrottle):
    """django-ninja throttle: at most ``ACC_API_RATE_LIMIT`` requests per window per bearer token."""

    def __init__(self) -> None:
        # One instance serves every thread; the wait belongs to the request that was refused.
        self._local = threading.local()

    def allow_request(self, request: HttpRequest) -> bool:
        limit, window = accs.api_rate_limit, accs.api_rate_window_sec
        # Runs after authentication: only an authenticated caller is counted, and an endpoint open
        # to all (the liveness probe) is never throttled.
        key = throttle_key(request)
        if limit <= 0 or key is None:
            return True
        with connection.cursor() as cur:
            cur.execute(COUNT_SQL, {"digest": key, "window": window})
            hits, left = cur.fetchone()
        self._local.wait = max(float(left), 1.0)
        return hits <= limit

    def wait(self) -> float | None:
        return getattr(self._local, "wait", None)
