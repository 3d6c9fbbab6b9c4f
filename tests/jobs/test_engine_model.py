"""A model-based test of the engine: random runs of starts, claims, reports, heartbeats, crashes,
outages, cancels, retries and retention against the real PostgreSQL, checked after every step.

:class:`EngineMachine` (a hypothesis ``RuleBasedStateMachine``) drives the engine's own functions,
the way the builder, agents and operators call them. Each simulated agent runs its calls on a
thread of its own, so on a database connection of its own. The machine remembers only what the
actors know (what each agent believes it holds, which reports were accepted); the invariants read
the database after every step:

* no cap is exceeded by what holds capacity: a capped service's held tasks, a key's held tasks
  under its per-key limit, and the jobs holding a workflow's ``max_active_jobs`` or a tenant's
  ``max_in_flight`` (admitted jobs, and any job while a task of it is held, whatever its status);
* no task is held twice: two live agents never both believe they hold a task, and a live agent's
  task is never rescued under it;
* no job is left unfinished when all its tasks are final;
* no row names a missing object: every artifact row's object is in storage and its job exists, and
  the object-deletion to-do is empty once the deciding transaction committed;
* no report is lost: every accepted report is the recorded outcome of its attempt;
* a late report (from an attempt that is no longer current) is refused and changes nothing of the
  task nor of its newer attempt;
* every status change has its event, naming the new status, and every event's move is one the
  transition table allows;
* a lease that ended during an outage the pulse recorded is rescued as an outage, never as a dead
  agent's ``lease_expired``.

Time: an agent crash is made by writing its tasks' ``lease_expires_at`` one second in the past
and ``heartbeat_at`` one lease before that (the lease length it was granted is kept). The rescue
reads nothing else of a lease but those two columns and the outages, so this is exactly the row a
dead agent leaves once its lease has run out; the rescue then runs on PostgreSQL's own clock. An
outage is recorded by the real pulse (:func:`jobs.pulse.stamp`, after its last stamp is set back
beyond the gap); the outage row and the cut-off agent's leases (ending inside it) are then moved
100 s into the past together, which is what the rows look like once a builder has ticked for
100 s after that outage, past every lease's grace. Retention runs with ``now`` 400 days ahead.
Crash restarts and promotions of the server itself are real in tests/system/test_crash_restart.py
and tests/system/test_failover_promotion.py.

Run length: :data:`MODEL_SETTINGS`, 12 examples of up to 30 steps (rules run only where they can act:
an agent reports only what it holds), derandomized (the same runs in every run and in CI) and
without the example database: the test's call takes about 15 s on two idle cores, 40 s on busy ones.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import pytest
from django.db import connection
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from accs_site.conf import reload
from events.artifacts import record_artifact
from events.models import Event
from events.timeline import unfold
from jobs import api, pulse, transitions
from jobs.claim import NodeLimits, ServiceSpec, claim_many, service_spec
from jobs.narrow import widen, widen_aged
from jobs.outcomes import Outcome, ReportResult
from jobs.retention import prune_finished_jobs
from jobs.states import JOB_ADMITTED, TASK_HELD, job_may, sql_in, task_may
from tenants.accounts import create_tenant
from tests.engine_helpers import KEY_HELD_DRIFT_SQL
from workflows.api import create_workflow

pytestmark = pytest.mark.django_db(transaction=True)

MODEL_SETTINGS = settings(max_examples=12, stateful_step_count=30, derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
AGENT_NAMES = ("agent-a", "agent-b", "agent-c")
LEASE = 60.0  # seconds: every claim's lease (no service asks for its own)
SLOTS = 3  # each agent runs at most this many tasks at once
SOURCE = "agent:model"
KINDS = ("plain", "capped", "keyed", "pair", "chain", "narrow", "narrow-capped")
# Per example, the engine's state starts empty (definitions and tenants stay); children first.
RESET_TABLES = ("accs_attempt", "accs_artifact", "accs_job_step", "accs_task", "accs_job", "accs_event", "accs_outage",
                "accs_cluster_pulse", "accs_object_deletion", "accs_rate_start", "accs_start")


@dataclass(frozen=True)
class Site:
    """The definitions every run uses: services with caps, capped workflows, a capped tenant."""

    specs: list[ServiceSpec]
    starts: dict[str, Callable[[str], Any]]


@pytest.fixture
def site(make_service, default_tenant, retention_defaults) -> Site:
    keyed_schema = {"type": "object", "properties": {"customer": {"type": "string"}}}
    services = [
        make_service("m-plain", max_attempts=2),
        make_service("m-capped", max_attempts=2, max_concurrent=2),
        make_service("m-keyed", max_attempts=2, concurrency_key="customer", concurrency_key_limit=2,
                     params_schema=keyed_schema),
    ]
    create_workflow(name="m-pair", max_active_jobs=2, steps=[
        {"key": "a", "service": "m-plain", "depends_on": []}, {"key": "b", "service": "m-capped", "depends_on": []}])
    create_workflow(name="m-chain", max_active_jobs=1, steps=[
        {"key": "a", "service": "m-capped", "depends_on": []}, {"key": "b", "service": "m-plain", "depends_on": ["a"]}])
    tenant, _ = create_tenant("m-tenant", max_in_flight=2)
    starts: dict[str, Callable[[str], Any]] = {
        "plain": lambda key: api.start_service("m-plain"),
        "capped": lambda key: api.start_service("m-capped", tenant=tenant),
        "keyed": lambda key: api.start_service("m-keyed", params={"customer": key}),
        "pair": lambda key: api.start_workflow("m-pair", tenant=tenant if key == "a" else None),
        "chain": lambda key: api.start_workflow("m-chain"),
        # Narrow starts (jobs.narrow): one row each, widened by a claim, the builder or a read by id.
        "narrow": lambda key: _narrow(lambda: api.start_service("m-plain")),
        "narrow-capped": lambda key: _narrow(lambda: api.start_service("m-capped")),
    }
    return Site(specs=[service_spec(s) for s in services], starts=starts)


def _narrow(start: Callable[[], Any]) -> Any:
    """Run ``start`` with narrow starts turned on (the site setting), and off again after it."""
    os.environ["ACC_NARROW_STARTS"] = "1"
    reload()
    try:
        return start()
    finally:
        del os.environ["ACC_NARROW_STARTS"]
        reload()


def _close_connection() -> None:
    """Close the calling thread's database connection."""
    connection.close()


