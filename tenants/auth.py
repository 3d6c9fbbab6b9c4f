"""Bearer tokens for the HTTP API. Only a token's SHA-256 digest is stored.

A token is shown once, when it is created (``manage.py create_api_token USER NAME``); it reads
``accs_<random>`` and its first characters are kept as ``prefix`` so operators can recognise it.
Each token has scopes (:class:`tenants.models.TokenScope`): an endpoint needs its scope on top of
what the token's user may do; ``definitions`` is never given unless asked for.

A staff user signed in to the admin may use the API from the same browser (:class:`StaffSession`,
the session cookie plus Django's CSRF token on every unsafe request). Scoping is the user's own,
as with a token: their tenant memberships, or everything for a superuser.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.http import HttpRequest
from django.utils import timezone
from ninja.security import APIKeyCookie, HttpBearer

from tenants.models import ApiToken, TokenScope, default_token_scopes

TOKEN_PREFIX = "accs_"
PREFIX_CHARS = 12
# last_used_at is a hint for operators; writing it at most once a minute keeps a burst of requests
# with one token from queueing on the token's row.
LAST_USED_RESOLUTION = timedelta(minutes=1)


def digest(raw: str) -> str:
    """Return the hex SHA-256 of a raw token."""
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()


def parse_scopes(given: Any) -> list[str]:
    """Return the scopes named in ``given`` (a list, or text separated by commas), checked and sorted.

    Raise ValueError naming an unknown scope.
    """
    names = given.split(",") if isinstance(given, str) else list(given)
    scopes = sorted({str(name).strip() for name in names if str(name).strip()})
    unknown = [name for name in scopes if name not in TokenScope.values]
    if unknown:
        raise ValueError(f"unknown token scope(s) {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(TokenScope.values)}")
    if not scopes:
        raise ValueError(f"a token needs at least one scope ({', '.join(TokenScope.values)})")
    return scopes


def create_token(user: Any, name: str, *, expires_at: datetime | None = None,
                 scopes: list[str] | None = None) -> tuple[ApiToken, str]:
    """Create a token for ``user`` (valid until ``expires_at``, if given; with ``scopes``, default
    all but definitions); return the row and the raw token (shown once, never stored)."""
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    chosen = parse_scopes(scopes) if scopes is not None else default_token_scopes()
    token = ApiToken.objects.create(user=user, name=name, prefix=raw[:PREFIX_CHARS], digest=digest(raw),
                                    expires_at=expires_at, scopes=chosen)
    return token, raw


def user_for_token(raw: str) -> Any | None:
    """Return the active user a valid, unrevoked, unexpired token belongs to, or None."""
    token = token_for(raw)
    return token.user if token is not None else None


def token_for(raw: str) -> ApiToken | None:
    """Return the valid, unrevoked, unexpired token of an active user (with its user), or None."""
    if not raw or len(raw) > 200:
        return None
    now = timezone.now()
    token = (ApiToken.objects.select_related("user")
             .filter(digest=digest(raw), revoked_at__isnull=True, user__is_active=True)
             .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now)).first())
    if token is None:
        return None
    if token.last_used_at is None or now - token.last_used_at >= LAST_USED_RESOLUTION:
        (ApiToken.objects.filter(pk=token.pk)
         .filter(Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - LAST_USED_RESOLUTION))
         .update(last_used_at=now))
    return token


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
