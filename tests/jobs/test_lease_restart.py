"""Room for long work across a short outage, without a process: the service's lease, the restart
grace of the rescue, requeue without using the retry budget, and the timeline log handler while
the database is down."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import psycopg
import pytest
from django.db import connection

from events.logging import EventBridgeHandler
from events.models import Event
from jobs import api, pulse, transitions
from jobs.models import Attempt, ClusterPulse, Outage, Task
from jobs.outcomes import Outcome
from jobs.rescue import rescue_expired
from tests.daemons import wait_for
from tests.engine_helpers import claim_for, run_ok

pytestmark = pytest.mark.django_db


def _server_times() -> tuple:
    """PostgreSQL's start time and now."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_postmaster_start_time(), now()")
        return cur.fetchone()


def _expire(task_id, *, lease: timedelta, ended) -> None:
    """Make the task's lease one of length ``lease`` that ended at ``ended``."""
    Task.objects.filter(pk=task_id).update(lease_expires_at=ended, heartbeat_at=ended - lease)


def test_the_claim_and_the_renewals_use_the_services_lease(make_service):
    long_svc, plain = make_service("long", lease_seconds=300), make_service("plain")
    api.start_service("long")
    api.start_service("plain")
    (long_task,), (plain_task,) = claim_for(long_svc), claim_for(plain)  # the claimer's default: 60 s
    assert (long_task.lease_seconds, plain_task.lease_seconds) == (300, 60)

    def granted(task_id) -> float:
        t = Task.objects.get(pk=task_id)
        return (t.lease_expires_at - t.heartbeat_at).total_seconds()

    assert (granted(long_task.id), granted(plain_task.id)) == (300, 60)
    lost, _ = transitions.heartbeat([(long_task.id, 1), (plain_task.id, 1)], agent_id="agent-t",
                                    lease_seconds={(long_task.id, 1): 300.0, (plain_task.id, 1): 60.0})
    assert lost == set()
    assert (granted(long_task.id), granted(plain_task.id)) == (300, 60)


def _outage(*, began, ended) -> None:
    """An outage the cluster's pulse recorded."""
    Outage.objects.create(began_at=began, ended_at=ended, cause="gap")


def test_a_lease_live_when_an_outage_began_is_not_rescued_before_one_lease_length_after_it_ended(make_service):
    svc = make_service("svc", max_attempts=3)
    api.start_service("svc")
    (task,) = claim_for(svc)
    _, now = _server_times()
    _outage(began=now - timedelta(seconds=60), ended=now - timedelta(seconds=30))
    # An hour's lease that ended a second ago, after the outage: its holder may still be reconnecting.
    _expire(task.id, lease=timedelta(hours=1), ended=now - timedelta(seconds=1))
    assert rescue_expired(now=now) == transitions.ReportResult()
    assert Task.objects.get(pk=task.id).status == "starting"
    # One lease length after the outage it is rescued as any expired lease (it ended after the outage).
    later = now - timedelta(seconds=30) + timedelta(hours=1, seconds=1)
    assert rescue_expired(now=later).retried == [task.id]
    t = Task.objects.get(pk=task.id)
    assert (t.status, t.max_attempts, t.error_code) == ("scheduled", 3, "lease_expired")


def test_a_short_lease_is_rescued_as_soon_as_it_is_one_lease_length_past_the_outage(make_service):
    svc = make_service("svc")
    api.start_service("svc")
    (task,) = claim_for(svc)
    _, now = _server_times()
    _outage(began=now - timedelta(seconds=60), ended=now - timedelta(seconds=30))
    _expire(task.id, lease=timedelta(seconds=5), ended=now - timedelta(seconds=1))
    assert rescue_expired(now=now).retried == [task.id]
    assert Task.objects.get(pk=task.id).error_code == "lease_expired"


