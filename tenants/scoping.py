"""Tenant scoping: which tenants a user may see and act in. The HTTP API and the admin both
filter through these functions, so isolation has one definition."""

from __future__ import annotations

from uuid import UUID

from django.db.models import QuerySet

from tenants.models import TenantMembership, TenantRole


def tenant_ids_for(user, *, write: bool = False) -> set[UUID] | None:
    """Return the tenant ids ``user`` may read (or act in, with ``write``); None means every tenant.

    Superusers see all tenants. Other users see the tenants they are members of; acting needs the
    tenant-admin role. Anonymous or inactive users see nothing.
    """
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return set()
    if user.is_superuser:
        return None
    memberships = TenantMembership.objects.filter(user=user)
    if write:
        memberships = memberships.filter(role=TenantRole.ADMIN)
    return set(memberships.values_list("tenant_id", flat=True))


def scope(queryset: QuerySet, user, *, write: bool = False, field: str = "tenant_id") -> QuerySet:
    """Filter ``queryset`` (of a model with a tenant) to what ``user`` may see or act on."""
    allowed = tenant_ids_for(user, write=write)
    if allowed is None:
        return queryset
    return queryset.filter(**{f"{field}__in": allowed})


def can_act(user, tenant_id: UUID | None, *, write: bool = True) -> bool:
    """Return whether ``user`` may read (``write=False``) or act in one tenant."""
    allowed = tenant_ids_for(user, write=write)
    return allowed is None or tenant_id in allowed
