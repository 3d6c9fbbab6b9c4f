"""The operators' pages of jobs, tasks and nodes, and the admin site's titles.

The lower apps register plain admins for their models (lists, filters, actions); the pages an
operator reads to understand one object — a job's picture, tasks and timeline, a task's attempts
and why it is not moving, what a node holds now — are this app's read side. So this module takes
over those registrations with the same admins plus their pages, and the lower apps import nothing
from ``ops``. The other operators' pages are wired in :mod:`ops.urls`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from django.contrib import admin
from django.db import connections
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html

from events.admin import ArtifactAdmin, EventAdmin
from events.models import Artifact, Event
from jobs import ids
from jobs.admin import AttemptAdmin, JobAdmin, TaskAdmin
from jobs.attempt_refs import refs_complete
from jobs.models import Attempt, Job, Task
from nodes.admin import NodeAdmin, NodeListFilter
from nodes.models import Node
from ops.dashboard import sees_infrastructure
from ops.jobpage import job_page_context, task_page_context
from ops.nodepage import node_page_context
from ops.rates import page_rates
from ops.timerange import time_range_filter
from workflows.admin import ServiceAdmin
from workflows.models import Service, Workflow

admin.site.site_header = "ACCS operations"
admin.site.site_title = "ACCS"
admin.site.index_title = "Jobs, workflows, nodes and timeline"


def _with_page(view: Callable[..., HttpResponse], request: HttpRequest, object_id: str, form_url: str,
               extra_context: dict[str, Any] | None, obj: Any, page: Callable[[Any], dict[str, Any]]) -> HttpResponse:
    """Render the admin's change view with the page's sections (when the object exists)."""
    extra = dict(extra_context or {})
    if obj is not None:
        extra.update(page(obj))
    return view(request, object_id, form_url, extra_context=extra)


class DefinitionFilter(admin.SimpleListFilter):
    """Filter a list by a service or workflow (the definitions are few), offered to those who may read the
    definitions: a service's or workflow's name may name another tenant, which a tenant admin does not see.
    The parameter works for everyone (a link from the dashboard or a service's page)."""

    definition: type[Service] | type[Workflow] = Service
    label = "key"
    field = "service_id"

    def lookups(self, request, model_admin):
        model = self.definition._meta
        if not request.user.has_perm(f"{model.app_label}.view_{model.model_name}"):
            return []
        return [(str(pk), name) for pk, name in self.definition.objects.order_by(self.label)
                .values_list("pk", self.label)]

    def has_output(self) -> bool:
        return bool(self.lookup_choices)

    def field_for(self, queryset: QuerySet) -> str:
        """The column the filter compares (a subclass may choose it per request)."""
        return self.field

    def queryset(self, request, queryset):
        value = self.value() or ""
        return queryset.filter(**{self.field_for(queryset): int(value)}) if value.isdigit() else queryset


class AttemptServiceFilter(DefinitionFilter):
    """Filter attempts by their task's service: the attempt's copy of it (``attempt_service_idx``) once every
    attempt carries one (jobs.attempt_refs), else through the task."""

    title, parameter_name, field = "service", "service", "service_id"

    def field_for(self, queryset: QuerySet) -> str:
        with connections[queryset.db].cursor() as cur:
            return "service_id" if refs_complete(cur) else "task__service_id"


class JobServiceFilter(DefinitionFilter):
    """Filter jobs by their service (``job_service_idx``); the redrive form reads the same parameter."""

    title, parameter_name, field = "service", "service__id__exact", "service_id"


class JobWorkflowFilter(DefinitionFilter):
    """Filter jobs by their workflow (``job_workflow_idx``)."""

    title, parameter_name, field, definition, label = ("workflow", "workflow__id__exact", "workflow_id", Workflow,
                                                       "name")


class JobPageAdmin(JobAdmin):
    """Jobs, filterable by service, workflow and creation time, with the job page: DAG, tasks, attempts,
    artifacts, timeline, why it is stuck, buttons."""

    list_filter: ClassVar[tuple[Any, ...]] = (*JobAdmin.list_filter, JobServiceFilter, JobWorkflowFilter,
                                              time_range_filter("created_at"))
    change_form_template = "admin/jobs/job/change_form.html"

    def change_view(self, request, object_id, form_url="", extra_context=None):
        return _with_page(super().change_view, request, object_id, form_url, extra_context,
                          self.get_object(request, object_id), lambda job: job_page_context(request, job))


class TaskPageAdmin(TaskAdmin):
    """Tasks, filterable by node, with the task page: summary, buttons, attempts, why it is not moving."""

    # Tasks' ids are time-ordered (uuid7): the range is a range of the primary key.
    list_filter = (*TaskAdmin.list_filter, NodeListFilter, time_range_filter("pk", by_id=True))
    change_form_template = "admin/jobs/task/change_form.html"

    def change_view(self, request, object_id, form_url="", extra_context=None):
        return _with_page(super().change_view, request, object_id, form_url, extra_context,
                          self.get_object(request, object_id), lambda task: task_page_context(request, task))


class NodePageAdmin(NodeAdmin):
    """Nodes, with the node page: held tasks with elapsed time and progress, recent failures, links."""

    change_form_template = "admin/nodes/node/change_form.html"

    def change_view(self, request, object_id, form_url="", extra_context=None):
        return _with_page(super().change_view, request, object_id, form_url, extra_context,
                          self.get_object(request, object_id),
                          lambda node: node_page_context(request, node, can_act=self.has_act_permission(request, node)))


class ServiceRatesAdmin(ServiceAdmin):
    """Services, with each service's success and failure per node over the time range on its page."""

    change_form_template = "admin/workflows/service/change_form.html"

    def change_view(self, request, object_id, form_url="", extra_context=None):
        def page(service: Service) -> dict[str, Any]:
            window = page_rates(request, service_id=service.pk)
            return {"service_rates": window["rates"], "service_rates_range": window["range"],
                    "service_rates_picker": window["picker"], "service_rates_nodes": sees_infrastructure(request.user)}

        return _with_page(super().change_view, request, object_id, form_url, extra_context,
                          self.get_object(request, object_id), page)


#: What an empty cell shows, as Django's lists do.
EMPTY = admin.site.empty_value_display


def job_link(job_id: Any) -> str:
    """A job's short id, linking to its page; a dash for none."""
    if not job_id:
        return EMPTY
    return format_html('<a href="{}">{}</a>', reverse("admin:jobs_job_change", args=[job_id]), ids.short_id(job_id))


def task_link(task_id: Any, task: Task | None) -> str:
    """A task's key (its short id once the task is gone), linking to its page; a dash for none."""
    if not task_id:
        return EMPTY
    label = task.task_key if task is not None else ids.short_id(task_id)
    return format_html('<a href="{}">{}</a>', reverse("admin:jobs_task_change", args=[task_id]), label)


def node_link(name: str) -> str:
    return format_html('<a href="{}">{}</a>', reverse("admin:nodes_node_change", args=[name]), name) if name else EMPTY


class LinkedRowsMixin(admin.ModelAdmin):
    """Rows of the read-only lists (events, attempts, artifacts) link their job and task by name.

    The raw id columns (``task_column``, ``job_id``) become links; the task's key comes from
    ``list_select_related`` (one join by primary key for the page's rows).
    """

    task_column = "task_id"

    def get_list_display(self, request: HttpRequest) -> Any:
        out: list[Any] = []
        columns = tuple(super().get_list_display(request))
        for name in columns:
            if name == "job_id":
                out.append("job_link")
            elif name == self.task_column:
                out += ["task_link"] if "job_id" in columns else ["job_link", "task_link"]
            else:
                out.append("node_link" if name == "node" else name)
        return out

    @admin.display(description="job")
    def job_link(self, obj: Any) -> str:
        return job_link(obj.job_id if hasattr(obj, "job_id") else obj.task.job_id)

    @admin.display(description="task")
    def task_link(self, obj: Any) -> str:
        return task_link(obj.task_id, obj.task if obj.task_id else None)

    @admin.display(description="node", ordering="node")
    def node_link(self, obj: Any) -> str:
        return node_link(obj.node)


class EventLinksAdmin(LinkedRowsMixin, EventAdmin):
    """The timeline, each row linking to its job and task, in the time range (the partitions' key)."""

    list_filter: ClassVar[tuple[Any, ...]] = (*EventAdmin.list_filter, time_range_filter("ts"))

    list_select_related = ("task",)


class AttemptLinksAdmin(LinkedRowsMixin, AttemptAdmin):
    """Attempts, each row linking to its job, task and node, filterable by node, service and time range."""

    list_filter: ClassVar[tuple[Any, ...]] = (*AttemptAdmin.list_filter, NodeListFilter, AttemptServiceFilter,
                        time_range_filter("started_at"))

    task_column = "task"
    list_display_links = ("attempt_no",)  # the first column links its job: the attempt's own page is its number


class ArtifactLinksAdmin(LinkedRowsMixin, ArtifactAdmin):
    """Artifacts, each row linking to its job and task."""

    list_select_related = ("task",)


for model, page_admin in ((Job, JobPageAdmin), (Task, TaskPageAdmin), (Node, NodePageAdmin),
                          (Event, EventLinksAdmin), (Attempt, AttemptLinksAdmin), (Artifact, ArtifactLinksAdmin),
                          (Service, ServiceRatesAdmin)):
    admin.site.unregister(model)
    admin.site.register(model, page_admin)
