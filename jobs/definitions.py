"""Resolved definitions (tenants, workflows, services), kept in memory for a few seconds.

Starting a job resolves its tenant, its workflow and their services by name; reading them from
PostgreSQL on every start would cost more round trips than the start itself. Entries live at
most :data:`TTL` seconds (definitions changed elsewhere are picked up within that time) and are
dropped at once when this process saves or deletes a tenant, workflow or service.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from django.db.models.signals import post_delete, post_save

from jobs.models import JOB_ACTIVE, Job, Trigger
from tenants.models import Tenant
from workflows.models import Service, Workflow

TTL = 10.0
MAX_ENTRIES = 10_000


class DefinitionCache:
    """A small thread-safe map of resolved definitions with a time to live."""

    def __init__(self, *, ttl: float = TTL, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self._clock = clock
        self._items: dict[Hashable, tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, load: Callable[[], Any]) -> Any:
        """Return the cached value for ``key``, loading (and caching) it when absent or stale."""
        now = self._clock()
        with self._lock:
            hit = self._items.get(key)
        if hit is not None and now - hit[0] < self.ttl:
            return hit[1]
        value = load()  # may raise (not found): nothing is cached then
        with self._lock:
            if len(self._items) >= MAX_ENTRIES:
                self._items.clear()
            self._items[key] = (now, value)
        return value

    def clear(self, *_args: Any, **_kwargs: Any) -> None:
        """Forget everything (connected to the definitions' save and delete signals)."""
        with self._lock:
            self._items.clear()


definitions = DefinitionCache()


def jobs_naming_service(key: str) -> list[str]:
    """Return the unfinished jobs and the triggers that name the service ``key`` (a rename would strand them).

    Registered with :func:`workflows.validation.register_service_users` by :class:`jobs.apps.JobsConfig`.
    """
    users = []
    active = Job.objects.filter(status__in=JOB_ACTIVE, service__key=key).count()
    if active:
        users.append(f"{active} unfinished job(s)")
    return users + [f"trigger {t.label!r}" for t in Trigger.objects.filter(service__key=key)]


def connect_invalidation() -> None:
    """Clear the cache whenever this process changes a tenant, workflow or service."""
    for model in (Tenant, Workflow, Service):
        post_save.connect(definitions.clear, sender=model, dispatch_uid=f"accs-definitions-{model.__name__}-save")
        post_delete.connect(definitions.clear, sender=model, dispatch_uid=f"accs-definitions-{model.__name__}-delete")
