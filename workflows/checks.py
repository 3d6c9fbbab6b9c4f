"""A deploy check: the services and workflows in code match the database (``manage.py accs_sync``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core.checks import Warning, register
from django.db import DatabaseError

from workflows.code import app_modules, discover
from workflows.sync import plan
from workflows.validation import DefinitionError


@register("accs", deploy=True)
def check_code_definitions(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[Warning]:
    """Warn (under ``check --deploy``) when the definitions in code and the database differ."""
    modules = app_modules()
    if not modules:
        return []
    try:
        planned = plan(discover(modules))
    except DefinitionError as exc:
        return [Warning(f"the definitions in code are invalid: {exc.problems[0]}"
                        + (f" (and {len(exc.problems) - 1} more)" if len(exc.problems) > 1 else ""),
                        hint="Run manage.py accs_sync --plan to see every problem.", id="accs.W030")]
    except DatabaseError:
        return []  # no database to compare with (a build step): accs_sync --check reports it where there is one
    if not planned.changes:
        return []
    shown = "; ".join(str(a) for a in planned.changes[:3])
    return [Warning(f"the services and workflows in code differ from the database ({len(planned.changes)} change(s):"
                    f" {shown}{' ...' if len(planned.changes) > 3 else ''})",
                    hint="Run manage.py accs_sync on deploy (accs_sync --check in CI).", id="accs.W030")]
