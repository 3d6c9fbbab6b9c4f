"""Admin for nodes, hosts, host blocks and disk samples.

A node's configuration (labels, limits, wake method) is editable; its state (active/draining,
presence, heartbeat, disk level) is not: operators drain and undrain with actions, and clear a host's
quarantine with an action, all through :mod:`nodes.verbs`. Nodes are not deleted from a form:
the *Retire* action removes only those :func:`nodes.api.retire_nodes` allows (not online, no
history) and says why it kept the others. A node's page (what it holds now) is added by :mod:`ops.admin`.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.contrib.admin import ShowFacets
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from accs_site.admin_kit import (
    ActionTable,
    EstimatedCountPaginator,
    PageActionsMixin,
    actor,
    perform,
    status_pill,
    when_ago_html,
)
from nodes import verbs
from nodes.api import retire_nodes, stale_after_seconds
from nodes.models import DiskSample, Host, HostBlock, Node

NODE_ACTIONS: ActionTable = {
    "drain": ("Drain", verbs.drain_node),
    "undrain": ("Undrain", verbs.undrain_node),
}


@admin.register(Node)
class NodeAdmin(PageActionsMixin, admin.ModelAdmin):
    """Nodes: configuration is edited here; state changes by the Drain/Undrain actions and buttons."""

    page_actions = NODE_ACTIONS

    def has_act_permission(self, request, obj=None) -> bool:
        return self.has_change_permission(request, obj)

    def after_action_url(self, request, obj: Node) -> str:
        return reverse("admin:nodes_node_change", args=[obj.pk])

    list_display = ("name", "presence_badge", "heartbeat", "state_badge", "services_list", "slot_cap", "cpu_budget",
                    "disk_level", "version")
    list_filter = ("presence", "state", "awake_state", "wake_method", "disk_level")
    search_fields = ("name", "agent_id")
    readonly_fields = ("state", "presence", "awake_state", "agent_id", "version", "services", "last_seen",
                       "last_wake_at", "disk_level", "created_at")
    fieldsets = (
        (None, {"fields": ("name", "presence", "state", "awake_state", "last_seen", "agent_id", "version", "services",
                           "disk_level", "created_at")}),
        ("Limits", {"fields": ("labels", "max_concurrency", "slot_cap", "cpu_budget")}),
        ("Wake-up", {"fields": ("wake_method", "mac", "wake_address", "provider_ref", "script", "last_wake_at")}),
    )
    actions = ("drain", "undrain", "retire")

    def get_actions(self, request):
        # Deleting a node by hand would orphan the history that names it: retiring is the way out.
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def get_readonly_fields(self, request, obj=None):
        # The name is the primary key: set once when an operator pre-registers a node.
        return self.readonly_fields + (("name",) if obj else ())

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj: Node) -> str:
        return status_pill(obj.state)

    @admin.display(description="presence", ordering="presence")
    def presence_badge(self, obj: Node) -> str:
        return status_pill(obj.presence)

    @admin.display(description="last seen", ordering="last_seen")
    def heartbeat(self, obj: Node) -> str:
        if obj.last_seen is None:
            return "never"
        ago = (timezone.now() - obj.last_seen).total_seconds()
        # An online node whose heartbeat is overdue, before the builder marks it lost.
        late = obj.presence == "online" and obj.awake_state != "sleep" and ago > stale_after_seconds()
        return when_ago_html(obj.last_seen, note=format_html(" {}", status_pill("suspect")) if late else "")

    @admin.display(description="services")
    def services_list(self, obj: Node) -> str:
        return ", ".join(obj.services or []) or "—"

    @admin.action(description="Drain selected nodes (claim nothing new)", permissions=["change"])
    def drain(self, request, queryset):
        perform(request, self, "Drain", list(queryset), lambda n: verbs.drain_node(n.name, by=actor(request)))

    @admin.action(description="Undrain selected nodes (claim again)", permissions=["change"])
    def undrain(self, request, queryset):
        perform(request, self, "Undrain", list(queryset), lambda n: verbs.undrain_node(n.name, by=actor(request)))

    @admin.action(description="Retire selected nodes (not online, never ran anything)", permissions=["change"])
    def retire(self, request, queryset):
        retired, refused = retire_nodes(list(queryset.values_list("name", flat=True)), by=actor(request))
        parts = [f"Retired: {', '.join(retired)}"] if retired else []
        parts += [f"kept {name}: {why}" for name, why in sorted(refused.items())]
        level = messages.SUCCESS if not refused else messages.WARNING if retired else messages.ERROR
        self.message_user(request, "; ".join(parts) or "Retire: nothing selected", level)


class NodeListFilter(admin.SimpleListFilter):
    """Filter tasks by the node that holds or last held them, attempts by the node that ran them (the nodes
    are few; tasks and attempts are many)."""

    title = "node"
    parameter_name = "node"

    def lookups(self, request, model_admin):
        return [(name, name) for name in Node.objects.order_by("name").values_list("name", flat=True)]

    def queryset(self, request, queryset):
        return queryset.filter(node=self.value()) if self.value() else queryset


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    list_display = ("name", "node", "status_badge", "quarantined_at", "quarantine_reason")
    list_filter = ("status", "node")
    search_fields = ("name",)
    readonly_fields = ("status", "quarantined_at", "quarantine_reason")
    actions = ("clear_quarantine",)
    paginator = EstimatedCountPaginator
    show_full_result_count = False

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Host) -> str:
        label = "quarantined" if obj.status == "error" else obj.status
        return status_pill(obj.status, label=label)

    @admin.action(description="Clear quarantine of selected hosts", permissions=["change"])
    def clear_quarantine(self, request, queryset):
        perform(request, self, "Clear quarantine", list(queryset),
                lambda h: verbs.clear_quarantine(h.pk, by=actor(request)))


@admin.register(HostBlock)
class HostBlockAdmin(admin.ModelAdmin):
    list_display = ("host", "service", "reason", "created_at")
    list_filter = ("service",)
    search_fields = ("host__name", "service__key")
    autocomplete_fields = ("host",)


@admin.register(DiskSample)
class DiskSampleAdmin(admin.ModelAdmin):
    list_display = ("node", "ts", "path", "used_pct", "level")
    list_filter = ("level", "node")
    ordering = ("-ts",)
    show_full_result_count = False
    show_facets = ShowFacets.NEVER
    paginator = EstimatedCountPaginator

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
