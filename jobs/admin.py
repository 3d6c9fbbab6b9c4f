"""Admin for tenants, jobs, tasks, attempts and triggers: the operator's cockpit (OPS1).

State-holding models (jobs, tasks, attempts) are read-only. Operators change state with admin
actions and with the buttons on the job page; both call :mod:`jobs.transitions` (the same functions
the API uses) and report the outcome with ``message_user``.

Tenant isolation, the page buttons and the bulk actions come from :mod:`accs_site.admin_kit`; the
list's bulk actions are built from the same action tables as the job and task pages' buttons.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import Q
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from accs_site.admin_kit import (
    ActionTable, PageActionsAdmin, ReadOnlyScopedAdmin, TenantListFilter, TenantScopedAdmin, bulk_actions, safe_next,
    status_pill, uuid_or_none,
)
from jobs import transitions
from jobs.models import (
    JOB_ACTIVE, ApiToken, ApprovalState, Attempt, Job, JobStatus, Task, TaskStatus, Tenant, TenantMembership, Trigger,
    TriggerType,
)
from jobs.scoping import can_act, scope

#: Rows shown on the job page (the lists link to the full, filtered admin lists).
JOB_PAGE_TASKS, JOB_PAGE_ATTEMPTS, JOB_PAGE_EVENTS = 300, 100, 200
LEVELS = ("debug", "info", "warn", "error")


# --------------------------------------------------------------------------------------------
# Tenants, memberships, tokens
# --------------------------------------------------------------------------------------------

@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "timezone", "max_in_flight", "created_at")
    search_fields = ("slug", "name")

    def get_queryset(self, request):
        return scope(super().get_queryset(request), request.user, field="id")


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


# --------------------------------------------------------------------------------------------
# Jobs: list with bulk actions; the job page with DAG, tasks, attempts, timeline and buttons
# --------------------------------------------------------------------------------------------

JOB_ACTIONS: ActionTable = {
    "retry": ("Retry", transitions.retry_job),
    "cancel": ("Cancel", transitions.cancel_job),
    "approve": ("Approve", transitions.approve),
    "reject": ("Reject", transitions.reject),
}


def job_actions_for(job: Job) -> list[str]:
    """Return the actions that apply to a job in its current state (buttons on its page)."""
    out = []
    if job.approval_state == ApprovalState.PENDING and job.status == JobStatus.QUEUED:
        out += ["approve", "reject"]
    if job.status in (JobStatus.ERROR, JobStatus.CANCELED) and job.approval_state not in (
            ApprovalState.PENDING, ApprovalState.REJECTED):
        out.append("retry")
    if job.status in JOB_ACTIVE:
        out.append("cancel")
    return out


def task_actions_for(task: Task) -> list[str]:
    """Return the actions that apply to a task in its current state."""
    if task.status in (TaskStatus.ERROR, TaskStatus.SKIPPED, TaskStatus.CANCELED, TaskStatus.BLOCKED):
        return ["retry"]
    if task.status in (TaskStatus.WAITING, TaskStatus.QUEUED) or (
            task.status in (TaskStatus.STARTING, TaskStatus.RUNNING) and not task.cancel_requested_at):
        return ["cancel"]
    return []


@admin.register(Job)
class JobAdmin(PageActionsAdmin):
    list_display = ("short_id", "tenant", "target", "status_badge", "progress_pct", "current_task_key", "priority",
                    "source", "approval_state", "created_at", "finished_at")
    list_display_links = ("short_id",)
    list_filter = ("status", "approval_state", "source", TenantListFilter)
    search_fields = ("id",)  # see get_search_results: exact matches only, served by indexes
    search_help_text = "A job id, or an exact external id / dedupe key / correlation id."
    list_select_related = ("tenant", "workflow", "service")
    ordering = ("-created_at",)  # job_created_idx
    actions = bulk_actions(JOB_ACTIONS, "jobs")
    change_form_template = "admin/jobs/job/change_form.html"
    fieldsets = (
        (None, {"fields": ("id", "tenant", "workflow", "service", "status", "progress", "current_task_key",
                           "priority", "order_seq", "scheduled_at")}),
        ("Approval", {"fields": ("approval_state", "approved_by", "approved_at")}),
        ("Origin", {"fields": ("source", "source_ref", "external_id", "dedupe_key", "correlation_id", "created_by")}),
        ("Outcome", {"fields": ("error_code", "error_message", "created_at", "started_at", "finished_at", "updated_at")}),
        ("Parameters", {"fields": ("options", "step_params"), "classes": ("collapse",)}),
    )

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        as_uuid = uuid_or_none(term)
        if as_uuid:
            return queryset.filter(pk=as_uuid), False
        return queryset.filter(Q(external_id=term) | Q(dedupe_key=term) | Q(correlation_id=term)), False

    @admin.display(description="job", ordering="id")
    def short_id(self, obj: Job) -> str:
        return str(obj.id)[:8]

    @admin.display(description="workflow / service")
    def target(self, obj: Job) -> str:
        return obj.target_name

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Job) -> str:
        return status_pill(obj.status)

    @admin.display(description="progress", ordering="progress")
    def progress_pct(self, obj: Job) -> str:
        return f"{obj.progress * 100:.0f} %"

    # The job page ---------------------------------------------------------------------------

    page_actions = JOB_ACTIONS

    def after_action_url(self, request: HttpRequest, obj: Job) -> str:
        return reverse("admin:jobs_job_change", args=[obj.pk])

    def change_view(self, request, object_id, form_url="", extra_context=None):
        job = self.get_object(request, object_id)
        extra = dict(extra_context or {})
        if job is not None:
            extra.update(self.job_page_context(request, job))
        return super().change_view(request, object_id, form_url, extra_context=extra)

    def job_page_context(self, request: HttpRequest, job: Job) -> dict[str, Any]:
        """Collect the job page's picture, tasks, attempts and timeline (each bounded)."""
        from ops.dag import job_dag_svg
        from events.models import Event

        level = request.GET.get("level", "")
        level = level if level in LEVELS else ""
        tasks = list(Task.objects.filter(job_id=job.pk).select_related("service", "host")
                     .order_by("created_at", "task_key")[:JOB_PAGE_TASKS])
        # Show tasks in the order of the workflow's steps (they are created together).
        position = {s.get("key"): i for i, s in enumerate(job.workflow.steps or [])} if job.workflow_id else {}
        tasks.sort(key=lambda t: (position.get(t.step_key, len(position)), t.task_key))
        can = self.has_act_permission(request, job)
        for task in tasks:
            task.ops = task_actions_for(task) if can else []
        task_keys = {t.pk: t.task_key for t in tasks}
        attempts = list(Attempt.objects.filter(task__job_id=job.pk).select_related("task")
                        .order_by("-id")[:JOB_PAGE_ATTEMPTS])
        events = Event.objects.filter(job_id=job.pk)
        if level:
            events = events.filter(level__in=LEVELS[LEVELS.index(level):])
        events = list(events.order_by("-ts", "-id")[:JOB_PAGE_EVENTS])
        for event in events:
            event.task_key = task_keys.get(event.task_id, "") if event.task_id else ""
        return {
            "dag_svg": job_dag_svg(job),
            "job_ops": job_actions_for(job) if can else [],
            "job_tasks": tasks,
            "job_tasks_capped": len(tasks) >= JOB_PAGE_TASKS,
            "job_attempts": attempts,
            "job_events": events,
            "event_level": level,
            "event_levels": LEVELS,
            "events_capped": len(events) >= JOB_PAGE_EVENTS,
            "can_act": can,
        }


