"""Payload templates: placeholders checked when a trigger is saved and filled when it fires.

``{{event.<path>}}`` (event triggers), ``{{schedule.due_at|due_local|timezone|cron|runs_covered}}``
(schedule triggers), and ``{{trigger.id|label|event_name}}``, ``{{tenant.id|slug|name}}`` (both). A
string that is exactly one placeholder takes the value's JSON type; placeholders inside a longer
string are replaced by text.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from typing import Any

from jobs.models import TriggerType
from workflows.validation import Problem

PLACEHOLDER_RE = re.compile(r"\{\{(.*?)\}\}")
ONLY_PLACEHOLDER_RE = re.compile(r"^\{\{(.*?)\}\}$")
PATH_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_-]+)*$")
# Per trigger type: namespace -> the names it holds (None: any path, the event's own payload).
TEMPLATE_NAMESPACES: dict[str, dict[str, set[str] | None]] = {
    TriggerType.EVENT: {"event": None, "trigger": {"id", "label", "event_name"}, "tenant": {"id", "slug", "name"}},
    TriggerType.SCHEDULE: {
        "schedule": {"due_at", "due_local", "timezone", "cron", "runs_covered"},
        "trigger": {"id", "label", "event_name"}, "tenant": {"id", "slug", "name"},
    },
}
MAX_TEMPLATE_DEPTH = 20


class TemplateError(ValueError):
    """A placeholder cannot be filled; ``where`` is the template path, ``placeholder`` the missing name."""

    def __init__(self, where: str, placeholder: str, reason: str) -> None:
        self.where = where
        self.placeholder = placeholder
        super().__init__(f"payload_template.{where}: {{{{{placeholder}}}}} {reason}")


def _walk(template: Any, where: str = "", depth: int = 0) -> Iterator[tuple[str, str]]:
    """Yield (where, string) for every string value of a JSON template."""
    if depth > MAX_TEMPLATE_DEPTH:
        raise TemplateError(where or "(root)", "", f"nests deeper than {MAX_TEMPLATE_DEPTH} levels")
    if isinstance(template, str):
        yield where or "(root)", template
    elif isinstance(template, dict):
        for key, value in template.items():
            yield from _walk(value, f"{where}.{key}" if where else str(key), depth + 1)
    elif isinstance(template, list):
        for index, value in enumerate(template):
            yield from _walk(value, f"{where}[{index}]", depth + 1)


def template_problems(template: Any, *, trigger_type: str) -> list[Problem]:
    """Return every syntax problem of a payload template (unbalanced braces, unknown namespaces)."""
    if not isinstance(template, dict):
        return [Problem("payload_template", "must be a JSON object")]
    namespaces = TEMPLATE_NAMESPACES.get(trigger_type, {})
    problems: list[Problem] = []
    try:
        strings = list(_walk(template))
    except TemplateError as exc:
        return [Problem(f"payload_template.{exc.where}", str(exc).split(": ", 1)[-1])]
    for where, text in strings:
        name = f"payload_template.{where}"
        leftover = PLACEHOLDER_RE.sub("", text)
        if "{{" in leftover or "}}" in leftover:
            problems.append(Problem(name, "unbalanced '{{' or '}}'"))
        for raw in PLACEHOLDER_RE.findall(text):
            path = raw.strip()
            if not PATH_RE.match(path):
                problems.append(Problem(name, f"{{{{{raw}}}}} is not a dotted name such as {{{{event.provider_id}}}}"))
                continue
            root, _, rest = path.partition(".")
            if root not in namespaces:
                problems.append(Problem(name, f"{{{{{path}}}}}: unknown namespace {root!r}; use one of "
                                              f"{sorted(namespaces)} in a {trigger_type} trigger"))
            elif not rest:
                problems.append(Problem(name, f"{{{{{path}}}}} names a namespace, not a value"))
            elif (names := namespaces[root]) is not None and rest.split(".")[0] not in names:
                problems.append(Problem(name, f"{{{{{path}}}}}: {root} has only {sorted(names)}"))
    return problems


def _lookup(context: dict[str, Any], path: str, where: str) -> Any:
    value: Any = context
    walked: list[str] = []
    for part in path.split("."):
        walked.append(part)
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise TemplateError(where, path, f"is missing: the context has no {'.'.join(walked)!r}")
    return value


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def render(template: Any, context: dict[str, Any], *, where: str = "") -> Any:
    """Render a JSON template from ``context``; raise TemplateError naming the first missing value."""
    if isinstance(template, str):
        here = where or "(root)"
        only = ONLY_PLACEHOLDER_RE.match(template)
        if only and "{{" not in only.group(1):
            return _lookup(context, only.group(1).strip(), here)
        return PLACEHOLDER_RE.sub(lambda m: _as_text(_lookup(context, m.group(1).strip(), here)), template)
    if isinstance(template, dict):
        return {k: render(v, context, where=f"{where}.{k}" if where else str(k)) for k, v in template.items()}
    if isinstance(template, list):
        return [render(v, context, where=f"{where}[{i}]") for i, v in enumerate(template)]
    return template


def payload_digest(payload: Any) -> str:
    """Return a stable SHA-256 of a rendered payload (the dedupe identity of an event firing)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()
