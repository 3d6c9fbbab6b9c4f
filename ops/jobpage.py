"""The job page's read side: its live sections, the data.json it refreshes from, artifact downloads
and attempt logs.

The page itself is the admin's change view of a job (:class:`ops.admin.JobPageAdmin`), which asks
:func:`job_page_context` for everything above the job's fields. While the job is active the page
fetches ``job/<id>/data.json`` every few seconds and swaps in the sections it returns, the way the
dashboard does; once the job is final the answer says so and the page stops asking.

Every view here answers 404 for a job the viewer may not see, exactly as for a job that does not
exist, so ids of other tenants' jobs, artifacts and attempts reveal nothing.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, ClassVar
from uuid import UUID

from django.contrib import admin
from django.db import connection
from django.db.models import Q
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.template.defaultfilters import filesizeformat
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.http import content_disposition_header, urlencode

from accs_site.admin_kit import actor, human_age, run_interval
from accs_site.redaction import redact_params
from events.models import Artifact, ArtifactKind, Event, EventType, Level
from events.timeline import unfold
from jobs.models import JOB_ACTIVE, TASK_FINAL, TASK_HELD, Attempt, AttemptStatus, Job, JobStatus, Task, TaskStatus
from jobs.progress import attempt_text, job_progress, job_progress_of, job_progress_subquery, shown_progress
from jobs.states import job_actions_for, sql_in, task_actions_for
from jobs.verbs import self_approval_reason
from ops.dag import job_dag_svg
from ops.dashboard import query_int, refresh_seconds, sees_infrastructure
from ops.overview import job_stuck_reasons
from ops.system_timeline import system_timeline
from tenants.scoping import can_act, scope

#: Rows shown on the job page (the sections link to the full, filtered admin lists).
JOB_PAGE_TASKS, JOB_PAGE_ATTEMPTS, JOB_PAGE_EVENTS, JOB_PAGE_ARTIFACTS = 300, 100, 200, 200
#: A job's own moves between running and waiting: it is "waiting" whenever none of its tasks is
#: starting or running, so a one-task step writes a pair around every task. Operators read them as
#: flapping and act on none of them; the timeline hides them unless asked for every change.
SETTLING = ("running", "waiting")
FLAPPING = Q(task_id__isnull=True, type=EventType.STATUS, data__from__in=SETTLING, data__to__in=SETTLING)
#: The same moves folded into their tasks' rows (jobs.finalize: a report's moves, a row per task), counted;
#: the page leaves them out line by line (:func:`is_flapping`).
FOLDED_FLAPPING_SQL = f"""
SELECT count(*) FROM accs_event e
 CROSS JOIN LATERAL jsonb_array_elements(coalesce(e.data->'job_before', '[]') || coalesce(e.data->'job', '[]')) m
 WHERE e.job_id = %s AND e.task_id IS NOT NULL AND e.type = 'status'
   AND m->>'from' IN {sql_in(SETTLING)} AND m->>'to' IN {sql_in(SETTLING)}
"""


def is_flapping(line: Event) -> bool:
    """Whether a timeline line is the job's own move between running and waiting (see FLAPPING)."""
    data = line.data if isinstance(line.data, dict) else {}
    return (line.task_id is None and line.type == EventType.STATUS and data.get("from") in SETTLING
            and data.get("to") in SETTLING)


#: Event levels, lowest first (the timeline's own); a level filter keeps that level and those after it.
LEVELS = tuple(Level.values)
#: Seconds between refreshes of an active job's page (``?refresh=N`` overrides, 1-300).
REFRESH_SECONDS = 3
#: Lines an attempt log page shows by default (``?tail=N`` overrides, up to MAX_TAIL).
DEFAULT_TAIL, MAX_TAIL = 500, 20_000
#: The lengths the log page's "Lines" control offers (besides the one shown).
TAIL_CHOICES = (100, DEFAULT_TAIL, 2_000, MAX_TAIL)
#: Level names agents may write, mapped onto the page's levels.
LOG_LEVEL_ALIASES = {"warning": "warn", "critical": "error", "fatal": "error"}


# --------------------------------------------------------------------------------------------
# Rows as the pages show them
# --------------------------------------------------------------------------------------------

