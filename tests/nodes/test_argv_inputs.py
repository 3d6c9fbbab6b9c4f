"""A command step's argv may read its parents' outputs: ``{inputs.<step>.<name>...}`` (a number picks an
element of a list; ``{inputs.item}`` for a step fanning out over a list). Each value stays one argument and
goes through the guards params go through: it never chooses the program, and a value starting with '-'
never becomes an option (unless after a literal '--'); the validator refuses a placeholder reading a step
the step does not depend on."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given, strategies as st

from nodes.executors.base import OptionInjection, render_argv
from workflows.api import create_workflow
from workflows.validation import DefinitionError, argv_fields, service_problems

INPUTS = {"pick": {"items": 2, "parcels": ["R-1/1", "-rf"], "note": None, "meta": {"a": [1]}}, "item": "x"}


@pytest.mark.parametrize(("template", "expected"), [
    (["tool", "{inputs.pick.items}"], ["tool", "2"]),
    (["tool", "--count={inputs.pick.items}"], ["tool", "--count=2"]),
    (["tool", "{inputs.pick.parcels.0}"], ["tool", "R-1/1"]),
    (["tool", "{inputs.pick.parcels}"], ["tool", json.dumps(["R-1/1", "-rf"])]),
    (["tool", "{inputs.pick.meta}"], ["tool", json.dumps({"a": [1]})]),
    (["tool", "{inputs.pick.note}"], ["tool", ""]),
    (["tool", "{inputs.item}", "{ref}"], ["tool", "x", "R-1"]),
    (["tool", "--", "{inputs.pick.parcels.1}"], ["tool", "--", "-rf"]),
])
def test_an_input_placeholder_renders_the_value_at_its_path_as_one_argument(template, expected):
    assert render_argv(template, {"ref": "R-1"}, inputs=INPUTS) == expected


@pytest.mark.parametrize(("template", "message"), [
    (["tool", "{inputs.ghost.items}"], "{inputs.ghost.items} has no value: the step's inputs has no 'ghost'"),
    (["tool", "{inputs.pick.parcels.5}"], "{inputs.pick.parcels.5} has no value: inputs.pick.parcels has no '5'"),
    (["tool", "{inputs.pick.items.x}"], "{inputs.pick.items.x} has no value: inputs.pick.items has no 'x'"),
])
def test_a_missing_input_is_refused_naming_the_path(template, message):
    with pytest.raises(ValueError) as refused:
        render_argv(template, {}, inputs=INPUTS)
    assert message in str(refused.value)


def test_an_input_starting_with_a_dash_never_becomes_an_option_even_if_listed_in_option_params():
    with pytest.raises(OptionInjection, match=r"\{inputs.pick.parcels.1\} is '-rf', which starts with '-'"):
        render_argv(["tool", "{inputs.pick.parcels.1}"], {}, inputs=INPUTS,
                    option_params=["inputs.pick.parcels.1"])


def test_an_input_never_chooses_the_program():
    with pytest.raises(ValueError, match="argv\\[0\\]"):
        render_argv(["{inputs.pick.parcels.0}"], {}, inputs=INPUTS)


@pytest.mark.parametrize("field", ["{inputs.pick[0]}", "{inputs.pick.items!r}", "{inputs.pick:>9}",
                                   "{inputs..pick}", "{inputs.pick.__class__x.y z}"])
def test_anything_but_a_plain_inputs_path_is_refused(field):
    with pytest.raises(ValueError):
        argv_fields(field)


TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
SCALAR = st.none() | st.booleans() | st.integers() | TEXT


@given(value=SCALAR, prefix=st.sampled_from(["", "x=", "--opt="]), separated=st.booleans())
def test_generated_input_values_stay_one_argument_and_a_leading_dash_is_refused_before_a_separator(
        value, prefix, separated):
    template = ["tool", *(["--"] if separated else []), prefix + "{inputs.pick.v}"]
    text = "" if value is None else str(value)
    leading_dash = not prefix and text.startswith("-")
    if leading_dash and not separated:
        with pytest.raises(OptionInjection):
            render_argv(template, {}, inputs={"pick": {"v": value}})
        return
    argv = render_argv(template, {}, inputs={"pick": {"v": value}})
    assert argv == ["tool", *(["--"] if separated else []), prefix + text], "one argument, the value verbatim"


@given(parcels=st.lists(TEXT, min_size=1, max_size=4), index=st.integers(0, 5))
def test_generated_list_indexes_pick_the_element_or_are_refused(parcels, index):
    template = ["tool", "--", "{inputs.pick.parcels.%d}" % index]
    if index >= len(parcels):
        with pytest.raises(ValueError, match="has no value"):
            render_argv(template, {}, inputs={"pick": {"parcels": parcels}})
    else:
        assert render_argv(template, {}, inputs={"pick": {"parcels": parcels}})[-1] == parcels[index]


class _Service:
    key = "label"
    executor = "command"
    params_schema = {"type": "object", "properties": {"ref": {"type": "string"}}}
    cpu_weight, timeout_seconds, max_attempts = 1, 30, 1
    backoff_base_seconds = backoff_cap_seconds = None
    priority_adjust_during: dict = {}
    block_during: list = []
    rate_period_seconds, rate_limit, rate_key_limit, concurrency_key_limit = 1, 0, 0, 0
    rate_key = concurrency_key = ""

    def __init__(self, argv: list[str]) -> None:
        self.executor_config = {"argv": argv}


def test_a_service_may_use_input_placeholders_without_declaring_them_as_params():
    assert service_problems(_Service([sys.executable, "{ref}", "{inputs.pick.items}"])) == []


@pytest.mark.django_db
@pytest.mark.parametrize(("argv", "step", "expected"), [
    (["python3", "{inputs.ghost.n}"], {}, "step 'label': argv placeholder {inputs.ghost.n} of service 'cmd-in' reads"
                                          " 'ghost', which is not among the step's inputs (['pick'])"),
    (["python3", "{inputs.item}"], {}, "reads 'item', which is not among the step's inputs"),
])
def test_a_step_whose_argv_reads_a_step_it_does_not_depend_on_is_a_definition_error(make_service, argv, step,
                                                                                     expected):
    make_service("py-pick")
    make_service("cmd-in", executor="command", executor_config={"argv": argv})
    with pytest.raises(DefinitionError) as caught:
        create_workflow(name="bad-argv", steps=[{"key": "pick", "service": "py-pick"},
                                                {"key": "label", "service": "cmd-in", "depends_on": ["pick"], **step}])
    assert expected in "\n".join(str(p) for p in caught.value.problems)


@pytest.mark.django_db
def test_a_fan_out_step_may_read_its_item_in_argv(make_service):
    make_service("py-pick")
    make_service("cmd-in", executor="command", executor_config={"argv": ["python3", "--", "{inputs.item}"]})
    create_workflow(name="ok-argv", steps=[
        {"key": "pick", "service": "py-pick"},
        {"key": "label", "service": "cmd-in", "depends_on": ["pick"], "fan_out": {"over": "$.pick.parcels"}}])
