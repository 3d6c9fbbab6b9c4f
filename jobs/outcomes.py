"""What an agent reports about an attempt, and what a report changed: plain values, no database."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

# The error codes of an interrupted attempt: not the task's fault, queued again at once, and the
# attempt does not use up the retry budget.
INTERRUPTED_BY_SHUTDOWN = "interrupted"  # the agent shut down and stopped it (a second SIGTERM)
INTERRUPTED_BY_OUTAGE = "outage"  # the database was unreachable, so its lease could not be renewed
# Failures of a lease: the agent stopped work it could not renew, or the builder found the lease ended.
LEASE_LOST = "lease_lost"
LEASE_EXPIRED = "lease_expired"


@dataclass
class Outcome:
    """How one attempt ended, as reported by an agent.

    ``status``: succeeded | failed | timeout | canceled | interrupted (the attempt was stopped for a
    reason that is not the task's: the agent shut down, ``error_code`` ``interrupted``, or a
    database outage took its lease, ``error_code`` ``outage``; it is retried at once and does not
    use up the retry budget).
    """

    task_id: UUID
    attempt: int
    status: str
    results: Any = None
    exit_code: int | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    error: str = ""
    error_code: str = ""
    retryable: bool = True


@dataclass
class ReportResult:
    """What a report changed.

    ``fenced`` lists reports rejected because the attempt is no longer current; ``repeated`` lists
    reports that were already recorded, word for word (a retry after a commit whose answer was lost).
    """

    done: list[UUID] = field(default_factory=list)
    retried: list[UUID] = field(default_factory=list)
    failed: list[UUID] = field(default_factory=list)
    canceled: list[UUID] = field(default_factory=list)
    fenced: list[UUID] = field(default_factory=list)
    repeated: list[UUID] = field(default_factory=list)


ATTEMPT_ENDINGS = ("failed", "timeout", "canceled", "interrupted")
DEFAULT_ERRORS = {"timeout": "timeout", "interrupted": "interrupted: the agent shut down"}


def attempt_status_words(status: str, error: str) -> str:
    """Say an attempt's status as lists show it: an interrupted attempt names what interrupted it.

    The attempt row keeps the error text, not the code: an outage's starts ``outage:`` (the agent's or
    the rescue's report) or ``lease_lost:`` (an agent that lost its lease to a restart of PostgreSQL,
    which the failure policy counts as the outage's).
    """
    if status != "interrupted":
        return status
    if error.startswith((f"{INTERRUPTED_BY_OUTAGE}:", f"{LEASE_LOST}:")):
        return "interrupted: database outage"
    return "interrupted: agent shut down"


def attempt_ending(o: Outcome) -> tuple[str, str]:
    """Return the status and error text a report writes on its attempt row."""
    if o.status == "succeeded":
        return "succeeded", ""
    status = o.status if o.status in ATTEMPT_ENDINGS else "failed"
    return status, o.error or DEFAULT_ERRORS.get(status, "failed")
