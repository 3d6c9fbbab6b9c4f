"""API tokens: creating them, and finding the valid token a raw one names. Only a token's SHA-256 digest is stored.

A token is shown once, when it is created (``manage.py create_api_token USER NAME``); it reads
``accs_<random>`` and its first characters are kept as ``prefix`` so operators can recognise it.
Each token has scopes (:class:`tenants.models.TokenScope`): an endpoint needs its scope on top of
what the token's user may do; ``definitions`` is never given unless asked for.

Kept apart from the HTTP API's authentication classes (:mod:`tenants.auth`, django-ninja's): the
daemons and the commands that issue tokens load this module at every start, and need none of the
HTTP framework.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Q
from django.utils import timezone

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
