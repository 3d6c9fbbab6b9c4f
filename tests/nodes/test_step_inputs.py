"""Data between steps: each task receives its parent steps' outputs (a fanned-out parent's as a list in task
order) through the python ctx, the ACCS_INPUTS file and a process-isolated child's ctx; a step's output is
checked against its output schema; nothing crosses from one job to another. Real agents run the workflows."""

from __future__ import annotations

import os
import uuid

import pytest
from django.db import connection, transaction
from hypothesis import HealthCheck, given, settings, strategies as st

from jobs import api, transitions, verbs
from jobs.claim import NodeLimits
from jobs.inputs import step_context, step_contexts
from jobs.locks import is_lock_timeout
from jobs.models import Job, JobStep, Task
from jobs.transitions import Outcome
from nodes.executors import output_violation
from nodes.models import Host, Node
from tests.daemons import agent_in_this_process, wait_all_final
from tests.engine_helpers import claim_for, previous_release_inputs
from workflows.api import create_workflow

SHOW_INPUTS = ("import json, os, stat; p = os.environ['ACCS_INPUTS']; "
               "print(json.dumps(dict(inputs=json.load(open(p)), path=p, mode=oct(stat.S_IMODE(os.stat(p).st_mode)))))")
SERVICES = "py-echo,py-host,cmd-inputs,py-iso,py-strict"


def _services(make_service) -> None:
    make_service("py-echo", executor_config={"callable": "tests.callables:echo"})
    make_service("py-host", executor_config={"callable": "tests.callables:host_of"})
    make_service("cmd-inputs", executor="command", executor_config={"argv": ["python3", "-c", SHOW_INPUTS]})
    make_service("py-iso", executor_config={"callable": "tests.callables:inputs_of", "isolation": "process"},
                 params_schema={"type": "object", "properties": {"parents": {"type": "array"}}})
    make_service("py-strict", executor_config={"callable": "tests.callables:echo"})


@pytest.mark.django_db(transaction=True)
def test_real_agents_pass_each_job_its_own_parents_outputs_and_fail_an_output_breaking_its_schema(
        make_service, daemons, db_url):
    _services(make_service)
    node = Node.objects.create(name="n1")
    for name in ("h1", "h2"):
        Host.objects.create(name=name, node=node)
    create_workflow(name="flow", steps=[
        {"key": "one", "service": "py-echo"},
        {"key": "count", "service": "py-host", "fan_out": "hosts"},
        {"key": "show", "service": "cmd-inputs", "depends_on": ["one", "count"]},
        {"key": "iso", "service": "py-iso", "depends_on": ["one", "count"], "default_params": {
            "parents": ["one", "count"]}, "output_schema": {"type": "object", "required": ["inputs"]}},
        {"key": "strict", "service": "py-strict", "depends_on": ["one"], "on_failure": "continue",
         "output_schema": {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}},
    ])
    jobs = {tag: api.start_workflow("flow", options={"hosts": ["h1", "h2"]}, step_params={"one": {"tag": tag}})
            for tag in ("A", "B")}
    daemons.agent("n1", SERVICES, "--max-concurrent", "4")
    wait_all_final(db_url, timeout=90)

    for tag, job in jobs.items():
        tasks = {t.task_key: t for t in Task.objects.filter(job=job)}
        expected = {"one": {"echo": {"tag": tag}}, "count": [{"host": "h1"}, {"host": "h2"}]}
        show = tasks["show"]
        assert show.status == "done", show.error_message
        assert show.results["inputs"] == expected, "the command's ACCS_INPUTS file holds this job's outputs only"
        assert show.results["mode"] == "0o600", "only the task's OS user may read the inputs file"
        assert not os.path.exists(show.results["path"]), "the inputs file goes with the attempt's scratch"
        iso = tasks["iso"]
        assert iso.status == "done", iso.error_message
        assert iso.results == {"inputs": expected, "task_output": expected}, "a process-isolated child's ctx"
        strict = tasks["strict"]
        assert strict.status == "error" and strict.error_code == "bad_output"
        assert "output_schema" in strict.error_message and "'n' is a required property" in strict.error_message
        assert strict.attempt == 1, "an output that breaks its schema is not retried"
        assert Job.objects.get(pk=job.pk).status == "partial"


