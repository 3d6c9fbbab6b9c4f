"""The DAG picture of one job: its workflow's steps with its tasks' states (drawn by :mod:`workflows.dag`)."""

from __future__ import annotations

from django.db.models import Count, Max

from jobs.models import Job, Task
from workflows.dag import (  # the drawing's names, importable from here as before it moved down
    POLICY_COLOUR,
    POLICY_TAGS,
    STATUS_COLOURS,
    STATUS_PRIORITY,
    StepState,
    render_svg,
    steps_from,
)

__all__ = ["POLICY_COLOUR", "POLICY_TAGS", "STATUS_COLOURS", "STATUS_PRIORITY", "StepState", "job_dag_svg",
           "render_svg", "steps_from"]


def job_dag_svg(job: Job) -> str:
    """Render the DAG of one job from its workflow steps and a per-step aggregate of its tasks."""
    rows = (Task.objects.filter(job_id=job.pk)
            .values("step_key", "status", "service__key", "depends_on")
            .annotate(n=Count("id"), attempt=Max("attempt"), max_attempts=Max("max_attempts"), hosted=Count("host_id"))
            .order_by())
    task_rows = [{**r, "service": r["service__key"]} for r in rows]
    if job.workflow:
        definition = job.workflow.steps
    else:
        definition = [{"key": job.service.key, "service": job.service.key}] if job.service else []
    title = f"DAG of {job.target_name}"
    return render_svg(steps_from(definition, task_rows), title=title)