def test_a_lease_that_ended_during_an_outage_is_queued_again_without_using_the_budget(make_service):
    svc = make_service("svc", max_attempts=1)  # a failure that counted would dead-letter it
    job = api.start_service("svc")
    before = api.start_service("svc")
    (task, dead) = sorted(claim_for(svc), key=lambda t: t.job_id != job.id)
    _, now = _server_times()
    _outage(began=now - timedelta(seconds=60), ended=now - timedelta(seconds=30))
    _expire(task.id, lease=timedelta(seconds=3), ended=now - timedelta(seconds=40))
    # A lease that ended before the outage began: its agent died, the outage has nothing to do with it.
    _expire(dead.id, lease=timedelta(seconds=3), ended=now - timedelta(seconds=61))
    result = rescue_expired(now=now)
    assert result.retried == [task.id] and result.failed == [dead.id]
    t = Task.objects.get(pk=task.id)
    assert (t.status, t.attempt, t.max_attempts, t.error_code) == ("queued", 1, 2, "outage")
    attempt = Attempt.objects.get(task_id=task.id, attempt_no=1)
    assert attempt.status == "interrupted" and attempt.error_text.startswith("outage:")
    event = Event.objects.get(job_id=job.id, type="retry")
    assert "stopped by a database outage" in event.message and event.data["counted"] is False
    assert Task.objects.get(job=before).error_code == "lease_expired"
    # It runs again, as attempt 2 of a budget that still has room.
    (again,) = claim_for(svc)
    assert again.attempt == 2 and run_ok([again]).done == [task.id]


def test_the_pulse_records_a_gap_and_a_restart_and_nothing_else(db):
    with connection.cursor() as cur:
        cur.execute("DELETE FROM accs_cluster_pulse")
    assert pulse.stamp() is None and pulse.stamp() is None, "the first stamp of a site has nothing to compare with"
    assert not Outage.objects.exists()
    _, now = _server_times()
    with connection.cursor() as cur:
        cur.execute(f"SELECT {pulse.RESTARTED_AT_SQL}")
        restarted_at = cur.fetchone()[0]
    # A silence that began after PostgreSQL's last restart (another test on this worker's cluster may
    # have restarted it seconds ago), longer than the gap allowed: a gap, not a restart.
    silent_since = max(now - timedelta(seconds=30), restarted_at + (now - restarted_at) / 2)
    gap = (now - silent_since).total_seconds() / 2
    ClusterPulse.objects.filter(name=pulse.PULSE_NAME).update(seen_at=silent_since)
    assert pulse.stamp(gap_seconds=gap) == silent_since
    outage = Outage.objects.get()
    assert (outage.began_at, outage.cause) == (silent_since, "gap") and outage.ended_at >= now
    ClusterPulse.objects.filter(name=pulse.PULSE_NAME).update(seen_at=restarted_at - timedelta(milliseconds=1))
    assert pulse.stamp(gap_seconds=3600) is not None, "a restart since the last stamp is an outage however short"
    assert Outage.objects.filter(cause="restart").count() == 1
    assert pulse.stamp(gap_seconds=3600) is None and Outage.objects.count() == 2
    with pytest.raises(ValueError, match="gap_seconds must be positive"):
        pulse.stamp(gap_seconds=0)


