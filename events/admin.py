"""Admin for the timeline and artifacts (read-only, tenant-scoped)."""

from __future__ import annotations

from typing import Any, ClassVar
from uuid import UUID

from django.contrib import admin
from django.db.models import Q
from django.utils.html import format_html

from accs_site.admin_kit import ReadOnlyScopedAdmin, uuid_or_none, when_html
from events.models import Artifact, Event, EventType


class EventTypeFilter(admin.SimpleListFilter):
    """Filter on the common event types; ``type`` is free text, and a DISTINCT over the timeline
    (Django's default for a field without choices) would read every row."""

    title = "type"
    parameter_name = "type"

    def lookups(self, request, model_admin):
        return EventType.choices

    def queryset(self, request, queryset):
        return queryset.filter(type=self.value()) if self.value() else queryset


@admin.register(Event)
class EventAdmin(ReadOnlyScopedAdmin):
    # Events carry no tenant: they are scoped through their job (events without a job, such as
    # node or host events, are visible to superusers only).
    tenant_path = "job__tenant_id"
    list_display = ("time", "level", "type", "source", "job_id", "task_id", "attempt", "message")
    list_filter: ClassVar[tuple[Any, ...]] = ("level", EventTypeFilter)
    search_fields = ("message",)
    search_help_text = "A job or task id (exact), or words of the message."
    # The list's columns; ``data`` stays on the event's page (it may carry a job's params).
    export_fields = ("id", "ts", "level", "type", "source", "job_id", "task_id", "attempt", "message")
    # The partitioned table's primary key is (id, ts): ordering by id reads it backwards per
    # partition; ordering by ts would sort the whole timeline.
    ordering = ("-id",)

    def tenant_of(self, obj: Event) -> UUID | None:
        return obj.job.tenant_id if obj.job_id and obj.job else None

    @admin.display(description="time")
    def time(self, obj: Event) -> str:
        """The event's time to the millisecond (events of one second are often many)."""
        return format_html('<span style="white-space:nowrap">{}</span>', when_html(obj.ts, ms=True))

    def get_search_results(self, request, queryset, search_term):
        as_uuid = uuid_or_none(search_term)
        if as_uuid:
            # A task's creation is recorded in its job's creation row (events.timeline.creation_event),
            # found through the task's job so the search stays on the job index.
            tasks = Event._meta.get_field("task").related_model._default_manager
            created = Q(task_id__isnull=True, job_id__in=tasks.filter(pk=as_uuid).values("job_id"),
                        data__tasks__contains=[{"id": str(as_uuid)}])
            return queryset.filter(Q(job_id=as_uuid) | Q(task_id=as_uuid) | created), False
        return super().get_search_results(request, queryset, search_term)


@admin.register(Artifact)
class ArtifactAdmin(ReadOnlyScopedAdmin):
    tenant_path = "job__tenant_id"
    list_display = ("key", "kind", "job_id", "task_id", "size_bytes", "content_type", "checksum", "created_at")
    list_filter = ("kind",)
    search_fields = ("key",)
    ordering = ("-id",)

    def tenant_of(self, obj: Artifact) -> UUID | None:
        return obj.job.tenant_id

    def get_search_results(self, request, queryset, search_term):
        as_uuid = uuid_or_none(search_term)
        if as_uuid:
            return queryset.filter(job_id=as_uuid), False
        return super().get_search_results(request, queryset, search_term)
