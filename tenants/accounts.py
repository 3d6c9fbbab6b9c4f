"""Tenants, memberships and API tokens, scripted: what the admin does, as functions commands call.

Each function validates its input and raises :class:`AccountError` with a sentence naming the
problem, so ``manage.py accs_tenant`` / ``accs_member`` / ``accs_token`` stay thin.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone
from django.utils.text import slugify

from tenants.models import ApiToken, Tenant, TenantMembership, TenantRole
from tenants.tokens import PREFIX_CHARS, TOKEN_PREFIX, create_token, parse_scopes

DURATION_RE = re.compile(r"^(\d+)([smhdw])$")
UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


class AccountError(ValueError):
    """Input that cannot be applied; the message says what is wrong."""


def parse_duration(text: str) -> timedelta:
    """Parse ``90d``, ``12h``, ``30m``, ``2w`` or ``45s`` into a timedelta."""
    found = DURATION_RE.match(text.strip())
    if not found or int(found.group(1)) == 0:
        raise AccountError(f"expected a duration such as 90d, 12h, 30m or 2w, got {text!r}")
    return timedelta(**{UNITS[found.group(2)]: int(found.group(1))})


def create_tenant(slug: str, *, name: str = "", tz: str = "UTC", max_in_flight: int | None = None,
                  min_priority: int | None = None, max_priority: int | None = None) -> tuple[Tenant, bool]:
    """Create a tenant, or update the name/zone/limits of an existing one; return it and whether it is new.

    A limit left as None keeps an existing tenant's value, and gives a new one the default
    (``ACC_TENANT_MAX_IN_FLIGHT``; the widest priority band).
    """
    if slugify(slug) != slug or not slug or len(slug) > 100:
        raise AccountError(f"a tenant slug is 1-100 lower-case letters, digits, '-' or '_', got {slug!r}")
    try:
        ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise AccountError(f"unknown time zone {tz!r}; use an IANA name such as Europe/Oslo") from None
    if max_in_flight is not None and max_in_flight < 0:
        raise AccountError("max in flight must be 0 (unlimited) or more")
    limits = {k: v for k, v in (("max_in_flight", max_in_flight), ("min_priority", min_priority),
                                ("max_priority", max_priority)) if v is not None}
    current: dict[str, Any] = dict(
        Tenant.objects.filter(slug=slug).values("min_priority", "max_priority").first() or {})
    low = limits.get("min_priority", current.get("min_priority", Tenant._meta.get_field("min_priority").default))
    high = limits.get("max_priority", current.get("max_priority", Tenant._meta.get_field("max_priority").default))
    if low > high:
        raise AccountError(f"the priority band is empty: min priority {low} is above max priority {high}")
    return Tenant.objects.update_or_create(slug=slug, defaults={"name": name or slug, "timezone": tz, **limits})


def user_id_named(username: str) -> int | None:
    """Return the id of the user called ``username``, or None when there is none."""
    user_model = get_user_model()
    return (user_model._default_manager.filter(**{user_model.USERNAME_FIELD: username})
            .values_list("pk", flat=True).first()) if username else None


def _user(username: str):
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise AccountError(f"no user {username!r}; create it first (manage.py createsuperuser or the admin)")
    return user


def _tenant(slug: str) -> Tenant:
    tenant = Tenant.objects.filter(slug=slug).first()
    if tenant is None:
        raise AccountError(f"no tenant {slug!r}; create it with manage.py accs_tenant create {slug}")
    return tenant


def add_member(username: str, tenant_slug: str, *, role: str = TenantRole.ADMIN) -> TenantMembership:
    """Give a user a role in a tenant (admin acts, viewer reads); an existing membership changes role.

    Tenant admins use the Django admin too, so the user is made staff.
    """
    if role not in TenantRole.values:
        raise AccountError(f"role must be one of {', '.join(TenantRole.values)}, got {role!r}")
    user, tenant = _user(username), _tenant(tenant_slug)
    with transaction.atomic():
        membership, _ = TenantMembership.objects.update_or_create(user=user, tenant=tenant, defaults={"role": role})
        if not user.is_staff:
            type(user).objects.filter(pk=user.pk).update(is_staff=True)
    return membership


def remove_member(username: str, tenant_slug: str) -> bool:
    """Remove a user's membership; False when there was none."""
    deleted, _ = TenantMembership.objects.filter(user=_user(username), tenant=_tenant(tenant_slug)).delete()
    return bool(deleted)


def issue_token(username: str, name: str, *, expires_at: datetime | None = None,
                scopes: list[str] | str | None = None) -> tuple[ApiToken, str]:
    """Create an API token for an active user; return the row and the raw token (shown once).

    ``scopes`` (names or text separated by commas) default to all but ``definitions``, which only a
    superuser's token may have.
    """
    user = _user(username)
    if not user.is_active:
        raise AccountError(f"user {username!r} is not active")
    if not name.strip() or len(name) > 100:
        raise AccountError("a token name is 1-100 characters")
    if expires_at is not None and expires_at <= timezone.now():
        raise AccountError("the expiry must be in the future")
    try:
        chosen = parse_scopes(scopes) if scopes is not None else None
    except ValueError as exc:
        raise AccountError(str(exc)) from None
    if chosen and "definitions" in chosen and not user.is_superuser:
        raise AccountError(f"the definitions scope is for superusers' tokens; {username!r} is not a superuser")
    return create_token(user, name.strip(), expires_at=expires_at, scopes=chosen)


def full_prefix(given: str) -> str:
    """Return the stored prefix a ``--prefix`` names: its first 12 characters, which must all be given.

    A shorter text (``accs_``) would match every token of every user.
    """
    given = given.strip()
    if len(given) < PREFIX_CHARS or not given.startswith(TOKEN_PREFIX):
        raise AccountError(f"a token prefix is the first {PREFIX_CHARS} characters of the token, as "
                           f"'accs_token list' shows them (e.g. accs_AbC123x), got {given!r}")
    return given[:PREFIX_CHARS]


def revoke_tokens(*, prefix: str | None = None, username: str | None = None, name: str | None = None) -> int:
    """Revoke the unrevoked tokens matching a prefix, or a user (and name); return how many."""
    if not prefix and not username:
        raise AccountError("say which tokens: a prefix (accs_...) or a user")
    tokens = ApiToken.objects.filter(revoked_at__isnull=True)
    if prefix:
        tokens = tokens.filter(prefix=full_prefix(prefix))
    if username:
        tokens = tokens.filter(user=_user(username))
    if name:
        tokens = tokens.filter(name=name)
    return tokens.update(revoked_at=timezone.now())