@pytest.mark.django_db(transaction=True)
def test_a_stamp_holds_the_pulse_row_only_within_its_one_statement_and_a_second_stamper_compares_with_the_first(
        db_url):
    """A builder frozen between two statements of its stamp would hold the pulse row, and every other
    builder's tick (and so a takeover of the leader's lease) would wait until the server ended that
    transaction. The stamp is one statement, committed by itself; stampers that meet still take turns."""
    statements: list[tuple[str, bool]] = []

    def record(execute, sql, params, many, context):
        statements.append((sql, connection.in_atomic_block))
        return execute(sql, params, many, context)

    pulse.stamp()
    with connection.execute_wrapper(record):
        pulse.stamp()
    assert [in_transaction for _sql, in_transaction in statements] == [False], statements

    # The first stamper's statement has run, its commit has not: the second waits for it, then compares
    # its own clock with that stamp, not the one before.
    with psycopg.connect(db_url) as first, psycopg.connect(db_url, autocommit=True) as second, \
            psycopg.connect(db_url, autocommit=True) as watch:
        assert first.execute(pulse.STAMP_SQL, {"name": pulse.PULSE_NAME, "gap": 3600}).fetchone() == (None,)
        first_stamp = first.execute("SELECT seen_at FROM accs_cluster_pulse WHERE name = %s",
                                    [pulse.PULSE_NAME]).fetchone()[0]
        answer: list = []
        waiting = threading.Thread(target=lambda: answer.append(second.execute(
            pulse.STAMP_SQL, {"name": pulse.PULSE_NAME, "gap": 1e-6}).fetchone()[0]))
        waiting.start()
        pid = second.info.backend_pid
        wait_for(lambda: watch.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                                       [pid]).fetchone()[0], timeout=10, message="the second stamper waits")
        first.commit()
        waiting.join(timeout=10)
    assert answer == [first_stamp], (answer, first_stamp)
    outage = Outage.objects.get()
    assert outage.began_at == first_stamp and outage.ended_at > first_stamp
    assert ClusterPulse.objects.get(name=pulse.PULSE_NAME).seen_at == outage.ended_at


def test_an_attempt_the_agent_stopped_in_an_outage_is_queued_again_without_using_the_budget(make_service):
    svc = make_service("svc", max_attempts=1)
    job = api.start_service("svc")
    (task,) = claim_for(svc)
    result = transitions.report([Outcome(task_id=task.id, attempt=1, status="interrupted", error_code="outage",
                                         error="outage: the database was unreachable")],
                                started=[(task.id, 1, 123)], agent_id="agent-t", source="agent:test")
    assert result.retried == [task.id]
    t = Task.objects.get(pk=task.id)
    assert (t.status, t.max_attempts, t.error_code) == ("queued", 2, "outage")
    assert Event.objects.filter(job_id=job.id, type="retry", message__contains="database outage").exists()


def test_the_timeline_log_handler_waits_then_drops_and_counts_while_the_database_is_down(make_service, monkeypatch,
                                                                                          capsys, caplog):
    make_service("svc")
    job = api.start_service("svc")
    handler = EventBridgeHandler(buffer_lines=3, retry_seconds=0)
    logger = logging.getLogger("accs.test.outage_handler")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        import events.timeline

        real = events.timeline.write_events

        def down(rows, *, cursor=None):
            raise psycopg.OperationalError("connection refused")

        monkeypatch.setattr(events.timeline, "write_events", down)
        with caplog.at_level(logging.INFO, logger="accs.events.logging"):
            for i in range(5):
                logger.warning("line %d", i, extra={"job_id": job.id})
            assert (len(handler.pending), handler.dropped) == (3, 2)
            monkeypatch.setattr(events.timeline, "write_events", real)
            logger.warning("back", extra={"job_id": job.id})
        logged = Event.objects.filter(job_id=job.id, type="log").order_by("id")
        messages = list(logged.values_list("message", flat=True))
        assert messages == ["line 0", "line 1", "line 2", "back"]
        report = Event.objects.get(type="log", job_id=None, data__dropped=2)
        assert "2 dropped" in report.message
        said = [r.getMessage() for r in caplog.records if r.name == "accs.events.logging"]
        assert len(said) == 2 and "cannot take log lines" in said[0] and "2 dropped" in said[1]
        assert (handler.pending, handler.dropped) == (type(handler.pending)(), 0)
        err = capsys.readouterr().err
        assert "Logging error" not in err and "Traceback" not in err
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def test_a_lease_lost_report_after_a_restart_since_the_last_renewal_is_an_outage(make_service):
    # The agent could not tell the database was down (it reports lease_lost), but PostgreSQL
    # started after the lease's last renewal: the outage stopped the work, not the task.
    svc = make_service("svc", max_attempts=1)
    job = api.start_service("svc")
    (task,) = claim_for(svc)
    started, now = _server_times()
    Task.objects.filter(pk=task.id).update(heartbeat_at=started - timedelta(seconds=1))
    lost = Outcome(task_id=task.id, attempt=1, status="failed", error_code="lease_lost",
                   error="lease_lost: the agent could not renew the lease")
    result = transitions.report([lost], started=[(task.id, 1, 123)], agent_id="agent-t", source="agent:test")
    assert result.retried == [task.id] and result.failed == []
    t = Task.objects.get(pk=task.id)
    assert (t.status, t.max_attempts, t.error_code) == ("queued", 2, "outage")
    assert Event.objects.filter(job_id=job.id, type="retry", message__contains="database outage").exists()