class _Shown:
    """A row with what a page shows beside its fields: a template reads the row's own fields and
    relations through it (``task.status``), as from the row itself."""

    #: The attribute that holds the row.
    row_attr: ClassVar[str]

    def __getattr__(self, name: str) -> Any:
        # Called only for names the wrapper lacks; private names are never the row's to give.
        if name.startswith("_") or name == type(self).row_attr:
            raise AttributeError(name)
        return getattr(getattr(self, type(self).row_attr), name)


@dataclass
class TaskRow(_Shown):
    """A task of the job page's list, with its buttons and the texts shown beside its fields."""

    row_attr: ClassVar[str] = "task"

    task: Task
    shown_progress: float | None
    elapsed_text: str
    attempt_text: str
    next_text: str
    ops: list[str]
    #: The progress as attribute and CSS values, never localised (empty without progress).
    progress_attr: str = ""
    progress_width: str = ""
    #: The step's output (what its dependents receive) as JSON, secret-named values redacted; empty without one.
    output_text: str = ""


@dataclass
class EventRow(_Shown):
    """An event of the job page's timeline, with the key of its task (empty for the job's own)."""

    row_attr: ClassVar[str] = "event"

    event: Event
    task_key: str


@dataclass
class ArtifactRow(_Shown):
    """An artifact as the pages list it: its file name, whether it can be viewed inline and, for a log,
    the attempt whose log page shows it."""

    row_attr: ClassVar[str] = "artifact"

    artifact: Artifact
    name: str
    previewable: bool
    log_attempt_id: int | None = None

    @classmethod
    def of(cls, artifact: Artifact) -> ArtifactRow:
        return cls(artifact=artifact, name=artifact_name(artifact), previewable=previewable(artifact))


# --------------------------------------------------------------------------------------------
# Access
# --------------------------------------------------------------------------------------------

def levels_from(level: str) -> tuple[str, ...]:
    """Return ``level`` and the levels above it; every level for an empty or unknown one."""
    return LEVELS[LEVELS.index(level):] if level in LEVELS else LEVELS


def visible_job(request: HttpRequest, job_id: UUID) -> Job:
    """Return the job if the viewer may see it; raise Http404 otherwise (missing or another tenant's)."""
    job = (scope(Job.objects.filter(pk=job_id), request.user)
           .select_related("tenant", "workflow", "service").first())
    if job is None:
        raise Http404("no such job")
    return job


def may_act(request: HttpRequest, job: Job) -> bool:
    """Whether the viewer may press the job's buttons (tenant admins and superusers)."""
    return request.user.is_staff and can_act(request.user, job.tenant_id, write=True)


# --------------------------------------------------------------------------------------------
# The page's sections
# --------------------------------------------------------------------------------------------

def _job_buttons(job: Job, by: str, *, stopping: int, can: bool) -> dict[str, Any]:
    """The job's buttons; Approve left out, with the reason, for whom four eyes bar from approving it."""
    ops = job_actions_for(job, tasks_stopping=stopping) if can else []
    barred = self_approval_reason(job, by=by) if "approve" in ops else None
    if barred:
        ops = [op for op in ops if op != "approve"]
    return {"job_ops": ops, "approve_barred": f"You {barred}: another approver must approve it (four eyes; "
                                              "ACC_ALLOW_SELF_APPROVAL allows self-approval)." if barred else ""}