@pytest.mark.django_db(transaction=True)
def test_a_step_whose_parent_never_ran_receives_null_for_it(make_service, daemons, db_url):
    make_service("py-fail", executor_config={"callable": "tests.callables:fail"}, max_attempts=1)
    make_service("py-iso", executor_config={"callable": "tests.callables:inputs_of"})
    create_workflow(name="cleanup", steps=[
        {"key": "boom", "service": "py-fail", "on_failure": "continue"},
        {"key": "after", "service": "py-fail", "depends_on": ["boom"]},
        {"key": "tidy", "service": "py-iso", "depends_on": ["boom", "after"], "always": True},
    ])
    job = api.start_workflow("cleanup")
    daemons.agent("n1", "py-fail,py-iso")
    wait_all_final(db_url, timeout=60)
    tidy = Task.objects.get(job=job, task_key="tidy")
    assert tidy.status == "done", tidy.error_message
    assert tidy.results["inputs"] == {"boom": None, "after": None}


@pytest.mark.django_db(transaction=True)
def test_real_agents_give_each_task_of_a_fan_out_over_a_list_its_item_in_a_process_isolated_ctx(
        make_service, daemons, db_url):
    make_service("py-echo", executor_config={"callable": "tests.callables:echo"})
    make_service("py-iso", executor_config={"callable": "tests.callables:inputs_of", "isolation": "process"},
                 params_schema={"type": "object", "properties": {"parents": {"type": "array"}}})
    create_workflow(name="per-item", steps=[
        {"key": "one", "service": "py-echo"},
        {"key": "each", "service": "py-iso", "depends_on": ["one"], "fan_out": {"over": "$.one.echo.parcels"}},
        {"key": "all", "service": "py-iso", "depends_on": ["each"], "default_params": {"parents": ["each"]}}])
    job = api.start_workflow("per-item", step_params={"one": {"parcels": ["p1", {"p": 2}]}})
    daemons.agent("n1", "py-echo,py-iso", "--max-concurrent", "4")
    wait_all_final(db_url, timeout=90)
    tasks = {t.task_key: t for t in Task.objects.filter(job=job)}
    assert set(tasks) == {"one", "each[0]", "each[1]", "all"}
    parent = {"echo": {"parcels": ["p1", {"p": 2}]}}
    for index, item in enumerate(["p1", {"p": 2}]):
        each = tasks[f"each[{index}]"]
        assert each.status == "done", each.error_message
        assert each.results["inputs"] == {"one": parent, "item": item, "index": index}
    assert tasks["all"].results["task_output"] == {"each": [tasks["each[0]"].results, tasks["each[1]"].results]}
    assert Job.objects.get(pk=job.pk).status == "done"


