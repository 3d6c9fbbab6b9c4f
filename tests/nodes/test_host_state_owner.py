"""A host's quarantine has one owner: nodes.quarantine sets and clears it; jobs reaches it through a callback."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APPS = ("accs_site", "events", "workflows", "jobs", "nodes", "ops")


def _sources():
    for app in APPS:
        for path in (ROOT / app).rglob("*.py"):
            if "migrations" not in path.parts:
                yield path


def test_only_nodes_quarantine_writes_a_hosts_quarantine():
    writers = {str(p.relative_to(ROOT)) for p in _sources()
               if re.search(r"UPDATE\s+accs_host\b[^;]*quarantine", p.read_text(), re.S | re.I)}
    assert writers == {"nodes/quarantine.py"}


def test_jobs_imports_nothing_of_nodes_but_its_models():
    bad = []
    for path in (ROOT / "jobs").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names
                    if (n == "nodes" or n.startswith("nodes.")) and n != "nodes.models"]
    assert bad == []


def test_the_nodes_app_registers_its_quarantine_with_the_failure_path():
    from jobs.failure import apply
    from nodes.quarantine import quarantine_hosts

    assert apply._host_quarantine is quarantine_hosts
