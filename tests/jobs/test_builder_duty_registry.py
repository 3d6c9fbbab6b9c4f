"""The builder takes the fleet's duties from its registry: nodes registers them, the builder imports no nodes."""

from __future__ import annotations

import ast
from pathlib import Path

from django.db import connection

from jobs.builder import Builder
from jobs.duties import all_duties, registered_duties
from nodes.api import register_node
from nodes.models import Node

ROOT = Path(__file__).resolve().parents[2]


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_builder_and_its_duties_import_nothing_from_nodes():
    files = [ROOT / "jobs" / "builder.py", *sorted((ROOT / "jobs" / "duties").glob("*.py"))]
    reaching = {str(f.relative_to(ROOT)): sorted(m for m in _imported_modules(f) if m.split(".")[0] == "nodes")
                for f in files}
    assert not {f: m for f, m in reaching.items() if m}, reaching


def test_the_nodes_app_registers_its_presence_and_wake_duties_at_start():
    assert {d.name for d in registered_duties()} >= {"mark_lost_nodes", "wake_nodes"}
    names = [d.name for d in all_duties(batch=100)]
    assert names[0] == "rescue_expired_leases", "rescue still runs first"
    assert {"mark_lost_nodes", "wake_nodes"} <= set(names)


def test_a_builder_tick_runs_the_registered_presence_duty(transactional_db):
    register_node("silent", labels={}, services=[], agent_id="h:1:a")
    with connection.cursor() as cur:  # ten minutes of silence on PostgreSQL's clock
        cur.execute("UPDATE accs_node SET last_seen = now() - interval '10 minutes' WHERE name = 'silent'")
    builder = Builder(once=True, duties=registered_duties())
    try:
        builder.tick()
        assert builder.is_leader, "only the leader runs duties"
    finally:
        builder._drop_session("test over")
    assert Node.objects.get(name="silent").presence == "lost"
