"""Admin for jobs, tasks, attempts and triggers: the operator's cockpit.

State-holding models (jobs, tasks, attempts) are read-only. Operators change state with admin
actions and with the buttons on the job page; both call :mod:`jobs.transitions` (the same functions
the API uses) and report the outcome with ``message_user``.

Tenant isolation, the page buttons and the bulk actions come from :mod:`accs_site.admin_kit`; the
list's bulk actions are built from the same action tables as the job and task pages' buttons. The
task and job lists also offer "Redrive all matching…" (:class:`RedriveAdmin`, over :mod:`jobs.redrive`).
Which buttons a job or task offers comes from :mod:`jobs.states` (where each verb applies).

The job and task *pages* (picture, tasks, timeline, why it is stuck) are what operators read, so
they live in :mod:`ops.admin`, which registers these admins with those pages added; this module
imports nothing above ``jobs``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any, ClassVar
from uuid import UUID

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Case, F, ForeignKey, Func, JSONField, OuterRef, Q, QuerySet, Subquery, Value, When
from django.http import HttpRequest, HttpResponse, QueryDict, StreamingHttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import mark_safe
from django.utils.text import Truncator

from accs_site.admin_kit import (
    ActionTable,
    PageActionsAdmin,
    PageActionsMixin,
    ReadOnlyAdmin,
    ReadOnlyScopedAdmin,
    TenantListFilter,
    TenantScopedAdmin,
    actor,
    bulk_actions,
    human_age,
    log_bulk,
    run_interval,
    safe_next,
    status_pill,
    uuid_or_none,
    uuid_prefix_range,
    when_ago_html,
    when_html,
)
from accs_site.redaction import keep_secrets, redact_params
from jobs import ids, redrive, transitions, triggers
from jobs.models import (
    SHORT_ID_BYTES,
    ApprovalState,
    Attempt,
    IdEnd,
    Job,
    JobStatus,
    LeaderTerm,
    Outage,
    Task,
    TaskStatus,
    Trigger,
    TriggerType,
)
from jobs.outcomes import attempt_status_words
from jobs.progress import attempt_text, job_progress, job_progress_of, job_progress_subquery
from jobs.pulse import outage_words
from jobs.tasks_backend import SOURCE_REF_PREFIX as DJANGO_TASK_REF
from tenants.models import Tenant
from tenants.scoping import can_act, scope, tenant_ids_for
from workflows.models import Service, Workflow
from workflows.validation import DefinitionError

# --------------------------------------------------------------------------------------------
# Bulk redrive: "Redrive all matching…" on the task and job lists
# --------------------------------------------------------------------------------------------

FULL_UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")


def failed_task_subquery() -> Case:
    """The first task of a failed job that failed for good: its step, key, node, host and error, as JSON.

    Only for jobs in error (a CASE: the other rows read nothing), one probe of the job's tasks by the
    (job, task_key) index per listed failed job.
    """
    # jsonb_build_object by hand: Django's JSONObject casts each key to ::text, which the list's plan
    # tests read as a text comparison of ids.
    fields = {"step": "step_key", "task": "task_key", "node": "node", "host": "host__name", "error": "error_message"}
    pairs = [part for key, column in fields.items() for part in (Value(key), F(column))]
    first = (Task.objects.filter(job_id=OuterRef("pk"), status=TaskStatus.ERROR).order_by("finished_at", "id")
             .values(failed=Func(*pairs, function="jsonb_build_object", output_field=JSONField()))[:1])
    return Case(When(status=JobStatus.ERROR, then=Subquery(first, output_field=JSONField())), default=None,
                output_field=JSONField())


def failed_task_words(failed: dict[str, Any]) -> str:
    """Say which task failed where and why: ``step render · render@studio-4 on node-t, host studio-4: …``."""
    step, task = failed.get("step") or "", failed.get("task") or ""
    named = f"step {step}" + (f" · {task}" if task and task != step else "") if step else f"task {task}"
    where = ", ".join(x for x in (failed.get("node") and f"on {failed['node']}",
                                  failed.get("host") and f"host {failed['host']}") if x)
    return f"{named}{' ' + where if where else ''}: {failed.get('error') or 'failed'}"


def error_cell(row: Job | Task) -> str:
    """Render a job's or task's error for a list row, cut at 120 characters, the whole text as its title;
    nothing when it has no error.

    A failed job says which task failed, on which node and host, and why (``failed_task`` annotated by
    :func:`failed_task_subquery`); other ids in a text are shown by their short id (the digits that
    tell them apart, and that the search finds), never by their first digits (a time-ordered id's
    first digits are its minute, shared by every job of that minute).
    """
    message, code = row.error_message, row.error_code
    if failed := getattr(row, "failed_task", None):
        message, code = failed_task_words(failed), ""
    if not message:
        return ""
    message = FULL_UUID.sub(lambda m: ids.short_id(m.group(0)), message)
    whole = f"{code}: {message}" if code else message
    return format_html('<span class="accs-error-text" title="{}">{}</span>', whole, Truncator(message).chars(120))


class RedriveForm(forms.Form):
    """The filter of a bulk redrive; the tenant choices are the tenants the operator administers."""

    service = forms.CharField(required=False, max_length=100, help_text="Service key.")
    tenant = forms.ChoiceField(required=False)
    error_contains = forms.CharField(required=False, max_length=500,
                                     help_text="Part of the error message (any case).")
    since = forms.DateTimeField(required=False, widget=forms.DateTimeInput(
        attrs={"type": "datetime-local", "step": 1}, format="%Y-%m-%dT%H:%M:%S"))
    until = forms.DateTimeField(required=False, widget=forms.DateTimeInput(
        attrs={"type": "datetime-local", "step": 1}, format="%Y-%m-%dT%H:%M:%S"))
    node = forms.CharField(required=False, max_length=200, help_text="Node that last held the task.")
    include = forms.MultipleChoiceField(required=False, widget=forms.CheckboxSelectMultiple,
                                        choices=[(s, s) for s in sorted(redrive.JOB_EXTRA)],
                                        help_text="Also jobs in these states, besides failed ones.")

    def __init__(self, *args: Any, tenants: QuerySet, jobs: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tenant = self.fields["tenant"]
        assert isinstance(tenant, forms.ChoiceField)  # declared so above; self.fields holds a copy of each
        tenant.choices = [("", "every tenant you administer")] + [(str(t.id), t.slug) for t in tenants]
        zone = timezone.get_current_timezone_name()  # how the server reads a time typed without a zone
        self.fields["since"].help_text = f"Finished at or after: YYYY-MM-DD HH:MM[:SS], {zone}."
        self.fields["until"].help_text = f"Finished before: YYYY-MM-DD HH:MM[:SS], {zone}."
        if not jobs:
            del self.fields["include"]

    def to_filter(self, *, jobs: bool) -> redrive.RedriveFilter:
        data = self.cleaned_data
        return redrive.RedriveFilter(
            jobs=jobs, service=data["service"] or None, tenant=data["tenant"] or None,
            error_contains=data["error_contains"] or None, since=data["since"], until=data["until"],
            node=data["node"] or None, include=frozenset(data.get("include") or ()))


#: Matches a redrive from the admin retries per transaction.
REDRIVE_BATCH = 500


def redrive_summary(done: redrive.RedriveResult, *, seconds: float) -> str:
    """Say what a redrive did: matched, redriven, skipped and why, in how many batches and how long."""
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(done.reasons.items()))
    return (f"Redrive: {done.matched} matched, {done.redriven} redriven, {done.skipped} skipped (no longer "
            f"applicable{': ' + why if why else ''}) in {done.batches} batch{'es' if done.batches != 1 else ''} "
            f"of up to {REDRIVE_BATCH}, {seconds:.1f} s")


def redrive_batch_line(done: redrive.RedriveResult, *, seconds: float) -> str:
    """One batch of a redrive as it committed: the running totals, and a script moving the progress bar."""
    return format_html(
        '<li class="accs-redrive-batch">batch {}: {} taken in so far, {} redriven, {} skipped, {} s</li>'
        '<script>document.getElementById("accs-redrive-bar").value = {};'
        'document.getElementById("accs-redrive-done").textContent = "{}";</script>\n',
        done.batches, done.matched, done.redriven, done.skipped, f"{seconds:.1f}", done.matched, done.matched)


class RedriveAdmin(PageActionsAdmin):
    """A list with "Redrive all matching…": a form with the list's current filters, the dry-run
    count, then the redrive on confirmation (:mod:`jobs.redrive`), reported with ``message_user``."""

    redrive_jobs = False
    change_list_template = "admin/jobs/redrive_change_list.html"

    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}_redrive"
        return [path("redrive/", self.admin_site.admin_view(self.redrive_view), name=name)] + super().get_urls()

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        extra = dict(extra_context or {})
        if self.has_act_permission(request):
            url = reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_redrive")
            extra["redrive_url"] = f"{url}?{request.GET.urlencode()}" if request.GET else url
        return super().changelist_view(request, extra_context=extra)

    def _initial(self, params: QueryDict) -> dict[str, Any]:
        """The redrive filter the list's current filters stand for (service, tenant)."""
        initial: dict[str, Any] = {}
        if (service_id := params.get("service__id__exact", "")).isdigit():
            initial["service"] = Service.objects.filter(pk=service_id).values_list("key", flat=True).first() or ""
        if tenant := uuid_or_none(params.get("tenant", "")):
            initial["tenant"] = str(tenant)
        return initial

    def _redrive_progress(self, request: HttpRequest, flt: redrive.RedriveFilter,
                          batches: Iterator[redrive.RedriveResult], *, matched: int) -> StreamingHttpResponse:
        """Answer a confirmed redrive with a page that grows a line per batch as it commits, then the
        summary. The batches run while the page is sent: a browser that goes away stops the redrive
        after the batch in hand (whole), and what was done is still logged."""
        back = reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist")
        back = f"{back}?{request.GET.urlencode()}" if request.GET else back
        page = TemplateResponse(request, "admin/jobs/redrive_progress.html", {
            **self.admin_site.each_context(request), "opts": self.opts, "title": "Redrive in progress",
            "noun": "failed job(s)" if self.redrive_jobs else "dead-lettered task(s)", "matched": matched,
            "batch": REDRIVE_BATCH, "back": back}).rendered_content
        head, tail = page.split("<!--ACCS_BATCHES-->", 1)

        def lines() -> Iterator[str]:
            started, done = time.monotonic(), redrive.RedriveResult()
            yield head
            try:
                for done in batches:
                    yield redrive_batch_line(done, seconds=time.monotonic() - started)
            finally:
                # Also when the browser went away (the server closes this iterator): what was done is logged.
                summary = redrive_summary(done, seconds=time.monotonic() - started)
                if done.redriven:
                    log_bulk(request, self.model, f"{summary}; filter " + ", ".join(
                        f"{k}={v}" for k, v in flt.describe().items()))
            yield format_html('<li class="accs-redrive-summary" id="accs-redrive-summary" style="list-style:none">'
                              '<b>{}</b></li>', summary)
            yield tail

        return StreamingHttpResponse(lines(), content_type="text/html; charset=utf-8")

    def redrive_view(self, request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
        if not self.has_act_permission(request):
            raise PermissionDenied
        allowed = tenant_ids_for(request.user, write=True)
        tenants = scope(Tenant.objects.order_by("slug"), request.user, write=True, field="id")
        posted = request.method == "POST"
        form = RedriveForm(request.POST if posted else None, initial=self._initial(request.GET), tenants=tenants,
                           jobs=self.redrive_jobs)
        matched = None
        if posted and form.is_valid():
            flt = form.to_filter(jobs=self.redrive_jobs)
            try:
                if "confirm" in request.POST:
                    batches = redrive.redrive_batches(flt, by=actor(request), tenant_ids=allowed,
                                                      batch=REDRIVE_BATCH)
                    return self._redrive_progress(request, flt, batches, matched=redrive.count(flt,
                                                                                              tenant_ids=allowed))
                matched = redrive.count(flt, tenant_ids=allowed)
            except DefinitionError as exc:
                for problem in exc.problems:
                    form.add_error(problem.where if problem.where in form.fields else None, problem.message)
        context = {
            **self.admin_site.each_context(request), "opts": self.opts, "form": form, "matched": matched,
            "title": "Redrive failed jobs" if self.redrive_jobs else "Redrive dead-lettered tasks",
            "noun": "failed job(s)" if self.redrive_jobs else "dead-lettered task(s)",
            "batch": REDRIVE_BATCH, "batches": -(-(matched or 0) // REDRIVE_BATCH),
        }
        return TemplateResponse(request, "admin/jobs/redrive.html", context)


# --------------------------------------------------------------------------------------------
# Jobs: list with bulk actions; the job page with DAG, tasks, attempts, timeline and buttons
# --------------------------------------------------------------------------------------------

JOB_ACTIONS: ActionTable = {
    "retry": ("Retry", transitions.retry_job),
    "cancel": ("Cancel", transitions.cancel_job),
    "approve": ("Approve", transitions.approve),
    "reject": ("Reject", transitions.reject),
}


#: A trigram index finds a part of a text of three characters or more; shorter terms match exactly only.
ERROR_SEARCH_MIN_CHARS = 3
#: The most errors one search looks at (a common text costs no more than a rare one).
ERROR_SEARCH_LIMIT = 2000


def jobs_with_error(term: str, *, tenant_ids: set[UUID] | None) -> QuerySet:
    """Return the ids of the jobs of ``tenant_ids`` (None: every tenant) whose error, or one of whose
    tasks' last error, contains ``term`` (any case).

    Two scans of the trigram indexes of jobs.0015 (``UPPER(error_message)``, rows with an error only),
    one after the other, so a LIMIT stops both early; a job may come twice. The tenants are part of
    the scan, so the limit counts the reader's own matches only: another tenant's errors neither
    fill it nor show in the "more than" warning.
    """
    has_error = ~Q(error_message="") & Q(error_message__icontains=term)
    if tenant_ids is not None:
        has_error &= Q(tenant_id__in=tenant_ids)
    return Job.objects.filter(has_error).order_by().values_list("id", flat=True).union(
        Task.objects.filter(has_error).order_by().values_list("job_id", flat=True), all=True)


def ids_ending(model: type[Job] | type[Task], tail: bytes) -> list[UUID]:
    """Return the ids of ``model``'s rows that end with the bytes ``tail`` (a short id or longer).

    ``job_short_id_idx`` / ``task_short_id_idx`` hold the ids by their last SHORT_ID_BYTES bytes
    (the short form shown), so this is one index probe; a longer tail (an id's whole last group) is
    probed by its last bytes and checked whole. The ids are looked up before the list's query,
    which then stays a primary-key lookup: as a filter of that query, the planner would walk the
    list's order index through the whole table expecting an early match. The lookup itself asks
    for no order for the same reason: under the model's ordering (jobs newest first) and a limit,
    a planner without statistics on the index's expression (an index built since the table was
    last analyzed) walked ``job_created_idx`` through every job (a second at a million jobs)
    rather than probe the index.
    """
    if len(tail) < SHORT_ID_BYTES:
        raise ValueError(f"a short id is at least {SHORT_ID_BYTES} bytes, not {len(tail)}")
    rows = model.objects.alias(id_end=IdEnd("id")).filter(id_end=tail[-SHORT_ID_BYTES:])
    if len(tail) > SHORT_ID_BYTES:
        rows = rows.alias(id_tail=IdEnd("id", size=len(tail))).filter(id_tail=tail)
    return list(rows.order_by().values_list("pk", flat=True)[:100])


@admin.register(Job)
class JobAdmin(RedriveAdmin):
    # Fits 1440 px: priority, source and approval are filters (approval also shows by the status).
    list_display = ("short_id", "tenant", "target", "status_badge", "progress_pct", "current_task_key", "age",
                    "duration", "last_error")
    list_display_links = ("short_id",)
    list_filter: ClassVar[tuple[Any, ...]] = ("status", "approval_state", "source", TenantListFilter)
    search_fields = ("id",)  # see get_search_results: exact matches and id ranges only
    search_help_text = ("A job id or one of its tasks' ids, a job's short id (its id's last 10 hex digits) or a job "
                        "id's first characters (4 or more hex digits), "
                        "else an exact external id / dedupe key / correlation id, workflow name or service key, "
                        "or a part (3+ characters, any case) of the job's or one of its tasks' errors.")
    list_select_related = ("tenant", "workflow", "service", "created_by")
    ordering = ("-created_at",)  # job_created_idx
    actions = bulk_actions(JOB_ACTIONS, "jobs", batched={"retry": transitions.retry_jobs})
    redrive_jobs = True
    fieldsets = (
        (None, {"fields": ("id", "tenant", "workflow", "service", "status", "progress_shown", "current_task_key",
                           "priority", "order_seq", "scheduled_at")}),
        ("Approval", {"fields": ("approval_state", "approved_by", "approved_at")}),
        ("Origin", {"fields": ("source", "source_ref", "external_id", "dedupe_key", "correlation_id", "created_by")}),
        ("Outcome", {"fields": ("error_code", "error_message", "created_at", "started_at", "finished_at",
                                "updated_at")}),
        ("Parameters", {"fields": ("options", "step_params"), "classes": ("collapse",)}),
    )

    readonly_fields = ("django_task", "progress_shown")
    redacted_fields = ("step_params",)
    export_fields = ("id", "tenant_id", "workflow_id", "service_id", "status", "approval_state", "progress",
                     "current_task_key", "priority", "source", "source_ref", "external_id", "dedupe_key",
                     "correlation_id", "scheduled_at", "created_at", "started_at", "finished_at", "error_code",
                     "error_message", "step_params")

    @admin.display(description="progress")
    def progress_shown(self, obj: Job) -> str:
        """The job's progress as the list and the page's summary say it (the mean of its tasks'), not the
        stored share of finished tasks, which reads 0 % beside a task at 32 %."""
        return f"{job_progress_of(obj) * 100:.0f} %"

    def get_fieldsets(self, request: HttpRequest, obj: Job | None = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        if obj is not None and obj.source_ref.startswith(DJANGO_TASK_REF):
            # A job enqueued through Django's Tasks API: what the team's code called, and what it returned.
            fieldsets = (*fieldsets[:1], ("Django task", {"fields": ("django_task",)}), *fieldsets[1:])
        return fieldsets

    @admin.display(description="task")
    def django_task(self, obj: Job) -> str:
        """Show the @task function's import path, its arguments and its return value."""
        row = Task.objects.filter(job=obj).only("params", "results", "status").first()
        params = (row.params if row else (obj.step_params or {}).get(obj.service.key if obj.service else "")) or {}
        path = (obj.service.executor_config or {}).get("task", "") if obj.service else ""
        returned = "—"
        if row is not None and row.status == TaskStatus.DONE and isinstance(row.results, dict):
            returned = json.dumps(row.results.get("return_value"))
        return format_html(
            '<dl class="accs-django-task"><dt>import path</dt><dd><code>{}</code></dd>'
            "<dt>args</dt><dd><code>{}</code></dd><dt>kwargs</dt><dd><code>{}</code></dd>"
            "<dt>return value</dt><dd><code>{}</code></dd></dl>",
            path, json.dumps(params.get("args", [])), json.dumps(redact_params(params.get("kwargs", {}))), returned)

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        # Durations by the database's clock, the one that stamped the times.
        return super().get_queryset(request).annotate(
            run_interval=run_interval(),
            tasks_share=job_progress_subquery(),
            failed_task=failed_task_subquery(),
        )

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Job],
                           search_term: str) -> tuple[QuerySet[Job], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        as_uuid = uuid_or_none(term)
        if as_uuid:
            # A task id finds its job (one primary-key lookup on tasks).
            of_task = Task.objects.filter(pk=as_uuid).values("job_id")
            return queryset.filter(Q(pk=as_uuid) | Q(pk__in=of_task)), False
        if (tail := ids.short_id_term(term)) and (span := uuid_prefix_range(term)):
            # A short id is the end of an id (see ids_ending); the same digits may also begin an id
            # (shortened the old way, to its first digits).
            return queryset.filter(Q(pk__in=ids_ending(Job, tail)) | Q(pk__gte=span[0], pk__lte=span[1])), False
        if span := uuid_prefix_range(term):
            # An id prefix is searched as an id range only: OR-ing it with the unindexed text
            # fields below would read every job.
            return queryset.filter(pk__gte=span[0], pk__lte=span[1]), False
        match = Q(external_id=term) | Q(dedupe_key=term) | Q(correlation_id=term)
        # Workflows and services are few: look their ids up first, so the jobs are found by the
        # foreign-key indexes rather than by a join per row.
        if workflow_ids := list(Workflow.objects.filter(name=term).values_list("id", flat=True)):
            match |= Q(workflow_id__in=workflow_ids)
        if service_ids := list(Service.objects.filter(key=term).values_list("id", flat=True)):
            match |= Q(service_id__in=service_ids)
        if len(term) < ERROR_SEARCH_MIN_CHARS:
            return queryset.filter(match), False
        # Else also a part of the job's error or of one of its tasks' last errors, in any case: the
        # jobs are looked up first, at most ERROR_SEARCH_LIMIT of them, so the list's query stays a
        # bitmap OR of index scans (an OR with a subquery would read every job, and a text that
        # thousands of jobs share would fetch every one of them to show 100).
        rows = list(jobs_with_error(term, tenant_ids=tenant_ids_for(request.user))[:ERROR_SEARCH_LIMIT + 1])
        if len(rows) > ERROR_SEARCH_LIMIT:
            messages.warning(request, f"{term!r} is in the errors of more than {ERROR_SEARCH_LIMIT:,} jobs or tasks: "
                                      f"only the jobs of the first {ERROR_SEARCH_LIMIT:,} found are listed. "
                                      "Search a longer part of the error to see them all.", fail_silently=True)
        return queryset.filter(match | Q(pk__in=set(rows[:ERROR_SEARCH_LIMIT]))), False

    def get_list_display(self, request: HttpRequest) -> Any:
        """The pending-approval list (filtered on approval pending) adds who asked and with which params."""
        if request.GET.get("approval_state__exact") == ApprovalState.PENDING:
            return (*self.list_display[:3], "requested_by", "params_shown", *self.list_display[3:])
        return self.list_display

    @admin.display(description="requested by")
    def requested_by(self, obj: Job) -> str:
        return obj.created_by.get_username() if obj.created_by_id and obj.created_by else (obj.source or "—")

    @admin.display(description="params")
    def params_shown(self, obj: Job) -> str:
        """The job's params (a service job's, or each step's), secrets shown as ***."""
        params = obj.step_params or {}
        if obj.service_id and obj.service and set(params) <= {obj.service.key}:
            params = params.get(obj.service.key, {})
        text = json.dumps(redact_params(params), sort_keys=True)
        return format_html('<code title="{}">{}</code>', text, Truncator(text).chars(80))

    @admin.display(description="job", ordering="id")
    def short_id(self, obj: Job) -> str:
        return ids.short_id(obj.id)

    @admin.display(description="workflow / service")
    def target(self, obj: Job) -> str:
        return obj.target_name

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Job) -> str:
        if obj.approval_state == ApprovalState.PENDING:
            return status_pill(obj.status, extra=format_html(" {}", status_pill("pending", label="approval")))
        return status_pill(obj.status)

    @admin.display(description="error")
    def last_error(self, obj: Job) -> str:
        """The job's error, shortened (the full text is its title and on the job page)."""
        return error_cell(obj)

    @admin.display(description="progress")
    def progress_pct(self, obj: Job) -> str:
        return f"{job_progress(obj, getattr(obj, 'tasks_share', None)) * 100:.0f} %"

    @admin.display(description="age", ordering="-created_at")
    def age(self, obj: Job) -> str:
        return when_ago_html(obj.created_at)

    @admin.display(description="duration")
    def duration(self, obj: Job) -> str:
        """How long the job ran (finished − started), or has been running so far."""
        interval = getattr(obj, "run_interval", None)
        if interval is None:
            return "—"
        text = human_age(interval.total_seconds())
        return text if obj.finished_at else f"{text} so far"

    # The job page ---------------------------------------------------------------------------

    page_actions = JOB_ACTIONS
    page_action_options = {"reject": ("reason",)}
    confirm_notes = {
        "cancel": "Cancel: tasks not started yet are canceled; running tasks are told to stop at their next heartbeat "
                  "(the job page keeps refreshing until they have). The job can be retried afterwards.",
        "reject": "Reject: the job will never run; it is canceled and cannot be retried (start a new job instead).",
    }

    def action_subject(self, obj: Job) -> str:
        return f"job {ids.short_id(obj.pk)} ({obj.target_name})"

    def after_action_url(self, request: HttpRequest, obj: Job) -> str:
        return reverse("admin:jobs_job_change", args=[obj.pk])


# --------------------------------------------------------------------------------------------
# Tasks and attempts
# --------------------------------------------------------------------------------------------

TASK_ACTIONS: ActionTable = {
    "retry": ("Retry", transitions.retry_task),
    "cancel": ("Cancel", transitions.cancel_task),
}


@admin.register(Task)
class TaskAdmin(RedriveAdmin):
    list_display = ("task_key", "job_link", "workflow", "service", "status_badge", "attempts", "node", "host",
                    "finished", "last_error")
    list_filter: ClassVar[tuple[Any, ...]] = ("status", "service", TenantListFilter)  # by node: ops.admin
    search_fields = ("id",)  # see get_search_results: exact matches and id ranges only
    search_help_text = ("A task id or job id, the short id (last 10 hex digits) or the first characters (4 or more "
                        "hex digits) of either; else an exact task key or service key.")
    list_select_related = ("service", "host", "job__workflow")
    ordering = ("-pk",)  # the primary key is the only index covering every task
    actions = bulk_actions(TASK_ACTIONS, "tasks", batched={"retry": transitions.retry_tasks})
    redacted_fields = ("params", "results")  # results: the step's output, which its dependents receive
    export_fields = ("id", "job_id", "tenant_id", "task_key", "step_key", "service_id", "host_id", "status",
                     "attempt", "max_attempts", "node", "progress", "created_at", "started_at", "finished_at",
                     "error_code", "error_message", "params", "results")

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Task],
                           search_term: str) -> tuple[QuerySet[Task], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        as_uuid = uuid_or_none(term)
        if as_uuid:
            return queryset.filter(Q(pk=as_uuid) | Q(job_id=as_uuid)), False
        if (tail := ids.short_id_term(term)) and (span := uuid_prefix_range(term)):
            # The short id (the end, see ids_ending) of the task's or of its job's id, or their first
            # digits.
            by_end = Q(pk__in=ids_ending(Task, tail)) | Q(job_id__in=ids_ending(Job, tail))
            by_start = Q(pk__gte=span[0], pk__lte=span[1]) | Q(job_id__gte=span[0], job_id__lte=span[1])
            return queryset.filter(by_end | by_start), False
        if span := uuid_prefix_range(term):
            # Ranges on the primary key and on task_job_key_unique (job first), nothing else: an
            # OR with the unindexed fields below would read every task.
            in_span = Q(pk__gte=span[0], pk__lte=span[1]) | Q(job_id__gte=span[0], job_id__lte=span[1])
            return queryset.filter(in_span), False
        match = Q(task_key=term)
        if service_ids := list(Service.objects.filter(key=term).values_list("id", flat=True)):
            match |= Q(service_id__in=service_ids)
        return queryset.filter(match), False

    @admin.display(description="workflow")
    def workflow(self, obj: Task) -> str:
        workflow = obj.job.workflow  # None without a query for a job of a single service
        return workflow.name if workflow is not None else "—"

    @admin.display(description="job")
    def job_link(self, obj: Task) -> str:
        return format_html('<a href="{}">{}</a>', reverse("admin:jobs_job_change", args=[obj.job_id]),
                           ids.short_id(obj.job_id))

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Task) -> str:
        return status_pill(obj.status)

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, obj: Task) -> str:
        return when_html(obj.finished_at)

    @admin.display(description="error")
    def last_error(self, obj: Task) -> str:
        """The task's last error, shortened (the full text is its title and on the task page)."""
        return error_cell(obj)

    @admin.display(description="attempt")
    def attempts(self, obj: Task) -> str:
        return attempt_text(attempt=obj.attempt, max_attempts=obj.max_attempts, budget=obj.service.max_attempts)

    page_actions = TASK_ACTIONS
    confirm_notes = {"cancel": "Cancel: a task not started yet is canceled; a running task is told to stop at its "
                               "next heartbeat."}

    def action_subject(self, obj: Task) -> str:
        return f"task {obj.task_key} (job {ids.short_id(obj.job_id)})"

    def after_action_url(self, request: HttpRequest, obj: Task) -> str:
        return safe_next(request, reverse("admin:jobs_job_change", args=[obj.job_id]))