# --------------------------------------------------------------------------------------------
# The gather and the schema check, without a database
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hosts=st.integers(min_value=1, max_value=4), data=st.data())
def test_a_task_receives_each_parents_output_and_a_fanned_parents_outputs_in_task_order(make_service, hosts, data):
    make_service("in-svc")
    node, _ = Node.objects.get_or_create(name="n-in")
    names = [Host.objects.get_or_create(name=f"in-h{i}", node=node)[0].name for i in range(hosts)]
    name = f"in-{uuid.uuid4().hex[:8]}"
    create_workflow(name=name, steps=[
        {"key": "single", "service": "in-svc"}, {"key": "many", "service": "in-svc", "fan_out": "hosts"},
        {"key": "other", "service": "in-svc"},
        {"key": "child", "service": "in-svc", "depends_on": ["single", "many"]}])
    jobs = [api.start_workflow(name, options={"hosts": names})
            for _ in range(2)]
    transitions.start_due_jobs(limit=10)
    # Keys jsonb can store: no NUL, no lone surrogate (an agent's outputs are JSON it could store).
    keys = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=4)
    outputs = st.one_of(st.none(), st.dictionaries(keys, st.integers(), max_size=2),
                        st.lists(st.integers(), max_size=2))
    # Drawn before the rows are read, so the draws never depend on what the database holds.
    drawn = data.draw(st.lists(outputs, min_size=2 * (hosts + 2), max_size=2 * (hosts + 2)))
    made = list(Task.objects.filter(job__in=jobs).exclude(step_key="child").order_by("id"))
    assert len(made) == len(drawn), "each job: single, other and one task per host"
    for task, output in zip(made, drawn, strict=True):
        Task.objects.filter(pk=task.pk).update(results=output)
    for job in jobs:
        tasks = Task.objects.filter(job=job)
        fanned = [t.results for t in tasks.filter(step_key="many").order_by("id")]
        assert [t.host.name for t in tasks.filter(step_key="many").order_by("id")] == names, "task order: hosts'"
        child = tasks.get(step_key="child")
        found = step_context(child.id)
        assert found.inputs == {"single": tasks.get(step_key="single").results, "many": fanned}
        assert found.output_schema is None
    # The batch read an agent makes of a claim's tasks gives each what its own read gives; a task that
    # is gone is left out.
    every = list(Task.objects.filter(job__in=jobs).values_list("id", flat=True))
    gone = uuid.uuid4()
    assert step_contexts([*every, gone], lock_wait=5) == {task_id: step_context(task_id) for task_id in every}
    assert all(step_context(task_id).inputs == previous_release_inputs(task_id) for task_id in every)


def _expected_inputs(job: Job) -> dict:
    """The child's inputs as the parents' tasks give them now: single's results, many's in task order."""
    tasks = Task.objects.filter(job=job)
    return {"single": tasks.get(step_key="single").results,
            "many": [t.results for t in tasks.filter(step_key="many").order_by("id")]}


@pytest.mark.django_db
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hosts=st.integers(min_value=1, max_value=4), data=st.data())
def test_a_steps_output_gathered_when_it_settles_is_what_its_tasks_give_even_after_a_retry(make_service, hosts,
                                                                                           data):
    """Parents finish through the engine: each settled step's row holds the output its tasks give (what a
    dependent reads in one row), and a parent task retried and finished again with another output is what
    the dependent receives then; the gathered output is never older than the step's tasks."""
    svc = make_service("gather-svc", max_attempts=1)  # a failure is for good
    tag = uuid.uuid4().hex[:8]  # the examples share one database: a node, hosts and workflow of their own
    node = Node.objects.create(name=f"n-{tag}")
    names = [Host.objects.create(name=f"{tag}-h{i}", node=node).name for i in range(hosts)]
    limits = NodeLimits(name=node.name, slot_cap=20, cpu_budget=20, per_service={})
    create_workflow(name=f"gather-{tag}", steps=[
        {"key": "single", "service": "gather-svc"},
        {"key": "many", "service": "gather-svc", "fan_out": "hosts", "on_failure": "continue"},
        {"key": "child", "service": "gather-svc", "depends_on": ["single", "many"], "always": True}])
    keys = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=4)
    output = st.dictionaries(keys, st.integers(), max_size=2)
    first = data.draw(st.lists(output, min_size=hosts + 1, max_size=hosts + 1))
    results = dict(zip(["single", *(f"many@{h}" for h in names)], first, strict=True))
    bad_key = f"many@{names[data.draw(st.integers(min_value=0, max_value=hosts - 1))]}"
    again = data.draw(output)

    def run(*, fail: str | None) -> None:
        """Claim and report as an agent until nothing is left: ``fail`` fails for good, the rest succeed."""
        while tasks := claim_for(svc, 10, limits=limits):
            transitions.report(
                [Outcome(task_id=t.id, attempt=t.attempt, status="failed", error="boom", exit_code=1)
                 if t.task_key == fail else
                 Outcome(task_id=t.id, attempt=t.attempt, status="succeeded", results=results.get(t.task_key, {}))
                 for t in tasks], started=[(t.id, t.attempt, 1) for t in tasks], agent_id="agent-t",
                source="agent:test")

    job = api.start_workflow(f"gather-{tag}", options={"hosts": names})
    transitions.start_due_jobs(limit=10)
    run(fail=bad_key)  # one task of "many" fails for good; the job goes on, and the child runs all the same
    steps = {s.step_key: s for s in JobStep.objects.filter(job=job)}
    assert steps["single"].output == _expected_inputs(job)["single"] == results["single"]
    assert steps["many"].output == _expected_inputs(job)["many"] and None in steps["many"].output

    # The failed task retried and finished with another output: the child receives it.
    bad = Task.objects.get(job=job, task_key=bad_key)
    assert verbs.retry_tasks([bad.id])[bad.id].changed
    assert JobStep.objects.get(job=job, step_key="many").output is None, "a task of the step left its final state"
    results[bad_key] = again
    run(fail=None)
    child = Task.objects.get(job=job, step_key="child")
    expected = _expected_inputs(job)
    assert Task.objects.get(pk=bad.pk).results == again and child.status == "done"
    assert step_context(child.id).inputs == expected
    # The retry reopened the step, so it was released and gathered again.
    for step in JobStep.objects.filter(job=job, step_key__in=["single", "many"]):
        assert step.output == expected[step.step_key], "a gathered output is never older than its tasks"

    # The dependent reads the step rows, not the tasks, once every parent has its output gathered.
    JobStep.objects.filter(job=job, step_key="many").update(output=["from the step row"])
    assert step_context(child.id).inputs["many"] == ["from the step row"]
    assert step_context(child.id).inputs == previous_release_inputs(child.id)


