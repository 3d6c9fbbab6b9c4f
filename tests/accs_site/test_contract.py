"""Contract: the Pydantic wire schemas agree with the Django models (names, nullability, enums)."""

from __future__ import annotations

import types
import typing
from enum import Enum

import pytest
from django.contrib.postgres.fields import ArrayField
from django.db import models

from events import schemas as event_schemas
from jobs import schemas as job_schemas
from nodes import schemas as node_schemas
from workflows import schemas as workflow_schemas

PAIRS = [
    (job_schemas.Job, "jobs.Job"),
    (job_schemas.JobTask, "jobs.Task"),
    (event_schemas.TaskEvent, "events.Event"),
    (event_schemas.TaskArtifact, "events.Artifact"),
    (node_schemas.Node, "nodes.Node"),
    (workflow_schemas.WorkflowDef, "workflows.Workflow"),
]

PY_TYPES = {
    ArrayField: "json",
    models.UUIDField: "UUID", models.CharField: "str", models.TextField: "str", models.SlugField: "str",
    models.IntegerField: "int", models.BigIntegerField: "int", models.PositiveIntegerField: "int",
    models.PositiveSmallIntegerField: "int", models.BigAutoField: "int", models.AutoField: "int",
    models.FloatField: "float", models.DateTimeField: "datetime", models.BooleanField: "bool",
    models.JSONField: "json",
}


def _model_field(model, name):
    for field in model._meta.concrete_fields:
        if name in (field.name, field.attname):
            return field
    return None


def _annotation_parts(annotation) -> tuple[set[str], bool]:
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else (annotation,)
    names, nullable = set(), False
    for arg in args:
        if arg is type(None):
            nullable = True
        elif isinstance(arg, type) and issubclass(arg, Enum):
            names.add("str")
        elif typing.get_origin(arg) in (dict, list) or arg in (dict, list):
            names.add("json")
        elif typing.get_origin(arg) is typing.Literal:
            names.add("str")
        else:
            names.add(getattr(arg, "__name__", str(arg)))
    return names, nullable


@pytest.mark.parametrize(("schema", "model_label"), PAIRS, ids=[p[1] for p in PAIRS])
def test_schema_fields_exist_on_the_model_with_matching_types(schema, model_label):
    from django.apps import apps

    model = apps.get_model(model_label)
    for name, info in schema.model_fields.items():
        field = _model_field(model, name)
        assert field is not None, f"{schema.__name__}.{name} has no column on {model_label}"
        kinds, nullable = _annotation_parts(info.annotation)
        if name == "steps":
            continue  # list[WorkflowStep] is the structured view of the JSON column
        target = field.target_field if field.is_relation else field
        expected = next(v for k, v in PY_TYPES.items() if isinstance(target, k))
        assert expected in kinds, f"{schema.__name__}.{name}: schema {kinds} vs model {expected}"
        if field.null and expected != "json":
            assert nullable, f"{schema.__name__}.{name} must be Optional: the column is nullable"
        if not field.null and nullable and info.is_required():
            pytest.fail(f"{schema.__name__}.{name} is Optional but {model_label}.{name} is NOT NULL")
        if getattr(field, "choices", None) and isinstance(next(iter(kinds)), str):
            enum_types = [a for a in typing.get_args(info.annotation) or (info.annotation,) if isinstance(a, type) and issubclass(a, Enum)]
            for enum in enum_types:
                assert {e.value for e in enum} == {c[0] for c in field.choices}, f"{schema.__name__}.{name} enum drifted"


def test_seed_000_workflow_example_parses_and_validates(make_service, db):
    from workflows.api import create_workflow
    from workflows.schemas import WorkflowDef

    steps = [
        {"key": "ingest", "service": "ingest", "depends_on": [], "default_params": {"source": "s3://bucket/in.wav"}},
        {"key": "audio", "service": "audio-norm", "depends_on": ["ingest"], "default_params": {"lufs": -16}},
        {"key": "render", "service": "renderer", "depends_on": ["audio"], "default_params": {"preset": "1080p30"}},
        {"key": "upload", "service": "yt-upload", "depends_on": ["render"], "default_params": {}},
    ]
    for key in ("ingest", "audio-norm", "renderer", "yt-upload"):
        make_service(key)
    definition = WorkflowDef(name="publish", version=1, steps=steps)
    workflow = create_workflow(name=definition.name, steps=[s.model_dump(exclude_none=True) for s in definition.steps])
    assert WorkflowDef.model_validate(workflow).steps[3].depends_on == ["render"]
