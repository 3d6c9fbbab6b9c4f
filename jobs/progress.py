"""How far a job or task has come, as the cockpit shows it: progress from the tasks, attempts against the budget.

The jobs list, the job, task and node pages and the API read these, so a job's progress and a task's
attempt read the same everywhere.
"""

from __future__ import annotations

from django.db.models import Avg, Case, F, FloatField, OuterRef, Subquery, Value, When
from django.db.models.functions import Coalesce

from jobs.models import TASK_HELD, Job, JobStatus, Task, TaskStatus


def _task_share() -> Case:
    """A task's part of its job's progress: 1 when done, its reported progress while held, else 0."""
    return Case(When(status=TaskStatus.DONE, then=Value(1.0)),
                When(status__in=TASK_HELD, then=Coalesce(F("progress"), Value(0.0))),
                default=Value(0.0), output_field=FloatField())


def job_progress_subquery() -> Subquery:
    """The mean of a job's tasks' shares, per job row (the jobs list annotates its page with it).

    The stored ``Job.progress`` is the share of *finished* tasks (failed ones too), so it reads
    100 % for a failed job and 0 % for a job whose only task is half done; operators see this.
    """
    tasks = (Task.objects.filter(job_id=OuterRef("pk")).order_by().values("job_id")
             .annotate(share=Avg(_task_share())).values("share"))  # task_job_key_unique (job first)
    return Subquery(tasks, output_field=FloatField())


def job_progress(job: Job, tasks_share: float | None) -> float:
    """Return the progress to show for a job: full once done, else the mean of its tasks' shares."""
    if job.status == JobStatus.DONE:
        return 1.0
    return max(0.0, min(1.0, tasks_share or 0.0))


def job_progress_of(job: Job) -> float:
    """Return :func:`job_progress` for one job, reading its tasks' shares in one query."""
    share = Task.objects.filter(job_id=job.pk).aggregate(share=Avg(_task_share()))["share"]
    return job_progress(job, share)


def shown_progress(task: Task) -> float | None:
    """Return the 0..1 progress to draw for a task: its reported progress, full once done."""
    if task.status == TaskStatus.DONE:
        return 1.0
    if task.progress is None:
        return None if task.status not in TASK_HELD else 0.0
    return max(0.0, min(1.0, task.progress))


def attempt_text(*, attempt: int, max_attempts: int, budget: int) -> str:
    """Describe a task's attempt against its retry budget: ``attempt 2 (retry 1 of 2)``.

    ``budget`` is the service's attempts per run. An operator's retry renews the budget on top of
    the attempts already used (``max_attempts`` = used + budget), so numbering goes on (attempt 4)
    while the retries count from the renewal.
    """
    if attempt <= 0:
        return f"not started (up to {max_attempts} attempt{'s' if max_attempts != 1 else ''})"
    base = max_attempts - budget
    if budget < 1 or base < 0 or attempt <= base:
        return f"attempt {attempt} of {max_attempts}"  # the service's budget changed since: plain numbers
    retry = attempt - base - 1
    if budget == 1:
        return f"attempt {attempt} (no retries)"
    if retry == 0:
        return f"attempt {attempt} (first of {budget})"
    return f"attempt {attempt} (retry {retry} of {budget - 1})"