SCHEMA = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}


@given(results=st.dictionaries(st.sampled_from(["n", "m"]), st.one_of(st.integers(), st.text(max_size=3))))
def test_output_violation_fails_exactly_the_outputs_that_break_the_schema(results):
    outcome = output_violation(Outcome(task_id="t", attempt=1, status="succeeded", results=results), SCHEMA)
    meets = isinstance(results.get("n"), int)
    assert (outcome.status == "succeeded") is meets
    if not meets:
        assert outcome.error_code == "bad_output" and not outcome.retryable
        assert outcome.error.startswith("bad output: the output does not match the step's output_schema: ")


def test_output_violation_leaves_failures_and_schemaless_steps_alone():
    failed = Outcome(task_id="t", attempt=1, status="failed", results=None, error="x")
    assert output_violation(failed, SCHEMA) is failed
    done = Outcome(task_id="t", attempt=1, status="succeeded", results={})
    assert output_violation(done, None) is done


def test_output_violation_never_quotes_a_secret_output():
    outcome = Outcome(task_id="t", attempt=1, status="succeeded", results={"n": 1, "api_token": "hunter2-long"})
    failed = output_violation(outcome, {"type": "object", "properties": {"api_token": {"type": "integer"}}})
    assert failed.status == "failed" and "hunter2" not in failed.error