class Agent:
    """A simulated agent: a thread (so a database connection) of its own and what it believes it holds."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.boot = 0
        self.limits = NodeLimits(name=f"node-{name}", slot_cap=SLOTS, cpu_budget=100, per_service={})
        self.held: dict[UUID, int] = {}  # task → the attempt it runs
        self.running: set[UUID] = set()  # held tasks it reported started
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    @property
    def agent_id(self) -> str:
        """Its identity; a restarted agent is a new one (as a real agent's host:pid:boot is)."""
        return f"{self.name}:{self.boot}"

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Start ``fn`` on this agent's thread and connection; its future holds the result."""
        return self._thread.submit(fn, *args, **kwargs)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on this agent's thread and connection; return its result."""
        return self.submit(fn, *args, **kwargs).result(timeout=60)

    def restart(self) -> None:
        self.boot += 1
        self.held.clear()
        self.running.clear()

    def close(self) -> None:
        self.call(_close_connection)
        self._thread.shutdown()


@dataclass
class Stale:
    """An attempt an agent stopped believing it holds (crashed, cut off, lost): it may still report late."""

    agent: str
    agent_id: str
    task_id: UUID
    attempt: int
    running: bool  # it had reported the attempt started


@dataclass
class Seen:
    """What the invariants saw at the previous step."""

    event_id: int = 0
    statuses: dict[tuple[str, UUID], str] = field(default_factory=dict)


def _rows(sql: str, params: Any = None) -> list[tuple]:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def _work_queued() -> bool:
    """Whether a claim could find work: a queued task, or a narrow start it would widen."""
    return bool(_rows("SELECT 1 FROM accs_task WHERE status = 'queued' UNION ALL SELECT 1 FROM accs_start LIMIT 1"))


def _task_row(task_id: UUID) -> tuple | None:
    rows = _rows("SELECT status, attempt, claimed_by, lease_expires_at, heartbeat_at, error_code, results,"
                 " finished_at, max_attempts FROM accs_task WHERE id = %s", [task_id])
    return rows[0] if rows else None


def _attempt_rows(task_id: UUID) -> list[tuple]:
    return _rows("SELECT attempt_no, status, error_text, finished_at FROM accs_attempt WHERE task_id = %s"
                 " ORDER BY attempt_no", [task_id])


def _ran(task_id: UUID, attempt: int, succeeded: bool) -> Outcome:
    """What an agent reports of an attempt it ran to its end: a success, or its command's failure."""
    return (Outcome(task_id=task_id, attempt=attempt, status="succeeded", results={"n": attempt}) if succeeded
            else Outcome(task_id=task_id, attempt=attempt, status="failed", error="boom", exit_code=1))


def _statuses_after(outcome: Outcome) -> frozenset[str]:
    """The attempt statuses an accepted report of ``outcome`` may leave (a failure's job may be canceled)."""
    return frozenset({"succeeded"}) if outcome.status == "succeeded" else frozenset({"failed", "canceled"})


def _accepted(result: ReportResult, task_id: UUID) -> bool:
    return task_id in set(result.done) | set(result.retried) | set(result.failed) | set(result.canceled)


class EngineMachine(RuleBasedStateMachine):
    """The engine driven by a builder, three agents and an operator, in random order."""

    site: Site
    storage_keys: Callable[[], list[str]]

    def __init__(self) -> None:
        super().__init__()
        with connection.cursor() as cur:
            for table in RESET_TABLES:
                cur.execute(f"DELETE FROM {table}")
        self.agents = {name: Agent(name) for name in AGENT_NAMES}
        self.jobs: list[UUID] = []
        self.narrow: set[UUID] = set()  # the jobs started as narrow starts
        self.accepted: dict[tuple[UUID, int], frozenset[str]] = {}  # (task, attempt) → attempt statuses allowed
        self.stale: list[Stale] = []
        self.cut_off: set[UUID] = set()  # tasks whose lease ended in a recorded outage, not yet rescued
        self.ended: set[UUID] = set()  # tasks whose lease the machine ended (crash, outage), not yet rescued
        self.seen = Seen()
        self.artifact_seq = 0

    def teardown(self) -> None:
        for agent in self.agents.values():
            agent.close()

    # ------------------------------------------------------------------ the API and the builder
    @rule(starts=st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(["a", "b"])), min_size=1, max_size=4))
    def start(self, starts: list[tuple[str, str]]) -> None:
        for kind, key in starts:
            self.jobs.append(self.site.starts[kind](key).id)
            if kind.startswith("narrow"):
                self.narrow.add(self.jobs[-1])

    @rule(kinds=st.lists(st.sampled_from(["narrow", "narrow-capped"]), min_size=1, max_size=4))
    def start_narrow(self, kinds: list[str]) -> None:
        """Narrow starts as often as all the other kinds together: their widening races every other step."""
        self.start([(kind, "a") for kind in kinds])

    @precondition(lambda self: bool(_rows("SELECT 1 FROM accs_job WHERE status = 'queued' LIMIT 1")))
    @rule()
    def admit(self) -> None:
        transitions.start_due_jobs()

    @precondition(lambda self: bool(_rows("SELECT 1 FROM accs_start LIMIT 1")))
    @rule(data=st.data(), by_id=st.booleans())
    def widen_starts(self, data: st.DataObject, by_id: bool) -> None:
        """The builder's widening of starts no claim took, or a read by id (the API, an operator's page)."""
        if by_id:
            widen([data.draw(st.sampled_from(self.jobs))])
        else:
            widen_aged(after_seconds=0, limit=data.draw(st.integers(1, 3)))

    # ------------------------------------------------------------------ agents
    def _holding(self) -> list[str]:
        return [a.name for a in self.agents.values() if a.held]

    @precondition(lambda self: any(len(a.held) < SLOTS for a in self.agents.values()) and _work_queued())
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        """An agent of every service: it claims through the keyed claim."""
        self._claim(data, self.site.specs)

    @precondition(lambda self: any(len(a.held) < SLOTS for a in self.agents.values()) and _work_queued())
    @rule(data=st.data())
    def claim_unkeyed(self, data: st.DataObject) -> None:
        """An agent of the services without a per-key limit: it claims through the plain claim, whose rows
        carry the creation of the narrow starts it widens and takes."""
        self._claim(data, [s for s in self.site.specs if not s.keyed])

    def _claim(self, data: st.DataObject, specs: list[ServiceSpec]) -> None:
        agent = self.agents[data.draw(st.sampled_from([n for n, a in self.agents.items() if len(a.held) < SLOTS]))]
        name, free = agent.name, SLOTS - len(agent.held)
        claimed = agent.call(claim_many, specs, agent.limits, agent_id=agent.agent_id, free_slots=free,
                             lease_seconds=LEASE)
        for task in claimed:
            others = [a.name for a in self.agents.values() if task.id in a.held]
            assert not others, f"task {task.id} claimed by {name} while {others} still hold it"
            agent.held[task.id] = task.attempt

    @precondition(lambda self: any(set(a.held) - a.running for a in self.agents.values()))
    @rule(data=st.data())
    def mark_running(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from([n for n, a in self.agents.items() if set(a.held) - a.running]))
        agent = self.agents[name]
        waiting = sorted(set(agent.held) - agent.running, key=str)
        task_id = data.draw(st.sampled_from(waiting))
        moved = agent.call(transitions.mark_running, [(task_id, agent.held[task_id], 4242)], agent_id=agent.agent_id,
                           source=SOURCE)
        assert moved == {task_id}, f"{name} could not start the task it holds under a live lease"
        agent.running.add(task_id)

    @precondition(lambda self: bool(self._holding()))
    @rule(data=st.data(), succeeded=st.booleans(), artifact=st.booleans())
    def finish(self, data: st.DataObject, succeeded: bool, artifact: bool) -> None:
        name = data.draw(st.sampled_from(self._holding()))
        agent = self.agents[name]
        task_id = data.draw(st.sampled_from(sorted(agent.held, key=str)))
        attempt = agent.held.pop(task_id)
        started = [] if task_id in agent.running else [(task_id, attempt, 4242)]
        agent.running.discard(task_id)
        job_id = _rows("SELECT job_id FROM accs_task WHERE id = %s", [task_id])[0][0]
        if artifact:
            self.artifact_seq += 1
            agent.call(record_artifact, job_id=job_id, task_id=task_id, attempt=attempt, kind="output",
                       name=f"out-{self.artifact_seq}.txt", data=b"output")
        outcome = _ran(task_id, attempt, succeeded)
        result = agent.call(transitions.report, [outcome], started=started, agent_id=agent.agent_id, source=SOURCE)
        assert _accepted(result, task_id), f"the report of {name}'s live attempt was refused: {result}"
        self.accepted[(task_id, attempt)] = _statuses_after(outcome)

    @precondition(lambda self: len(self._holding()) > 1)
    @rule(data=st.data())
    def finish_together(self, data: st.DataObject) -> None:
        """Every agent that holds tasks reports all of them at once, each on its own connection, racing
        the others (two agents may hold tasks of the same keys, in any order of their ids)."""
        calls = []
        for name in self._holding():
            agent = self.agents[name]
            outcomes, started = [], []
            for task_id, attempt in sorted(agent.held.items(), key=lambda item: str(item[0])):
                outcomes.append(_ran(task_id, attempt, data.draw(st.booleans(), label=f"{name} {task_id} succeeded")))
                if task_id not in agent.running:
                    started.append((task_id, attempt, 4242))
            calls.append((agent, outcomes, agent.submit(
                transitions.report, outcomes, started=started, agent_id=agent.agent_id, source=SOURCE)))
        for agent, outcomes, future in calls:
            result = future.result(timeout=60)  # a deadlock or any other error is raised here
            for o in outcomes:
                assert _accepted(result, o.task_id), f"the report of {agent.name}'s live attempt was refused: {result}"
                self.accepted[(o.task_id, o.attempt)] = _statuses_after(o)
            agent.held.clear()
            agent.running.clear()

    @precondition(lambda self: bool(self._holding()))
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self._holding()))
        agent = self.agents[name]
        held = [(t, a) for t, a in agent.held.items()]
        lost, cancel = agent.call(transitions.heartbeat, held, agent_id=agent.agent_id, lease_seconds=LEASE)
        assert not lost, f"{name} lost live leases {lost}: nothing rescues or takes a lease that is renewed"
        for task_id, attempt in sorted(cancel, key=str):
            # The agent stops what an operator canceled and says so.
            agent.held.pop(task_id)
            agent.running.discard(task_id)
            result = agent.call(transitions.report, [Outcome(task_id=task_id, attempt=attempt, status="canceled",
                                                             error="canceled by an operator")],
                                agent_id=agent.agent_id, source=SOURCE)
            assert _accepted(result, task_id), result
            self.accepted[(task_id, attempt)] = frozenset({"canceled"})

    @precondition(lambda self: bool(self._holding()))
    @rule(data=st.data(), how=st.sampled_from(["crash", "outage"]))
    def lose_agent(self, data: st.DataObject, how: str) -> None:
        """An agent stops renewing its leases: it died, or PostgreSQL was out of its reach (see the module
        docstring for how the leases run out). It comes back under a new identity."""
        agent = self.agents[data.draw(st.sampled_from(self._holding()))]
        ended = self._crash(agent) if how == "crash" else self._outage(agent)
        self.ended |= ended
        self.stale += [Stale(agent.name, agent.agent_id, t, a, running=t in agent.running)
                       for t, a in sorted(agent.held.items(), key=str)]
        agent.restart()

    def _crash(self, agent: Agent) -> set[UUID]:
        """The agent's leases ran out a second ago; return their tasks."""
        with connection.cursor() as cur:
            cur.execute("UPDATE accs_task SET lease_expires_at = now() - interval '1 second',"
                        " heartbeat_at = now() - interval '1 second' - (lease_expires_at - heartbeat_at)"
                        f" WHERE claimed_by = %s AND status IN {sql_in(TASK_HELD)} RETURNING id", [agent.agent_id])
            return {row[0] for row in cur.fetchall()}

    def _outage(self, agent: Agent) -> set[UUID]:
        """The pulse records an outage (its last stamp older than the gap); the agent's leases end in it."""
        pulse.stamp()  # the site's first stamp, or a regular one
        with connection.cursor() as cur:
            cur.execute("UPDATE accs_cluster_pulse SET seen_at = clock_timestamp() - make_interval(secs => %s)"
                        " WHERE name = %s", [pulse.GAP_SECONDS * 6, pulse.PULSE_NAME])
        assert pulse.stamp() is not None, "a stamp after a gap records an outage"
        with connection.cursor() as cur:
            cur.execute("UPDATE accs_outage SET began_at = began_at - interval '100 s',"
                        " ended_at = ended_at - interval '100 s'"
                        " WHERE id = (SELECT max(id) FROM accs_outage) RETURNING began_at, ended_at")
            began, ended = cur.fetchone()
            middle = began + (ended - began) / 2
            cur.execute("UPDATE accs_task SET lease_expires_at = %s,"
                        " heartbeat_at = %s - (lease_expires_at - heartbeat_at)"
                        f" WHERE claimed_by = %s AND status IN {sql_in(TASK_HELD)} RETURNING id",
                        [middle, middle, agent.agent_id])
            cut = {row[0] for row in cur.fetchall()}
        self.cut_off |= cut
        return cut

    @precondition(lambda self: bool(self.stale))
    @rule(data=st.data(), succeeded=st.booleans())
    def late_report(self, data: st.DataObject, succeeded: bool) -> None:
        """An attempt an agent stopped believing it holds is reported after all (a frozen agent wakes up)."""
        late = self.stale.pop(data.draw(st.integers(0, len(self.stale) - 1)))
        before, attempts_before = _task_row(late.task_id), _attempt_rows(late.task_id)
        outcome = (Outcome(task_id=late.task_id, attempt=late.attempt, status="succeeded", results={"late": True})
                   if succeeded else Outcome(task_id=late.task_id, attempt=late.attempt, status="failed", error="late"))
        current = (before is not None and before[0] in TASK_HELD and before[1] == late.attempt
                   and before[2] == late.agent_id)
        started = [] if late.running else [(late.task_id, late.attempt, 4242)]
        result = self.agents[late.agent].call(transitions.report, [outcome], started=started, agent_id=late.agent_id,
                                              source=SOURCE)
        if current:
            # Its lease ran out but nothing rescued it yet: the attempt is still its own to report.
            assert _accepted(result, late.task_id), result
            self.accepted[(late.task_id, late.attempt)] = _statuses_after(outcome)
            self.cut_off.discard(late.task_id)
            self.ended.discard(late.task_id)
            return
        assert not _accepted(result, late.task_id), f"a late report of attempt {late.attempt} was accepted: {result}"
        assert _task_row(late.task_id) == before, "a late report changed the task"
        assert _attempt_rows(late.task_id) == attempts_before, "a late report changed an attempt"

    # ------------------------------------------------------------------ the leader's duties
    @precondition(lambda self: bool(self.ended))
    @rule()
    def rescue(self) -> None:
        live = {t: a.name for a in self.agents.values() for t in a.held}
        result = transitions.rescue_expired()
        rescued = set(result.retried) | set(result.failed)
        assert not rescued & set(live), f"the rescue took leases that live agents renew: {rescued & set(live)}"
        for task_id in sorted(self.cut_off & rescued, key=str):
            row = _task_row(task_id)
            assert row is not None and row[5] == "outage", (
                f"a lease that ended in a recorded outage was rescued as {row and row[5]}, not as an outage")
        self.cut_off -= rescued
        assert not {t for t in self.ended - rescued if (_task_row(t) or ("",))[0] in TASK_HELD}, (
            "leases that ended long ago are still held after the rescue")
        self.ended.clear()

    @precondition(lambda self: bool(_rows("SELECT 1 FROM accs_job WHERE finished_at IS NOT NULL LIMIT 1")))
    @rule()
    def prune(self) -> None:
        with connection.cursor() as cur:
            cur.execute("SELECT now() + interval '400 days'")
            later = cur.fetchone()[0]
        live = {t for a in self.agents.values() for t in a.held}
        result = prune_finished_jobs(limit=100, now=later, export=False)
        pruned = set(result.job_ids)
        assert not {t for t in live if not _rows("SELECT 1 FROM accs_task WHERE id = %s", [t])}, (
            f"retention deleted tasks that agents run (jobs {pruned})")
        self.jobs = [j for j in self.jobs if j not in pruned]
        self.narrow -= pruned

    # ------------------------------------------------------------------ the operator
    @precondition(lambda self: bool(self.jobs))
    @rule(data=st.data(), verb=st.sampled_from(["cancel_job", "retry_job"]))
    def job_verb(self, data: st.DataObject, verb: str) -> None:
        job_id = data.draw(st.sampled_from(self.jobs))
        getattr(transitions, verb)(job_id, by="operator")

    @precondition(lambda self: bool(self.jobs))
    @rule(data=st.data(), verb=st.sampled_from(["cancel_task", "retry_task"]))
    def task_verb(self, data: st.DataObject, verb: str) -> None:
        tasks = [row[0] for row in _rows("SELECT id FROM accs_task ORDER BY id")]
        if not tasks:
            return
        getattr(transitions, verb)(data.draw(st.sampled_from(tasks)), by="operator")

    # ------------------------------------------------------------------ invariants, after every step
    @invariant()
    def caps_count_what_holds_capacity(self) -> None:
        # A job holds a slot of its workflow and tenant while admitted, or while a task of it is held.
        holds_capacity = (f"(j.status IN {sql_in(JOB_ADMITTED)} OR EXISTS (SELECT 1 FROM accs_task t"
                          f" WHERE t.job_id = j.id AND t.status IN {sql_in(TASK_HELD)}))")
        over = _rows(f"""
            SELECT 'service ' || s.key, count(*), s.max_concurrent FROM accs_task t JOIN accs_service s
              ON s.id = t.service_id WHERE t.status IN {sql_in(TASK_HELD)} AND s.max_concurrent > 0
             GROUP BY s.key, s.max_concurrent HAVING count(*) > s.max_concurrent
            UNION ALL
            SELECT 'key ' || s.key || '/' || (t.params->>s.concurrency_key), count(*), s.concurrency_key_limit
              FROM accs_task t JOIN accs_service s ON s.id = t.service_id
             WHERE t.status IN {sql_in(TASK_HELD)} AND s.concurrency_key_limit > 0
             GROUP BY s.key, t.params->>s.concurrency_key, s.concurrency_key_limit
            HAVING count(*) > s.concurrency_key_limit
            UNION ALL
            SELECT 'workflow ' || w.name, count(*), w.max_active_jobs FROM accs_job j
              JOIN accs_workflow w ON w.id = j.workflow_id
             WHERE w.max_active_jobs > 0 AND {holds_capacity}
             GROUP BY w.name, w.max_active_jobs HAVING count(*) > w.max_active_jobs
            UNION ALL
            SELECT 'tenant ' || tn.slug, count(*), tn.max_in_flight FROM accs_job j
              JOIN accs_tenant tn ON tn.id = j.tenant_id
             WHERE tn.max_in_flight > 0 AND {holds_capacity}
             GROUP BY tn.slug, tn.max_in_flight HAVING count(*) > tn.max_in_flight
        """)
        assert not over, f"caps exceeded (what, holding, cap): {over}"

    @invariant()
    def each_key_counts_exactly_its_held_tasks(self) -> None:
        # The keyed claim trusts the count kept per key instead of counting held tasks.
        drift = _rows(KEY_HELD_DRIFT_SQL)
        assert not drift, f"held counts per key drifted (service, key, kept, real): {drift}"

    @invariant()
    def no_task_is_held_twice(self) -> None:
        holders: dict[UUID, list[str]] = {}
        for agent in self.agents.values():
            for task_id in agent.held:
                holders.setdefault(task_id, []).append(agent.name)
        twice = {t: names for t, names in holders.items() if len(names) > 1}
        assert not twice, f"tasks held by two live agents: {twice}"
        for agent in self.agents.values():
            for task_id, attempt in agent.held.items():
                row = _task_row(task_id)
                assert row is not None and row[0] in TASK_HELD and (row[1], row[2]) == (attempt, agent.agent_id), (
                    f"{agent.name} renews attempt {attempt} of {task_id}, but the database says {row and row[:3]}")

    @invariant()
    def every_start_is_one_job_or_one_narrow_start(self) -> None:
        if not self.jobs:
            return
        ids = sorted(self.jobs, key=str)
        jobs = {r[0] for r in _rows("SELECT id FROM accs_job WHERE id = ANY(%s)", [ids])}
        starts = {r[0] for r in _rows("SELECT id FROM accs_start WHERE id = ANY(%s)", [ids])}
        assert not jobs & starts, f"starts that are also jobs: {jobs & starts}"
        assert jobs | starts == set(ids), f"starts lost: {set(ids) - jobs - starts}"
        widened = _rows("SELECT j.id, count(t.id) FROM accs_job j LEFT JOIN accs_task t ON t.job_id = j.id"
                        " WHERE j.id = ANY(%s) GROUP BY j.id HAVING count(t.id) <> 1",
                        [sorted(self.narrow & jobs, key=str)])
        assert not widened, f"narrow starts widened into jobs without exactly one task: {widened}"
        assert not starts - self.narrow, f"wide starts written as narrow ones: {starts - self.narrow}"

    @invariant()
    def no_job_is_left_unfinished_when_its_tasks_are(self) -> None:
        stuck = _rows("""
            SELECT j.id, j.status FROM accs_job j
             WHERE j.status NOT IN ('done', 'partial', 'error', 'canceled')
               AND EXISTS (SELECT 1 FROM accs_task t WHERE t.job_id = j.id)
               AND NOT EXISTS (SELECT 1 FROM accs_task t WHERE t.job_id = j.id
                                  AND t.status NOT IN ('done', 'error', 'skipped', 'canceled', 'blocked'))
        """)
        assert not stuck, f"jobs left unfinished with every task final: {stuck}"

    @invariant()
    def no_row_names_a_missing_object(self) -> None:
        rows = _rows("SELECT a.key, a.job_id, j.id IS NOT NULL FROM accs_artifact a"
                     " LEFT JOIN accs_job j ON j.id = a.job_id")
        if rows:
            stored = set(self.storage_keys())
            assert {key for key, _, _ in rows} <= stored, "artifact rows name objects that are not in storage"
        assert all(has_job for _, _, has_job in rows), "artifact rows name jobs that do not exist"
        assert not _rows("SELECT bucket, key FROM accs_object_deletion"), "object deletions left undone after commit"

    @invariant()
    def no_accepted_report_is_lost(self) -> None:
        if not self.accepted:
            return
        recorded = {(t, a): s for t, a, s in _rows(
            "SELECT task_id, attempt_no, status FROM accs_attempt WHERE task_id = ANY(%s)",
            [sorted({t for t, _ in self.accepted}, key=str)])}
        existing = {r[0] for r in _rows("SELECT id FROM accs_task WHERE id = ANY(%s)",
                                        [sorted({t for t, _ in self.accepted}, key=str)])}
        lost = {k: (recorded.get(k), sorted(allowed)) for k, allowed in self.accepted.items()
                if k[0] in existing and recorded.get(k) not in allowed}
        assert not lost, f"accepted reports not reflected (attempt: recorded, expected): {lost}"

    @invariant()
    def every_status_change_has_its_event(self) -> None:
        now = {("task", i): s for i, s in _rows("SELECT id, status FROM accs_task")}
        now |= {("job", i): s for i, s in _rows("SELECT id, status FROM accs_job")}
        # The lines operators see: a row that folds several moves (a task's and its job's) stands for each.
        rows = list(Event.objects.filter(id__gt=self.seen.event_id, type__in=("status", "retry")).order_by("id"))
        events = [(line.id, line.job_id, line.task_id, line.data.get("from"), line.data["to"])
                  for row in rows for line in unfold(row) if isinstance(line.data, dict) and "to" in line.data]
        last_to: dict[tuple[str, UUID], str] = {}
        for _, job_id, task_id, frm, to in events:
            key = ("task", task_id) if task_id else ("job", job_id)
            allowed = task_may(frm, to) if task_id else job_may(frm, to)
            assert allowed, f"{key[0]} {key[1]} moved {frm} → {to}, outside the transition table"
            last_to[key] = to
        changed = {k: (self.seen.statuses[k], s) for k, s in now.items()
                   if k in self.seen.statuses and self.seen.statuses[k] != s}
        missing = {k: moved for k, moved in changed.items() if last_to.get(k) != moved[1]}
        assert not missing, f"status changes without an event naming the new status: {missing}"
        self.seen = Seen(event_id=max([self.seen.event_id] + [e.id for e in rows]), statuses=now)


def test_the_engine_keeps_its_promises_whatever_the_order_of_events(site, s3):
    """Random runs (:data:`MODEL_SETTINGS`) of the engine against the real PostgreSQL and S3 server."""

    class Machine(EngineMachine):
        pass

    Machine.site = site
    Machine.storage_keys = staticmethod(s3.keys)  # type: ignore[assignment]
    run_state_machine_as_test(Machine, settings=MODEL_SETTINGS)
