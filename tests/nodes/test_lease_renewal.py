"""The agent's lease renewal runs on its own thread and connection: a claim that waits for a lock
costs no running task, and a claim waits for a lock only for a bounded time.

Real agents against a real PostgreSQL; a test connection holds the advisory lock a capped
service's claim takes (``accs:service:<id>``, as a site pausing the service does).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jobs import api
from jobs.models import Attempt, Task
from jobs.outcomes import LEASE_LOST
from nodes.renewal import Held, LeaseRenewal, renewal_lock_wait, renewal_period
from tests.daemons import wait_all_final, wait_until
from tests.engine_helpers import NODE, spec

pytestmark = pytest.mark.django_db(transaction=True)

LEASE = 3.0

UNTIL_RELEASED = {"executor": "python", "executor_config": {"callable": "tests.callables:until_released"},
                  "params_schema": {"type": "object", "properties": {"release": {"type": "string"}}}}

# When the named agent's main connection waits for an advisory lock: the database's clock then, else NULL.
CLAIM_WAITING_SQL = """
SELECT clock_timestamp() FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name = 'accs agent ' || %s
"""


def _service_lock(conn: psycopg.Connection, service_id: int) -> None:
    """Take, in ``conn``'s open transaction, the lock every claimer of the capped service shares."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:service:{service_id}"])


def _log(proc) -> str:
    return proc.log_path.read_text()


def test_a_claim_waiting_longer_than_the_lease_for_a_capped_services_lock_costs_no_running_task(
        make_service, daemons, db_url, tmp_path):
    release = tmp_path / "release"
    make_service("steady", **UNTIL_RELEASED, max_attempts=3)
    capped = make_service("paused", max_concurrent=1)
    job = api.start_service("steady", params={"release": str(release)})
    # The claim may wait a minute: the main loop stays blocked for far longer than the lease.
    agent = daemons.agent("hb1", "steady,paused", "--lease-seconds", str(LEASE), "--poll-interval", "0.2",
                          env={"ACC_CLAIM_LOCK_WAIT_SEC": "60"})
    wait_until(lambda: Task.objects.filter(job=job, status="running").exists(), timeout=30,
               message="the steady task runs")
    with psycopg.connect(db_url) as holder, psycopg.connect(db_url, autocommit=True) as watch:
        _service_lock(holder, capped.id)
        capped_job = api.start_service("paused")  # its NOTIFY wakes the agent, whose claim waits for the lock
        waiting_since = wait_until(lambda: watch.execute(CLAIM_WAITING_SQL, ["hb1"]).fetchone(), timeout=30,
                                   message="the agent's claim waits for the capped service's lock")[0]

        def renewed_well_past_the_old_deadline():
            task = Task.objects.get(job=job)
            assert task.status == "running" and task.attempt == 1, (task.status, task.attempt, _log(agent)[-3000:])
            return task.heartbeat_at > waiting_since + timedelta(seconds=2 * LEASE)

        # Without renewals of its own, the agent stopped the task lease − lease/4 after its last one.
        wait_until(renewed_well_past_the_old_deadline, timeout=30,
                   message="the steady task's lease renewed while the claim waits, beyond two leases")
        assert watch.execute(CLAIM_WAITING_SQL, ["hb1"]).fetchone(), "the claim waited the whole time"
        release.touch()  # the task ends by itself...
        holder.commit()  # ...and the site lets the capped service's claims in again
    wait_all_final(db_url, timeout=60, expected=2)
    task = Task.objects.get(job=job)
    assert (task.status, task.attempt) == ("done", 1), (task.status, task.attempt, task.error_message)
    assert list(Attempt.objects.filter(task=task).values_list("status", flat=True)) == ["succeeded"]
    assert task.max_attempts - task.attempt == 2, "no retry budget was spent"
    assert not Attempt.objects.filter(error_text__contains=LEASE_LOST).exists()
    assert Task.objects.get(job=capped_job).status == "done"
    assert "not renewed" not in _log(agent) and "lease lost" not in _log(agent), _log(agent)[-3000:]


