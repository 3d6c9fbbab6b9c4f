"""Dynamic fan-out: a step with ``fan_out: {"over": path}`` becomes one task per item of the list the path
finds in a parent's output, made in the report that settled the parent; each task receives its item and
index; a dependent gathers their outputs in the list's order. An empty list skips the step; no list, or
more items than ACC_MAX_FAN_OUT_ITEMS, fails its one task naming why, and no item task is made."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from hypothesis import HealthCheck, given, settings, strategies as st

from accs_site.conf import reload
from events.models import Event
from jobs import api
from jobs.claim import NodeLimits
from jobs.inputs import step_context
from jobs.models import Job, JobStep, Task
from tests.engine_helpers import claim_for, previous_release_inputs, run_ok
from workflows.api import create_workflow
from workflows.models import Service
from workflows.validation import DefinitionError

pytestmark = pytest.mark.django_db

LIMITS = NodeLimits(name="node-f", slot_cap=50, cpu_budget=8, per_service={})
STEPS = [{"key": "pick", "service": "f-svc"},
         {"key": "label", "service": "f-svc", "depends_on": ["pick"], "fan_out": {"over": "$.pick.parcels"}},
         {"key": "ship", "service": "f-svc", "depends_on": ["label"]},
         {"key": "close", "service": "f-svc", "depends_on": ["label"], "always": True}]


@pytest.fixture
def svc(make_service) -> Service:
    return make_service("f-svc")


def _run_step(job: Job, *steps: str, results: Any) -> None:
    """Claim the queued tasks of ``steps`` and succeed each with ``results(task inputs)``."""
    service = Service.objects.get(key="f-svc")
    tasks = [t for t in claim_for(service, 50, limits=LIMITS) if t.job_id == job.id]
    assert tasks and {Task.objects.get(pk=t.id).step_key for t in tasks} == set(steps), "only these steps queued"
    for task in tasks:
        run_ok([task], results=results(step_context(task.id).inputs))


def _tasks(job: Job) -> dict[str, str]:
    return dict(Task.objects.filter(job=job).order_by("id").values_list("task_key", "status"))


def test_a_step_fans_out_over_a_parents_list_and_a_dependent_gathers_the_outputs_in_order(svc):
    create_workflow(name="parcels", steps=STEPS)
    job = api.start_workflow("parcels")
    _run_step(job, "pick", results=lambda inputs: {"parcels": ["a", {"b": 1}, 3]})
    assert _tasks(job) == {"pick": "done", "label[0]": "queued", "label[1]": "queued", "label[2]": "queued",
                           "ship": "waiting", "close": "waiting"}
    assert JobStep.objects.get(job=job, step_key="label").total == 3, "the dependents wait for every item"
    event = Event.objects.get(job_id=job.id, data__fan_out="$.pick.parcels")
    assert event.message == "step label fanned out over $.pick.parcels: 3 task(s)"
    # Finished out of order: the gather still follows the list.
    service = Service.objects.get(key="f-svc")
    claimed = sorted(claim_for(service, 50, limits=LIMITS), key=lambda t: str(t.id), reverse=True)
    for task in claimed:
        inputs = step_context(task.id).inputs
        assert inputs["pick"] == {"parcels": ["a", {"b": 1}, 3]}
        assert inputs == previous_release_inputs(task.id)
        run_ok([task], results={"labelled": inputs["item"], "at": inputs["index"]})
    _run_step(job, "ship", "close", results=lambda inputs: inputs)
    ship = Task.objects.get(job=job, task_key="ship")
    assert ship.results["label"] == [{"labelled": "a", "at": 0}, {"labelled": {"b": 1}, "at": 1},
                                     {"labelled": 3, "at": 2}]
    assert "item" not in ship.results, "only the fanned-out step's tasks get an item"
    assert Job.objects.get(pk=job.pk).status == "done"


def test_an_empty_list_skips_the_step_with_the_reason_and_its_dependents_follow(svc):
    create_workflow(name="parcels", steps=STEPS)
    job = api.start_workflow("parcels")
    _run_step(job, "pick", results=lambda inputs: {"parcels": []})
    assert _tasks(job) == {"pick": "done", "label": "skipped", "ship": "skipped", "close": "queued"}
    label = Task.objects.get(job=job, task_key="label")
    assert label.error_message == "fan_out over an empty list: $.pick.parcels"
    assert Event.objects.get(task_id=label.id, data__to="skipped").message == (
        "task waiting → skipped (fan_out over an empty list: $.pick.parcels)")
    _run_step(job, "close", results=lambda inputs: {"label": inputs["label"]})
    assert Task.objects.get(job=job, task_key="close").results == {"label": None}
    assert Job.objects.get(pk=job.pk).status == "done"


@pytest.mark.parametrize(("output", "reason"), [
    ({"parcels": "a,b"}, "fan_out over $.pick.parcels found string, not a list"),
    ({"boxes": [1]}, "fan_out over $.pick.parcels found no value in the parents' outputs"),
])
def test_a_fan_out_over_no_list_fails_its_task_naming_what_it_found(svc, output, reason):
    create_workflow(name="parcels", steps=STEPS)
    job = api.start_workflow("parcels")
    _run_step(job, "pick", results=lambda inputs: output)
    label = Task.objects.get(job=job, step_key="label")
    assert (label.task_key, label.status, label.error_code, label.error_message) == (
        "label", "error", "fan_out_failed", reason)
    assert _tasks(job)["ship"] == "skipped" and _tasks(job)["close"] == "queued", "an always step still runs"
    _run_step(job, "close", results=lambda inputs: {})
    assert Job.objects.get(pk=job.pk).status == "error"


@pytest.fixture
def three_items(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setenv("ACC_MAX_FAN_OUT_ITEMS", "3")
    reload()
    yield 3
    monkeypatch.undo()
    reload()


def test_more_items_than_the_limit_fail_the_job_naming_the_limit_and_make_no_task(svc, three_items):
    create_workflow(name="parcels", steps=STEPS)
    job = api.start_workflow("parcels")
    assert JobStep.objects.get(job=job, step_key="label").max_items == 3, "the site's limit when the job was made"
    _run_step(job, "pick", results=lambda inputs: {"parcels": [1, 2, 3, 4]})
    assert Task.objects.filter(job=job, step_key="label").count() == 1, "nothing half-made"
    label = Task.objects.get(job=job, step_key="label")
    assert label.status == "error" and label.error_message == (
        "fan_out over $.pick.parcels found 4 items, more than the limit of 3 (ACC_MAX_FAN_OUT_ITEMS)")
    assert Event.objects.filter(task_id=label.id, data__to="error", level="error").exists()
    assert _tasks(job)["ship"] == "skipped", "the job fails: its unstarted tasks are skipped"
    assert Event.objects.get(job_id=job.id, task_id=None, type="policy").message == (
        "job fails (on_failure fail_job): fan_out over $.pick.parcels found 4 items, more than the limit of 3"
        " (ACC_MAX_FAN_OUT_ITEMS)")
    _run_step(job, "close", results=lambda inputs: {})
    assert Job.objects.get(pk=job.pk).status == "error"


def test_a_list_at_the_limit_is_made_in_full(svc, three_items):
    create_workflow(name="parcels", steps=STEPS)
    job = api.start_workflow("parcels")
    _run_step(job, "pick", results=lambda inputs: {"parcels": [1, 2, 3]})
    assert Task.objects.filter(job=job, step_key="label", status="queued").count() == 3


# Text jsonb can store (no NUL), as a task's output is cleaned to before it is stored.
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=3)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-10, 10) | TEXT,
                    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(TEXT, inner, max_size=2),
                    max_leaves=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(JSON, max_size=6))
def test_each_item_task_receives_its_own_item_and_the_gather_returns_them_in_list_order(make_service, items):
    if not Service.objects.filter(key="f-svc").exists():
        make_service("f-svc")
    if not Job.objects.filter(workflow__name="parcels").exists():
        create_workflow(name="parcels", steps=STEPS[:3])
    job = api.start_workflow("parcels")
    _run_step(job, "pick", results=lambda inputs: {"parcels": items})
    if not items:
        assert _tasks(job) == {"pick": "done", "label": "skipped", "ship": "skipped"}
        return
    assert [key for key in _tasks(job) if key.startswith("label")] == [f"label[{i}]" for i in range(len(items))]
    _run_step(job, "label", results=lambda inputs: {"echo": inputs["item"], "index": inputs["index"]})
    _run_step(job, "ship", results=lambda inputs: inputs)
    assert Task.objects.get(job=job, task_key="ship").results["label"] == [
        {"echo": item, "index": i} for i, item in enumerate(items)]


@pytest.mark.parametrize(("fan_out", "depends_on", "expected"), [
    ({"over": "$.ghost.parcels"}, ["pick"], "step 'label': fan_out reads ['ghost'], which it does not depend on"),
    ({"over": "$.pick.picked"}, ["pick"],
     "step 'label': fan_out over '$.pick.picked': step 'pick''s output_schema says it is string, not a list"),
    ({"over": "$.pick.parcels ["}, ["pick"], "step 'label': fan_out over '$.pick.parcels [' is not a jsonpath"),
    ({"over": "$.pick.parcels"}, [], "step 'label': fan_out over '$.pick.parcels' reads a parent's output; the step"
                                     " has no depends_on"),
    ({"over": "$.*"}, ["pick"], "step 'label': fan_out over '$.*' must read one parent's output"),
    ({"each": "$.pick.parcels"}, ["pick"], 'step \'label\': fan_out must be "hosts", {"over": '),
    ("items", ["pick"], 'step \'label\': fan_out must be "hosts"'),
])
def test_a_bad_fan_out_is_a_definition_error_naming_the_step(svc, fan_out, depends_on, expected):
    with pytest.raises(DefinitionError) as caught:
        create_workflow(name="bad-parcels", steps=[
            {"key": "pick", "service": "f-svc", "output_schema": {
                "type": "object", "properties": {"picked": {"type": "string"}, "parcels": {"type": "array"}}}},
            {"key": "label", "service": "f-svc", "depends_on": depends_on, "fan_out": fan_out}])
    assert expected in "\n".join(str(p) for p in caught.value.problems)


def test_a_fan_out_step_cannot_depend_on_a_step_keyed_like_its_item_inputs(svc):
    with pytest.raises(DefinitionError, match=r"cannot depend on steps keyed \['item'\]"):
        create_workflow(name="bad-parcels", steps=[
            {"key": "item", "service": "f-svc"},
            {"key": "label", "service": "f-svc", "depends_on": ["item"], "fan_out": {"over": "$.item.all"}}])


@pytest.mark.parametrize("bad", ["$.pick[", "pick.parcels)", "$ ? (", "last"])
def test_a_stored_fan_out_path_that_is_not_a_jsonpath_fails_its_step_and_the_report_goes_through(svc, bad):
    """The validator refuses such a path on every save path; one written into the row by hand fails the step,
    saying so, instead of making every report that settles its job raise."""
    create_workflow(name="parcels", steps=STEPS)
    job = api.start_workflow("parcels")
    with connection.cursor() as cur:
        cur.execute("UPDATE accs_workflow SET steps = jsonb_set(steps, '{1,fan_out,over}', to_jsonb(%s::text))"
                    " WHERE id = %s", [bad, job.workflow_id])
    _run_step(job, "pick", results=lambda inputs: {"parcels": ["a", "b"]})
    label = Task.objects.get(job=job, step_key="label")
    assert (label.status, label.error_code, label.error_message) == (
        "error", "fan_out_failed", f"fan_out over {bad} is not a valid jsonpath")
    assert _tasks(job)["close"] == "queued", "the job settles as for any failed step"
