"""Compare two workflow versions' steps, step by step, for the workflow page ("what changed")."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepChange:
    """One step that differs between two versions: added, removed or changed (with its fields)."""

    key: str
    change: str  # "added", "removed" or "changed"
    fields: list[tuple[str, str, str]] = field(default_factory=list)  # (field, before, after)


def _show(value: Any) -> str:
    return "—" if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False)


def _by_key(steps: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(steps, list):
        return {}
    return {str(s.get("key")): s for s in steps if isinstance(s, dict)}


def steps_diff(before: Any, after: Any) -> list[StepChange]:
    """Return how ``after``'s steps differ from ``before``'s, in ``after``'s order, removed steps last.

    Steps are matched by key, so a reordered list with the same steps shows no change.
    """
    old, new = _by_key(before), _by_key(after)
    changes: list[StepChange] = []
    for key, step in new.items():
        if key not in old:
            changes.append(StepChange(key, "added", [(name, "—", _show(v)) for name, v in sorted(step.items())]))
            continue
        prior = old[key]
        fields = [(name, _show(prior.get(name)), _show(step.get(name)))
                  for name in sorted(set(prior) | set(step)) if prior.get(name) != step.get(name)]
        if fields:
            changes.append(StepChange(key, "changed", fields))
    changes += [StepChange(key, "removed") for key in old if key not in new]
    return changes
