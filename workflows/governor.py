"""The resource governor: named conditions that defer or re-prioritise services while they hold.

A condition such as ``live_session`` is raised (optionally until an expiry) and cleared from the
admin, the Python API (:func:`jobs.api.raise_condition`) or the ORM. While it holds:

* services whose ``block_during`` names it are not claimed (agents defer them);
* services whose ``priority_adjust_during`` names it get that priority change (e.g. ``-3``).

Pausing a service is raising its own condition, ``pause-<service key>`` (:func:`pause_service`,
:func:`resume_service`): it blocks that service as a condition in its ``block_during`` would, with
the same record of who raised it, when, why and until when, and the same event. Pausing a tenant
is raising ``tenant-pause-<tenant id>`` (:func:`pause_tenant`, :func:`resume_tenant`): the claim
itself (:data:`PAUSED_TENANTS_SQL`, read in :mod:`jobs.claim`'s statement) passes over that
tenant's queued tasks while it holds, so every agent honours it, agents of the previous release too.

This module is the one place that changes a condition; each change writes a ``governor`` event in
the same transaction. The builder calls :func:`expire_conditions` every tick; agents call
:func:`active_conditions` (cheap: the table holds a handful of rows) through
:func:`claim_adjustments` before claiming (the agent refreshes the set every couple of seconds).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any
from uuid import UUID

from django.db import connection, transaction
from django.utils import timezone

from accs_site.clock import db_now
from events.timeline import EventRow, operator_source, write_events
from tenants.models import Tenant
from workflows.models import GovernorCondition, Service
from workflows.validation import CONDITION_NAME_RE, DefinitionError, Problem

NAME_RE = CONDITION_NAME_RE

# "Holds" in SQL, the same rule as GovernorCondition.holds(): raised, not cleared since, not expired.
HOLDS_SQL = ("raised_at IS NOT NULL AND (cleared_at IS NULL OR cleared_at < raised_at)"
             " AND (expires_at IS NULL OR expires_at > %(now)s)")

RAISE_SQL = """
INSERT INTO accs_governor_condition (name, reason, raised_at, expires_at, cleared_at, raised_by)
VALUES (%(name)s, %(reason)s, %(now)s, %(expires)s, NULL, %(by)s)
-- Raising a condition that exists (held or not) re-arms it with the new reason and expiry.
ON CONFLICT (name) DO UPDATE
   SET reason = EXCLUDED.reason, raised_at = EXCLUDED.raised_at, expires_at = EXCLUDED.expires_at,
       cleared_at = NULL, raised_by = EXCLUDED.raised_by