def job_page_context(request: HttpRequest, job: Job) -> dict[str, Any]:
    """Collect the job page's picture, tasks, attempts, artifacts and timeline (each bounded)."""

    level = request.GET.get("level", "")
    level = level if level in LEVELS else ""
    event_type = request.GET.get("type", "")
    event_type = event_type if event_type in EventType.values else ""
    can = may_act(request, job)

    stopping = tasks_stopping(job)
    tasks = _tasks(job, stopping=stopping, can_act=can)
    progress = job_progress_of(job)
    task_keys = {t.task.pk: t.task.task_key for t in tasks}
    attempts = list(Attempt.objects.filter(task__job_id=job.pk).select_related("task")
                    .order_by("-id")[:JOB_PAGE_ATTEMPTS])
    events = Event.objects.filter(job_id=job.pk)
    show_all = request.GET.get("moves") == "all"
    hidden = 0
    if not show_all:
        flapping = Event.objects.filter(job_id=job.pk).filter(FLAPPING)
        with connection.cursor() as cur:
            cur.execute(FOLDED_FLAPPING_SQL, [job.pk])
            hidden = flapping.count() + cur.fetchone()[0]
        events = events.exclude(FLAPPING)
    if level:
        events = events.filter(level__in=levels_from(level))
    if event_type:
        events = events.filter(type=event_type)
    # A job's creation is one row for the job and its tasks: shown as its lines, newest first like the rest.
    shown_levels = levels_from(level)
    timeline = [EventRow(event=line, task_key=task_keys.get(line.task_id, "") if line.task_id else "")
                for event in events.order_by("-ts", "-id")[:JOB_PAGE_EVENTS]
                for line in reversed(unfold(event))
                if line.level in shown_levels and (show_all or not is_flapping(line))]
    artifacts = _artifacts(job)
    attempt_ids: dict[tuple[UUID | None, int | None], int] = {(a.task_id, a.attempt_no): a.pk for a in attempts}
    for row in artifacts:
        is_log = row.artifact.kind == ArtifactKind.LOG
        row.log_attempt_id = attempt_ids.get((row.artifact.task_id, row.artifact.attempt)) if is_log else None
    page_url = reverse("admin:jobs_job_change", args=[job.pk])
    return {
        # A canceled job is final at once, but its running tasks stop at their next heartbeat: the
        # page keeps refreshing until they have.
        "job_active": job.status in JOB_ACTIVE or bool(stopping),
        "tasks_stopping": stopping,
        "job_progress": progress,
        "page_url": page_url + (f"?{request.GET.urlencode()}" if request.GET else ""),
        "data_url": reverse("ops:job_data", args=[job.pk]) + (f"?{request.GET.urlencode()}" if request.GET else ""),
        "refresh_seconds": refresh_seconds(request, REFRESH_SECONDS),
        "dag_svg": job_dag_svg(job),
        **_job_buttons(job, actor(request), stopping=stopping, can=can),
        "job_tasks": tasks,
        "job_tasks_capped": len(tasks) >= JOB_PAGE_TASKS,
        "job_attempts": attempts,
        "job_artifacts": artifacts,
        "artifacts_capped": len(artifacts) >= JOB_PAGE_ARTIFACTS,
        "job_events": timeline,
        "event_level": level,
        "event_type": event_type,
        "level_links": _filter_links(request, page_url, "level", [(lv, f"≥ {lv}") for lv in LEVELS]),
        "type_links": _filter_links(request, page_url, "type", EventType.choices),
        "events_capped": len(timeline) >= JOB_PAGE_EVENTS,
        "job_stuck": job_stuck_reasons(job, show_nodes=sees_infrastructure(request.user)),
        "moves_hidden": hidden,
        "moves_links": _filter_links(request, page_url, "moves", [("all", "every job status change")],
                                     unset="hide job running ↔ waiting"),
        "can_act": can,
        **_system_context(request, job),
    }


def _system_context(request: HttpRequest, job: Job) -> dict[str, Any]:
    """The system timeline while the job ran (created → finished, or now), for those who see the infrastructure."""
    if not sees_infrastructure(request.user):
        return {}
    until = job.finished_at or timezone.now()
    return {"system_events": system_timeline(since=min(job.created_at, until), until=until),
            "system_window": "while this job ran" if job.finished_at else "since this job was created",
            "show_system": True}


def task_page_context(request: HttpRequest, task: Task) -> dict[str, Any]:
    """Collect the task page's summary, buttons, attempts and why it is not moving (its job's reasons
    that concern this task: its service's, or its own backoff)."""
    job = task.job
    reasons = [r for r in job_stuck_reasons(job, show_nodes=sees_infrastructure(request.user))
               if (r.reason == "backoff" and r.message.startswith(f"task {task.task_key} "))
               or (r.reason != "backoff" and (r.service == task.service.key or job.status == JobStatus.QUEUED))]
    if task.status not in ("waiting", "queued", "scheduled"):
        reasons = []
    elapsed = Task.objects.filter(pk=task.pk).annotate(elapsed=run_interval()).values_list("elapsed", flat=True).first()
    attempts = list(Attempt.objects.filter(task_id=task.pk).order_by("-attempt_no")[:JOB_PAGE_ATTEMPTS])
    return {
        "task_stuck": reasons,
        "task_ops": task_actions_for(task, approval=job.approval_state, tasks_stopping=tasks_stopping(job))
        if may_act(request, job) else [],
        "task_attempt_text": attempt_text(attempt=task.attempt, max_attempts=task.max_attempts,
                                          budget=task.service.max_attempts),
        "task_elapsed": elapsed_text(task, elapsed=elapsed),
        "task_progress": shown_progress(task),
        "task_attempts": attempts,
        "task_job": job,
        "task_page_url": reverse("admin:jobs_task_change", args=[task.pk]),
        "task_due_in": (task.next_attempt_at - timezone.now()).total_seconds()
        if task.status in ("queued", "scheduled") else None,
    }