@pytest.mark.django_db(transaction=True)
def test_an_agent_hands_its_claims_tasks_their_inputs_from_one_read_and_no_worker_queries_them(
        make_service, monkeypatch):
    """The claim's tasks get their parents' outputs from one batch read in the agent's loop: with the
    one pooled connection, a read per worker queued every attempt (and the next report) behind the
    others. A worker's own read is made to fail here: the children still receive their inputs."""
    from nodes import agent as agent_module
    from nodes.agent import Agent

    make_service("batch-in", executor_config={"callable": "tests.callables:inputs_of"},
                 params_schema={"type": "object", "properties": {"parents": {"type": "array"}}})
    node = Node.objects.create(name="batch-node")
    names = [Host.objects.create(name=f"batch-h{i}", node=node).name for i in range(3)]
    create_workflow(name="batch-flow", steps=[
        {"key": "one", "service": "batch-in", "fan_out": "hosts"},
        {"key": "two", "service": "batch-in", "fan_out": "hosts", "depends_on": ["one"]}])
    job = api.start_workflow("batch-flow", options={"hosts": names})
    transitions.start_due_jobs(limit=10)

    def no_reads_in_workers(task_id):
        raise AssertionError(f"a worker read its own inputs (task {task_id})")

    monkeypatch.setattr(agent_module, "step_context", no_reads_in_workers)
    for _ in ("one", "two"):  # a run with --once ends when the queue is empty: the second runs step two
        agent = Agent(node="batch-node", services=["batch-in"], max_concurrent=8, once=True, lease_seconds=30)
        with agent_in_this_process():
            assert agent.run() == 0
    tasks = Task.objects.filter(job=job)
    assert {(t.step_key, t.status) for t in tasks} == {("one", "done"), ("two", "done")}, [
        (t.task_key, t.status, t.error_message) for t in tasks]
    parents = [t.results for t in tasks.filter(step_key="one").order_by("id")]
    for child in tasks.filter(step_key="two"):
        assert child.results["inputs"] == {"one": parents}


@pytest.mark.django_db(transaction=True)
def test_the_batch_read_of_inputs_gives_up_on_a_held_lock_instead_of_holding_up_the_agent(make_service, db_url):
    """The agent's loop must not wait behind a lock for its claim's inputs: the batch read's wait is
    bounded (its tasks then read their own, in their workers)."""
    import psycopg

    make_service("locked-in")
    job = api.start_service("locked-in")
    task = Task.objects.get(job=job)
    with psycopg.connect(db_url) as blocker:
        blocker.execute("LOCK TABLE accs_workflow IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(Exception) as raised:
            step_contexts([task.id], lock_wait=0.2)
        assert is_lock_timeout(raised.value), raised.value
    with connection.cursor() as cur:
        cur.execute("SHOW lock_timeout")
        before = cur.fetchone()[0]
        assert step_contexts([task.id], lock_wait=0.2) == {task.id: step_context(task.id)}
        # One statement in its own transaction: the bound ends with it (the connection's later
        # statements, its claims and reports among them, keep their own).
        cur.execute("SHOW lock_timeout")
        assert cur.fetchone()[0] == before != "200ms"


def _task_rows_read(read) -> int:
    """How many rows of accs_task ``read()`` reads (index fetches and sequential reads, this transaction's counts).

    The read's plan is made once per connection and kept: one made while the table was a page or two (in
    an earlier test, after an autovacuum's ANALYZE saw it so) walks the whole table, as a plan for a table
    that small should. So the table is first given a size it has in use (waiting filler tasks of the same
    job: a read that scanned the job's tasks reads them too) and an ANALYZE, which makes the connection
    plan the read again.
    """
    def counted(cur) -> int:
        cur.execute("SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables"
                    " WHERE relname = 'accs_task'")
        return cur.fetchone()[0]

    with transaction.atomic(), connection.cursor() as cur:
        _fill_task_table(cur)
        before = counted(cur)
        read()
        return counted(cur) - before


def _fill_task_table(cur, rows: int = 5000) -> None:
    """Give the table ``rows`` waiting tasks (copies of the newest, under new ids, in a step of their own),
    once, then ANALYZE it."""
    cur.execute("SELECT count(*) FROM accs_task WHERE step_key = 'filler'")
    if cur.fetchone()[0]:
        return
    cur.execute("SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) FROM pg_attribute"
                " WHERE attrelid = 'accs_task'::regclass AND attnum > 0 AND NOT attisdropped"
                " AND attname NOT IN ('id', 'task_key', 'step_key')")
    columns = cur.fetchone()[0]
    cur.execute(f"INSERT INTO accs_task (id, task_key, step_key, {columns})"
                f" SELECT gen_random_uuid(), 'filler-' || g, 'filler', {columns}"
                f"   FROM (SELECT * FROM accs_task WHERE status = 'waiting' ORDER BY created_at DESC LIMIT 1) t,"
                f"        generate_series(1, %s) g",
                [rows])
    cur.execute("ANALYZE accs_task")


@pytest.mark.django_db
def test_a_tasks_read_of_its_inputs_reads_its_own_row_only_however_many_tasks_its_job_has(make_service):
    """A task without parents reads none, and a task whose parents' outputs are gathered reads their
    step rows: neither reads the job's other tasks (a read per task that scanned them cost the step
    after a 1,000-host fan-out one read of 2,000 rows per task)."""
    svc = make_service("own-row")
    node = Node.objects.create(name="n-own")
    names = [Host.objects.create(name=f"own-h{i}", node=node).name for i in range(40)]
    create_workflow(name="own-rows", steps=[
        {"key": "root", "service": "own-row", "fan_out": "hosts"},
        {"key": "next", "service": "own-row", "depends_on": ["root"], "fan_out": "hosts"}])
    job = api.start_workflow("own-rows", options={"hosts": names})
    transitions.start_due_jobs(limit=10)
    limits = NodeLimits(name=node.name, slot_cap=100, cpu_budget=100, per_service={})
    roots = claim_for(svc, 100, limits=limits)
    assert len(roots) == 40
    # Its own row (and a few at most), never the job's 5,080 tasks (all read without the fix).
    assert _task_rows_read(lambda: step_context(roots[0].id)) <= 10
    assert _task_rows_read(lambda: step_contexts([t.id for t in roots], lock_wait=5)) <= 10 * 40
    transitions.report([Outcome(task_id=t.id, attempt=t.attempt, status="succeeded", results={"n": 1}) for t in roots],
                       started=[(t.id, t.attempt, 1) for t in roots], agent_id="agent-own", source="agent:test")
    child = Task.objects.get(job=job, task_key=f"next@{names[0]}")
    assert JobStep.objects.get(job=job, step_key="root").output == [{"n": 1}] * 40, "the parent's output is gathered"
    assert step_context(child.id).inputs == {"root": [{"n": 1}] * 40} == previous_release_inputs(child.id)
    assert _task_rows_read(lambda: step_context(child.id)) <= 10


SECRET_WORDS = ["password", "api-key", "Token", "MyPrivate_Key", "note", "x", "päss", "tokenish"]
# Text jsonb can store (no NUL, no lone surrogate), with the names above mixed in.
_text = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=12)
_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), _text, st.sampled_from(SECRET_WORDS)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.one_of(st.sampled_from(SECRET_WORDS), _text), inner, max_size=3)),
    max_leaves=12)