@admin.register(Attempt)
class AttemptAdmin(ReadOnlyScopedAdmin):
    tenant_path = "task__tenant_id"
    list_display = ("task", "attempt_no", "status_badge", "node", "pid", "exit_code", "started", "finished")
    list_filter: ClassVar[tuple[Any, ...]] = ("status",)
    search_fields = ("task__id",)
    search_help_text = "A task id (exact)."
    list_select_related = ("task",)
    ordering = ("-id",)  # newest first, by primary key
    export_fields = ("id", "task_id", "attempt_no", "node", "agent_id", "pid", "status", "started_at", "finished_at",
                     "exit_code", "error_text")

    def tenant_of(self, obj: Attempt) -> UUID | None:
        return obj.task.tenant_id

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Attempt],
                           search_term: str) -> tuple[QuerySet[Attempt], bool]:
        as_uuid = uuid_or_none(search_term)
        if search_term.strip() and not as_uuid:
            return queryset.none(), False
        return (queryset.filter(task_id=as_uuid), False) if as_uuid else (queryset, False)

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Attempt) -> str:
        return attempt_pill(obj)

    @admin.display(description="started", ordering="started_at")
    def started(self, obj: Attempt) -> str:
        return when_html(obj.started_at)

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, obj: Attempt) -> str:
        return when_html(obj.finished_at)


