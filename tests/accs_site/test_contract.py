"""Contract: the schemas the HTTP API serves (its OpenAPI document) agree with the Django models (names,
nullability, enums), and real responses match them."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.postgres.fields import ArrayField
from django.db import models
from jsonschema import Draft202012Validator

from jobs import api
from tests.api_helpers import client_for, user_with_token
from tests.engine_helpers import claim_for, run_fail

# Each response shape of the API and the model whose rows it shows.
PAIRS = [
    ("JobOut", "jobs.Job"),
    ("TaskOut", "jobs.Task"),
    ("TriggerOut", "jobs.Trigger"),
    ("ServiceOut", "workflows.Service"),
    ("WorkflowOut", "workflows.Workflow"),
]

# A column's type in JSON Schema: (type, format); "json" for JSON and array columns.
JSON_TYPES: list[tuple[type[models.Field], tuple[str, str | None] | str]] = [
    (ArrayField, "json"), (models.JSONField, "json"),
    (models.UUIDField, ("string", "uuid")), (models.DateTimeField, ("string", "date-time")),
    (models.CharField, ("string", None)), (models.TextField, ("string", None)),
    (models.BooleanField, ("boolean", None)), (models.FloatField, ("number", None)),
    (models.IntegerField, ("integer", None)), (models.BigIntegerField, ("integer", None)),
    (models.PositiveIntegerField, ("integer", None)), (models.PositiveSmallIntegerField, ("integer", None)),
    (models.BigAutoField, ("integer", None)), (models.AutoField, ("integer", None)),
]
# A related row is shown by the field that names it (a tenant's slug, a service's key, ...).
NAMING_FIELDS = ("slug", "key", "name")
# Fields the API reads from a related row rather than a column of its own: name -> (relation, field).
DERIVED = {"workflow_version": ("workflow", "version")}


@pytest.fixture
def document(client) -> dict[str, Any]:
    """The OpenAPI document as the API serves it."""
    response = client.get("/api/v1/openapi.json")
    assert response.status_code == 200, response.content
    return response.json()


def _model_field(model, name: str) -> models.Field | None:
    for field in model._meta.concrete_fields:
        if name in (field.name, field.attname):
            return field
    return None


def _json_type(field: models.Field) -> tuple[str, str | None] | str:
    return next(kind for cls, kind in JSON_TYPES if isinstance(field, cls))


def _property_parts(prop: dict[str, Any], components: dict[str, Any]) -> tuple[set, bool, list | None]:
    """Return the (type, format) pairs a property allows, whether it allows null, and its enum if any."""
    options = prop.get("anyOf", [prop])
    kinds, nullable, enum = set(), False, None
    for option in options:
        if "$ref" in option:
            option = components[option["$ref"].rsplit("/", 1)[1]]
        if option.get("type") == "null":
            nullable = True
        elif option.get("type") in ("object", "array") or "type" not in option:
            kinds.add("json")
        else:
            kinds.add((option["type"], option.get("format")))
        enum = option.get("enum", enum)
    return kinds, nullable, enum


@pytest.mark.parametrize(("schema_name", "model_label"), PAIRS, ids=[p[1] for p in PAIRS])
def test_served_schema_fields_exist_on_the_model_with_matching_types(document, schema_name, model_label):
    from django.apps import apps

    model = apps.get_model(model_label)
    components = document["components"]["schemas"]
    schema = components[schema_name]
    for name, prop in schema["properties"].items():
        kinds, nullable, enum = _property_parts(prop, components)
        where = f"{schema_name}.{name}"
        if name in DERIVED:
            relation, source = DERIVED[name]
            link = _model_field(model, relation)
            field = link.related_model._meta.get_field(source)
            assert nullable == (link.null or field.null), f"{where}: nullable only where {relation} may be null"
        else:
            field = _model_field(model, name)
            assert field is not None, f"{where} has no column on {model_label}"
        expected = _json_type(field.target_field if field.is_relation else field)
        if field.is_relation and kinds == {("string", None)}:
            named = [n for n in NAMING_FIELDS if _has_field(field.related_model, n)]
            assert named, f"{where} shows a {field.related_model.__name__} by a name it does not have"
        else:
            assert expected in kinds, f"{where}: the schema says {kinds}, the column {expected}"
        if field.null and expected != "json":
            assert nullable, f"{where} must allow null: the column is nullable"
        if not field.null and name not in DERIVED:
            assert not nullable, f"{where} allows null but {model_label}.{name} is NOT NULL"
        if enum is not None and field.choices:
            assert set(enum) == {c[0] for c in field.choices}, f"{where}: the enum drifted from the choices"


def _has_field(model, name: str) -> bool:
    return any(f.name == name for f in model._meta.concrete_fields)


def _validator(document: dict[str, Any], path: str, method: str, status: str) -> Draft202012Validator:
    """Return a validator for the response body ``method path`` answers with ``status``, as the document says."""
    body = document["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]
    return Draft202012Validator({**body, "components": document["components"]})


def _assert_valid(validator: Draft202012Validator, body: Any, what: str) -> None:
    problems = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(body)]
    assert problems == [], f"{what} does not match the API's own schema: {problems[:5]}"


@pytest.mark.django_db
def test_a_job_with_a_failed_task_matches_the_served_schema(document, make_service, default_tenant):
    """A job whose task failed once (error text, retry time set) is answered as documented."""
    svc = make_service("flaky", max_attempts=2)
    job = api.start_service(svc, tenant=default_tenant)
    run_fail(claim_for(svc), error="boom")
    _, token = user_with_token("root", superuser=True)
    response = client_for(token).get(f"/api/v1/jobs/{job.id}")
    assert response.status_code == 200, response.content
    body = response.json()
    _assert_valid(_validator(document, "/api/v1/jobs/{job_id}", "get", "200"), body, "GET /api/v1/jobs/{id}")
    tasks = [(t["status"], t["error_message"]) for t in body["tasks"]]
    assert tasks == [("scheduled", "boom")], "waiting for its retry"


@pytest.mark.django_db
def test_the_example_workflow_posts_and_reads_back_in_the_apis_own_schema(document, make_service):
    steps = [
        {"key": "ingest", "service": "ingest", "depends_on": [], "default_params": {"source": "s3://bucket/in.wav"}},
        {"key": "audio", "service": "audio-norm", "depends_on": ["ingest"], "default_params": {"lufs": -16}},
        {"key": "render", "service": "renderer", "depends_on": ["audio"], "default_params": {"preset": "1080p30"}},
        {"key": "upload", "service": "yt-upload", "depends_on": ["render"], "default_params": {}},
    ]
    for key in ("ingest", "audio-norm", "renderer", "yt-upload"):
        make_service(key)
    _, token = user_with_token("root", superuser=True)
    client = client_for(token)
    created = client.post("/api/v1/workflows", {"name": "publish", "version": 1, "steps": steps},
                          content_type="application/json")
    assert created.status_code == 201, created.content
    _assert_valid(_validator(document, "/api/v1/workflows", "post", "201"), created.json(), "POST /api/v1/workflows")
    read = client.get("/api/v1/workflows/publish/1")
    assert read.status_code == 200, read.content
    _assert_valid(_validator(document, "/api/v1/workflows/{name}/{version}", "get", "200"), read.json(),
                  "GET /api/v1/workflows/{name}/{version}")
    assert read.json()["steps"][3]["depends_on"] == ["render"]
