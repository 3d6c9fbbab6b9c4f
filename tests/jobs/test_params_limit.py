"""The largest params a job may start with (``ACC_MAX_PARAMS_BYTES``, in bytes of the JSON a task reads)
is enforced where every start converges (:func:`jobs.enqueue._plan`): the Python API, the Tasks
backend, the HTTP API and triggers refuse a larger start with an error naming the size and the limit,
and write nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from accs_site.conf import reload
from jobs import api, triggers
from jobs.enqueue import params_too_large
from jobs.instantiate import params_json
from jobs.models import Job, Trigger
from tests import task_funcs
from tests.api_helpers import client_for, user_with_token
from workflows.api import create_workflow
from workflows.validation import DefinitionError

LIMIT = 4096

pytestmark = pytest.mark.django_db


@pytest.fixture
def limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setenv("ACC_MAX_PARAMS_BYTES", str(LIMIT))
    reload()
    yield LIMIT
    monkeypatch.undo()
    reload()


@pytest.fixture
def upload(make_service):
    return make_service("upload", params_schema={"type": "object", "properties": {"blob": {"type": "string"}}})


def _params(size: int) -> dict[str, str]:
    """Return params whose JSON is exactly ``size`` bytes (at least 12)."""
    params = {"blob": "x" * (size - len(params_json({"blob": ""})))}
    assert len(params_json(params).encode()) == size
    return params


def _names_the_limit(message: str, size: int) -> None:
    assert f"params are {size:,} bytes of JSON, more than the limit of {LIMIT:,} bytes (ACC_MAX_PARAMS_BYTES)" \
        in message, message


def test_the_python_api_refuses_params_over_the_limit_on_every_start_verb(limit, upload, default_tenant):
    big = _params(LIMIT + 1)
    create_workflow(name="flow", steps=[{"key": "up", "service": "upload", "default_params": {"blob": "small"}}])
    starts = {
        "start_service": lambda: api.start_service("upload", params=big),
        "start_workflow": lambda: api.start_workflow("flow", step_params={"up": big}),
        "start_many": lambda: api.start_many([api.JobSpec(service="upload", params={"blob": "ok"}),
                                              api.JobSpec(service="upload", params=big)]),
        "validate": lambda: api.validate(api.JobSpec(service="upload", params=big)),
    }
    for name, start in starts.items():
        with pytest.raises(DefinitionError) as refused:
            start()
        message = str(refused.value)
        _names_the_limit(message, LIMIT + 1)
        assert ("step 'up' params" if name == "start_workflow" else "step 'upload' params") in message, (name, message)
    assert not Job.objects.exists(), "a refused start writes nothing (start_many: none of the batch)"
    assert api.start_service("upload", params=_params(LIMIT)).was_created, "params of exactly the limit start"


def test_a_workflow_steps_default_params_count_with_the_start_overrides(limit, make_service, default_tenant):
    make_service("merge", params_schema={"type": "object"})
    create_workflow(name="merged", steps=[{"key": "m", "service": "merge", "default_params": _params(LIMIT - 20)}])
    with pytest.raises(DefinitionError) as refused:
        api.start_workflow("merged", step_params={"m": {"extra": "x" * 40}})
    assert "(ACC_MAX_PARAMS_BYTES)" in str(refused.value)
    assert api.start_workflow("merged").was_created


def test_the_default_limit_is_two_mib(upload, default_tenant):
    with pytest.raises(DefinitionError, match=r"more than the limit of 2,097,152 bytes \(ACC_MAX_PARAMS_BYTES\)"):
        api.start_service("upload", params={"blob": "x" * (2 * 1024 * 1024)})
    assert api.start_service("upload", params={"blob": "x" * (1024 * 1024)}).was_created


@pytest.mark.django_db(transaction=True)
def test_the_tasks_backend_refuses_arguments_over_the_limit(limit, default_tenant):
    with pytest.raises(DefinitionError) as refused:
        task_funcs.add.enqueue("x" * LIMIT, 1)
    assert "(ACC_MAX_PARAMS_BYTES)" in str(refused.value)
    assert not Job.objects.exists()


def test_the_http_api_answers_422_naming_the_limit(limit, upload, default_tenant):
    _, token = user_with_token("root", superuser=True)
    big = _params(LIMIT + 100)
    answer = client_for(token).post("/api/v1/jobs", {"service": "upload", "params": big},
                                    content_type="application/json")
    assert answer.status_code == 422, answer.content
    _names_the_limit(json.dumps(answer.json()), LIMIT + 100)
    assert not Job.objects.exists()


def test_a_trigger_whose_payload_is_over_the_limit_records_the_error_and_starts_nothing(limit, upload,
                                                                                       default_tenant):
    trigger = triggers.create_trigger(tenant=default_tenant, label="on upload", trigger_type="event",
                                      event_name="file.uploaded", service="upload",
                                      payload_template={"blob": "{{event.content}}"})
    result = api.emit_event("file.uploaded", {"content": "x" * LIMIT})
    assert result.jobs == [] and not Job.objects.exists()
    [(trigger_id, message)] = result.errors
    assert trigger_id == trigger.id
    _names_the_limit(message, LIMIT + len(params_json({"blob": ""})))
    assert "(ACC_MAX_PARAMS_BYTES)" in Trigger.objects.get(pk=trigger.id).last_error


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(min_value=LIMIT - 64, max_value=LIMIT + 64) | st.integers(min_value=12, max_value=4 * LIMIT),
       text=st.text(min_size=0, max_size=30))
def test_params_are_refused_exactly_when_their_json_is_over_the_limit(limit, size, text):
    # Any characters (escaped as the task reads them), padded to a size around the limit.
    params = {"t": text, "blob": ""}
    pad = size - len(params_json(params).encode())
    params["blob"] = "y" * max(pad, 0)
    actual = len(params_json(params).encode())
    problem = params_too_large(params)
    assert bool(problem) == (actual > LIMIT), (actual, problem)
    if problem:
        assert f"{actual:,} bytes" in problem and "ACC_MAX_PARAMS_BYTES" in problem