def attempt_pill(attempt: Attempt) -> str:
    """An attempt's status pill; an interrupted one names what interrupted it (an outage or a shutdown)."""
    return status_pill(attempt.status, label=attempt_status_words(attempt.status, attempt.error_text))


# --------------------------------------------------------------------------------------------
# The system's own record: outages and leadership terms, rows the engine writes about itself
# (read-only; the system timeline links here)
# --------------------------------------------------------------------------------------------

@admin.register(Outage)
class OutageAdmin(ReadOnlyAdmin):
    """PostgreSQL's outages as the builders' pulse recorded them (jobs.pulse), with how long each lasted."""

    list_display = ("began_at", "ended_at", "lasted", "cause")
    list_filter = ("cause",)
    ordering = ("-ended_at",)  # outage_ended_idx
    fields = ("began_at", "ended_at", "lasted", "cause")
    readonly_fields = fields

    @admin.display(description="lasted")
    def lasted(self, obj: Outage) -> str:
        return outage_words(began_at=obj.began_at, ended_at=obj.ended_at)


@admin.register(LeaderTerm)
class LeaderTermAdmin(ReadOnlyAdmin):
    """Who led the builders when (one row per leadership term), and the release each leader ran."""

    list_display = ("fence", "holder", "acquired_at", "expires_at", "writes")
    ordering = ("-fence",)
    fields = ("fence", "holder", "acquired_at", "expires_at", "first_write_at", "last_write_at", "writes")
    readonly_fields = fields


