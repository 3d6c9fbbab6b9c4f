"""Helpers for HTTP API tests: users with tenant roles and bearer tokens, clients that send them."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.test import Client

from tenants.auth import create_token
from tenants.models import Tenant, TenantMembership, TokenScope


def user_with_token(username: str, *, superuser: bool = False, tenants: dict[Tenant, str] | None = None,
                    scopes: list[str] | None = None) -> tuple:
    """Create a user (superuser, or member of ``tenants`` with the given roles) and a token; return both.

    A superuser's token has every scope (definitions too) unless ``scopes`` says otherwise; other
    tokens get the default scopes.
    """
    model = get_user_model()
    # No password: tokens authenticate, and skipping the hasher keeps tests fast.
    user = (model.objects.create_superuser(username, f"{username}@example.test", None) if superuser
            else model.objects.create_user(username, f"{username}@example.test", None))
    for tenant, role in (tenants or {}).items():
        TenantMembership.objects.create(user=user, tenant=tenant, role=role)
    if scopes is None and superuser:
        scopes = list(TokenScope.values)
    return user, create_token(user, f"{username}-token", scopes=scopes)[1]


def client_for(token: str) -> Client:
    """Return a test client that authenticates every request with ``token``."""
    return Client(headers={"Authorization": f"Bearer {token}"})
