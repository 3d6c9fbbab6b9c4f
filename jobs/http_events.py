"""``POST /api/v1/events/{name}``: an external system emits an application event to its tenant.

The event fires the tenant's event triggers exactly as :func:`jobs.api.emit_event` does. With an
``event_id`` the call is idempotent per tenant: a repeated delivery answers 200 with what the first
one did and fires nothing; the same id with another name or context answers 409.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any
from uuid import UUID

from django.db import IntegrityError, transaction
from django.http import HttpRequest
from ninja import Field, Router, Schema, Status

from accs_site.http import In, require_scope, responses, username
from jobs import api
from jobs.http import _tenant_to_act_in
from jobs.receipts import EventReceipt

router = Router(tags=["events"])


class EventIn(In):
    """An application event: ``context`` feeds the triggers' payload templates (``{{event.*}}``)."""

    context: dict[str, Any] = Field(default_factory=dict)
    event_id: str | None = Field(None, min_length=1, max_length=200,
                                 description="Makes the delivery idempotent per tenant "
                                             "(e.g. the sender's delivery id).")
    tenant: str | None = Field(None, min_length=1, max_length=100, description="Tenant slug or id.")
    correlation_id: str = Field("", max_length=200)


class EventOut(Schema):
    name: str
    tenant: str
    event_id: str | None
    jobs: list[UUID] = Field(description="Jobs the event's triggers started.")
    deduplicated: list[dict[str, UUID]] = Field(description="Triggers whose dedupe window held a job already.")
    errors: list[dict[str, str]] = Field(description="Triggers that could not fire, and why.")
    replayed: bool = Field(description="True when this event id was received before; nothing fired again.")


class EventIdReused(Exception):
    """The event id was used before for a different event."""


def _digest(name: str, context: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps([name, context], sort_keys=True, default=str).encode()).hexdigest()


def _fire(name: str, body: EventIn, tenant, request: HttpRequest) -> dict[str, Any]:
    result = api.emit_event(name, body.context, tenant=tenant, correlation_id=body.correlation_id,
                            source=f"api:{username(request)}"[:200], sent_by=getattr(request, "auth", None))
    return {
        "jobs": [str(j.id) for j in result.jobs],
        "deduplicated": [{"trigger_id": str(t), "job_id": str(j)} for t, j in result.deduplicated],
        "errors": [{"trigger_id": str(t), "error": e} for t, e in result.errors],
    }


@router.post("/{name}", response=responses({200: EventOut, 201: EventOut}), summary="Emit an application event")
def emit_event(request: HttpRequest, name: str, body: EventIn):
    """Fire the tenant's event triggers named ``name``; 201 when fired, 200 for a repeated ``event_id``
    (what the first delivery did; nothing fires again), 409 when that id was used for another event."""
    require_scope(request, "run")
    tenant = _tenant_to_act_in(request, body.tenant)
    out = {"name": name, "tenant": tenant.slug, "event_id": body.event_id}
    if body.event_id is None:
        return Status(201, {**out, **_fire(name, body, tenant, request), "replayed": False})
    digest = _digest(name, body.context)
    with transaction.atomic():
        try:
            # The unique (tenant, event_id) index decides between concurrent deliveries: the second
            # waits for the first to commit, then finds its receipt.
            with transaction.atomic():
                receipt = EventReceipt.objects.create(tenant=tenant, event_id=body.event_id, name=name,
                                                      body_digest=digest)
        except IntegrityError:
            previous = EventReceipt.objects.get(tenant=tenant, event_id=body.event_id)
            if previous.body_digest != digest:
                return Status(409, {"detail": f"event id {body.event_id!r} was already used for a different event "
                                              f"({previous.name!r} at {previous.created_at.isoformat()}); "
                                              "use a new id for a new event"})
            return Status(200, {**out, **previous.result, "replayed": True})
        receipt.result = _fire(name, body, tenant, request)
        receipt.save(update_fields=["result"])
    return Status(201, {**out, **receipt.result, "replayed": False})
