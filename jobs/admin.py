"""Admin for tenants, jobs, tasks, attempts and triggers. State-holding models are read-only."""

from django.contrib import admin

from jobs.models import ApiToken, Attempt, Job, Task, Tenant, TenantMembership, Trigger


class ReadOnlyAdmin(admin.ModelAdmin):
    """State changes go through jobs.transitions, never through a form."""

    show_full_result_count = False  # no exact COUNT(*) on huge tables

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "timezone", "max_in_flight", "created_at")
    search_fields = ("slug", "name")


@admin.register(TenantMembership)
class TenantMembershipAdmin(admin.ModelAdmin):
    list_display = ("user", "tenant", "role")
    list_filter = ("role", "tenant")
    search_fields = ("user__username", "tenant__slug")


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("name", "user", "prefix", "created_at", "last_used_at", "revoked_at")
    search_fields = ("name", "user__username", "prefix")
    readonly_fields = ("prefix", "digest", "last_used_at")


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = ("id", "tenant", "target", "status", "progress", "current_task_key", "priority", "order_seq",
                    "source", "approval_state", "created_at", "finished_at")
    list_filter = ("status", "source", "approval_state", "tenant")
    search_fields = ("=id", "external_id", "dedupe_key", "correlation_id")
    list_select_related = ("tenant", "workflow", "service")

    @admin.display(description="workflow / service")
    def target(self, obj: Job) -> str:
        return obj.target_name


@admin.register(Task)
class TaskAdmin(ReadOnlyAdmin):
    list_display = ("task_key", "job_id", "service", "status", "attempt", "max_attempts", "priority", "order_seq",
                    "node", "host", "next_attempt_at", "finished_at")
    list_filter = ("status", "service")
    search_fields = ("=id", "=job__id", "task_key", "claimed_by")
    list_select_related = ("service", "host")


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin):
    list_display = ("task_id", "attempt_no", "status", "node", "pid", "exit_code", "started_at", "finished_at")
    list_filter = ("status",)
    search_fields = ("=task__id", "node", "error_text")


@admin.register(Trigger)
class TriggerAdmin(admin.ModelAdmin):
    list_display = ("label", "tenant", "trigger_type", "event_name", "cron_expr", "timezone", "is_enabled",
                    "next_run_at", "last_fired_at")
    list_filter = ("trigger_type", "is_enabled", "tenant")
    search_fields = ("label", "event_name")
