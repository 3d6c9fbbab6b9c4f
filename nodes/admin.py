"""Admin for nodes, hosts, host blocks and disk samples."""

from django.contrib import admin

from nodes.models import DiskSample, Host, HostBlock, Node


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("name", "state", "awake_state", "last_seen", "slot_cap", "cpu_budget", "disk_level", "version")
    list_filter = ("state", "awake_state", "wake_method", "disk_level")
    search_fields = ("name", "agent_id")


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    list_display = ("name", "node", "status", "quarantined_at", "quarantine_reason")
    list_filter = ("status", "node")
    search_fields = ("name",)
    readonly_fields = ("status", "quarantined_at", "quarantine_reason")


@admin.register(HostBlock)
class HostBlockAdmin(admin.ModelAdmin):
    list_display = ("host", "service", "reason", "created_at")
    list_filter = ("service",)
    search_fields = ("host__name", "service__key")


@admin.register(DiskSample)
class DiskSampleAdmin(admin.ModelAdmin):
    list_display = ("node", "ts", "path", "used_pct", "level")
    list_filter = ("level", "node")
    show_full_result_count = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