RETURNING id
"""


def _event(message: str, *, level: str = "info", source: str, data: dict[str, Any]) -> EventRow:
    return EventRow(type="governor", message=message, level=level, source=source, data=data)


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise DefinitionError([Problem("name", "a condition name is 1-100 letters, digits, '-' or '_'")])
    return name


def raise_condition(name: str, *, reason: str, expires_at: datetime | None = None, by: str,
                    now: datetime | None = None, about: Mapping[str, Any] | None = None) -> GovernorCondition:
    """Raise (or re-arm) a condition until ``expires_at`` or until cleared; write a governor event.

    Works inside the caller's transaction. Raises DefinitionError for a bad name or an expiry that
    is naive or not in the future. ``about`` is added to the event's data (e.g. the tenant a pause
    is of).
    """
    _check_name(name)
    if expires_at is not None and timezone.is_naive(expires_at):
        raise DefinitionError([Problem("expires_at", "must be a timezone-aware time in the future")])
    with transaction.atomic(), connection.cursor() as cur:
        now = now or db_now(cur)
        if expires_at is not None and expires_at <= now:
            raise DefinitionError([Problem("expires_at", "must be a timezone-aware time in the future")])
        cur.execute("SELECT " + HOLDS_SQL + " FROM accs_governor_condition WHERE name = %(name)s FOR UPDATE",
                    {"name": name, "now": now})
        row = cur.fetchone()
        was_holding = bool(row and row[0])
        cur.execute(RAISE_SQL, {"name": name, "reason": reason or "", "now": now, "expires": expires_at,
                                "by": by or ""})
        until = f" until {expires_at.isoformat()}" if expires_at else " until cleared"
        verb = "re-raised" if was_holding else "raised"
        write_events([_event(f"governor condition {name} {verb} by {by or 'api'}{until}: {reason}".rstrip(": "),
                             level="warn", source=operator_source(by),
                             data={"condition": name, "to": "raised", "reason": reason,
                                   "expires_at": expires_at.isoformat() if expires_at else None,
                                   **(about or {})})], cursor=cur)
    return GovernorCondition.objects.get(name=name)


def clear_condition(name: str, by: str = "", *, now: datetime | None = None,
                    about: Mapping[str, Any] | None = None) -> bool:
    """Clear a holding condition; False (and nothing written) when it does not hold."""
    with transaction.atomic(), connection.cursor() as cur:
        now = now or db_now(cur)
        cur.execute("UPDATE accs_governor_condition SET cleared_at = %(now)s WHERE name = %(name)s AND " + HOLDS_SQL
                    + " RETURNING id", {"name": name, "now": now})
        if not cur.fetchone():
            return False
        write_events([_event(f"governor condition {name} cleared by {by or 'api'}",
                             source=operator_source(by), data={"condition": name, "to": "cleared", **(about or {})})],
                     cursor=cur)
    return True


def expire_conditions(now: datetime | None = None, *, limit: int = 100) -> list[str]:
    """Mark conditions whose expiry passed as cleared, with an event each (a builder duty). Return their names.

    Such a condition already stopped holding at ``expires_at``; this records that it ended, once.
    """
    with transaction.atomic(), connection.cursor() as cur:
        now = now or db_now(cur)
        # Served by governor_expires_idx; SKIP LOCKED lets a concurrent raise/clear win. Picked once
        # (MATERIALIZED), so no plan rescans the pick and clears more than the limit.
        cur.execute(
            "WITH picked AS MATERIALIZED (SELECT id FROM accs_governor_condition"
            "  WHERE expires_at <= %(now)s AND raised_at IS NOT NULL AND (cleared_at IS NULL OR cleared_at < raised_at)"
            "  ORDER BY expires_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED)"
            " UPDATE accs_governor_condition g SET cleared_at = greatest(g.expires_at, g.raised_at)"
            " FROM picked p WHERE g.id = p.id"
            " RETURNING g.name, g.expires_at",
            {"now": now, "limit": limit},
        )
        rows = sorted(cur.fetchall())
        write_events([_event(f"governor condition {name} expired", source="builder",
                             data={"condition": name, "to": "expired", "expires_at": expires.isoformat()})
                      for name, expires in rows], cursor=cur)
    return [name for name, _ in rows]


def active_conditions(now: datetime | None = None) -> set[str]:
    """Return the names of the conditions that hold now (one small query)."""
    with connection.cursor() as cur:
        cur.execute("SELECT name FROM accs_governor_condition WHERE "
                    + HOLDS_SQL.replace("%(now)s", "coalesce(%(now)s::timestamptz, now())"), {"now": now})
        return {r[0] for r in cur.fetchall()}


#: The condition that pauses a service is named this prefix and the service's key.
PAUSE_PREFIX = "pause-"


def pause_name(service_key: str) -> str:
    """Return the name of the condition that pauses ``service_key`` (DefinitionError if it cannot be one)."""
    name = PAUSE_PREFIX + service_key
    if not NAME_RE.match(name):
        raise DefinitionError([Problem("service", f"service {service_key!r} cannot be paused: its pause's condition "
                                                  f"name {name!r} is not 1-100 letters, digits, '-' or '_'")])
    return name


def paused_service_key(condition_name: str) -> str | None:
    """Return the service a condition pauses, or None for any other condition."""
    return condition_name[len(PAUSE_PREFIX):] if condition_name.startswith(PAUSE_PREFIX) else None


#: The longest reason a pause keeps (the admin's reason page asks no more).
MAX_REASON = 500


def _pause_reason(reason: Any, *, what: str) -> str:
    """Return a pause's reason stripped; DefinitionError naming what is wrong with it.

    A pause says why (it shows on the dashboard), in at most :data:`MAX_REASON` characters that the
    database can store (no NUL, no lone surrogate).
    """
    text = reason.strip() if isinstance(reason, str) else ""
    if not text:
        raise DefinitionError([Problem("reason", f"say why the {what} is paused (it shows on the dashboard)")])
    if len(text) > MAX_REASON:
        raise DefinitionError([Problem("reason", f"a pause's reason is at most {MAX_REASON} characters, "
                                                 f"not {len(text)}")])
    if "\x00" in text:
        raise DefinitionError([Problem("reason", "a pause's reason cannot hold a NUL character")])
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise DefinitionError([Problem("reason", "a pause's reason must be valid text (it holds a lone "
                                                 "surrogate)")]) from None
    return text


def pause_service(service_key: str, *, reason: str, by: str, expires_at: datetime | None = None,
                  now: datetime | None = None) -> GovernorCondition:
    """Pause a service until ``expires_at`` or until resumed: no agent claims its tasks meanwhile.

    Its queued tasks stay queued (running ones finish). Raises DefinitionError for an unknown
    service or a blank reason: a pause says why.
    """
    reason = _pause_reason(reason, what="service")
    if not Service.objects.filter(key=service_key).exists():
        raise DefinitionError([Problem("service", f"unknown service {service_key!r}")])
    return raise_condition(pause_name(service_key), reason=reason, expires_at=expires_at, by=by, now=now)


def resume_service(service_key: str, *, by: str, now: datetime | None = None) -> bool:
    """Resume a paused service; False (nothing written) when it is not paused."""
    return clear_condition(pause_name(service_key), by, now=now)


#: The condition that pauses a tenant is named this prefix and the tenant's id (a slug may change and
#: may be too long for a condition's name; the id is neither). It does not start with
#: :data:`PAUSE_PREFIX`, so no service's pause can be read as a tenant's, nor the other way round.
TENANT_PAUSE_PREFIX = "tenant-pause-"

# The ids (as text) of the tenants paused at the instant {stamp}: the claim statement passes over their
# queued tasks. (Text, not uuid: a condition someone named 'tenant-pause-x' by hand matches no tenant
# instead of failing every claim on a cast. The table holds a handful of rows: read whole.)
PAUSED_TENANTS_SQL = ("SELECT substr(g.name, " + str(len(TENANT_PAUSE_PREFIX) + 1) + ") FROM accs_governor_condition g"
                      " WHERE starts_with(g.name, '" + TENANT_PAUSE_PREFIX + "') AND "
                      + HOLDS_SQL.replace("raised_at", "g.raised_at").replace("cleared_at", "g.cleared_at")
                      .replace("expires_at", "g.expires_at").replace("%(now)s", "{stamp}"))


def tenant_pause_name(tenant_id: UUID | str) -> str:
    """Return the name of the condition that pauses the tenant ``tenant_id``."""
    return TENANT_PAUSE_PREFIX + str(UUID(str(tenant_id)))


def paused_tenant_id(condition_name: str) -> UUID | None:
    """Return the tenant a condition pauses, or None for any other condition."""
    if not condition_name.startswith(TENANT_PAUSE_PREFIX):
        return None
    try:
        tenant_id = UUID(condition_name[len(TENANT_PAUSE_PREFIX):])
    except ValueError:
        return None
    return tenant_id if tenant_pause_name(tenant_id) == condition_name else None


def _tenant(tenant: Tenant | UUID | str) -> Tenant:
    """Return the tenant given as a row, an id or a slug; DefinitionError naming an unknown one."""
    if isinstance(tenant, Tenant):
        return tenant
    found = None
    if isinstance(tenant, (UUID, str)):
        try:
            found = Tenant.objects.filter(pk=UUID(str(tenant))).first()
        except ValueError:
            found = Tenant.objects.filter(slug=tenant).first()
    if found is None:
        raise DefinitionError([Problem("tenant", f"unknown tenant {tenant!r}")])
    return found


def pause_tenant(tenant: Tenant | UUID | str, *, reason: str, by: str, expires_at: datetime | None = None,
                 now: datetime | None = None) -> GovernorCondition:
    """Pause a tenant (a row, its id or its slug) until ``expires_at`` or until resumed.

    No agent claims the tenant's tasks meanwhile, whatever their service; its queued tasks stay
    queued and its running ones finish. Raises DefinitionError for an unknown tenant, a blank
    reason or an expiry that is naive or not in the future. Who may pause which tenant is the
    caller's to check (the admin: :class:`workflows.admin.TenantPauseAdmin`).
    """
    reason = _pause_reason(reason, what="tenant")
    row = _tenant(tenant)
    return raise_condition(tenant_pause_name(row.pk), reason=reason, expires_at=expires_at, by=by, now=now,
                           about={"tenant": row.slug, "tenant_id": str(row.pk)})


def resume_tenant(tenant: Tenant | UUID | str, *, by: str, now: datetime | None = None) -> bool:
    """Resume a paused tenant; False (nothing written) when it is not paused.

    Its queued tasks are claimable by the next claim (an idle agent's poll, at most
    ``ACC_POLL_INTERVAL_SEC`` away, or a NOTIFY of new work).
    """
    row = _tenant(tenant)
    return clear_condition(tenant_pause_name(row.pk), by, now=now,
                           about={"tenant": row.slug, "tenant_id": str(row.pk)})


def claim_adjustments(service: Any, active: Iterable[str]) -> tuple[bool, int]:
    """Return (blocked, priority_delta) for ``service`` while the ``active`` conditions hold.

    ``service`` is a Service (or anything with ``block_during`` and ``priority_adjust_during``, and
    a ``key`` itself or in its ``spec``, as the agent's services have). Blocked means: do not claim
    it now, because a condition it names holds or the service is paused. The delta is the sum of
    the adjustments of every active condition the service names (e.g. ``{"live_session": -3}`` → -3).
    """
    active = set(active)
    if not active:
        return False, 0
    key = getattr(getattr(service, "spec", service), "key", None)
    blocked = (isinstance(key, str) and PAUSE_PREFIX + key in active) or any(
        name in active for name in (getattr(service, "block_during", None) or ()))
    adjust: Mapping[str, Any] = getattr(service, "priority_adjust_during", None) or {}
    delta = sum(int(v) for k, v in adjust.items() if k in active and isinstance(v, int))
    return blocked, delta


__all__ = [
    "PAUSED_TENANTS_SQL", "PAUSE_PREFIX", "TENANT_PAUSE_PREFIX", "active_conditions", "claim_adjustments",
    "clear_condition", "expire_conditions", "pause_name", "pause_service", "pause_tenant", "paused_service_key",
    "paused_tenant_id", "raise_condition", "resume_service", "resume_tenant", "tenant_pause_name",
]
