"""Admin for services, workflows and governor conditions; saving runs the full validation."""

from django.contrib import admin

from workflows.models import GovernorCondition, Service, Workflow


@admin.register(Service)
class ServiceAdmin(admin.ModelAdmin):
    list_display = ("key", "executor", "is_active", "max_concurrent", "cpu_weight", "base_priority",
                    "requires_approval", "exclusive_per_host", "timeout_seconds", "max_attempts")
    list_filter = ("executor", "is_active", "requires_approval", "exclusive_per_host")
    search_fields = ("key", "description")


@admin.register(Workflow)
class WorkflowAdmin(admin.ModelAdmin):
    list_display = ("name", "version", "is_active", "max_active_jobs", "step_count", "updated_at")
    list_filter = ("is_active",)
    search_fields = ("name", "description")

    @admin.display(description="steps")
    def step_count(self, obj: Workflow) -> int:
        return len(obj.steps or [])


@admin.register(GovernorCondition)
class GovernorConditionAdmin(admin.ModelAdmin):
    list_display = ("name", "raised_at", "expires_at", "cleared_at", "raised_by")
    search_fields = ("name", "reason")
