"""Authentication of the HTTP API: bearer tokens (:mod:`tenants.tokens`) and the admin's session.

A staff user signed in to the admin may use the API from the same browser (:class:`StaffSession`,
the session cookie plus Django's CSRF token on every unsafe request). Scoping is the user's own,
as with a token: their tenant memberships, or everything for a superuser.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest
from ninja.security import APIKeyCookie, HttpBearer

# The token functions live in tenants.tokens; they stay importable from here, where they always were.
from tenants.tokens import (  # noqa: F401
    LAST_USED_RESOLUTION,
    PREFIX_CHARS,
    TOKEN_PREFIX,
    create_token,
    digest,
    parse_scopes,
    token_for,
    user_for_token,
)


class BearerToken(HttpBearer):
    """``Authorization: Bearer <token>``; the authenticated user becomes ``request.user``."""

    def authenticate(self, request: HttpRequest, token: str) -> Any | None:
        found = token_for(token.strip())
        if found is None:
            return None
        request.user = found.user
        # Read by accs_site.http.require_scope, which every endpoint calls.
        request.token_scopes = frozenset(found.scopes)
        return found.user


class StaffSession(APIKeyCookie):
    """The admin's session cookie: an active staff user signed in to the admin becomes ``request.user``.

    Unsafe methods need Django's CSRF token (``X-CSRFToken``), as the admin's own forms do; a
    session has no token scopes, so the user's tenant memberships alone decide (as in the admin).
    """

    param_name = settings.SESSION_COOKIE_NAME

    def _get_key(self, request: HttpRequest) -> str | None:
        # The CSRF check belongs to a staff session only: a request that sends a token (valid or
        # not) or has no staff session is not authenticated by this, so it gets the API's 401
        # ("no or bad token"), never a 403 "CSRF check failed" that says nothing about the token.
        if "Authorization" in request.headers or _session_staff(request) is None:
            return None
        return super()._get_key(request)

    def authenticate(self, request: HttpRequest, key: str | None) -> Any | None:
        # No key: :meth:`_get_key` declined the request (so no CSRF check was made); never authenticate it.
        return _session_staff(request) if key is not None else None


def _session_staff(request: HttpRequest) -> Any | None:
    """Return the active staff user signed in to the admin in this request's session, or None."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and user.is_active and user.is_staff:
        return user
    return None