# --------------------------------------------------------------------------------------------
# Triggers: editable by tenant admins, inside their tenants only
# --------------------------------------------------------------------------------------------

class TriggerForm(forms.ModelForm):
    """Name what is wrong with a trigger field by field, instead of a violated CHECK constraint."""

    class Meta:
        model = Trigger
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        super().clean()  # a ModelForm's returns its cleaned_data
        data = self.cleaned_data
        if self.instance.pk is not None and isinstance(data.get("payload_template"), dict):
            # The page showed the template redacted: a ``***`` left as shown keeps the stored secret.
            stored = Trigger.objects.filter(pk=self.instance.pk).values_list("payload_template", flat=True).first()
            data["payload_template"] = keep_secrets(data["payload_template"], stored)
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
            probe = Trigger(**{f.name: data[f.name] for f in Trigger._meta.concrete_fields if f.name in data})
            for problem in triggers.trigger_problems(probe):
                field = problem.where.split(".")[0]
                self.add_error(field if field in self.fields else None, problem.message)
        if {"cron_expr", "timezone"} & set(self.changed_data) and "next_run_at" in self.fields:
            data["next_run_at"] = None  # the builder computes the next due time from the new schedule
        return data


TRIGGER_ACTIONS: ActionTable = {"run_now": ("Run now", triggers.run_now)}
#: Due times a schedule trigger's page previews.
PREVIEW_RUNS = 5