def tasks_stopping(job: Job) -> int:
    """Return how many tasks of a finished job an agent still holds (told to stop, not stopped yet)."""
    if job.status in JOB_ACTIVE:
        return 0
    return Task.objects.filter(job_id=job.pk, status__in=TASK_HELD).count()  # task_job_open_idx


def _tasks(job: Job, *, stopping: int, can_act: bool) -> list[TaskRow]:
    """Return the job's tasks in the workflow's step order, each with its elapsed time, texts and buttons."""
    tasks = list(Task.objects.filter(job_id=job.pk).select_related("service", "host").annotate(elapsed=run_interval())
                 .order_by("created_at", "task_key")[:JOB_PAGE_TASKS])
    now = timezone.now()
    # Show tasks in the order of the workflow's steps (they are created together).
    workflow = job.workflow if job.workflow_id else None
    position = {s.get("key"): i for i, s in enumerate(workflow.steps or [])} if workflow is not None else {}
    tasks.sort(key=lambda t: (position.get(t.step_key, len(position)), t.task_key))
    return [_task_row(task, job=job, now=now, stopping=stopping, can_act=can_act) for task in tasks]


def _task_row(task: Task, *, job: Job, now: datetime, stopping: int, can_act: bool) -> TaskRow:
    progress = shown_progress(task)
    row = TaskRow(
        task=task, shown_progress=progress, elapsed_text=elapsed_text(task),
        attempt_text=attempt_text(attempt=task.attempt, max_attempts=task.max_attempts,
                                  budget=task.service.max_attempts),
        next_text=next_attempt_text(task, now=now),
        ops=task_actions_for(task, approval=job.approval_state, tasks_stopping=stopping) if can_act else [],
        output_text=output_text(task.results),
    )
    if progress is not None:  # attribute and CSS values, never localised
        row.progress_attr, row.progress_width = f"{progress:.3f}", f"{progress * 100:.1f}"
    return row


def output_text(results: Any) -> str:
    """Return a step's output as the job page shows it: compact JSON, secret-named values redacted."""
    if results is None:
        return ""
    return json.dumps(redact_params(results), ensure_ascii=False, separators=(",", ":"), default=str)


def next_attempt_text(task: Task, *, now: datetime) -> str:
    """Say when a queued task may start: "due now" once its time has come, else "in 4 min"."""
    if task.status not in (TaskStatus.QUEUED, TaskStatus.SCHEDULED):
        return ""
    ahead = (task.next_attempt_at - now).total_seconds()
    return f"in {human_age(ahead)}" if ahead > 1 else "due now"


def elapsed_text(task: Task, *, elapsed: timedelta | None = None) -> str:
    """Describe how long a held task has been running, or how long a finished one ran.

    ``elapsed`` defaults to the task's ``elapsed`` annotation (:func:`accs_site.admin_kit.run_interval`).
    """
    elapsed = elapsed if elapsed is not None else getattr(task, "elapsed", None)
    if elapsed is None or not (task.status in TASK_HELD or task.status in TASK_FINAL):
        return ""  # not started, or queued again for a retry: the last start says nothing about now
    return human_age(elapsed.total_seconds())


def _artifacts(job: Job) -> list[ArtifactRow]:
    return [ArtifactRow.of(artifact) for artifact in Artifact.objects.filter(job_id=job.pk).select_related("task")
            .order_by("task__task_key", "attempt", "kind", "key")[:JOB_PAGE_ARTIFACTS]]


def artifact_name(artifact: Artifact) -> str:
    """Return the file name of an artifact: its key after ``{kind}/{job}/{task}/``."""
    parts = artifact.key.split("/", 3)
    return parts[3] if len(parts) == 4 else artifact.key


def _filter_links(request: HttpRequest, page_url: str, name: str,
                  choices: Iterable[tuple[str, str]], *, unset: str = "all") -> list[dict[str, Any]]:
    """Build one filter's links, each keeping the page's other filters."""
    others = {k: request.GET[k] for k in request.GET if k != name}  # each one's last value, as QueryDict.items()
    current = request.GET.get(name, "")

    def link(value: str) -> str:
        params = {**others, name: value} if value else others
        return f"{page_url}?{urlencode(params)}#accs-timeline" if params else f"{page_url}#accs-timeline"

    out = [{"value": "", "label": unset, "url": link(""), "active": not current}]
    out += [{"value": value, "label": label, "url": link(value), "active": current == value}
            for value, label in choices]
    return out


