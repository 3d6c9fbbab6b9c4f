"""Branching: a step with a condition (``when``, a jsonpath predicate over its parents' outputs) runs only
when it holds; otherwise its tasks end ``skipped`` with the condition on the timeline, and their dependents
follow the skip rules (an ``always`` step still runs), all in the report that settled the parents."""

from __future__ import annotations

import pytest
from django.db import DatabaseError, connection, transaction
from hypothesis import HealthCheck, given, settings, strategies as st

from events.models import Event
from jobs import api
from jobs.claim import NodeLimits
from jobs.models import Job, Task
from nodes.models import Host, Node
from tests.engine_helpers import claim_for, run_ok
from workflows.api import create_workflow
from workflows.models import Service
from workflows.validation import DefinitionError

pytestmark = pytest.mark.django_db


def _steps(when: str) -> list[dict]:
    return [{"key": "check", "service": "c-svc"},
            {"key": "deploy", "service": "c-svc", "depends_on": ["check"], "when": when},
            {"key": "notify", "service": "c-svc", "depends_on": ["deploy"]},
            {"key": "cleanup", "service": "c-svc", "depends_on": ["deploy"], "always": True}]


def _run(job: Job, results: dict | None = None, *, node: str = "node-t") -> None:
    """Claim (as an agent on ``node``) and succeed the job's queued tasks (with ``results``) until none is left."""
    service = Service.objects.get(key="c-svc")
    limits = NodeLimits(name=node, slot_cap=20, cpu_budget=8, per_service={})
    while tasks := claim_for(service, limits=limits):
        run_ok(tasks, results=results)


def _status(job: Job) -> dict[str, str]:
    return dict(Task.objects.filter(job=job).values_list("task_key", "status"))


def test_a_step_whose_condition_does_not_hold_is_skipped_with_the_reason_and_its_dependents_follow(make_service):
    make_service("c-svc")
    create_workflow(name="gate", steps=_steps("$.check.healthy == true"))
    job = api.start_workflow("gate")
    _run(job, results={"healthy": False})
    assert _status(job) == {"check": "done", "deploy": "skipped", "notify": "skipped", "cleanup": "done"}
    deploy = Task.objects.get(job=job, task_key="deploy")
    assert deploy.error_message == "condition did not hold: $.check.healthy == true"
    event = Event.objects.get(task_id=deploy.id, data__to="skipped")
    assert event.message == "task waiting → skipped (condition did not hold: $.check.healthy == true)"
    assert event.data["when"] == "$.check.healthy == true"
    notify = Task.objects.get(job=job, task_key="notify")
    assert notify.error_message == "a dependency did not succeed", "the existing skip rule"
    assert Job.objects.get(pk=job.pk).status == "done", "a branch not taken is no failure"


def test_a_step_whose_condition_holds_runs(make_service):
    make_service("c-svc")
    create_workflow(name="gate", steps=_steps("$.check.healthy == true"))
    job = api.start_workflow("gate")
    _run(job, results={"healthy": True})
    assert set(_status(job).values()) == {"done"}
    assert not Event.objects.filter(job_id=job.id, data__to="skipped").exists()


def test_a_condition_over_a_fanned_out_parent_sees_the_list_of_its_outputs(make_service):
    make_service("c-svc")
    node = Node.objects.create(name="c-node")
    for name in ("c1", "c2"):
        Host.objects.create(name=name, node=node)
    create_workflow(name="fleet-gate", steps=[
        {"key": "probe", "service": "c-svc", "fan_out": "hosts"},
        {"key": "all", "service": "c-svc", "depends_on": ["probe"], "when": "$.probe.size() == 2"},
        {"key": "none", "service": "c-svc", "depends_on": ["probe"], "when": "$.probe.size() == 3"}])
    job = api.start_workflow("fleet-gate", options={"hosts": ["c1", "c2"]})
    _run(job, node="c-node")
    assert _status(job) == {"probe@c1": "done", "probe@c2": "done", "all": "done", "none": "skipped"}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Text without NUL: an agent strips NUL characters from a task's results before it reports them
