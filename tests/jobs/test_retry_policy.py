"""The retry policy as a pure function (jobs.failure.decide): no database, plain values in and out.

The real-database tests of the same path (reports, rescue, failure policies) stay where they are;
these pin the decision itself: cancel, requeue without using the budget, retry after a backoff,
dead letter with quarantine and the step's failure policy.
"""

from __future__ import annotations

import ast
import random
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from jobs.failure.decide import Action, RetryDefaults, TaskFacts, decide, decide_one
from jobs.outcomes import Outcome

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
DEFAULTS = RetryDefaults(base=15.0, cap=3600.0)


def facts(**over) -> TaskFacts:
    base = dict(task_id=uuid.uuid4(), job_id=uuid.uuid4(), attempt=1, max_attempts=3, status="running", budget=3)
    return TaskFacts(**{**base, **over})


def failed(f: TaskFacts, **over) -> Outcome:
    return Outcome(**{"task_id": f.task_id, "attempt": f.attempt, "status": "failed", "error": "boom", **over})


def one(f: TaskFacts, o: Outcome, *, rng: random.Random | None = None):
    return decide_one(f, o, now=NOW, defaults=DEFAULTS, rng=rng or random.Random(1))


def test_the_decision_module_touches_no_database():
    tree = ast.parse((Path(__file__).resolve().parents[2] / "jobs" / "failure" / "decide.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and (m.startswith("django") or m in ("jobs.models", "jobs.failure.apply"))}


def test_a_failure_with_attempts_left_is_scheduled_after_the_backoff():
    f = facts(attempt=1, max_attempts=3, backoff_base=10.0)
    d = one(f, failed(f, error_code="exit_1"))
    assert (d.action, d.to, d.error_code, d.refund) == (Action.RETRY, "scheduled", "exit_1", False)
    assert 10.0 <= d.delay < 11.0, "base · 2^0 plus a jitter under 10 %"
    assert d.next_attempt_at == NOW + timedelta(seconds=d.delay)


def test_the_backoff_doubles_per_attempt_and_stops_at_the_smaller_cap():
    f = facts(attempt=3, max_attempts=5, budget=5, backoff_base=10.0, backoff_cap=25.0)
    d = one(f, failed(f))
    assert 25.0 <= d.delay < 27.5, "10 · 2^2 = 40, capped by the service's 25"
    site_cap = decide_one(f, failed(f), now=NOW, defaults=RetryDefaults(base=15.0, cap=12.0), rng=random.Random(1))
    assert 12.0 <= site_cap.delay < 13.2, "the site's cap wins when it is lower"


def test_the_backoff_counts_from_the_start_of_the_current_budget():
    # An operator's retry renewed the budget: max_attempts = 4 + 3; attempt 5 is the first of it.
    f = facts(attempt=5, max_attempts=7, budget=3, backoff_base=10.0)
    assert 10.0 <= one(f, failed(f)).delay < 11.0


def test_no_backoff_means_queued_at_once():
    f = facts(backoff_base=0.0)
    d = one(f, failed(f))
    assert (d.action, d.to, d.delay, d.next_attempt_at) == (Action.RETRY, "queued", 0.0, NOW)


def test_the_site_default_base_applies_when_the_service_has_none():
    f = facts(backoff_base=None)
    d = decide_one(f, failed(f), now=NOW, defaults=RetryDefaults(base=2.0, cap=3600.0), rng=random.Random(1))
    assert 2.0 <= d.delay < 2.2


def test_the_last_attempt_is_a_dead_letter_that_fails_the_job():
    f = facts(attempt=3, max_attempts=3)
    d = one(f, failed(f, status="timeout"))
    assert (d.action, d.to, d.attempt_status, d.error_code) == (Action.DEAD_LETTER, "error", "timeout", "timeout")
    assert (d.fail_job, d.continue_policy, d.quarantine_host) == (True, False, False)


def test_a_failure_that_is_not_retryable_is_a_dead_letter_at_once():
    f = facts(attempt=1, max_attempts=3)
    assert one(f, failed(f, retryable=False, error_code="bad_output")).action is Action.DEAD_LETTER


def test_a_dead_letter_of_a_continue_step_does_not_fail_the_job():
    f = facts(attempt=1, max_attempts=1, on_failure="continue", step_key="lint")
    d = one(f, failed(f))
    assert (d.fail_job, d.continue_policy) == (False, True)


def test_a_dead_letter_quarantines_the_host_only_when_the_service_says_so_and_there_is_a_host():
    f = facts(attempt=1, max_attempts=1, host_id=7, quarantine_on_final_failure=True)
    assert one(f, failed(f)).quarantine_host
    assert not one(facts(attempt=1, max_attempts=1, host_id=None, quarantine_on_final_failure=True),
                   failed(facts(attempt=1))).quarantine_host
    no_flag = facts(attempt=1, max_attempts=1, host_id=7)
    assert not one(no_flag, failed(no_flag)).quarantine_host
    retried = facts(attempt=1, max_attempts=2, host_id=7, quarantine_on_final_failure=True)
    assert not one(retried, failed(retried)).quarantine_host, "only a final failure quarantines"


@pytest.mark.parametrize("code, why", [("interrupted", "agent's shutdown"), ("outage", "database outage")])
def test_an_interrupted_attempt_is_queued_at_once_and_does_not_count(code, why):
    f = facts(attempt=3, max_attempts=3)  # the last attempt of its budget
    d = one(f, Outcome(task_id=f.task_id, attempt=3, status="interrupted", error_code=code))
    assert (d.action, d.to, d.refund, d.next_attempt_at, d.error_code) == (Action.REQUEUE, "queued", True, NOW, code)
    assert why in d.why


def test_a_cancel_wins_over_a_retry():
    f = facts(cancel_requested=True)
    assert one(f, failed(f)).action is Action.CANCEL
    g = facts()
    assert one(g, failed(g, status="canceled")).to == "canceled"


def test_an_outcome_of_an_older_attempt_gets_no_decision():
    f = facts(attempt=2)
    old, current = failed(f, attempt=1), failed(f)
    assert decide([(f, old)], now=NOW, defaults=DEFAULTS) == []
    assert [d.task_id for d in decide([(f, current)], now=NOW, defaults=DEFAULTS)] == [f.task_id]


def test_a_lease_lost_across_a_postgresql_restart_is_an_outage_and_does_not_count():
    f = facts(attempt=1, max_attempts=1, held_across_restart=True)
    d = one(f, failed(f, error_code="lease_lost", error="lease_lost: could not renew"))
    assert (d.action, d.to, d.refund, d.error_code) == (Action.REQUEUE, "queued", True, "outage")
    assert "database outage" in d.why
    g = facts(attempt=1, max_attempts=1)  # no restart since the last renewal: a failure like any other
    assert one(g, failed(g, error_code="lease_lost")).action is Action.DEAD_LETTER


@given(before=st.integers(min_value=0, max_value=20), bound=st.integers(min_value=0, max_value=10),
       attempt=st.integers(min_value=1, max_value=6), left=st.integers(min_value=0, max_value=3),
       code=st.sampled_from(["interrupted", "outage"]))
def test_an_interrupted_attempt_is_refunded_only_under_the_bound(before, bound, attempt, left, code):
    f = facts(attempt=attempt, max_attempts=attempt + left, interrupted_before=before)
    d = decide_one(f, Outcome(task_id=f.task_id, attempt=attempt, status="interrupted", error_code=code),
                   now=NOW, defaults=RetryDefaults(base=0.0, cap=0.0, max_refunded=bound), rng=random.Random(1))
    assert d.attempt_status == "interrupted" and d.error_code == code
    if before < bound:
        assert (d.action, d.refund, d.counted_interruption) == (Action.REQUEUE, True, False)
    else:
        assert not d.refund and d.counted_interruption
        assert d.action is (Action.RETRY if left else Action.DEAD_LETTER)


def test_a_lease_lost_across_a_restart_past_the_bound_counts_and_its_attempt_says_interrupted():
    f = facts(attempt=1, max_attempts=1, held_across_restart=True, interrupted_before=3)
    d = one(f, failed(f, error_code="lease_lost", error="lease_lost: could not renew"))
    assert (d.action, d.error_code, d.attempt_status, d.refund) == (Action.DEAD_LETTER, "outage", "interrupted", False)


@pytest.mark.parametrize("value, problem", [("-1", "must be at least 0"), ("three", "expected a whole number"),
                                            ("1001", "must be at most 1000")])
def test_a_bad_bound_of_refunds_is_a_system_check_error(monkeypatch, value, problem):
    from accs_site.checks import check_accs_settings
    from accs_site.conf import reload

    monkeypatch.setenv("ACC_MAX_REFUNDED_ATTEMPTS", value)
    reload()
    try:
        errors = [e for e in check_accs_settings() if e.id == "accs.E001"]
    finally:
        monkeypatch.undo()
        reload()
    assert [e.msg for e in errors] == [f"ACC_MAX_REFUNDED_ATTEMPTS: {problem}, got {value!r}"
                                       if "whole" in problem else f"ACC_MAX_REFUNDED_ATTEMPTS: {problem}, got {value}"]