def job_data_view(request: HttpRequest, job_id: UUID) -> JsonResponse:
    """Return the job's live sections, rendered, and whether the page should keep refreshing."""
    job = visible_job(request, job_id)
    context = {"original": job, **job_page_context(request, job)}
    html = render_to_string("admin/jobs/job/_live.html", context, request=request)
    return JsonResponse({
        "status": job.status,
        "active": context["job_active"],
        "progress": context["job_progress"],
        "generated_at": timezone.now().isoformat(),
        "html": html,
    })


# --------------------------------------------------------------------------------------------
# Artifacts
# --------------------------------------------------------------------------------------------

def artifact_download_view(request: HttpRequest, job_id: UUID, artifact_id: int) -> HttpResponseBase:
    """Stream one of the job's artifacts from object storage as an attachment."""
    # Storage's modules (boto3) load only when a page reads a file.
    from events.artifacts import StorageNotConfigured, open_artifact

    job = visible_job(request, job_id)
    artifact = Artifact.objects.filter(pk=artifact_id, job_id=job.pk).first()
    if artifact is None:
        raise Http404("no such artifact")
    try:
        chunks = open_artifact(artifact)
    except FileNotFoundError:
        raise Http404("the artifact's object is missing from storage") from None
    except StorageNotConfigured as exc:
        return HttpResponse(str(exc), status=503, content_type="text/plain; charset=utf-8")
    response = StreamingHttpResponse(chunks, content_type=artifact.content_type or "application/octet-stream")
    response["Content-Length"] = str(artifact.size_bytes)
    response["Content-Disposition"] = content_disposition_header(True, artifact_name(artifact).rsplit("/", 1)[-1])
    response["X-Content-Type-Options"] = "nosniff"
    return response


#: Text and JSON artifacts are shown inline up to this size, read whole and so checked against their
#: checksum; of a bigger one, the first this many bytes (a part, which no checksum covers).
PREVIEW_MAX_BYTES = 512 * 1024
PREVIEW_SUFFIXES = (".txt", ".log", ".csv", ".tsv", ".json", ".jsonl", ".md", ".yaml", ".yml", ".xml", ".html")


def previewable(artifact: Artifact) -> bool:
    """Whether an artifact is text or JSON the page can show inline (whole, or its first part)."""
    kind = (artifact.content_type or "").split(";")[0].strip().lower()
    texty = kind.startswith("text/") or kind.endswith(("/json", "+json", "/x-ndjson", "/xml", "/yaml"))
    return texty or artifact_name(artifact).lower().endswith(PREVIEW_SUFFIXES)


def read_first(artifact: Artifact, limit: int) -> bytes:
    """Return the first ``limit`` bytes of an artifact, reading no further (the object is closed after)."""
    from events.artifacts import open_artifact  # as the views below: storage's modules load when a page reads it

    chunks, kept = open_artifact(artifact), bytearray()
    try:
        for chunk in chunks:
            kept += chunk
            if len(kept) >= limit:
                break
    finally:
        chunks.close()  # stops the download; the checksum, which needs every byte, is not checked
    return bytes(kept[:limit])