@pytest.mark.django_db
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(outputs=st.tuples(*[_json_values.filter(lambda v: v is not None)] * 2),  # (a SQL NULL: not gathered)
       parent=st.sampled_from(["first", "token"]))
def test_the_secrets_found_in_a_tasks_inputs_are_every_value_under_a_secret_name(make_service, outputs, parent):
    """The read names the values among a task's inputs under secret-looking names (for its logs to redact),
    the same as a walk of the whole inputs finds, whatever the outputs' shapes and wherever the name is: a
    key at any depth, or a parent step's own key."""
    from accs_site.redaction import secrets_in

    make_service("sec-in")
    name = f"sec-{uuid.uuid4().hex[:8]}"
    create_workflow(name=name, steps=[{"key": parent, "service": "sec-in"}, {"key": "second", "service": "sec-in"},
                                      {"key": "child", "service": "sec-in", "depends_on": [parent, "second"]}])
    job = api.start_workflow(name)
    for key, output in zip([parent, "second"], outputs, strict=True):
        JobStep.objects.filter(job=job, step_key=key).update(output=output, total=1)
    child = Task.objects.get(job=job, step_key="child")
    found = step_context(child.id)
    assert found.inputs == {parent: outputs[0], "second": outputs[1]}
    assert sorted(found.secrets) == sorted(secrets_in(found.inputs))
