"""Admin for the timeline and artifacts (read-only)."""

from django.contrib import admin

from events.models import Artifact, Event


@admin.register(Event)
class EventAdmin(admin.ModelAdmin):
    list_display = ("ts", "level", "type", "source", "job_id", "task_id", "attempt", "message")
    list_filter = ("level", "type")
    search_fields = ("=job__id", "=task__id", "message")
    show_full_result_count = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # append-only; old months are archived and dropped by the builder


@admin.register(Artifact)
class ArtifactAdmin(admin.ModelAdmin):
    list_display = ("key", "kind", "job_id", "task_id", "size_bytes", "content_type", "checksum", "created_at")
    list_filter = ("kind", "content_type")
    search_fields = ("key", "=job__id")
    show_full_result_count = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