def test_a_claim_gives_up_on_a_busy_lock_after_its_bound_and_claims_the_other_services(
        make_service, daemons, db_url):
    capped = make_service("paused", max_concurrent=1)
    make_service("plain")
    with psycopg.connect(db_url) as holder:
        _service_lock(holder, capped.id)  # held for as long as this test runs the plain tasks
        capped_job = api.start_service("paused")
        plain = [api.start_service("plain") for _ in range(3)]
        agent = daemons.agent("hb2", "plain,paused", "--poll-interval", "0.2", env={"ACC_CLAIM_LOCK_WAIT_SEC": "0.5"})
        wait_until(lambda: Task.objects.filter(job__in=plain, status="done").count() == 3, timeout=30,
                   message="the plain tasks run while the capped service's lock stays held")
        assert Task.objects.get(job=capped_job).status == "queued"
        wait_until(lambda: "gave up" in _log(agent), timeout=10, message="the agent says it gave up waiting")
        holder.commit()
    wait_all_final(db_url, timeout=30, expected=4)
    assert Task.objects.get(job=capped_job).status == "done", "claimed once the lock was free"
    assert _log(agent).count("gave up") == 1, "said once, however many claims found the lock busy"


def test_the_renewal_renews_only_the_attempt_it_names(make_service):
    """A renewal of an old attempt finds it lost and leaves the newer attempt's lease alone."""
    from jobs.claim import claim_many

    svc = make_service("renewed")
    api.start_service("renewed")
    [claimed] = claim_many([spec(svc)], NODE, agent_id="agent-r", free_slots=1, lease_seconds=30)
    before = Task.objects.get(pk=claimed.id).lease_expires_at
    answers = []
    renewal = LeaseRenewal(node=NODE.name, agent_id="agent-r", agent_lease=30, claim_lock_wait=5, held=dict,
                           on_answer=answers.append, stall_limit=45, logger=logging.getLogger("tests.renewal"))
    try:
        old = (claimed.id, claimed.attempt - 1)
        answer = renewal.renew({old: Held(30, 0.0)}, lock_wait=1)
        assert answer is not None and answer.lost == {old} and not answer.renewed
        assert Task.objects.get(pk=claimed.id).lease_expires_at == before, "the newer attempt was not touched"
        current = (claimed.id, claimed.attempt)
        answer = renewal.renew({current: Held(30, 0.0)}, lock_wait=1)
        assert answer is not None and answer.renewed == {current} and not answer.lost
        assert Task.objects.get(pk=claimed.id).lease_expires_at > before
    finally:
        renewal.close()


def test_a_renewal_waits_for_a_locked_row_only_for_its_bound(make_service, db_url):
    from jobs.claim import claim_many

    svc = make_service("locked")
    api.start_service("locked")
    [claimed] = claim_many([spec(svc)], NODE, agent_id="agent-l", free_slots=1, lease_seconds=30)
    renewal = LeaseRenewal(node=NODE.name, agent_id="agent-l", agent_lease=30, claim_lock_wait=5, held=dict,
                           on_answer=lambda answer: None, stall_limit=45,
                           logger=logging.getLogger("tests.renewal"))
    key = (claimed.id, claimed.attempt)
    try:
        with psycopg.connect(db_url) as holder:
            holder.execute("SELECT 1 FROM accs_task WHERE id = %s FOR UPDATE", [claimed.id])
            assert renewal.renew({key: Held(30, 0.0)}, lock_wait=0.2) is None, "gave up: not lost, retried"
            assert renewal.outage_since is None, "a lock wait that ran out is no outage"
        answer = renewal.renew({key: Held(30, 0.0)}, lock_wait=0.2)
        assert answer is not None and answer.renewed == {key}
    finally:
        renewal.close()


LEASES = st.floats(min_value=0.3, max_value=86_400, allow_nan=False)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(agent=LEASES, held=st.lists(LEASES, max_size=5), claim_wait=st.floats(min_value=0.01, max_value=3600))
def test_renewals_come_every_third_of_the_shortest_lease_and_a_renewal_and_its_retry_fit_before_the_deadline(
        agent: float, held: list[float], claim_wait: float) -> None:
    period = renewal_period(agent_lease=agent, leases=held)
    shortest = min([agent, *held])
    assert period == pytest.approx(shortest / 3)
    wait = renewal_lock_wait(period=period, claim_lock_wait=claim_wait)
    # A renewal that waits its bound out, and its retry (a quarter period later) waiting as long,
    # both end before the watchdog's deadline (lease − lease/4).
    assert period + wait + period / 4 + wait < shortest * 3 / 4
    assert 0 < wait <= claim_wait