def trigger_jobs_url(trigger: Trigger) -> str:
    """Return the jobs list of the jobs a trigger started (their ``source_ref`` names it)."""
    return f"{reverse('admin:jobs_job_changelist')}?{urlencode({'source_ref__startswith': f'trigger:{trigger.pk}'})}"


def next_runs(trigger: Trigger, *, count: int = PREVIEW_RUNS) -> tuple[list[datetime], str]:
    """Return a schedule trigger's next due times (its own zone's rules), or why there are none."""
    if trigger.trigger_type != TriggerType.SCHEDULE:
        return [], ""
    try:
        schedule = triggers.Schedule.parse(trigger.cron_expr, trigger.timezone)
        start = timezone.now()
        return schedule.due_times(start, start + timedelta(days=3660), limit=count), ""
    except triggers.ScheduleError as exc:
        return [], str(exc)


@admin.register(Trigger)
class TriggerAdmin(PageActionsMixin, TenantScopedAdmin):
    """Triggers: tenant admins edit them; each page previews the next runs, links the jobs the trigger
    started and offers *Run now* (a schedule trigger's job, started at once)."""

    form = TriggerForm
    list_display = ("label", "tenant", "when", "is_enabled", "next_run", "last_fired", "fired_jobs")
    list_filter = ("trigger_type", "is_enabled", TenantListFilter)
    search_fields = ("label", "event_name")
    readonly_fields = ("next_run_at", "upcoming", "last_fired_at", "last_error", "jobs_started", "created_by",
                       "updated_by", "created_at", "updated_at")
    actions = bulk_actions(TRIGGER_ACTIONS, "triggers")
    page_actions = TRIGGER_ACTIONS
    change_form_template = "admin/jobs/trigger/change_form.html"
    redacted_fields = ("payload_template",)

    def after_action_url(self, request: HttpRequest, obj: Trigger) -> str:
        return reverse("admin:jobs_trigger_change", args=[obj.pk])

    def get_readonly_fields(self, request: HttpRequest, obj: Trigger | None = None) -> list[str] | tuple[str, ...]:
        fields = super().get_readonly_fields(request, obj)
        return fields if obj is not None else tuple(f for f in fields if f not in ("upcoming", "jobs_started"))

    def action_subject(self, obj: Trigger) -> str:
        return f"trigger {obj.label!r}"

    @admin.display(description="when")
    def when(self, obj: Trigger) -> str:
        if obj.trigger_type == TriggerType.EVENT:
            return format_html("on event <code>{}</code>", obj.event_name)
        return format_html("<code>{}</code> {}", obj.cron_expr, obj.timezone)

    @admin.display(description="next run", ordering="next_run_at")
    def next_run(self, obj: Trigger) -> str:
        return when_ago_html(obj.next_run_at)

    @admin.display(description="last fired", ordering="last_fired_at")
    def last_fired(self, obj: Trigger) -> str:
        return when_ago_html(obj.last_fired_at, never="never")

    @admin.display(description="jobs")
    def fired_jobs(self, obj: Trigger) -> str:
        return format_html('<a href="{}">jobs →</a>', trigger_jobs_url(obj))

    @admin.display(description="next runs")
    def upcoming(self, obj: Trigger) -> str:
        due, problem = next_runs(obj)
        if problem:
            return problem
        if not due:
            return "—" if obj.trigger_type == TriggerType.SCHEDULE else "when its event is emitted"
        zone = triggers.zone(obj.timezone)
        return format_html_join(mark_safe("<br>"), "{} <span class=\"accs-muted\">({})</span>",
                                ((d.astimezone(zone).strftime("%a %Y-%m-%d %H:%M %Z"),
                                  f"in {human_age((d - timezone.now()).total_seconds())}") for d in due))

    @admin.display(description="jobs started")
    def jobs_started(self, obj: Trigger) -> str:
        return self.fired_jobs(obj) if obj.pk else "—"

    def formfield_for_foreignkey(self, db_field: ForeignKey, request: HttpRequest,
                                 **kwargs: Any) -> forms.ModelChoiceField | None:
        if db_field.name == "tenant":
            kwargs["queryset"] = scope(Tenant.objects.all(), request.user, write=True, field="id")
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return super().has_add_permission(request) or self._member(request, write=True)

    def has_change_permission(self, request: HttpRequest, obj: Trigger | None = None) -> bool:
        if obj is not None and not can_act(request.user, obj.tenant_id, write=True):
            return False
        return super().has_change_permission(request, obj) or self._member(request, write=True)

    def has_delete_permission(self, request: HttpRequest, obj: Trigger | None = None) -> bool:
        if obj is not None and not can_act(request.user, obj.tenant_id, write=True):
            return False
        return super().has_delete_permission(request, obj) or self._member(request, write=True)

    def save_model(self, request: HttpRequest, obj: Trigger, form: forms.ModelForm, change: bool) -> None:
        if not can_act(request.user, obj.tenant_id, write=True):
            raise PermissionDenied  # the form's choices already exclude it; this guards forged posts
        # The admin serves only logged-in staff, so the user is always a stored one here.
        if not change and obj.created_by_id is None and request.user.is_authenticated:
            obj.created_by = request.user
        if change and request.user.is_authenticated:
            obj.updated_by = request.user  # the last editor may not approve the trigger's jobs
        super().save_model(request, obj, form, change)
