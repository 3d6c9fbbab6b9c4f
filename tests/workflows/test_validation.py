"""Every validation error names the problem, and nothing is written."""

from __future__ import annotations

import pytest

from workflows.api import create_workflow, import_definitions, save_service
from workflows.models import Service, Workflow
from workflows.validation import DefinitionError

pytestmark = pytest.mark.django_db

AUDIO_SCHEMA = {
    "type": "object",
    "properties": {"lufs": {"type": "number", "minimum": -70, "maximum": 0}, "src": {"type": "string"}},
    "required": ["src"],
    "additionalProperties": False,
}


@pytest.fixture
def services(make_service):
    make_service("ingest")
    make_service("audio-norm", params_schema=AUDIO_SCHEMA)
    return Service.objects.count()


def messages(exc: DefinitionError) -> str:
    return "\n".join(str(p) for p in exc.problems)


def step(key, service="ingest", deps=(), params=None):
    return {"key": key, "service": service, "depends_on": list(deps), "default_params": params or {}}


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ([step("a"), step("a")], "step 'a': duplicate step key"),
        ([step("a", service="nope")], "step 'a': unknown service 'nope'"),
        ([step("a", deps=["ghost"])], "step 'a': depends on unknown step 'ghost'"),
        ([step("a", deps=["a"])], "step 'a': depends on itself"),
        ([step("a", "audio-norm", params={"lufs": -100})],
         "step 'a': default_params.lufs: -100 is less than the minimum of -70"),
        ([step("a", "audio-norm", params={"bogus": 1})],
         "step 'a': default_params.(root): Additional properties are not allowed"),
        ([], "steps: a workflow needs a non-empty list of steps"),
        ([{"key": "a", "service": "ingest", "oops": 1}], "step 'a': unknown fields ['oops']"),
        ([step("a") | {"fan_out": "planets"}], 'step \'a\': fan_out must be "hosts", {"over": '),
        ([step("a") | {"output_schema": ["n"]}], "step 'a': output_schema must be a JSON object (a JSON Schema)"),
        ([step("a") | {"output_schema": {"type": "integr"}}], "step 'a': output_schema is not a valid JSON Schema"),
    ],
)
def test_invalid_workflow_is_rejected_with_named_problem_and_nothing_saved(services, steps, expected):
    with pytest.raises(DefinitionError) as info:
        create_workflow(name="wf", steps=steps)
    assert expected in messages(info.value)
    assert Workflow.objects.count() == 0


def test_cycle_error_names_the_cycle_path(services):
    steps = [step("a", deps=["c"]), step("b", deps=["a"]), step("c", deps=["b"]), step("d")]
    with pytest.raises(DefinitionError) as info:
        create_workflow(name="wf", steps=steps)
    text = messages(info.value)
    assert "dependency cycle:" in text
    cycle = text.split("dependency cycle: ")[1].split("\n")[0].split(" → ")
    assert cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert Workflow.objects.count() == 0


def test_default_params_may_leave_required_fields_to_the_job(services):
    workflow = create_workflow(name="wf", steps=[step("a", "audio-norm", params={"lufs": -16})])
    assert workflow.version == 1
    assert create_workflow(name="wf", steps=[step("a")]).version == 2


def test_all_problems_are_reported_together(services):
    with pytest.raises(DefinitionError) as info:
        create_workflow(name="wf", steps=[step("a", service="nope"), step("b", deps=["zzz"])])
    assert len(info.value.problems) == 2


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"executor": "command", "executor_config": {}},
         "executor_config.argv: a command service needs a non-empty list"),
        ({"executor": "command", "executor_config": {"argv": ["tool", "{missing}"]},
          "params_schema": {"type": "object", "properties": {"x": {}}}},
         "placeholders ['missing'] are not properties of params_schema"),
        ({"executor": "python", "executor_config": {"callable": "not a path"}}, "executor_config.callable"),
        ({"executor": "http", "executor_config": {"url": "http://10.1.2.3/run"}}, "must be a local service (loopback)"),
        ({"executor": "python", "executor_config": {"callable": "m:f"}, "params_schema": {"type": "nonsense"}},
         "params_schema: not a valid JSON Schema"),
        ({"executor": "python", "executor_config": {"callable": "m:f"}, "cpu_weight": 9},
         "cpu_weight: must be between 1 and 5"),
    ],
)
def test_invalid_service_is_rejected_and_not_saved(fields, expected):
    with pytest.raises(DefinitionError) as info:
        save_service(key="svc", **fields)
    assert expected in messages(info.value)
    assert not Service.objects.filter(key="svc").exists()


def test_import_is_all_or_nothing():
    data = {
        "services": [{"key": "good", "executor": "python", "executor_config": {"callable": "tests.callables:noop"}}],
        "workflows": [{"name": "wf", "steps": [step("a", "good"), step("b", "missing")]}],
    }
    with pytest.raises(DefinitionError) as info:
        import_definitions(data)
    assert "workflow 'wf' v1 step 'b': unknown service 'missing'" in messages(info.value)
    assert not Service.objects.filter(key="good").exists()
    assert Workflow.objects.count() == 0
    data["workflows"][0]["steps"] = [step("a", "good")]
    services, workflows = import_definitions(data)
    assert [s.key for s in services] == ["good"] and workflows[0].steps[0]["service"] == "good"


def test_admin_form_runs_the_same_validation(admin_client, services):
    response = admin_client.post(
        "/admin/workflows/workflow/add/",
        {"name": "wf", "version": 1, "description": "", "is_active": "on", "max_active_jobs": 0,
         "steps": '[{"key": "a", "service": "ingest", "depends_on": ["a"]}]',
         "created_at_0": "2026-01-01", "created_at_1": "00:00:00"},
    )
    assert response.status_code == 200
    assert "step &#x27;a&#x27;: depends on itself" in response.content.decode()
    assert Workflow.objects.count() == 0