# --------------------------------------------------------------------------------------------
# Tasks and attempts
# --------------------------------------------------------------------------------------------

TASK_ACTIONS: ActionTable = {
    "retry": ("Retry", transitions.retry_task),
    "cancel": ("Cancel", transitions.cancel_task),
}


@admin.register(Task)
class TaskAdmin(PageActionsAdmin):
    list_display = ("task_key", "job_link", "service", "status_badge", "attempts", "priority", "node", "host",
                    "next_attempt_at", "finished_at")
    list_filter = ("status", "service", TenantListFilter)
    search_fields = ("id",)
    search_help_text = "A task id or a job id (exact), or a task key."
    list_select_related = ("service", "host")
    ordering = ("-pk",)  # the primary key is the only index covering every task
    actions = bulk_actions(TASK_ACTIONS, "tasks")

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        as_uuid = uuid_or_none(term)
        if as_uuid:
            return queryset.filter(Q(pk=as_uuid) | Q(job_id=as_uuid)), False
        return queryset.filter(task_key=term), False

    @admin.display(description="job")
    def job_link(self, obj: Task) -> str:
        return format_html('<a href="{}">{}</a>', reverse("admin:jobs_job_change", args=[obj.job_id]),
                           str(obj.job_id)[:8])

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Task) -> str:
        return status_pill(obj.status)

    @admin.display(description="attempt")
    def attempts(self, obj: Task) -> str:
        return f"{obj.attempt}/{obj.max_attempts}"

    page_actions = TASK_ACTIONS

    def after_action_url(self, request: HttpRequest, obj: Task) -> str:
        return safe_next(request, reverse("admin:jobs_job_change", args=[obj.job_id]))


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyScopedAdmin):
    tenant_path = "task__tenant_id"
    list_display = ("task", "attempt_no", "status_badge", "node", "pid", "exit_code", "started_at", "finished_at")
    list_filter = ("status",)
    search_fields = ("task__id",)
    search_help_text = "A task id (exact)."
    list_select_related = ("task",)
    ordering = ("-id",)  # newest first, by primary key

    def tenant_of(self, obj: Attempt) -> UUID | None:
        return obj.task.tenant_id

    def get_search_results(self, request, queryset, search_term):
        as_uuid = uuid_or_none(search_term)
        if search_term.strip() and not as_uuid:
            return queryset.none(), False
        return (queryset.filter(task_id=as_uuid), False) if as_uuid else (queryset, False)

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Attempt) -> str:
        return status_pill(obj.status)


