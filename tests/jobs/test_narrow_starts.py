"""Narrow starts (jobs.narrow): one row per start, widened into its job by a claim, the builder or a read.

The promises checked here, each where it is used:

* a start on the narrow path writes one row of ``accs_start`` and nothing else, in the caller's
  transaction, and the job the caller got back is the job the start becomes (same ids, order and times);
* a start that needs anything decided first (idempotency, approval, a schedule, a cap, options, a
  limited service, a workflow) never takes the narrow path;
* a claim takes narrow and wide work in the one global order (priority, then order of start);
* every start becomes its job exactly once, whoever widens it and however they race: claimers,
  the builder and readers, each on its own connection;
* a read by id (the operators' verbs, the API's and the Tasks backend's reads) finds a start as the
  queued job it is.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone
from hypothesis import HealthCheck, given, settings, strategies as st

from accs_site.conf import reload
from events.models import Event
from events.timeline import unfold
from jobs import api
from jobs.claim import NodeLimits
from jobs.duties import all_duties
from jobs.enqueue import JobSpec, start
from jobs.models import Job, JobStatus, Start, Task, TaskStatus
from jobs.narrow import widen
from tests.engine_helpers import claim_for, run_ok

pytestmark = pytest.mark.django_db

# A node with room for every task these tests start.
ROOMY = NodeLimits(name="node-narrow", slot_cap=1000, cpu_budget=1000, per_service={})


@pytest.fixture
def narrow(monkeypatch):
    """Turn narrow starts on for the test (the site setting), and off again after it."""
    monkeypatch.setenv("ACC_NARROW_STARTS", "1")
    reload()
    yield
    monkeypatch.undo()
    reload()


def _counts() -> tuple[int, int, int, int]:
    from jobs.models import JobStep

    return Start.objects.count(), Job.objects.count(), Task.objects.count(), JobStep.objects.count()


def test_a_plain_start_is_one_row_and_the_claim_makes_it_the_job_the_caller_got(narrow, make_service, monkeypatch):
    svc = make_service("narrow-one")
    job = api.start_service(svc, params={"n": 1}, priority=3, correlation_id="c-1", source_ref="ref-1")
    assert job.was_created and job.status == JobStatus.WAITING
    assert _counts() == (1, 0, 0, 0)
    row = Start.objects.get()
    assert (row.id, row.order_seq, row.created_at, row.params) == (job.id, job.order_seq, job.created_at, {"n": 1})
    assert not Event.objects.filter(job_id=job.id).exists()

    [claimed] = claim_for(svc, 4)
    assert (claimed.job_id, claimed.id, claimed.params) == (job.id, row.task_id, {"n": 1})
    assert Start.objects.count() == 0
    stored = Job.objects.get(pk=job.id)
    for name in ("order_seq", "created_at", "started_at", "scheduled_at", "priority", "step_params", "source",
                 "source_ref", "correlation_id", "current_task_key", "tenant_id", "service_id"):
        assert getattr(stored, name) == getattr(job, name), name
    task = Task.objects.get(pk=claimed.id)
    assert (task.order_seq, task.priority, task.created_at, task.max_attempts) == (
        job.order_seq, 3 + svc.base_priority, job.created_at, svc.max_attempts)
    run_ok([claimed])
    assert Job.objects.get(pk=job.id).status == JobStatus.DONE

    # Its timeline reads line for line as a wide start's, its creation stamped when it started.
    monkeypatch.setenv("ACC_NARROW_STARTS", "0")
    reload()
    wide = api.start_service(svc, params={"n": 1}, priority=3, correlation_id="c-1", source_ref="ref-1")
    run_ok(claim_for(svc, 4))

    def lines(job_id):
        return [(line.message, line.level, line.source, sorted(line.data))
                for e in Event.objects.filter(job_id=job_id).order_by("id") for line in unfold(e)]

    assert lines(job.id) == lines(wide.id)
    # In two rows instead of three: the claim's row carries the job's creation, at the start's time.
    rows = list(Event.objects.filter(job_id=job.id).order_by("id"))
    assert len(rows) == 2 and Event.objects.filter(job_id=wide.id).count() == 3
    first = unfold(rows[0])
    assert first[0].ts == job.created_at and first[0].source == "api:manual" and first[-1].ts == rows[0].ts
    assert rows[0].task_id == row.task_id and rows[0].data["created"]["task_key"] == svc.key


def test_a_rolled_back_start_leaves_nothing(narrow, make_service):
    svc = make_service("narrow-rollback")
    with pytest.raises(RuntimeError), transaction.atomic():
        api.start_service(svc, params={})
        assert Start.objects.count() == 1
        raise RuntimeError("the caller's transaction fails")
    assert _counts() == (0, 0, 0, 0)


@pytest.mark.parametrize("case", ["external_id", "dedupe_key", "scheduled_at", "options", "approval", "rate_limit",
                                  "concurrency_key", "workflow", "tenant_cap", "setting_off"])
def test_a_start_that_needs_a_decision_takes_the_wide_path(case, narrow, make_service, monkeypatch):
    fields = {"approval": {"requires_approval": True}, "rate_limit": {"rate_limit": 5},
              "concurrency_key": {"concurrency_key_limit": 1, "concurrency_key": "k"}}.get(case, {})
    svc = make_service(f"narrow-wide-{case.replace('_', '-')}", **fields)
    options: dict = {"external_id": {"external_id": "x-1"}, "dedupe_key": {"dedupe_key": "d-1"},
                     "scheduled_at": {"scheduled_at": timezone.now() - timedelta(seconds=1)},
                     "options": {"options": {"note": "kept"}}}.get(case, {})
    if case == "tenant_cap":
        from tenants.models import Tenant

        options["tenant"] = Tenant.objects.create(slug="capped", name="Capped", max_in_flight=5)
    if case == "setting_off":
        monkeypatch.setenv("ACC_NARROW_STARTS", "0")
        reload()
    if case == "workflow":
        from workflows.api import create_workflow

        create_workflow(name="narrow-wf", steps=[{"key": "a", "service": svc.key, "depends_on": []}])
        job = start(JobSpec(workflow="narrow-wf"))
    else:
        job = api.start_service(svc, params={}, **options)
    assert Start.objects.count() == 0
    assert Job.objects.filter(pk=job.id).exists()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.booleans(), st.integers(-2, 2)), min_size=1, max_size=12),
       st.integers(1, 4))
def test_a_claim_takes_narrow_and_wide_work_in_the_one_global_order(narrow, make_service, monkeypatch, starts, batch):
    """Starts of one service, each narrow or wide, at generated priorities: claims of ``batch`` at a
    time take them by priority, then in the order they were started."""
    svc = make_service("narrow-order")

    class Done(Exception):
        pass

    with pytest.raises(Done), transaction.atomic():
        expected = []
        for narrow_one, priority in starts:
            monkeypatch.setenv("ACC_NARROW_STARTS", "1" if narrow_one else "0")
            reload()
            job = api.start_service(svc, params={}, priority=priority)
            expected.append((-priority, job.order_seq, job.id))
        taken = []
        while len(taken) < len(starts):
            got = claim_for(svc, batch, limits=ROOMY)
            assert got, "a claim found nothing with starts left"
            taken += [t.job_id for t in got]
        assert taken == [jid for *_, jid in sorted(expected)]
        assert Start.objects.count() == 0
        raise Done


def test_a_read_by_id_finds_a_start_as_its_queued_job(narrow, make_service):
    svc = make_service("narrow-read")
    job = api.start_service(svc, params={})
    other = api.start_service(svc, params={})
    assert widen([job.id]) == 1 and widen([job.id]) == 0
    assert Start.objects.filter(pk=other.id).exists()
    # An operator's verb widens the start it names, then acts on the job.
    result = api.cancel(other.id, by="op")
    assert result.changed, result
    assert Job.objects.get(pk=other.id).status == JobStatus.CANCELED
    assert Task.objects.get(job_id=other.id).status == TaskStatus.CANCELED
    assert Start.objects.count() == 0


def test_the_builder_widens_the_starts_no_claim_took(narrow, make_service, monkeypatch):
    svc = make_service("narrow-aged")
    jobs = [api.start_service(svc, params={"i": i}) for i in range(3)]
    [duty] = [d for d in all_duties(batch=100) if d.name == "widen_aged_starts"]
    monkeypatch.setenv("ACC_NARROW_WIDEN_AFTER_SEC", "3600")
    reload()
    assert duty.run(100) == 0
    monkeypatch.setenv("ACC_NARROW_WIDEN_AFTER_SEC", "0")
    reload()
    # Started in this test's transaction, so "older than 0 s" by the next transaction's clock: run it in one.
    with connection.cursor() as cur:
        cur.execute("UPDATE accs_start SET created_at = created_at - interval '1 second'")
    assert duty.run(2) == 2 and duty.run(2) == 1 and duty.run(2) == 0
    assert set(Job.objects.values_list("id", flat=True)) == {j.id for j in jobs}
    assert set(Task.objects.values_list("status", flat=True)) == {TaskStatus.QUEUED}


def _race(racers: list) -> list[BaseException]:
    """Run each racer on a thread (so a database connection) of its own, released at once; return their errors."""
    barrier = threading.Barrier(len(racers))
    errors: list[BaseException] = []

    def run(racer) -> None:
        try:
            barrier.wait()
            racer()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(racer,)) for racer in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.django_db(transaction=True)
def test_racing_claimers_builder_and_readers_make_each_start_its_job_once(narrow, make_service, default_tenant):
    """Four claimers, the builder's widening and a reader by id, each on its own connection, released at
    once over 240 narrow starts: every start becomes one job with one task, claimed once, none lost."""
    svc = make_service("narrow-race")
    ids = [api.start_service(svc, params={"i": i}).id for i in range(240)]
    assert Start.objects.count() == 240
    claimed: list = []

    def claimer(n: int) -> None:
        # Until nothing is left to claim: no start, and no queued task (another racer may widen the last
        # starts after this claim looked).
        while True:
            got = claim_for(svc, 7, limits=ROOMY, agent=f"agent-{n}")
            claimed.extend(t.id for t in got)
            if not got and not Start.objects.exists() and not Task.objects.filter(status=TaskStatus.QUEUED).exists():
                return

    def builder() -> None:
        from jobs.narrow import widen_aged

        while Start.objects.exists():
            widen_aged(after_seconds=0, limit=5)

    def reader() -> None:
        for jid in ids[::-7]:
            widen([jid])
            assert Job.objects.filter(pk=jid).exists()

    errors = _race([lambda n=n: claimer(n) for n in range(4)] + [builder, reader])
    assert not errors, errors
    assert sorted(Job.objects.values_list("id", flat=True)) == sorted(ids)
    assert Task.objects.count() == 240 and Start.objects.count() == 0
    assert len(claimed) == len(set(claimed)) == 240
    # Each job's creation is on its timeline once: its own row, or folded into the claim's row.
    created = [line.job_id for e in Event.objects.filter(job_id__in=ids) for line in unfold(e)
               if line.task_id is None and line.data.get("from") == "created"]
    assert sorted(created) == sorted(ids)


def test_many_narrow_starts_are_written_in_the_order_given(narrow, make_service, django_assert_max_num_queries):
    svc = make_service("narrow-many")
    specs = [JobSpec(service=svc, params={"i": i}, priority=i % 2) for i in range(7)]
    api.start_many(specs[:1])  # the tenant and the service are looked up once, then cached
    with django_assert_max_num_queries(4):  # the savepoint, the insert, the wake-up, its release
        ids = api.start_many(specs[1:])
    rows = {r.id: r for r in Start.objects.all()}
    assert sorted(rows, key=lambda i: rows[i].order_seq)[1:] == ids
    assert [rows[i].params for i in ids] == [{"i": i} for i in range(1, 7)]
    assert Job.objects.count() == 0
    # One spec that needs a decision sends the whole call the wide way.
    mixed = api.start_many([JobSpec(service=svc, params={}), JobSpec(service=svc, params={}, external_id="e-1")])
    assert Job.objects.filter(id__in=mixed).count() == 2 and Start.objects.count() == 7


@pytest.mark.django_db(transaction=True)
def test_real_agents_and_builder_run_narrow_starts_to_done(narrow, make_service, daemons, default_tenant):
    """Two agents and a builder (processes): 150 narrow starts of the agents' service, made while they
    run, all end done, each the job it was started as; a start of a service no agent serves becomes a
    queued job by the builder's hand within a few seconds."""
    from tests.daemons import wait_for

    make_service("narrow-live")
    make_service("narrow-nobody")
    daemons.agents_together(["narrow-a", "narrow-b"], "narrow-live", "--max-concurrent", "8")
    daemons.builder()
    jobs = [api.start_service("narrow-live", params={"i": i}) for i in range(150)]
    idle = api.start_service("narrow-nobody", params={})
    wait_for(lambda: Job.objects.filter(id__in=[j.id for j in jobs], status=JobStatus.DONE).count() == 150,
             timeout=90, message="150 narrow starts done")
    stored = {j.id: j for j in Job.objects.filter(id__in=[j.id for j in jobs])}
    assert all(stored[j.id].order_seq == j.order_seq and stored[j.id].created_at == j.created_at for j in jobs)
    assert Task.objects.filter(job_id__in=stored, status=TaskStatus.DONE).count() == 150
    wait_for(lambda: Job.objects.filter(pk=idle.id).exists(), timeout=30, message="the builder widens the idle start")
    assert Task.objects.get(job_id=idle.id).status == TaskStatus.QUEUED
    assert not Start.objects.exists()