def artifact_preview_view(request: HttpRequest, job_id: UUID, artifact_id: int) -> HttpResponse:
    """Show a text or JSON artifact inline, escaped: whole (JSON indented) and checked against its checksum up
    to :data:`PREVIEW_MAX_BYTES`, else its first :data:`PREVIEW_MAX_BYTES`, said to be a part."""
    # Storage's modules (boto3) load only when a page reads a file.
    from events.artifacts import ChecksumMismatch, StorageNotConfigured, read_artifact

    job = visible_job(request, job_id)
    artifact = Artifact.objects.filter(pk=artifact_id, job_id=job.pk).select_related("task").first()
    if artifact is None:
        raise Http404("no such artifact")
    text, problem, part = "", "", ""
    whole = artifact.size_bytes <= PREVIEW_MAX_BYTES
    if not previewable(artifact):
        problem = (f"Only text and JSON are shown here; download this one "
                   f"({artifact.content_type}, {artifact.size_bytes} bytes).")
    else:
        try:
            raw = read_artifact(artifact) if whole else read_first(artifact, PREVIEW_MAX_BYTES)
            text = raw.decode("utf-8", errors="replace")
            if not whole:
                part = (f"The first {PREVIEW_MAX_BYTES // 1024} KB of {filesizeformat(artifact.size_bytes)} are shown; "
                        "download the file for the rest (a part is not checked against the recorded checksum).")
        except StorageNotConfigured as exc:
            problem = str(exc)
        except FileNotFoundError:
            problem = f"The artifact's object {artifact.key} is missing from storage."
        except ChecksumMismatch as exc:
            problem = f"The artifact was changed after it was stored and is not shown: {exc}"
    is_json = artifact_name(artifact).lower().endswith(".json") or "/json" in (artifact.content_type or "")
    if text and is_json and whole:
        try:
            text = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        except ValueError:
            pass  # JSON lines, or not JSON after all: shown as stored
    context = {
        **admin.site.each_context(request),
        "title": f"{artifact_name(artifact)} ({artifact.kind})",
        "job": job, "artifact": artifact, "text": text, "problem": problem, "part": part,
        "job_url": reverse("admin:jobs_job_change", args=[job.pk]),
        "download_url": reverse("ops:job_artifact", args=[job.pk, artifact.pk]),
    }
    return TemplateResponse(request, "admin/accs/artifact_preview.html", context)


# --------------------------------------------------------------------------------------------
# Attempt logs
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LogLine:
    """One record of an attempt's log, as the page shows it."""

    ts: datetime | None
    level: str
    message: str


@dataclass(frozen=True)
class LogTail:
    """The last lines of a log that pass a level filter, and how many lines were read in all."""

    lines: list[LogLine]
    total: int
    matched: int


def parse_log_line(raw: str) -> LogLine | None:
    """Turn one ``.jsonl`` line into a :class:`LogLine` (None for a blank line).

    A line that is not a JSON object is shown as it is, at level info, rather than dropped.
    """
    raw = raw.strip()
    if not raw:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        return LogLine(ts=None, level="info", message=raw)
    level = str(record.get("level") or "info").lower()
    level = LOG_LEVEL_ALIASES.get(level, level)
    ts = None
    if isinstance(record.get("ts"), str):
        try:
            ts = datetime.fromisoformat(record["ts"])
        except ValueError:
            ts = None
    return LogLine(ts=ts, level=level if level in LEVELS else "info", message=str(record.get("message", "")))


def tail_log(chunks: Iterable[bytes], *, min_level: str = "", tail: int = DEFAULT_TAIL) -> LogTail:
    """Read a log's chunks line by line and keep the last ``tail`` lines at ``min_level`` or above.

    Only the kept lines stay in memory, however long the log is.
    """
    wanted = set(levels_from(min_level))
    kept: deque[LogLine] = deque(maxlen=tail)
    total = matched = 0
    for raw in _lines(chunks):
        line = parse_log_line(raw)
        if line is None:
            continue
        total += 1
        if line.level in wanted:
            matched += 1
            kept.append(line)
    return LogTail(lines=list(kept), total=total, matched=matched)


def _lines(chunks: Iterable[bytes]) -> Iterator[str]:
    pending = b""
    for chunk in chunks:
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.decode("utf-8", errors="replace")
    if pending:
        yield pending.decode("utf-8", errors="replace")


def tail_size(request: HttpRequest) -> int:
    """Return the number of lines to show: ``?tail=N`` (1 to MAX_TAIL) or :data:`DEFAULT_TAIL`."""
    return query_int(request, "tail", default=DEFAULT_TAIL, low=1, high=MAX_TAIL)


