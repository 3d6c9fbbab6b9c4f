"""Definitions in code (workflows.code) and their sync (workflows.sync): the one validator's problems
name the file and line of the declaration and nothing is written; a change is a new version; a
definition made in the admin is adopted without a new version; deactivating a service still in use
is refused unless allowed."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jobs import api as jobs_api
from workflows import checks, code, sync
from workflows.api import create_workflow
from workflows.checks import check_code_definitions
from workflows.models import Service, Workflow
from workflows.validation import DefinitionError

pytestmark = pytest.mark.django_db

HEADER = "from workflows import code\n"
NOOP = '{"callable": "tests.callables:noop"}'


@pytest.fixture
def write(tmp_path, monkeypatch):
    """Write a definitions module on sys.path; return (module name, its path)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write_module(body: str) -> tuple[str, Path]:
        name = f"defs_{uuid.uuid4().hex[:10]}"
        path = tmp_path / f"{name}.py"
        path.write_text(HEADER + textwrap.dedent(body))
        return name, path

    return write_module


def line_of(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def counts() -> tuple[int, int]:
    return Service.objects.count(), Workflow.objects.count()


def refused(name: str) -> str:
    before = counts()
    with pytest.raises(DefinitionError) as caught:
        sync.apply(code.discover([name]))
    assert counts() == before, "nothing written"
    return "\n".join(str(p) for p in caught.value.problems)


def test_cycle_is_refused_at_the_workflow_with_file_and_line(write):
    name, path = write(f"""
        svc = code.service("cyc-svc", executor="python", executor_config={NOOP})
        code.workflow("cyclic", steps=[
            code.step("a", svc, depends_on=["b"]),
            code.step("b", svc, depends_on=["a"]),
        ])
    """)
    found = refused(name)
    assert f"{path}:{line_of(path, 'code.workflow(')}: workflow 'cyclic' steps: dependency cycle" in found
    assert not Service.objects.filter(key="cyc-svc").exists(), "the valid service in the same sync is not written"


def test_unknown_service_is_refused_at_the_step_line(write):
    name, path = write(f"""
        svc = code.service("known-svc", executor="python", executor_config={NOOP})
        code.workflow("strays", steps=[
            code.step("ok", svc),
            code.step("lost", "no-such-service", depends_on=["ok"]),
        ])
    """)
    line = line_of(path, 'code.step("lost"')
    assert f"{path}:{line}: workflow 'strays' step 'lost': unknown service 'no-such-service'" in refused(name)


def test_dependency_on_a_missing_step_is_refused_at_its_line(write):
    name, path = write(f"""
        svc = code.service("dep-svc", executor="python", executor_config={NOOP})
        code.workflow("orphan", steps=[code.step("a", svc),
            code.step("b", svc, depends_on=["ghost"])])
    """)
    assert f"{path}:{line_of(path, 'ghost')}: workflow 'orphan' step 'b': depends on unknown step 'ghost'" in (
        refused(name))


def test_a_bad_output_schema_is_refused_at_the_step_line(write):
    name, path = write(f"""
        svc = code.service("schema-svc", executor="python", executor_config={NOOP})
        code.workflow("typed", steps=[code.step("a", svc),
            code.step("b", svc, output_schema={{"type": "objekt"}})])
    """)
    assert f"{path}:{line_of(path, 'objekt')}: workflow 'typed' step 'b': output_schema is not a valid JSON Schema" in (
        refused(name))


def test_an_output_schema_in_code_is_stored_with_its_step(write):
    name, _ = write(f"""
        svc = code.service("typed-svc", executor="python", executor_config={NOOP})
        code.workflow("typed-ok", steps=[code.step("a", svc, output_schema={{"type": "object", "required": ["n"]}})])
    """)
    sync.apply(code.discover([name]))
    stored = Workflow.objects.get(name="typed-ok").steps
    assert stored[0]["output_schema"] == {"type": "object", "required": ["n"]}


def test_a_condition_on_a_missing_parent_is_refused_at_the_step_line(write):
    name, path = write(f"""
        svc = code.service("when-svc", executor="python", executor_config={NOOP})
        code.workflow("gated", steps=[code.step("a", svc),
            code.step("b", svc, depends_on=["a"], when="$.ghost.ok == true")])
    """)
    assert f"{path}:{line_of(path, 'ghost')}: workflow 'gated' step 'b': when reads ['ghost'], which it does not" in (
        refused(name))


@pytest.mark.parametrize(("fan_out", "expected"), [
    ('{"over": "$.ghost.parcels"}', "fan_out reads ['ghost'], which it does not depend on"),
    ('{"over": "$.a.count"}', "fan_out over '$.a.count': step 'a''s output_schema says it is integer, not a list"),
])
def test_a_fan_out_over_a_missing_parent_or_a_non_list_is_refused_at_the_step_line(write, fan_out, expected):
    name, path = write(f"""
        svc = code.service("fan-svc", executor="python", executor_config={NOOP})
        code.workflow("fanned", steps=[
            code.step("a", svc, output_schema={{"type": "object", "properties": {{"count": {{"type": "integer"}}}}}}),
            code.step("b", svc, depends_on=["a"],
                      fan_out={fan_out})])
    """)
    line = line_of(path, 'code.step("b"')
    assert f"{path}:{line}: workflow 'fanned' step 'b': {expected}" in refused(name)


def test_a_fan_out_over_a_parents_list_in_code_is_stored_with_its_step(write):
    name, _ = write(f"""
        svc = code.service("fan-ok-svc", executor="python", executor_config={NOOP})
        code.workflow("fanned-ok", steps=[code.step("a", svc),
            code.step("b", svc, depends_on=["a"], fan_out={{"over": "$.a.parcels"}})])
    """)
    sync.apply(code.discover([name]))
    assert Workflow.objects.get(name="fanned-ok").steps[1]["fan_out"] == {"over": "$.a.parcels"}


def test_a_task_step_declaring_inputs_gets_them_and_default_params_cannot_set_them():
    from tests.task_funcs import add, count_parcels

    assert code.takes_inputs(count_parcels.func) and not code.takes_inputs(add.func)
    with pytest.raises(TypeError, match="receives its parents' outputs as inputs="):
        code.step("count", count_parcels, depends_on=["pick"], default_params={"order": "R", "inputs": {}})


def test_a_nul_in_default_params_is_refused_at_the_step_line(write):
    name, path = write(f"""
        svc = code.service("nul-svc", executor="python", executor_config={NOOP})
        code.workflow("nul", steps=[
            code.step("a", svc, default_params={{"a": "x\\x00y"}})])
    """)
    assert f"{path}:{line_of(path, 'code.step(')}: workflow 'nul' step 'a': default_params hold a NUL character" in (
        refused(name))


def test_default_params_over_the_params_limit_are_refused_at_the_step_line(write):
    """Every start would be refused (params over ACC_MAX_PARAMS_BYTES): the definition is; nothing is written."""
    from workflows.models import Workflow

    name, path = write(f"""
        svc = code.service("big-svc", executor="python", executor_config={NOOP})
        code.workflow("big", steps=[
            code.step("a", svc, default_params={{"blob": "x" * 3_000_000}})])
    """)
    assert (f"{path}:{line_of(path, 'code.step(')}: workflow 'big' step 'a': default_params are 3,000,012 bytes"
            " of JSON, more than the limit of 2,097,152 bytes (ACC_MAX_PARAMS_BYTES)") in refused(name)
    assert not Workflow.objects.filter(name="big").exists()


def test_bad_service_fields_are_refused_at_the_service_line(write):
    name, path = write(f"""
        code.service("heavy", executor="python", executor_config={NOOP}, cpu_weight=9)
        code.service("typo", executor="python", executor_config={NOOP}, max_atempts=2)
        code.service("Not A Slug", executor="python", executor_config={NOOP})
    """)
    found = refused(name)
    assert f"{path}:{line_of(path, 'heavy')}: service 'heavy' cpu_weight: must be between 1 and 5" in found
    assert f"{path}:{line_of(path, 'typo')}: service 'typo': unknown fields ['max_atempts']" in found
    assert f"{path}:{line_of(path, 'Not A Slug')}: service 'Not A Slug' key:" in found


def test_a_workflow_declared_twice_is_refused_naming_both_places(write):
    name, path = write(f"""
        svc = code.service("twice-svc", executor="python", executor_config={NOOP})
        code.workflow("twice", steps=[code.step("a", svc)])
        code.workflow("twice", steps=[code.step("b", svc)])
    """)
    lines = [n for n, line in enumerate(path.read_text().splitlines(), 1) if "code.workflow(" in line]
    assert f"{path}:{lines[1]}: workflow 'twice': declared again (first at {path}:{lines[0]})" in refused(name)


def test_sync_creates_then_is_unchanged_then_a_change_is_a_new_version(write, default_tenant):
    body = """
        svc = code.service("ver-svc", executor="python", executor_config={NOOP}, max_attempts=2)
        code.workflow("ver", description="d", steps=[code.step("a", svc), code.step("b", svc, depends_on=["a"],
                                                     default_params={{"n": {n}}})])
    """
    first, path = write(body.format(NOOP=NOOP, n=1))
    applied = sync.apply(code.discover([first]))
    assert [(a.kind, a.target) for a in applied.changes] == [("create", "service ver-svc"),
                                                            ("create", "workflow ver v1")]
    v1 = Workflow.objects.get(name="ver", version=1)
    assert v1.defined_in == f"{first}:{line_of(path, 'code.workflow(')}"
    assert Service.objects.get(key="ver-svc").max_attempts == 2
    assert not sync.plan(code.discover([first])).changes, "applying again changes nothing"
    job = jobs_api.start_workflow("ver")

    second, _ = write(body.format(NOOP=NOOP, n=2))
    applied = sync.apply(code.discover([second]))
    assert [(a.kind, a.target, a.detail) for a in applied.changes if a.target.startswith("workflow")] == [
        ("new version", "workflow ver v2", "step b changed")]
    v1.refresh_from_db()
    assert v1.steps[1]["default_params"] == {"n": 1}, "the version the job used keeps its steps"
    job.refresh_from_db()
    assert job.workflow_id == v1.pk
    assert Workflow.objects.get(name="ver", version=2).steps[1]["default_params"] == {"n": 2}


def test_a_service_field_removed_from_code_goes_back_to_its_default(write):
    first, _ = write(f'code.service("dflt", executor="python", executor_config={NOOP}, max_attempts=5)\n')
    sync.apply(code.discover([first]))
    second, _ = write(f'code.service("dflt", executor="python", executor_config={NOOP})\n')
    applied = sync.apply(code.discover([second]))
    assert [(a.kind, a.detail) for a in applied.changes] == [("change", "max_attempts")]
    assert Service.objects.get(key="dflt").max_attempts == Service._meta.get_field("max_attempts").default


def test_a_workflow_made_in_the_admin_is_adopted_without_a_new_version(write, make_service):
    make_service("adopt-svc")
    create_workflow(name="adopted", steps=[{"key": "a", "service": "adopt-svc", "depends_on": [],
                                            "default_params": {}}])
    name, _ = write('code.workflow("adopted", steps=[code.step("a", "adopt-svc")])\n')
    applied = sync.apply(code.discover([name]))
    assert [(a.kind, a.target) for a in applied.changes] == [("mark", "workflow adopted v1")]
    assert list(Workflow.objects.filter(name="adopted").values_list("version", "defined_in")) == [
        (1, f"{name}:2")]


def test_removing_a_service_with_unfinished_jobs_needs_allow_destructive(write, default_tenant):
    first, _ = write(f'code.service("busy", executor="python", executor_config={NOOP})\n')
    sync.apply(code.discover([first]))
    jobs_api.start_service("busy")
    empty, _ = write("")
    with pytest.raises(sync.DestructiveChange, match="deactivate service busy.*1 unfinished job"):
        sync.apply(code.discover([empty]))
    assert Service.objects.get(key="busy").is_active, "nothing written"
    sync.apply(code.discover([empty]), allow_destructive=True)
    assert not Service.objects.get(key="busy").is_active


def test_removing_a_code_workflow_deactivates_it(write):
    first, _ = write(f"""
        svc = code.service("gone-svc", executor="python", executor_config={NOOP})
        code.workflow("gone", steps=[code.step("a", svc)])
    """)
    sync.apply(code.discover([first]))
    second, _ = write(f'code.service("gone-svc", executor="python", executor_config={NOOP})\n')
    applied = sync.apply(code.discover([second]))
    assert [(a.kind, a.target) for a in applied.changes if a.target.startswith("workflow")] == [
        ("deactivate", "workflow gone v1")]
    assert not Workflow.objects.get(name="gone").is_active


def test_deploy_check_warns_on_drift_and_is_quiet_once_synced(write, monkeypatch):
    name, _ = write(f'code.service("checked", executor="python", executor_config={NOOP})\n')
    monkeypatch.setattr(checks, "app_modules", lambda: [name])
    (warning,) = check_code_definitions()
    assert warning.id == "accs.W030" and "create service checked" in warning.msg
    sync.apply(code.discover([name]))
    assert check_code_definitions() == []


# Text PostgreSQL can store in JSON (a NUL is refused by the validator: see the test below).
TEXT = st.text(alphabet=st.characters(blacklist_characters="\x00"), max_size=5)
STEP_KEYS = st.lists(st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True), min_size=1, max_size=6, unique=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=STEP_KEYS, data=st.data())
def test_any_acyclic_workflow_syncs_to_exactly_its_steps_and_then_is_in_step(write, keys, data):
    steps = []
    for index, key in enumerate(keys):
        deps = data.draw(st.lists(st.sampled_from(keys[:index]), unique=True) if index else st.just([]))
        params = data.draw(st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True),
                                           st.integers() | TEXT | st.booleans(), max_size=3))
        steps.append({"key": key, "service": "gen-svc", "depends_on": deps, "default_params": params})
    flow = f"gen-{uuid.uuid4().hex[:8]}"
    calls = ",\n".join(f"    code.step({s['key']!r}, svc, depends_on={s['depends_on']!r}, "
                       f"default_params={s['default_params']!r})" for s in steps)
    name, _ = write(f'svc = code.service("gen-svc", executor="python", executor_config={NOOP})\n'
                    f"code.workflow({flow!r}, steps=[\n{calls}])\n")
    sync.apply(code.discover([name]))
    assert Workflow.objects.get(name=flow).steps == steps
    assert not [a for a in sync.plan(code.discover([name])).changes if a.target.startswith("workflow")]
