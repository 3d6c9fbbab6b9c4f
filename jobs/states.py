"""The transition table: which status may follow which, for tasks and jobs.

Every verb that changes a status names its source and target states from these sets, and the
test suite checks every status event it wrote against this table. Where an operator's verb applies
(:data:`JOB_VERBS`, :data:`TASK_VERBS`) is stated once, from the same sets: the verbs refuse
elsewhere and the cockpit offers their buttons exactly there (:func:`job_actions_for`,
:func:`task_actions_for`). SQL that needs a set of
states takes it from here (:func:`sql_in`), so a state is never retyped as a literal list.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from jobs import models
from jobs.models import ApprovalState, JobStatus, TaskStatus

T = TaskStatus
J = JobStatus

TASK_FINAL: frozenset[str] = frozenset(models.TASK_FINAL)
TASK_HELD: frozenset[str] = frozenset(models.TASK_HELD)
TASK_UNSTARTED: frozenset[str] = frozenset(models.TASK_UNSTARTED)
# Final states that mean "this task did not succeed": its dependents can no longer run.
TASK_UNSUCCESSFUL: frozenset[str] = frozenset({T.ERROR, T.SKIPPED, T.CANCELED, T.BLOCKED})
# States an operator's retry puts back to work.
TASK_RETRYABLE: frozenset[str] = frozenset({T.ERROR, T.SKIPPED, T.CANCELED, T.BLOCKED})

JOB_FINAL: frozenset[str] = frozenset(models.JOB_FINAL)
JOB_ACTIVE: frozenset[str] = frozenset(models.JOB_ACTIVE)
# Admitted jobs (tasks created): "running" while a task of it is starting or running, else "waiting".
JOB_ADMITTED: frozenset[str] = frozenset(models.JOB_ADMITTED)
JOB_RETRYABLE: frozenset[str] = frozenset(models.JOB_FAILED)

# Task status → the statuses it may move to. "created" is the pseudo-state of a new row.
TASK_TRANSITIONS: dict[str, frozenset[str]] = {
    "created": frozenset({T.WAITING, T.QUEUED, T.BLOCKED}),
    # waiting → queued: its dependencies are done (for an "always" step: final, whatever their outcome).
    # waiting → error: its step fans out over a parent's list and found no list, or too many items.
    T.WAITING: frozenset({T.QUEUED, T.SKIPPED, T.CANCELED, T.ERROR}),
    # scheduled → queued: the retry's backoff is over.
    T.SCHEDULED: frozenset({T.QUEUED, T.SKIPPED, T.CANCELED, T.WAITING}),
    # queued → waiting: a retried job waits for admission before its tasks are claimable again.
    T.QUEUED: frozenset({T.STARTING, T.SKIPPED, T.CANCELED, T.BLOCKED, T.WAITING}),
    # starting/running → queued: a retry after a failed, expired or interrupted attempt.
    T.STARTING: frozenset({T.RUNNING, T.DONE, T.QUEUED, T.SCHEDULED, T.ERROR, T.CANCELED}),
    T.RUNNING: frozenset({T.DONE, T.QUEUED, T.SCHEDULED, T.ERROR, T.CANCELED}),
    T.DONE: frozenset(),
    # error/skipped/canceled → blocked: a retry of a task whose service was blocked on its host since.
    T.ERROR: frozenset({T.QUEUED, T.WAITING, T.BLOCKED}),
    T.SKIPPED: frozenset({T.QUEUED, T.WAITING, T.BLOCKED}),
    T.CANCELED: frozenset({T.QUEUED, T.WAITING, T.BLOCKED}),
    T.BLOCKED: frozenset({T.QUEUED, T.WAITING}),
}

JOB_TRANSITIONS: dict[str, frozenset[str]] = {
    # created → waiting: started at once (due, no approval, no cap), its tasks created with it.
    "created": frozenset({J.QUEUED, J.WAITING}),
    # queued → waiting: admitted, its tasks created.
    J.QUEUED: frozenset({J.WAITING, J.ERROR, J.CANCELED}),
    # waiting ⇄ running: a task of it started; its last starting or running task ended.
    J.WAITING: frozenset({J.RUNNING, J.DONE, J.PARTIAL, J.ERROR, J.CANCELED}),
    J.RUNNING: frozenset({J.WAITING, J.DONE, J.PARTIAL, J.ERROR, J.CANCELED}),
    J.DONE: frozenset({J.WAITING}),  # one task retried by an operator
    J.PARTIAL: frozenset({J.WAITING, J.QUEUED}),
    J.ERROR: frozenset({J.WAITING, J.QUEUED}),
    J.CANCELED: frozenset({J.WAITING, J.QUEUED}),
}


def task_may(frm: str, to: str) -> bool:
    """Return whether a task may move from ``frm`` to ``to``."""
    return to in TASK_TRANSITIONS.get(frm, frozenset())


def job_may(frm: str, to: str) -> bool:
    """Return whether a job may move from ``frm`` to ``to``."""
    return to in JOB_TRANSITIONS.get(frm, frozenset())


def sql_in(states: Iterable[str]) -> str:
    """Render a state set as a SQL list literal, e.g. ``('done', 'error')``, in a stable order."""
    return "(" + ", ".join(f"'{str(s)}'" for s in sorted(str(s) for s in states)) + ")"


A = ApprovalState
APPROVALS: frozenset[str] = frozenset(A.values)


@dataclass(frozen=True)
class VerbRule:
    """Where an operator's verb applies to a job or task.

    ``statuses``: the states it acts on; ``approvals``: the job's approval states it allows;
    ``while_stopping``: whether it applies while tasks that a cancel told to stop still run (a
    retry then would run beside them); ``repeat_cancel``: whether it applies again to a held task
    whose cancel was requested already.
    """

    statuses: frozenset[str]
    approvals: frozenset[str] = APPROVALS
    while_stopping: bool = True
    repeat_cancel: bool = True

    def applies(self, status: str, *, approval: str, stopping: int = 0, cancel_requested: bool = False) -> bool:
        """Return whether the verb applies to something in ``status`` whose job's approval is ``approval``."""
        return (status in self.statuses and approval in self.approvals
                and (self.while_stopping or not stopping)
                and (self.repeat_cancel or not cancel_requested))