# --------------------------------------------------------------------------------------------
# Triggers: editable by tenant admins, inside their tenants only
# --------------------------------------------------------------------------------------------

class TriggerForm(forms.ModelForm):
    """Name what is wrong with a trigger field by field, instead of a violated CHECK constraint."""

    class Meta:
        model = Trigger
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        kind = data.get("trigger_type")
        if kind == TriggerType.EVENT:
            if not data.get("event_name"):
                self.add_error("event_name", "an event trigger needs the event name it listens to")
            for name in ("cron_expr", "timezone"):
                if data.get(name):
                    self.add_error(name, "only schedule triggers have this; leave it empty")
        elif kind == TriggerType.SCHEDULE:
            if data.get("event_name"):
                self.add_error("event_name", "only event triggers have this; leave it empty")
            cron = data.get("cron_expr")
            if not cron:
                self.add_error("cron_expr", "a schedule trigger needs a cron expression, e.g. '0 2 * * *'")
            else:
                from croniter import croniter

                if not croniter.is_valid(cron):
                    self.add_error("cron_expr", f"{cron!r} is not a valid cron expression")
            tz = data.get("timezone")
            if not tz:
                self.add_error("timezone", "a schedule trigger needs an IANA time zone, e.g. 'Europe/Oslo'")
            else:
                from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

                try:
                    ZoneInfo(tz)
                except (ZoneInfoNotFoundError, ValueError):
                    self.add_error("timezone", f"unknown IANA time zone {tz!r}")
        if bool(data.get("workflow")) == bool(data.get("service")):
            self.add_error("workflow", "choose exactly one of a workflow or a service")
        if not self.errors:
            # The same rules as the Python and HTTP APIs (templates, 5-field cron, params).
            from jobs.triggers import trigger_problems

            probe = Trigger(**{f.name: data[f.name] for f in Trigger._meta.concrete_fields if f.name in data})
            for problem in trigger_problems(probe):
                field = problem.where.split(".")[0]
                self.add_error(field if field in self.fields else None, problem.message)
        if {"cron_expr", "timezone"} & set(self.changed_data) and "next_run_at" in self.fields:
            data["next_run_at"] = None  # the builder computes the next due time from the new schedule
        return data


@admin.register(Trigger)
class TriggerAdmin(TenantScopedAdmin):
    form = TriggerForm
    list_display = ("label", "tenant", "trigger_type", "event_name", "cron_expr", "timezone", "is_enabled",
                    "next_run_at", "last_fired_at")
    list_filter = ("trigger_type", "is_enabled", TenantListFilter)
    search_fields = ("label", "event_name")
    readonly_fields = ("next_run_at", "last_fired_at", "last_error", "created_by", "created_at", "updated_at")

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "tenant":
            kwargs["queryset"] = scope(Tenant.objects.all(), request.user, write=True, field="id")
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def has_add_permission(self, request) -> bool:
        return super().has_add_permission(request) or self._member(request, write=True)

    def has_change_permission(self, request, obj=None) -> bool:
        if obj is not None and not can_act(request.user, obj.tenant_id, write=True):
            return False
        return super().has_change_permission(request, obj) or self._member(request, write=True)

    def has_delete_permission(self, request, obj=None) -> bool:
        if obj is not None and not can_act(request.user, obj.tenant_id, write=True):
            return False
        return super().has_delete_permission(request, obj) or self._member(request, write=True)

    def save_model(self, request, obj, form, change):
        if not can_act(request.user, obj.tenant_id, write=True):
            raise PermissionDenied  # the form's choices already exclude it; this guards forged posts
        if not change and obj.created_by_id is None:
            obj.created_by = request.user
        super().save_model(request, obj, form, change)
