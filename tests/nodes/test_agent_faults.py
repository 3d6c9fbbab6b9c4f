"""Agents under faults, as real processes against a real PostgreSQL: outages, bad output, stalls,
cut-off connections, orphans, shutdowns and callables that will not stop."""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from typing import Any

import psycopg
import pytest

from events.models import Event
from jobs import api, transitions
from jobs.ids import short_id
from jobs.models import Attempt, Job, Task
from tests.daemons import ROOT, agent_in_this_process, wait_all_final, wait_until
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.django_db(transaction=True)


# Callables the agent imports by dotted path (tests.nodes.test_agent_faults:...).
def spin(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    """Ignore cancel and never return by itself (a callable only an interruption can stop)."""
    while True:
        time.sleep(0.01)


def block_in_c(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    """Block in C for a minute: only a killable process stops it early."""
    time.sleep(60)
    return {}


def nan_result(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    return {"value": float("nan")}


def _proxied_env(db_url: str, proxy: TcpProxy) -> dict[str, str]:
    return {"ACC_DB_URL": db_url.replace(db_url.split("@", 1)[1].split("/", 1)[0], f"127.0.0.1:{proxy.port}")}


def _db_port(db_url: str) -> int:
    return int(db_url.split("@", 1)[1].split("/", 1)[0].split(":")[1])


def _terminate_daemon_sessions(db_url: str) -> int:
    """Kill every session of the test database except this test's own (a connection loss)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        return conn.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                            " AND application_name LIKE 'accs %%'").fetchone()[0]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return "State:\tZ" not in fh.read()
    except FileNotFoundError:
        return False


def _literal(script: str) -> str:
    """Return ``script`` as one argv element with no placeholders (braces doubled)."""
    return script.replace("{", "{{").replace("}", "}}")


def _log(proc) -> str:
    return proc.log_path.read_text()


SLEEP = {"executor": "python", "executor_config": {"callable": "tests.callables:sleep"},
         "params_schema": {"type": "object", "properties": {"seconds": {"type": "number"}}}}


@pytest.mark.slow
def test_agents_and_builder_survive_connection_loss_and_outage_and_finish_every_task_once(
    make_service, daemons, db_url
):
    make_service("steady", **SLEEP, backoff_base_seconds=0, backoff_cap_seconds=0)
    with TcpProxy(0, "127.0.0.1", _db_port(db_url)) as proxy:
        env = _proxied_env(db_url, proxy)
        proxy.cut(reset=True)  # the database is down when the daemons start
        agents = [daemons.agent(f"n{i}", "steady", "--max-concurrent", "3", "--lease-seconds", "30", env=env)
                  for i in range(2)]
        builder = daemons.start("runbuilder", "--tick", "0.2", name="builder", env=env)
        wait_until(lambda: all("waiting for PostgreSQL at 127.0.0.1:" in _log(p) for p in agents + [builder]),
                   timeout=30, message="each daemon says it waits for PostgreSQL")
        proxy.restore()
        api.start_many([api.JobSpec(service="steady", params={"seconds": 0.3}) for _ in range(30)])
        wait_until(lambda: Task.objects.filter(status="done").count() >= 5, timeout=60, message="some tasks done")
        assert _terminate_daemon_sessions(db_url) > 0  # connection loss: every daemon session killed
        wait_until(lambda: Task.objects.filter(status="done").count() >= 12, timeout=60, message="work goes on")
        proxy.cut(reset=True)  # full outage: refused and reset, while tasks finish in memory
        time.sleep(4)  # the outage itself is what is being tested: it must last a while
        for proc in agents + [builder]:
            assert proc.poll() is None, _log(proc)[-3000:]
        proxy.restore()
        wait_all_final(db_url, timeout=90, expected=30)
    for proc in agents + [builder]:
        assert proc.poll() is None, f"a daemon exited: {_log(proc)[-3000:]}"
        text = _log(proc)
        assert text.count("waiting for PostgreSQL at") == 1, "start-up says it once"
        assert text.count("database unreachable") <= 3, "an outage is logged once, not once per retry"
    assert Task.objects.filter(status="done").count() == 30
    attempts = list(Attempt.objects.values_list("task_id", "attempt_no", "status", "agent_id", "error_text"))
    again = {a[0] for a in attempts if a[1] > 1 or a[2] != "succeeded"}
    assert len(attempts) == 30 and not again, (
        "no outcome was lost (nothing ran twice)", [a for a in attempts if a[0] in again],
        list(Event.objects.filter(task_id__in=again).order_by("id").values_list("task_id", "type", "message")))
    assert not Event.objects.filter(type="fenced").exists()


BAD_OUTPUT = (
    "import sys, json; mode = sys.argv[1]\n"
    "print('before\\x00after', file=sys.stderr, flush=True)\n"
    "if mode == 'nan': print('{\"x\": NaN}')\n"
    "elif mode == 'nul': print(json.dumps({'s': 'a\\u0000b', 'k\\u0000': ['\\u0000']}))\n"
    "elif mode == 'surrogate': print('{\"s\": \"\\\\ud800\"}')\n"
    "else: print(json.dumps({'ok': True}))\n"
)


def test_bad_output_fails_only_its_task_and_never_the_batch_or_the_agent(make_service, daemons, db_url):
    make_service("printer", executor="command",
                 executor_config={"argv": ["python", "-c", _literal(BAD_OUTPUT), "{mode}"]},
                 params_schema={"type": "object", "properties": {"mode": {"type": "string"}}}, max_attempts=2,
                 backoff_base_seconds=0, backoff_cap_seconds=0)
    make_service("nan-python", executor_config={"callable": "tests.nodes.test_agent_faults:nan_result"}, max_attempts=2)
    modes = ["ok", "nan", "nul", "surrogate", "ok"]
    jobs = {mode + str(i): api.start_service("printer", params={"mode": mode}) for i, mode in enumerate(modes)}
    jobs["python-nan"] = api.start_service("nan-python")
    agent = daemons.agent("n1", "printer,nan-python", "--max-concurrent", "6")
    wait_all_final(db_url, timeout=60)
    assert agent.poll() is None, _log(agent)[-3000:]
    tasks = {name: Task.objects.get(job=job) for name, job in jobs.items()}
    assert tasks["ok0"].status == tasks["ok4"].status == "done", "the rest of the batch is reported"
    assert tasks["nul2"].status == "done" and tasks["nul2"].results == {"s": "ab", "k": [""]}, "NUL stripped"
    for name in ("nan1", "surrogate3", "python-nan"):
        task = tasks[name]
        assert (task.status, task.error_code, task.attempt) == ("error", "bad_output", 1), (name, task.error_message)
        assert "bad output" in task.error_message
    logs = list(Event.objects.filter(task=tasks["ok0"], type="log").values_list("message", flat=True))
    assert logs == ["beforeafter"], "NUL stripped from log lines"
    for task in tasks.values():
        running = Event.objects.filter(task=task, type="status", data__to="running").values_list("id", flat=True)
        first_log = Event.objects.filter(task=task, type="log").order_by("id").values_list("id", flat=True).first()
        if first_log is not None:
            assert running and running[0] < first_log, "a task's log lines follow its running event"
    leftovers = [p for t in tasks.values()
                 for p in glob.glob(os.path.join(tempfile.gettempdir(), "accs-scratch-*", f"accs-{short_id(t.id)}-*"))]
    assert leftovers == [], "scratch folders are removed after each attempt"


def _timed_command(make_service, key: str, marks: str, *, first_seconds: float, lease: float = 0) -> None:
    """A command that records its pid per attempt and, on a later attempt, whether an earlier one still lives."""
    script = (
        "import os, sys, time, json, pathlib\n"
        f"d = pathlib.Path({marks!r}); n = int(os.environ['ACCS_ATTEMPT'])\n"
        "(d / f'{n}.pid').write_text(str(os.getpid()))\n"
        "alive = []\n"
        "for p in d.glob('*.pid'):\n"
        "    pid = int(p.read_text())\n"
        "    if pid != os.getpid():\n"
        "        try:\n"
        "            st = open(f'/proc/{pid}/status').read()\n"
        "            if 'State:\\tZ' not in st: alive.append(p.stem)\n"
        "        except FileNotFoundError: pass\n"
        "(d / f'{n}.overlap').write_text(json.dumps(alive))\n"
        f"time.sleep({first_seconds} if n == 1 else 0.3)\n"
        "(d / f'{n}.end').write_text(str(time.time()))\n"
        "print('{}')\n"
    )
    make_service(key, executor="command", executor_config={"argv": ["python", "-c", _literal(script)]},
                 timeout_seconds=120, max_attempts=5, backoff_base_seconds=0, backoff_cap_seconds=0)


def test_agent_stalled_past_its_lease_tracks_and_finishes_the_new_attempt(make_service, daemons, db_url, tmp_path):
    _timed_command(make_service, "stall", str(tmp_path), first_seconds=4)
    job = api.start_service("stall")
    agent = daemons.agent("n1", "stall", "--lease-seconds", "3", "--poll-interval", "0.2")
    wait_until(lambda: Task.objects.filter(job=job, status="running").exists(), timeout=20, message="running")
    agent.send_signal(signal.SIGSTOP)
    try:
        daemons.builder()
        wait_until(lambda: Attempt.objects.filter(task__job=job, attempt_no=1, status="failed").exists(),
                   timeout=20, message="the builder rescues the stalled attempt")
    finally:
        agent.send_signal(signal.SIGCONT)
    wait_all_final(db_url, timeout=60)
    task = Task.objects.get(job=job)
    assert agent.poll() is None, _log(agent)[-3000:]
    assert task.status == "done", (task.status, task.error_message)
    final = Attempt.objects.get(task=task, attempt_no=task.attempt)
    assert final.status == "succeeded" and final.node == "n1", "the agent's new attempt was recorded"
    assert not Attempt.objects.filter(task=task, status="failed", attempt_no__gt=1).exists(), \
        "the new attempt was heartbeated (never rescued)"


@pytest.mark.slow
def test_agent_cut_off_from_the_database_stops_its_task_before_the_lease_ends(make_service, daemons, db_url, tmp_path):
    _timed_command(make_service, "cut", str(tmp_path), first_seconds=60)  # killed long before
    job = api.start_service("cut")
    with TcpProxy(0, "127.0.0.1", _db_port(db_url)) as proxy:
        cut_off = daemons.agent("n1", "cut", "--lease-seconds", "4", "--poll-interval", "0.2",
                                env=_proxied_env(db_url, proxy))
        wait_until(lambda: (tmp_path / "1.pid").exists(), timeout=20, message="attempt 1 runs on n1")
        first_pid = int((tmp_path / "1.pid").read_text())
        # Up before the cut (n1 holds the task meanwhile), so the time to the kill counts no daemon's start.
        daemons.builder()
        daemons.agent("n2", "cut", "--lease-seconds", "4", "--poll-interval", "0.2")
        # Cut after n1's start report committed: cut inside that transaction, its session would keep the
        # job's row lock on the server until the daemons' idle-in-transaction timeout (60 s) ends it, and
        # the builder's rescue of the task waits for that lock.
        wait_until(lambda: Task.objects.filter(job=job, status="running").exists(), timeout=20,
                   message="n1 reported attempt 1 running")
        proxy.cut()  # blackhole: the agent lives, its connections hang
        cut_at = time.monotonic()
        wait_until(lambda: not _alive(first_pid), timeout=10, message="the cut-off agent kills its task")
        killed_after = time.monotonic() - cut_at
        wait_until(lambda: Task.objects.filter(job=job, status="done").exists(), timeout=60, message="rerun done")
        assert cut_off.poll() is None
        proxy.restore()
        wait_until(lambda: "lease_lost" in _log(cut_off) or "fenced" in _log(cut_off) or
                   Event.objects.filter(type="fenced", task__job=job).exists(), timeout=60,
                   message="the cut-off agent reports its stopped attempt once it is back")
    assert killed_after < 4, f"the process was killed {killed_after:.1f}s after the cut, before the 4 s lease ended"
    task = Task.objects.get(job=job)
    assert task.status == "done" and task.node == "n2"
    assert json.loads((tmp_path / f"{task.attempt}.overlap").read_text()) == [], "the two runs never overlapped"
    assert not (tmp_path / "1.end").exists(), "attempt 1 never finished"
    assert cut_off.poll() is None, _log(cut_off)[-3000:]


GRANDCHILD = (
    "import os, subprocess, sys, time\n"
    "if os.environ['ACCS_ATTEMPT'] == '1':\n"
    "    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "    print('grandchild', p.pid, file=sys.stderr, flush=True)\n"
    "    time.sleep(120)\n"
    "print('{}')\n"
)


def test_task_processes_die_with_their_agent_and_the_task_runs_again(make_service, daemons, db_url):
    make_service("orphan", executor="command", executor_config={"argv": ["python", "-c", _literal(GRANDCHILD)]},
                 timeout_seconds=300, max_attempts=3, backoff_base_seconds=0, backoff_cap_seconds=0)
    job = api.start_service("orphan")
    # An agent ends the orphans of its node found among this machine's processes: a node name no agent
    # of another test (a parallel worker's) uses, so none of them ends these first.
    node = f"orphans-{uuid.uuid4().hex[:8]}"
    victim = daemons.agent(node, "orphan", "--lease-seconds", "3")
    event = wait_until(
        lambda: Event.objects.filter(job_id=job.id, type="log", message__startswith="grandchild").first(),
                       timeout=20, message="the grandchild started")
    grandchild = int(event.message.split()[1])
    child = Attempt.objects.get(task__job=job, attempt_no=1).pid
    assert child and _alive(child) and _alive(grandchild)
    try:
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        wait_until(lambda: not _alive(child), timeout=5, message="the direct child dies with its agent")
        assert _alive(grandchild), "(a grandchild survives the parent-death signal)"
        successor = daemons.agent(node, "orphan", "--lease-seconds", "3")
        wait_until(lambda: not _alive(grandchild), timeout=20, message="the next agent on the node ends the orphans")
        daemons.builder()
        wait_all_final(db_url, timeout=60)
    finally:
        for pid in (child, grandchild):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, TypeError):
                pass
    assert "orphaned task process" in _log(successor)
    task = Task.objects.get(job=job)
    assert task.status == "done" and task.attempt == 2


def test_second_sigterm_interrupts_running_tasks_and_they_are_retried(make_service, daemons, db_url):
    make_service("long", **SLEEP, max_attempts=1)
    job = api.start_service("long", params={"seconds": 60})
    agent = daemons.agent("n1", "long")
    wait_until(lambda: Task.objects.filter(job=job, status="running").exists(), timeout=20, message="running")
    agent.send_signal(signal.SIGTERM)
    # Two separate signals, as an operator's second Ctrl-C: the second once the first is handled.
    wait_until(lambda: "no new claims, draining" in _log(agent), timeout=10, message="the agent took the first SIGTERM")
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=20) == 0, _log(agent)[-3000:]
    attempt = Attempt.objects.get(task__job=job, attempt_no=1)
    task = Task.objects.get(job=job)
    assert attempt.status == "interrupted", attempt.error_text
    assert task.status == "queued", "an interrupted task is retried, even with max_attempts=1"
    Task.objects.filter(pk=task.pk).update(params={"seconds": 0.05})
    daemons.agent("n2", "long")
    wait_all_final(db_url, timeout=30)
    assert Task.objects.get(job=job).status == "done"


def test_python_callable_timeout_and_cancel_are_enforced(make_service, daemons, db_url):
    make_service("spin", executor_config={"callable": "tests.nodes.test_agent_faults:spin"}, timeout_seconds=1,
                 max_attempts=1)
    make_service("stuck",
                 executor_config={"callable": "tests.nodes.test_agent_faults:block_in_c", "isolation": "process"},
                 timeout_seconds=1, max_attempts=1)
    make_service("spin-long", executor_config={"callable": "tests.nodes.test_agent_faults:spin"}, timeout_seconds=600)
    spun, stuck = api.start_service("spin"), api.start_service("stuck")
    canceled = api.start_service("spin-long")
    agent = daemons.agent("n1", "spin,stuck,spin-long", "--max-concurrent", "3", "--lease-seconds", "6")
    wait_until(lambda: Task.objects.filter(job=canceled, status="running").exists(), timeout=20, message="running")
    transitions.cancel_job(canceled.id, by="test")
    wait_all_final(db_url, timeout=40)
    wait_until(lambda: not Task.objects.filter(status__in=["starting", "running"]).exists(), timeout=20,
               message="every attempt ended")
    assert agent.poll() is None
    for job in (spun, stuck):
        task = Task.objects.get(job=job)
        assert (task.status, task.error_code) == ("error", "timeout"), (job, task.error_message)
    assert Task.objects.get(job=canceled).status == "canceled"
    assert Job.objects.get(pk=canceled.pk).status == "canceled"
    assert Attempt.objects.get(task__job=canceled).status == "canceled"


def test_agent_adopts_tasks_whose_claim_committed_but_whose_answer_was_lost(make_service):
    """A claim that commits while the connection breaks leaves tasks claimed by an agent that never
    saw them; the agent finds them by its identity and runs them: one attempt each, not two."""
    from jobs.claim import NodeLimits, claim_many
    from nodes.agent import Agent
    from tests.engine_helpers import spec

    svc = make_service("adopted", backoff_base_seconds=0, backoff_cap_seconds=0)
    jobs = [api.start_service(svc) for _ in range(3)]
    agent = Agent(node="adopt-node", services=["adopted"], max_concurrent=4, once=True, lease_seconds=30)
    limits = NodeLimits(name="adopt-node", slot_cap=4, cpu_budget=100, per_service={}, labels={})
    lost = claim_many([spec(svc)], limits, agent_id=agent.agent_id, free_slots=2,
                      lease_seconds=1)  # the answer never reached the agent
    assert len(lost) == 2
    other = claim_many([spec(svc)], limits, agent_id="another-agent", free_slots=1,
                       lease_seconds=30)
    agent._claim_in_doubt = True  # what a claim that raised leaves behind
    with agent_in_this_process():
        assert agent.run() == 0
    for task in lost:
        task_row = Task.objects.get(pk=task.id)
        assert task_row.status == "done" and task_row.attempt == task.attempt == 1
        assert Attempt.objects.filter(task_id=task.id).count() == 1
    [held] = other
    assert Task.objects.get(pk=held.id).status == "starting", "another agent's claim is not taken"
    assert len(jobs) == 3


def test_an_agent_run_once_leaves_only_when_a_claim_with_room_found_nothing(make_service):
    """With ``--once`` the agent leaves once a claim finds the queue empty and nothing runs. A claim
    made while every slot was taken by finished but unreported tasks (the loop claims before it
    reports) found nothing because it asked for nothing: the agent left with most of the queue."""
    from nodes.agent import Agent

    make_service("once-full")
    jobs = [api.start_service("once-full") for _ in range(6)]
    agent = Agent(node="once-node", services=["once-full"], max_concurrent=1, once=True, lease_seconds=30)
    with agent_in_this_process():
        assert agent.run() == 0
    assert sorted(Task.objects.filter(job__in=jobs).values_list("status", flat=True)) == ["done"] * 6
    assert agent.stats["claimed"] == 6


def test_tasks_a_claim_returned_are_adopted_when_starting_one_of_them_fails(make_service, monkeypatch):
    """Starting a claimed task can raise (its scratch folder cannot be made: a full disk); the tasks
    after it in the claim's answer are this agent's all the same and must still run, not wait for
    their leases to end and be rescued as failures."""
    from django.db import connections

    from nodes import agent as agent_module
    from nodes.agent import Agent

    make_service("scratchy", executor="command", executor_config={"argv": ["python", "-c", "print('{{}}')"]},
                 max_attempts=1)
    jobs = [api.start_service("scratchy") for _ in range(2)]
    real_scratch_dir, calls = agent_module.scratch_dir, []

    def full_disk_once(task):
        calls.append(task.id)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real_scratch_dir(task)

    monkeypatch.setattr(agent_module, "scratch_dir", full_disk_once)
    agent = Agent(node="scratchy-node", services=["scratchy"], max_concurrent=2, once=True, lease_seconds=30)
    options = connections.settings["default"].setdefault("OPTIONS", {})
    saved = dict(options)
    try:
        assert agent.run() == 0
    finally:  # the agent gave this process's connections the daemons' timeouts: take them back
        options.clear()
        options.update(saved)
        connections.close_all()
    for job in jobs:
        task = Task.objects.get(job=job)
        assert (task.status, task.attempt) == ("done", 1), (task.status, task.error_message)
    assert len(calls) == 3, "the failed start was retried once, by adoption"


EXITS_WHEN_RELEASED = """
import pathlib, sys, time
release, runs = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
with runs.open("a") as fh:
    fh.write("run\\n")
deadline = time.monotonic() + 60
while not release.exists() and time.monotonic() < deadline:  # wait for the test's go, bounded
    time.sleep(0.01)
print('{{"answer": 42}}')
"""


def test_a_second_sigterm_after_the_command_exited_0_records_it_done_and_it_never_runs_again(
        make_service, subprocess_env, tmp_path, db_url):
    from tests.daemons import Daemons

    release, runs = tmp_path / "release", tmp_path / "runs"
    make_service("finisher", executor="command", max_attempts=1,
                 executor_config={"argv": ["python", "-c", EXITS_WHEN_RELEASED, "{release}", "{runs}"]},
                 params_schema={"type": "object", "properties": {"release": {"type": "string"},
                                                                 "runs": {"type": "string"}}})
    job = api.start_service("finisher", params={"release": str(release), "runs": str(runs)})
    hooked = Daemons(subprocess_env, tmp_path, manage_py=ROOT / "tests" / "hooked_manage.py")
    try:
        agent = hooked.agent("n1", "finisher", env={"ACCS_TEST_HOOK": "second_sigterm_after_exit"})
        wait_until(lambda: Task.objects.filter(job=job, status="running").exists(), timeout=30, message="running")
        agent.send_signal(signal.SIGTERM)  # the first: drain
        wait_until(lambda: "draining 1 running task" in _log(agent), timeout=10, message="the agent drains")
        release.touch()  # the command prints its result and exits 0; the hook sends the second SIGTERM
        assert agent.wait(timeout=30) == 0, _log(agent)[-3000:]
    finally:
        hooked.stop_all()
    log = _log(agent)
    assert "second signal" in log and "hook:" not in log, log[-3000:]
    attempts = list(Attempt.objects.filter(task__job=job))
    assert [(a.status, a.exit_code) for a in attempts] == [("succeeded", 0)], [a.error_text for a in attempts]
    task = Task.objects.get(job=job)
    assert (task.status, task.results) == ("done", {"answer": 42})
    daemons_again = Daemons(subprocess_env, tmp_path)
    try:
        daemons_again.agent("n2", "finisher", "--once", name="agent-after")
        wait_until(lambda: daemons_again.procs[0].poll() is not None, timeout=60, message="--once agent exits")
    finally:
        daemons_again.stop_all()
    assert runs.read_text() == "run\n", "the command ran once"
    assert Attempt.objects.filter(task__job=job).count() == 1


@pytest.mark.parametrize("stop", ["cancel", "timeout"])
def test_a_cancel_or_timeout_that_comes_after_the_command_exited_keeps_its_outcome(stop, monkeypatch):
    """The worker finds the stop before it looks at the process, which had already exited 0."""
    import subprocess
    import uuid

    from jobs.claim import ClaimedTask
    from nodes import executors

    class ExitedUnseen(subprocess.Popen):
        """A process that has exited before the worker's first look, which does not see it yet."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.wait()
            self.looks = 0

        def poll(self):
            self.looks += 1
            return None if self.looks == 1 else super().poll()

    monkeypatch.setattr(executors.subprocess, "Popen", ExitedUnseen)
    task = ClaimedTask(id=uuid.uuid4(), job_id=uuid.uuid4(), task_key="t", attempt=1, params={},
                       timeout_seconds=0 if stop == "timeout" else 60, host=None, service_key="s")
    ctx = executors.RunContext(task=task, service_config={}, on_started=lambda pid: None,
                               on_progress=lambda value: None, on_log=lambda level, text: None)
    if stop == "cancel":
        ctx.stop("cancel")
    outcome = executors.run_process(task, ctx, [sys.executable, "-c", "import json; print(json.dumps({'n': 1}))"])
    assert (outcome.status, outcome.exit_code, outcome.results) == ("succeeded", 0, {"n": 1}), outcome.error


def test_sigterms_during_the_agents_last_moments_still_exit_0(make_service, daemons, db_url):
    make_service("idle")
    agent = daemons.agent("n1", "idle")
    wait_until(lambda: "started on node n1" in _log(agent), timeout=30, message="agent started")
    agent.send_signal(signal.SIGTERM)
    wait_until(lambda: "agent stopped" in _log(agent) or agent.poll() is not None, timeout=30,
               message="the agent's last log line")
    while agent.poll() is None:  # a systemd stop and an impatient operator: SIGTERMs until it is gone
        agent.send_signal(signal.SIGTERM)
        time.sleep(0.002)  # paces the signals under test; it waits for nothing
    assert agent.returncode == 0, _log(agent)[-2000:]


def test_a_task_longer_than_the_drain_time_is_handed_back_interrupted_without_using_its_budget(
        make_service, daemons, db_url):
    make_service("long", **SLEEP, max_attempts=1)
    job = api.start_service("long", params={"seconds": 120})
    agent = daemons.agent("n1", "long", "--drain-seconds", "1")
    wait_until(lambda: Task.objects.filter(job=job, status="running").exists(), timeout=20, message="running")
    agent.send_signal(signal.SIGTERM)  # one SIGTERM only, as systemd sends it
    assert agent.wait(timeout=30) == 0, _log(agent)[-3000:]
    assert "draining 1 running task(s) for at most 1s" in _log(agent)
    assert "drain time (1s) is over" in _log(agent)
    attempt = Attempt.objects.get(task__job=job, attempt_no=1)
    task = Task.objects.get(job=job)
    assert attempt.status == "interrupted", attempt.error_text
    assert (task.status, task.max_attempts) == ("queued", 2), "queued again; the budget grew by the attempt it used"


WRITES_THEN_WAITS = """
import os, pathlib, sys, time
(pathlib.Path(os.environ["ACCS_OUTPUT_DIR"]) / "partial.txt").write_text("half")
deadline = time.monotonic() + 120
while time.monotonic() < deadline:  # runs until its agent is killed (bounded)
    time.sleep(0.05)
"""


def test_a_new_agent_removes_the_scratch_folders_a_killed_agent_left_and_keeps_live_ones(
        make_service, daemons, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    make_service("writer", executor="command", executor_config={"argv": ["python", "-c", WRITES_THEN_WAITS]})
    make_service("idle")
    neighbour = daemons.agent("n2", "idle", env=env, name="agent-neighbour")  # a live agent on the same machine
    wait_until(lambda: "started on node n2" in _log(neighbour), timeout=30, message="the neighbour started")
    live = tmp / f"accs-{'ab' * 4}-1-{neighbour.pid}-live"  # as if the neighbour ran an attempt now
    live.mkdir()
    job = api.start_service("writer")
    victim = daemons.agent("n1", "writer", env=env)
    left = wait_until(lambda: [p for p in tmp.glob("accs-scratch-*/accs-*") if (p / "partial.txt").exists()],
                      timeout=30, message="the attempt wrote into its scratch folder")
    assert Task.objects.filter(job=job, status__in=("starting", "running")).exists()
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    old_style_stale, old_style_fresh = tmp / "accs-cdcdcdcd-1-stale", tmp / "accs-efefefef-1-fresh"
    old_style_stale.mkdir()
    old_style_fresh.mkdir()
    two_days_ago = time.time() - 2 * 86400
    os.utime(old_style_stale, (two_days_ago, two_days_ago))
    assert all(p.exists() for p in left), "kill -9 leaves the attempt's folder behind"

    successor = daemons.agent("n1", "writer", env=env, name="agent-successor")
    wait_until(lambda: "started on node n1" in _log(successor), timeout=30, message="the successor started")
    assert not any(p.exists() for p in left + [old_style_stale]), _log(successor)[-2000:]
    assert live.exists() and old_style_fresh.exists(), "a live agent's folder and a young one are kept"
    assert not list(tmp.glob("accs-scratch-*/accs-*/params.json")), "the killed attempt's params folder went too"
    # The killed attempt's output and params folders, and the old-style stale one.
    assert "removed 3 leftover scratch folder(s)" in _log(successor)
