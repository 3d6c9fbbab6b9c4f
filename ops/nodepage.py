"""The node page's read side: what the node's agents hold now, its recent failures, links to its tasks.

The page is the admin's change view of a node (:class:`nodes.admin.NodeAdmin`); this module
collects what it shows above the node's fields.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.urls import reverse
from django.utils.http import urlencode

from accs_site.admin_kit import run_interval
from jobs.models import TASK_HELD, Attempt, AttemptStatus, Task
from nodes.models import Node
from ops.jobpage import attempt_text, elapsed_text, shown_progress
from ops.rates import page_rates

#: Held tasks listed on a node's page (a node holds as many as its slots).
NODE_PAGE_TASKS = 200
#: Failures listed, and how far back (in attempts, by primary key) they are looked for: attempts
#: have no index by node, so the read stays bounded on a long history.
NODE_PAGE_FAILURES, FAILURE_WINDOW = 10, 20_000


def node_tasks_url(node: str, **params: str) -> str:
    """Return the tasks list filtered to a node (and ``params``)."""
    return f"{reverse('admin:jobs_task_changelist')}?{urlencode({'node': node, **params})}"


def node_page_context(request: HttpRequest, node: Node, *, can_act: bool) -> dict[str, Any]:
    """Collect the node's held tasks, recent failures, buttons and links."""
    held = list(Task.objects.filter(node=node.name, status__in=TASK_HELD)  # task_held_node_idx
                .select_related("service", "job").annotate(elapsed=run_interval())
                .order_by("started_at")[:NODE_PAGE_TASKS])
    for task in held:
        task.shown_progress = shown_progress(task)
        task.elapsed_text = elapsed_text(task)
        task.attempt_text = attempt_text(attempt=task.attempt, max_attempts=task.max_attempts,
                                         budget=task.service.max_attempts)
    newest = Attempt.objects.order_by("-id").values_list("id", flat=True).first() or 0
    failures = list(Attempt.objects.filter(id__gt=newest - FAILURE_WINDOW, node=node.name)
                    .exclude(status__in=(AttemptStatus.SUCCEEDED, AttemptStatus.RUNNING))
                    .select_related("task").order_by("-id")[:NODE_PAGE_FAILURES])
    ops = []
    if can_act:
        ops = ["undrain"] if node.state == "draining" else ["drain"]
    window = page_rates(request, node=node.name)
    return {
        "node_rates": window["rates"], "node_rates_range": window["range"], "node_rates_picker": window["picker"],
        "node_held": held,
        "node_failures": failures,
        "node_ops": ops,
        "node_tasks_url": node_tasks_url(node.name),
        "node_held_url": node_tasks_url(node.name, status__in="starting,running"),
    }