@pytest.mark.django_db(transaction=True)
def test_two_threads_logging_as_the_database_returns_write_each_waiting_line_once(make_service, monkeypatch):
    make_service("svc")
    job = api.start_service("svc")
    handler = EventBridgeHandler(retry_seconds=0)
    logger = logging.getLogger("accs.test.outage_race")
    logger.addHandler(handler)
    logger.propagate = False
    import events.timeline

    real = events.timeline.write_events
    second_writes = threading.Event()
    errors: list[BaseException] = []

    def held_first(rows, *, cursor=None):
        # The first writer stays in its write until the second thread is writing too, so both
        # threads are inside the handler with the waiting lines at once.
        if threading.current_thread().name == "second":
            second_writes.set()
        else:
            assert second_writes.wait(10), "the second thread never wrote"
        return real(rows, cursor=cursor)

    def log(text: str) -> None:
        try:
            logger.warning(text, extra={"job_id": job.id})
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
        finally:
            connection.close()

    try:
        handler.pending.extend(handler._row(logging.makeLogRecord({"msg": f"waiting {i}", "job_id": job.id}),
                                            job.id) for i in range(3))
        monkeypatch.setattr(events.timeline, "write_events", held_first)
        threads = [threading.Thread(target=log, args=(name,), name=name) for name in ("first", "second")]
        threads[0].start()
        wait_for(lambda: not handler.pending, timeout=10, message="the first thread took the waiting lines")
        threads[1].start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        messages = sorted(Event.objects.filter(job_id=job.id, type="log").values_list("message", flat=True))
        assert messages == ["first", "second", "waiting 0", "waiting 1", "waiting 2"]
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


@pytest.mark.django_db(transaction=True)
def test_a_job_a_hung_session_holds_delays_only_its_own_rescue(make_service, db_url):
    """An agent cut off inside a transaction keeps its job's row lock until the server's idle timeout:
    the rescue of every other expired lease goes on meanwhile, and that job's follows once it is free."""
    svc = make_service("hung")
    held_job, other_job = api.start_service("hung"), api.start_service("hung")
    claimed = {t.job_id: t for t in claim_for(svc)}
    assert set(claimed) == {held_job.id, other_job.id}
    _, now = _server_times()
    for task in claimed.values():
        _expire(task.id, lease=timedelta(seconds=60), ended=now - timedelta(minutes=5))
    with psycopg.connect(db_url) as hung, connection.cursor() as cur:
        hung.execute("SELECT id FROM accs_job WHERE id = %s FOR NO KEY UPDATE", [held_job.id])
        cur.execute("SET lock_timeout = '5s'")  # the old rescue waited for the lock: fail, do not hang
        try:
            rescue_expired()
        finally:
            cur.execute("RESET lock_timeout")
        statuses = dict(Attempt.objects.filter(task_id__in=[t.id for t in claimed.values()])
                        .values_list("task__job_id", "status"))
        assert statuses == {held_job.id: "running", other_job.id: "failed"}, statuses
    rescue_expired()  # the hung session is gone: its job's lease is rescued now
    assert set(Attempt.objects.filter(task_id__in=[t.id for t in claimed.values()])
               .values_list("status", flat=True)) == {"failed"}