# (nodes.executors.clean_results), since PostgreSQL's jsonb cannot hold them.
@given(value=st.one_of(st.integers(-5, 5), st.text(st.characters(blacklist_characters="\x00"), max_size=2),
                       st.booleans(), st.none()),
       limit=st.integers(-3, 3))
def test_a_step_runs_exactly_when_postgresql_finds_its_condition_true(make_service, value, limit):
    # A value that is no number makes the comparison unknown: the condition does not hold.
    if not Service.objects.filter(key="c-svc").exists():
        make_service("c-svc")
    name = f"gen-{limit + 10}"
    create_workflow(name=name, steps=[
        {"key": "check", "service": "c-svc"},
        {"key": "deploy", "service": "c-svc", "depends_on": ["check"], "when": f"$.check.n > {limit}"}])
    job = api.start_workflow(name)
    _run(job, results={"n": value})
    holds = isinstance(value, int) and not isinstance(value, bool) and value > limit
    assert _status(job)["deploy"] == ("done" if holds else "skipped")


@pytest.mark.parametrize(("when", "depends_on", "expected"), [
    ("$.ghost.ok == true", ["check"], "step 'deploy': when reads ['ghost'], which it does not depend on"),
    ("$.check.ok == ", ["check"], "step 'deploy': when is not a jsonpath PostgreSQL accepts: syntax error"),
    ("true", ["check"], "step 'deploy': when 'true' reads no parent step's output"),
    ("$.check.ok == true", [], "step 'deploy': when is a condition over the outputs of the steps it depends on"),
    (["$.check"], ["check"], "step 'deploy': when must be a jsonpath predicate"),
])
def test_a_bad_condition_is_a_definition_error_naming_the_step(make_service, when, depends_on, expected):
    make_service("c-svc")
    with pytest.raises(DefinitionError) as caught:
        create_workflow(name="bad-gate", steps=[
            {"key": "check", "service": "c-svc"},
            {"key": "deploy", "service": "c-svc", "depends_on": depends_on, "when": when}])
    assert expected in "\n".join(str(p) for p in caught.value.problems)


@pytest.mark.parametrize("bad", ["$.check.healthy ==", "healthy == true)", "$ ? (@ >"])
def test_a_stored_condition_that_is_not_a_jsonpath_skips_its_step_saying_so_and_the_report_goes_through(
        make_service, bad):
    """The validator refuses such a condition on every save path; one written into the row by hand never
    holds, and says why, instead of making every report that settles its job raise."""
    make_service("c-svc")
    create_workflow(name="gate", steps=_steps("$.check.healthy == true"))
    job = api.start_workflow("gate")
    with connection.cursor() as cur:
        cur.execute("UPDATE accs_workflow SET steps = jsonb_set(steps, '{1,when}', to_jsonb(%s::text)) WHERE id = %s",
                    [bad, job.workflow_id])
    _run(job, results={"healthy": True})
    deploy = Task.objects.get(job=job, task_key="deploy")
    assert (deploy.status, deploy.error_message) == ("skipped", f"condition is not a valid jsonpath: {bad}")
    assert _status(job)["cleanup"] == "done"


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=30)
       | st.from_regex(r"\$(\.[a-z]{1,3}|\[[0-9]\])*( [=<>]{1,2} [0-9a-z\"]{1,3})?", fullmatch=True))
def test_the_safe_jsonpath_read_is_null_exactly_for_text_postgresql_cannot_read_as_one(text):
    with connection.cursor() as cur:
        cur.execute("SELECT accs_jsonpath(%s) IS NULL", [text])
        safe_null = cur.fetchone()[0]
        try:
            with transaction.atomic():
                cur.execute("SELECT %s::jsonpath", [text])
            valid = True
        except DatabaseError:
            valid = False
    assert safe_null == (not valid)
