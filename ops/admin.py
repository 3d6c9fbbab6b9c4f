"""The operators' pages of jobs, tasks and nodes, and the admin site's titles.

The lower apps register plain admins for their models (lists, filters, actions); the pages an
operator reads to understand one object — a job's picture, tasks and timeline, a task's attempts
and why it is not moving, what a node holds now — are this app's read side. So this module takes
over those registrations with the same admins plus their pages, and the lower apps import nothing
from ``ops``. The other operators' pages are wired in :mod:`ops.urls`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse

from jobs.admin import JobAdmin, TaskAdmin
from jobs.models import Job, Task
from nodes.admin import NodeAdmin, NodeListFilter
from nodes.models import Node
from ops.jobpage import job_page_context, task_page_context
from ops.nodepage import node_page_context

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


class JobPageAdmin(JobAdmin):
    """Jobs, with the job page: DAG, tasks, attempts, artifacts, timeline, why it is stuck, buttons."""

    change_form_template = "admin/jobs/job/change_form.html"

    def change_view(self, request, object_id, form_url="", extra_context=None):
        return _with_page(super().change_view, request, object_id, form_url, extra_context,
                          self.get_object(request, object_id), lambda job: job_page_context(request, job))


class TaskPageAdmin(TaskAdmin):
    """Tasks, filterable by node, with the task page: summary, buttons, attempts, why it is not moving."""

    list_filter = (*TaskAdmin.list_filter, NodeListFilter)
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


for model, page_admin in ((Job, JobPageAdmin), (Task, TaskPageAdmin), (Node, NodePageAdmin)):
    admin.site.unregister(model)
    admin.site.register(model, page_admin)
