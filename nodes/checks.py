"""A database check: daemons of another release still run (a rolling upgrade not finished).

Tagged ``database``, so it runs where Django runs the database checks (``migrate``,
``check --database default``), never in the web unit's ``check --deploy`` before gunicorn starts:
during a rolling upgrade old agents are expected, and the new web must start beside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core.checks import Tags, Warning, register
from django.db import DatabaseError

from accs_site.version import VERSION
from nodes.releases import other_release_daemons


@register(Tags.database)
def check_other_releases(app_configs: Sequence[AppConfig] | None = None, databases: Sequence[str] | None = None,
                         **kwargs: Any) -> list[Warning]:
    """Warn, naming them, while agents or the leading builder of another release run."""
    if not databases or "default" not in databases:
        return []
    try:
        others = other_release_daemons()
    except DatabaseError:
        return []  # not migrated yet: migrate reports it
    if not others:
        return []
    return [Warning(f"{len(others)} daemon(s) of another release than this code's ({VERSION}) still run: "
                    + ", ".join(str(d) for d in others),
                    hint="Finish the upgrade: restart each of them on this release (docs/deploy.md, Upgrading).",
                    id="accs.W040")]
