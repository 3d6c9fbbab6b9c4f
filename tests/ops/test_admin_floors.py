"""The admins do not reach up: the lower apps' admins import nothing from ``ops``, and the pages ops adds
are the registered ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from django.contrib import admin

from jobs.models import Job, Task
from nodes.models import Node

ROOT = Path(__file__).resolve().parents[2]


def _imported(relative: str) -> set[str]:
    """Return the modules a file imports, and each one's app (its first name)."""
    tree = ast.parse((ROOT / relative).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names | {name.split(".")[0] for name in names}


@pytest.mark.parametrize(("module", "above"), [
    # Its action results are its own now; tenants and scoping move down with the tenancy app.
    ("accs_site/admin_kit.py", {"workflows", "jobs.transitions", "jobs.verbs", "nodes", "ops"}),
    ("workflows/admin.py", {"jobs", "nodes", "ops"}),
    ("jobs/admin.py", {"nodes", "ops"}),
    ("nodes/admin.py", {"ops"}),
])
def test_an_admin_imports_nothing_from_the_floors_above_it(module, above):
    assert not _imported(module) & above


def test_the_job_task_and_node_pages_are_the_ones_ops_registers():
    from ops.admin import JobPageAdmin, NodePageAdmin, TaskPageAdmin

    assert type(admin.site._registry[Job]) is JobPageAdmin
    assert type(admin.site._registry[Task]) is TaskPageAdmin
    assert type(admin.site._registry[Node]) is NodePageAdmin