_BULK_SPEC = st.fixed_dictionaries({
    "params": st.one_of(st.none(), st.fixed_dictionaries({}, optional={"n": st.one_of(st.integers(-5, 5), st.text(
        max_size=3))}), st.just({"n": 1, "extra": "x" * 40})),
    "priority": st.one_of(st.integers(-3, 3), st.sampled_from([2**31, True])),
    "source": st.sampled_from(["manual", "api", "nonsense"]),
    "correlation_id": st.sampled_from(["", "c", "x" * 201]),
    "tenant": st.sampled_from([None, "banded", "missing"]),
    "external_id": st.sampled_from([None, None, None, "e-1"]),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_BULK_SPEC, min_size=1, max_size=5))
def test_a_bulk_start_writes_what_one_start_at_a_time_writes(narrow, make_service, monkeypatch, specs):
    """start_many's fast lane for narrow starts against start() one spec at a time, on generated specs
    (params the schema refuses or too large, out-of-range priorities, unknown sources and tenants,
    long references, an idempotency key): the same starts in the same order, or the same error."""
    from tenants.models import Tenant

    monkeypatch.setenv("ACC_MAX_PARAMS_BYTES", "1024")
    reload()
    svc = make_service("narrow-bulk", params_schema={"type": "object", "properties": {"n": {"type": "integer"}},
                                                     "additionalProperties": False})
    Tenant.objects.get_or_create(slug="banded", defaults={"name": "Banded", "min_priority": -1, "max_priority": 1})
    made = [JobSpec(service=svc.key, **spec) for spec in specs]

    def outcome(run) -> tuple:
        class Undo(Exception):
            pass

        try:
            with transaction.atomic():
                try:
                    ids = run()
                except Exception as exc:  # noqa: BLE001 - the outcome compared
                    return ("error", type(exc).__name__, str(exc))
                by_id = {r.id: r for r in Start.objects.all()}
                jobs = {j.id: j for j in Job.objects.all()}
                rows = [("narrow", by_id[i].priority, by_id[i].job_priority, by_id[i].params, by_id[i].source,
                         by_id[i].correlation_id, by_id[i].tenant_id) if i in by_id else
                        ("wide", jobs[i].priority, jobs[i].step_params, jobs[i].source, jobs[i].tenant_id)
                        for i in ids]
                raise Undo(rows)
        except Undo as undo:
            return ("ok", undo.args[0])

    bulk = outcome(lambda: api.start_many(made))
    one_by_one = outcome(lambda: [start(spec).id for spec in made])
    if one_by_one[0] == "ok" and any(s["external_id"] for s in specs):
        # A spec that needs a decision sends the whole bulk call the wide way; one at a time, the others stay narrow.
        assert bulk[0] == "ok" and all(row[0] == "wide" for row in bulk[1])
    else:
        assert bulk == one_by_one


def test_the_dashboard_metrics_and_stuck_reasons_count_a_start_before_it_is_widened(narrow, make_service):
    """A narrow start is a waiting job with a queued task for every count operators read, before any
    claim or builder widened it: the queue cards and `/metrics` (ops.overview.queue_depth) and the
    "why isn't it moving" reasons (no agent serves the service), for the site and for its job."""
    from ops.overview import queue_depth, stuck_reasons

    svc = make_service("narrow-counted")
    job = api.start_service(svc, params={})
    assert Start.objects.filter(pk=job.id).exists()
    tenants, services = queue_depth()
    [card] = [t for t in tenants if t.tenant == "default"]
    [row] = [r for r in services if r.service == svc.key]
    assert (card.queued, card.jobs_waiting, row.queued) == (1, 1, 1)
    assert card.oldest_queued_age is not None
    for reasons in (stuck_reasons(nodes=[], conditions=[]), stuck_reasons(nodes=[], conditions=[], job_id=job.id)):
        assert [(r.service, r.count) for r in reasons] == [(svc.key, 1)], reasons
    assert Start.objects.filter(pk=job.id).exists()  # reading widened nothing
