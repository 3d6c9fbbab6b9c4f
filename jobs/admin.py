"""Admin for tenants, jobs, tasks, attempts and triggers: the operator's cockpit (OPS1).

State-holding models (jobs, tasks, attempts) are read-only. Operators change state with admin
actions and with the buttons on the job page; both call :mod:`jobs.transitions` (the same functions
the API uses) and report the outcome with ``message_user``.

Tenant isolation has one definition, :mod:`jobs.scoping`: every tenant-owned list is filtered
through it, objects of other tenants do not exist for a tenant admin (their URLs redirect like a
deleted object's), and actions only touch objects the user may act on.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable
from functools import cached_property
from typing import Any
from uuid import UUID

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import ShowFacets
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import path, reverse
from django.utils.html import format_html
from django.utils.http import url_has_allowed_host_and_scheme

from jobs import transitions
from jobs.models import (
    ApiToken, ApprovalState, Attempt, Job, JobStatus, Task, TaskStatus, Tenant, TenantMembership, Trigger, TriggerType,
)
from jobs.scoping import can_act, scope, tenant_ids_for

#: Up to this many rows a list page counts exactly; beyond, it shows the planner's estimate.
EXACT_COUNT_LIMIT = 10_000
#: An action over "all N selected" acts on at most this many objects per click.
MAX_BULK = 1_000
#: Rows shown on the job page (the lists link to the full, filtered admin lists).
JOB_PAGE_TASKS, JOB_PAGE_ATTEMPTS, JOB_PAGE_EVENTS = 300, 100, 200
LEVELS = ("debug", "info", "warn", "error")


# --------------------------------------------------------------------------------------------
# Shared machinery: cheap pagination, tenant scoping, running transitions as actions
# --------------------------------------------------------------------------------------------

class EstimatedCountPaginator(Paginator):
    """Count exactly up to :data:`EXACT_COUNT_LIMIT` rows, then use PostgreSQL's row estimate.

    Django's changelist counts the filtered rows on every page view; on a table with millions of
    rows that exact ``COUNT(*)`` costs more than the page itself.
    """

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return super().count
        capped = queryset.order_by()[: EXACT_COUNT_LIMIT + 1].count()
        if capped <= EXACT_COUNT_LIMIT:
            return capped
        try:
            plan = json.loads(queryset.order_by().explain(format="json"))
            return max(int(plan[0]["Plan"]["Plan Rows"]), capped)
        except Exception:  # noqa: BLE001 - an estimate is optional; the capped count is still right
            return capped


def actor(request: HttpRequest) -> str:
    """Name the operator for the timeline (events record ``user:<name>``)."""
    return request.user.get_username()


def report(request: HttpRequest, modeladmin: admin.ModelAdmin, verb: str,
           results: list[transitions.ActionResult], *, denied: int = 0, capped: bool = False) -> None:
    """Summarise action outcomes in one message: how many changed, which did not and why."""
    changed = [r for r in results if r.changed]
    unchanged = Counter(r.message for r in results if not r.changed)
    parts = []
    if changed:
        detail = changed[0].message if len(changed) == 1 else f"{len(changed)} changed"
        parts.append(f"{verb}: {detail}")
    for message, n in unchanged.most_common():
        parts.append(f"{n} unchanged ({message})" if n > 1 else f"unchanged: {message}")
    if denied:
        parts.append(f"{denied} not permitted (another tenant, or viewer role)")
    if capped:
        parts.append(f"stopped after {MAX_BULK}; run the action again for the rest")
    level = messages.SUCCESS if changed and not unchanged and not denied else (
        messages.WARNING if changed else messages.ERROR)
    modeladmin.message_user(request, "; ".join(parts) or f"{verb}: nothing selected", level)


def uuid_or_none(text: str) -> UUID | None:
    try:
        return uuid.UUID(text.strip())
    except (ValueError, AttributeError):
        return None


class TenantListFilter(admin.SimpleListFilter):
    """Filter by tenant, offering only the tenants the viewer may see (never other tenants' names)."""

    title = "tenant"
    parameter_name = "tenant"
    tenant_path = "tenant_id"

    def lookups(self, request, model_admin):
        return [(str(t.id), t.slug) for t in scope(Tenant.objects.all(), request.user, field="id")]

    def queryset(self, request, queryset):
        value = uuid_or_none(self.value() or "")
        return queryset.filter(**{self.tenant_path: value}) if value else queryset


class TenantScopedAdmin(admin.ModelAdmin):
    """Admin for a tenant-owned model: lists, pages and actions follow :mod:`jobs.scoping`.

    Members of a tenant (non-superuser staff with a TenantMembership) may view these models
    without Django model permissions; acting needs the tenant-admin role. Superusers see all.
    """

    tenant_path = "tenant_id"
    show_full_result_count = False  # no exact COUNT(*) of the unfiltered table
    show_facets = ShowFacets.NEVER  # facet counts are one COUNT per filter option
    paginator = EstimatedCountPaginator

    def tenant_of(self, obj: Any) -> UUID | None:
        """Return the tenant id an object belongs to (override when ``tenant_path`` crosses a relation)."""
        return getattr(obj, "tenant_id", None)

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return scope(super().get_queryset(request), request.user, field=self.tenant_path)

    def _member(self, request: HttpRequest, *, write: bool = False) -> bool:
        allowed = tenant_ids_for(request.user, write=write)
        return request.user.is_staff and (allowed is None or bool(allowed))

    def has_module_permission(self, request: HttpRequest) -> bool:
        return super().has_module_permission(request) or self._member(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and not can_act(request.user, self.tenant_of(obj), write=False):
            return False
        return super().has_view_permission(request, obj) or self._member(request)

    def has_act_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Whether the user may run state-changing actions (on ``obj``, or on anything here)."""
        if not request.user.is_staff:
            return False
        if obj is not None:
            return can_act(request.user, self.tenant_of(obj), write=True)
        return self._member(request, write=True)

    def act_on(self, request: HttpRequest, queryset: QuerySet, verb: str,
               fn: Callable[[Any], transitions.ActionResult]) -> None:
        """Run ``fn`` on each selected object the user may act on, then report."""
        ids = list(queryset.order_by().values_list("pk", flat=True)[: MAX_BULK + 1])
        capped = len(ids) > MAX_BULK
        ids = ids[:MAX_BULK]
        allowed = scope(self.model.objects.filter(pk__in=ids), request.user, write=True, field=self.tenant_path)
        objects = list(allowed)
        results = [fn(obj) for obj in objects]
        report(request, self, verb, results, denied=len(ids) - len(objects), capped=capped)


class ReadOnlyScopedAdmin(TenantScopedAdmin):
    """State changes go through jobs.transitions, never through a form."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


def status_pill(status: str, *, extra: str = "") -> str:
    return format_html('<span class="accs-pill accs-{}">{}</span>{}', status, status, extra)


def safe_next(request: HttpRequest, fallback: str) -> str:
    """Return the ``next`` URL when it points back into this site, else ``fallback``."""
    target = request.POST.get("next") or request.GET.get("next") or ""
    if target and url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                                  require_https=request.is_secure()):
        return target
    return fallback


class PageActionsAdmin(ReadOnlyScopedAdmin):
    """Run one action from a button on an object's page (POST ``<id>/act/<action>/``), then go back.

    Subclasses name their actions (``page_actions``: name → (verb, transition)) and where to
    return (``after_action_url``); the URL is ``admin:<app>_<model>_act``.
    """

    page_actions: dict[str, tuple[str, Callable[..., transitions.ActionResult]]] = {}

    def after_action_url(self, request: HttpRequest, obj: Any) -> str:
        raise NotImplementedError

    def get_urls(self):
        name = f"{self.opts.app_label}_{self.opts.model_name}_act"
        return [
            path("<path:object_id>/act/<str:action>/", self.admin_site.admin_view(self.act_view), name=name),
        ] + super().get_urls()

    def act_view(self, request: HttpRequest, object_id: str, action: str) -> HttpResponse:
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        obj = self.get_object(request, object_id)
        if obj is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if action not in self.page_actions or not self.has_act_permission(request, obj):
            raise PermissionDenied
        verb, fn = self.page_actions[action]
        report(request, self, verb, [fn(obj.pk, by=actor(request))])
        return HttpResponseRedirect(self.after_action_url(request, obj))


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

JOB_ACTIONS: dict[str, tuple[str, Callable[..., transitions.ActionResult]]] = {
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
    if job.status in (JobStatus.QUEUED, JobStatus.RUNNING):
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
    actions = ("retry_jobs", "cancel_jobs", "approve_jobs", "reject_jobs")
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

    # Bulk actions -------------------------------------------------------------------------

    @admin.action(description="Retry selected failed/canceled jobs", permissions=["act"])
    def retry_jobs(self, request, queryset):
        self.act_on(request, queryset, "Retry", lambda job: transitions.retry_job(job.pk, by=actor(request)))

    @admin.action(description="Cancel selected jobs", permissions=["act"])
    def cancel_jobs(self, request, queryset):
        self.act_on(request, queryset, "Cancel", lambda job: transitions.cancel_job(job.pk, by=actor(request)))

    @admin.action(description="Approve selected jobs", permissions=["act"])
    def approve_jobs(self, request, queryset):
        self.act_on(request, queryset, "Approve", lambda job: transitions.approve(job.pk, by=actor(request)))

    @admin.action(description="Reject selected jobs", permissions=["act"])
    def reject_jobs(self, request, queryset):
        self.act_on(request, queryset, "Reject", lambda job: transitions.reject(job.pk, by=actor(request)))

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
        from events.dag import job_dag_svg
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

TASK_ACTIONS: dict[str, tuple[str, Callable[..., transitions.ActionResult]]] = {
    "retry": ("Retry task", transitions.retry_task),
    "cancel": ("Cancel task", transitions.cancel_task),
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
    actions = ("retry_tasks", "cancel_tasks")

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

    @admin.action(description="Retry selected tasks (attempts reset)", permissions=["act"])
    def retry_tasks(self, request, queryset):
        self.act_on(request, queryset, "Retry", lambda task: transitions.retry_task(task.pk, by=actor(request)))

    @admin.action(description="Cancel selected tasks", permissions=["act"])
    def cancel_tasks(self, request, queryset):
        self.act_on(request, queryset, "Cancel", lambda task: transitions.cancel_task(task.pk, by=actor(request)))

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


__all__ = ["EstimatedCountPaginator", "ReadOnlyScopedAdmin", "TenantScopedAdmin", "actor", "report", "uuid_or_none"]