#: The operators' job verbs (:mod:`jobs.verbs`), in the order their buttons show.
JOB_VERBS: dict[str, VerbRule] = {
    "approve": VerbRule(frozenset({J.QUEUED}), approvals=frozenset({A.PENDING})),
    # A job canceled while it waited for approval may still be rejected for good.
    "reject": VerbRule(JOB_ACTIVE | JOB_FINAL, approvals=frozenset({A.PENDING})),
    # A job canceled while it waited for approval goes back to waiting for approval.
    "retry": VerbRule(JOB_RETRYABLE, approvals=APPROVALS - {A.REJECTED}, while_stopping=False),
    "cancel": VerbRule(JOB_ACTIVE),
}

#: The operators' task verbs: retry waits for the job's approval; a held task is told to stop once.
TASK_VERBS: dict[str, VerbRule] = {
    "retry": VerbRule(TASK_RETRYABLE, approvals=APPROVALS - {A.PENDING, A.REJECTED}, while_stopping=False),
    "cancel": VerbRule(TASK_UNSTARTED | frozenset(models.TASK_HELD), repeat_cancel=False),
}


def job_actions_for(job: models.Job, *, tasks_stopping: int = 0) -> list[str]:
    """Return the verbs that apply to a job in its current state (the buttons on its page).

    ``tasks_stopping``: tasks of the finished job an agent still holds, told to stop by its
    cancel; retry waits until they have stopped, so a retried job never runs beside its last attempt.
    """
    return [name for name, rule in JOB_VERBS.items()
            if rule.applies(job.status, approval=job.approval_state, stopping=tasks_stopping)]


def task_actions_for(task: models.Task, *, approval: str, tasks_stopping: int = 0) -> list[str]:
    """Return the verbs that apply to a task in its current state; ``approval`` is its job's approval state.

    ``tasks_stopping`` is as for :func:`job_actions_for`, counted over the task's finished job.
    """
    return [name for name, rule in TASK_VERBS.items()
            if rule.applies(task.status, approval=approval, stopping=tasks_stopping,
                            cancel_requested=task.cancel_requested_at is not None)]
