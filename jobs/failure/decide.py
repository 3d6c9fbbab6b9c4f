"""Deciding what a failed attempt does to its task: a pure function, no database.

For a batch of attempt outcomes (failed, timed out, canceled, interrupted) and the facts about
their tasks, :func:`decide` says, per task, one of:

* **cancel**: the attempt was canceled, or an operator asked for a cancel: the task ends ``canceled``;
* **requeue**: the attempt was interrupted (the agent shut down, or a database outage took its
  lease: the agent saw the database unreachable, or PostgreSQL restarted since the lease's last
  renewal): queued again at once, and the attempt does not use up the retry budget, up to the
  site's bound of refunded attempts per task (``ACC_MAX_REFUNDED_ATTEMPTS``); past it, an
  interrupted attempt counts: it is retried or dead-lettered as a failure is;
* **retry**: attempts are left: ``scheduled`` after an exponential backoff (``queued`` when the
  backoff is zero), counted from the start of the current budget;
* **dead letter**: no attempt left, or the failure is not retryable: the task ends ``error``, the
  host is quarantined when the service says so, and the step's failure policy decides what
  happens to the job (``fail_job`` fails it, ``continue`` skips the step's dependents).

:mod:`jobs.failure.apply` loads the facts and writes the decisions, one batched statement per
target state. Times are given (PostgreSQL's ``now``), the jitter's random source can be.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Any
from uuid import UUID

from jobs.backoff import backoff_delay
from jobs.outcomes import INTERRUPTED_BY_OUTAGE, LEASE_LOST, Outcome, attempt_ending

# The step failure policies (workflows.models.StepFailurePolicy), as plain words: this module
# needs no model.
FAIL_JOB = "fail_job"
CONTINUE = "continue"


class Action(str, Enum):
    CANCEL = "cancel"
    REQUEUE = "requeue"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"


@dataclass(frozen=True)
class TaskFacts:
    """What the decision needs to know about a task whose attempt ended badly."""

    task_id: UUID
    job_id: UUID
    attempt: int
    max_attempts: int
    status: str  # starting | running: the state the task leaves
    budget: int  # the service's max_attempts: the size of one retry budget
    backoff_base: float | None = None  # the service's; None: the site's default
    backoff_cap: float = 3600.0
    host_id: int | None = None
    quarantine_on_final_failure: bool = False
    cancel_requested: bool = False
    # An outage (jobs.pulse) or a restart of PostgreSQL came after its last renewal: the server went away under it.
    held_across_restart: bool = False
    # Earlier attempts of this task that ended interrupted (each refunded while under the bound).
    interrupted_before: int = 0
    step_key: str = ""
    on_failure: str | None = FAIL_JOB  # None: a job without step rows (older jobs): fail_job


@dataclass(frozen=True)
class RetryDefaults:
    """The site's retry settings (``ACC_BACKOFF_BASE_SEC``, ``ACC_BACKOFF_CAP_SEC``, ``ACC_MAX_REFUNDED_ATTEMPTS``)."""

    base: float = 15.0
    cap: float = 3600.0
    max_refunded: int = 3


@dataclass(frozen=True)
class Decision:
    """What happens to one task: its new state, the attempt row's ending, and the consequences."""

    facts: TaskFacts
    outcome: Outcome
    action: Action
    to: str  # canceled | queued | scheduled | error
    attempt_status: str
    error: str
    error_code: str
    delay: float = 0.0
    next_attempt_at: datetime | None = None
    refund: bool = False  # the attempt does not count: max_attempts grows by one
    counted_interruption: bool = False  # interrupted past the bound of refunds: it counts as a failure
    quarantine_host: bool = False  # dead letter on a host whose service quarantines it
    fail_job: bool = False  # dead letter of a fail_job step: the job fails
    continue_policy: bool = False  # dead letter of a continue step: its dependents are skipped

    @property
    def task_id(self) -> UUID:
        return self.facts.task_id

    @property
    def why(self) -> str:
        """Why an interrupted attempt does not count, in words for its event."""
        if self.error_code == INTERRUPTED_BY_OUTAGE:
            return "stopped by a database outage (its lease could not be renewed)"
        return "interrupted by the agent's shutdown"


def decide(failures: Sequence[tuple[TaskFacts, Outcome]], *, now: datetime, defaults: RetryDefaults,
           rng: random.Random | None = None) -> list[Decision]:
    """Return one decision per (task facts, outcome) pair whose outcome names the task's current attempt.

    An outcome of another attempt is left out: it is fenced, and the caller records it so.
    """
    return [decide_one(facts, outcome, now=now, defaults=defaults, rng=rng)
            for facts, outcome in failures if outcome.attempt == facts.attempt]


def _interruption(facts: TaskFacts, outcome: Outcome, *, attempt_status: str) -> str:
    """Return the error code of an attempt stopped for a reason that is not the task's, else ''."""
    if attempt_status == "interrupted":
        return outcome.error_code or "interrupted"
    if outcome.error_code == LEASE_LOST and facts.held_across_restart:
        # The agent stopped the work because it could not renew the lease, and PostgreSQL restarted
        # since the last renewal: the outage stopped it (whether or not the agent could tell).
        return INTERRUPTED_BY_OUTAGE
    return ""


def decide_one(facts: TaskFacts, outcome: Outcome, *, now: datetime, defaults: RetryDefaults,
               rng: random.Random | None = None) -> Decision:
    """Decide what one badly ended attempt does to its task (see the module's docstring)."""
    attempt_status, error = attempt_ending(outcome)
    code = outcome.error_code or attempt_status

    def made(action: Action, to: str, error_code: str, **more: Any) -> Decision:
        return Decision(facts=facts, outcome=outcome, action=action, to=to, attempt_status=attempt_status,
                        error=error, error_code=error_code, **more)

    if attempt_status == "canceled" or facts.cancel_requested:  # an operator's cancel stays a cancel
        return made(Action.CANCEL, to="canceled", error_code="canceled")
    interrupted_code = _interruption(facts, outcome, attempt_status=attempt_status)
    if interrupted_code:
        attempt_status = "interrupted"  # the attempt row says so, refunded or not: the bound counts these
        if facts.interrupted_before < defaults.max_refunded:
            return made(Action.REQUEUE, to="queued", error_code=interrupted_code, next_attempt_at=now, refund=True)
        code = interrupted_code  # past the bound: it counts, as a failure would
    counted = bool(interrupted_code)
    if outcome.retryable and facts.attempt < facts.max_attempts:
        # Count the backoff from the start of the current budget (a retried task starts over).
        in_budget = max(1, facts.attempt - (facts.max_attempts - facts.budget))
        delay = backoff_delay(in_budget, base=defaults.base if facts.backoff_base is None else facts.backoff_base,
                              cap=min(facts.backoff_cap, defaults.cap), rng=rng)
        # A retry that must wait is "scheduled", out of the claim index, until its time comes.
        return made(Action.RETRY, to="scheduled" if delay > 0 else "queued", error_code=code,
                    delay=delay, next_attempt_at=now + timedelta(seconds=delay),
                    counted_interruption=counted)
    continues = facts.on_failure == CONTINUE
    return made(Action.DEAD_LETTER, to="error", error_code=code,
                quarantine_host=facts.quarantine_on_final_failure and facts.host_id is not None,
                fail_job=not continues, continue_policy=continues, counted_interruption=counted)