def attempt_log_view(request: HttpRequest, job_id: UUID, attempt_id: int) -> HttpResponse:
    """Show an attempt's log (its ``.jsonl`` log artifact) as a table, filtered and tailed."""
    # Storage's modules (boto3) load only when a page reads a file.
    from events.artifacts import ChecksumMismatch, StorageNotConfigured, open_artifact

    job = visible_job(request, job_id)
    attempt = Attempt.objects.filter(pk=attempt_id, task__job_id=job.pk).select_related("task").first()
    if attempt is None:
        raise Http404("no such attempt")
    level = request.GET.get("level", "")
    level = level if level in LEVELS[1:] else ""
    tail = tail_size(request)
    artifact = (Artifact.objects.filter(task_id=attempt.task_id, attempt=attempt.attempt_no, kind=ArtifactKind.LOG)
                .order_by("-created_at").first())
    problem, log = "", None
    running = attempt.status == AttemptStatus.RUNNING
    if artifact is None and running:
        log = timeline_log(attempt, min_level=level, tail=tail)
    elif artifact is None:
        problem = ("This attempt has no log artifact: agents store one when an attempt ends and artifact "
                   "storage is configured. The attempt's output tails are on the job page.")
    else:
        try:
            log = tail_log(open_artifact(artifact), min_level=level, tail=tail)
        except StorageNotConfigured:
            problem = ("Artifact storage is not configured on this server (ACC_MINIO_ENDPOINT, ACC_MINIO_ACCESS_KEY, "
                       "ACC_MINIO_SECRET_KEY), so the log cannot be read.")
        except FileNotFoundError:
            problem = f"The log's object {artifact.key} is missing from storage."
        except ChecksumMismatch as exc:
            problem = f"The log was changed after it was stored and is not shown: {exc}"
    page = reverse("ops:attempt_log", args=[job.pk, attempt.pk])
    others: dict[str, int | str] = {"tail": tail} if "tail" in request.GET else {}
    level_links = [{"label": "all", "url": f"{page}?{urlencode(others)}" if others else page, "active": not level}]
    level_links += [{"label": f"≥ {lv}", "value": lv, "url": f"{page}?{urlencode({**others, 'level': lv})}",
                     "active": level == lv} for lv in LEVELS[1:]]
    live = artifact is None and running
    files = [ArtifactRow.of(file)
             for file in Artifact.objects.filter(task_id=attempt.task_id, attempt=attempt.attempt_no)
             .exclude(kind=ArtifactKind.LOG).order_by("kind", "key")[:JOB_PAGE_ARTIFACTS]]
    context = {
        "files": files,
        **admin.site.each_context(request),
        "live": live,
        "live_url": f"{page}?{urlencode({**request.GET.dict(), 'format': 'json'})}",
        "refresh_seconds": refresh_seconds(request, REFRESH_SECONDS),
        "title": f"Log of {attempt.task.task_key}, attempt {attempt.attempt_no}",
        "job": job,
        "attempt": attempt,
        "artifact": artifact,
        "log": log,
        "problem": problem,
        "level": level,
        "level_links": level_links,
        "tail": tail,
        "tail_choices": sorted({*TAIL_CHOICES, tail}),
        "max_tail": MAX_TAIL,
        "job_url": reverse("admin:jobs_job_change", args=[job.pk]),
        "download_url": reverse("ops:job_artifact", args=[job.pk, artifact.pk]) if artifact else "",
    }
    if request.GET.get("format") == "json":
        html = render_to_string("admin/accs/_attempt_log_lines.html", context, request=request)
        return JsonResponse({"html": html, "active": live, "status": attempt.status,
                             "generated_at": timezone.now().isoformat()})
    return TemplateResponse(request, "admin/accs/attempt_log.html", context)


def timeline_log(attempt: Attempt, *, min_level: str = "", tail: int = DEFAULT_TAIL) -> LogTail:
    """Return a running attempt's last log lines from the timeline (its log artifact comes when it ends).

    Agents write each line the command prints to the timeline as a ``log`` event of the task and
    attempt, so the running attempt's page tails those (event_task_ts_idx, newest first).
    """
    lines = Event.objects.filter(task_id=attempt.task_id, attempt=attempt.attempt_no, type=EventType.LOG)
    matched = lines.filter(level__in=levels_from(min_level)) if min_level else lines
    newest = list(matched.order_by("-ts", "-id").values_list("ts", "level", "message")[:tail])
    return LogTail(lines=[LogLine(ts=ts, level=LOG_LEVEL_ALIASES.get(lv, lv), message=msg)
                          for ts, lv, msg in reversed(newest)],
                   total=lines.count(), matched=matched.count())


__all__ = [
    "DEFAULT_TAIL", "LEVELS", "LogLine", "LogTail", "artifact_download_view", "artifact_preview_view",
    "attempt_log_view", "job_data_view",
    "job_page_context", "parse_log_line", "tail_log", "visible_job",
    # Moved to jobs.progress (the jobs list reads them too); still importable from here.
    "attempt_text", "job_progress", "job_progress_of", "job_progress_subquery", "shown_progress",
]
