"""The migration lint: the SQL each ACCS migration runs, checked by squawk and a few rules of our own.

The SQL is what ``migrate`` really executes on an empty database, migration by migration
(``python -m tests.migration_lint OUT.json`` with ``ACC_DB_URL`` naming a scratch database):
``RunSQL`` and the server functions included, and the statements Django only decides by looking
at the schema (an index dropped by an ``AlterField``), which ``sqlmigrate`` on an empty or fully
migrated database does not show.

Each finding is ``(app, migration, rule)``. squawk's rules (https://squawkhq.com/docs/rules) catch
what takes strong locks or breaks the previous release's code: an index built or dropped without
CONCURRENTLY, a constraint added without NOT VALID, NOT NULL without a default, a column or table
dropped or renamed, a column's type changed. Ours add what squawk does not know: an ACCESS
EXCLUSIVE lock on the hot tables, a NOT NULL column whose default is dropped (the previous
release's INSERTs leave it out and fail), and an atomic migration that alters two existing tables
(it holds the first table's lock while it waits for the second's, and deadlocks with a daemon that
locks them in the other order: the upgrade drill met it; one statement per transaction avoids it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import sqlparse

ACCS_APPS = ("tenants", "events", "workflows", "jobs", "nodes", "ops", "accs_site")
HOT_TABLES = ("accs_job", "accs_task", "accs_event", "accs_attempt")

# squawk's rules that match ours; the style rules (prefer bigint, text, timestamptz...) are left out.
SQUAWK_RULES = (
    "require-concurrent-index-creation",
    "require-concurrent-index-deletion",
    "constraint-missing-not-valid",
    "adding-foreign-key-constraint",
    "disallowed-unique-constraint",
    "adding-required-field",
    "adding-not-nullable-field",
    "adding-field-with-default",
    "adding-primary-key-constraint",
    "adding-serial-primary-key-field",
    "changing-column-type",
    "ban-drop-column",
    "ban-drop-table",
    "ban-drop-not-null",
    "renaming-column",
    "renaming-table",
    "ban-truncate-cascade",
)
HOT_LOCK = "access-exclusive-on-hot-table"
DROPPED_DEFAULT = "not-null-default-dropped"
TWO_TABLES = "atomic-alters-two-tables"

# ALTER TABLE actions that take less than ACCESS EXCLUSIVE (PostgreSQL's ALTER TABLE page): SHARE UPDATE
# EXCLUSIVE for validating, statistics, storage parameters and clustering marks; SHARE ROW EXCLUSIVE
# for a foreign key and triggers (squawk's rules judge the foreign key's scan).
_WEAKER_ALTER = re.compile(
    r"^(VALIDATE CONSTRAINT|ALTER COLUMN \S+ SET STATISTICS|ALTER COLUMN \S+ SET \(|ALTER COLUMN \S+ RESET \("
    r"|SET \(|RESET \(|SET WITHOUT CLUSTER|CLUSTER ON|ENABLE TRIGGER|DISABLE TRIGGER"
    r"|ADD CONSTRAINT \S+ FOREIGN KEY )",
    re.IGNORECASE | re.DOTALL)
_HOT = "|".join(HOT_TABLES)
_ALTER_HOT = re.compile(rf'^ALTER TABLE\s+(?:ONLY\s+)?(?:IF EXISTS\s+)?"?({_HOT})"?\s+(.*)$',
                        re.IGNORECASE | re.DOTALL)
_ALTER_ANY = re.compile(r'^ALTER TABLE\s+(?:ONLY\s+)?(?:IF EXISTS\s+)?"?(\w+)"?\s+(.*)$', re.IGNORECASE | re.DOTALL)
_STRONG_HOT = re.compile(
    rf'^(?:LOCK\s+(?:TABLE\s+)?(?:ONLY\s+)?"?({_HOT})\b"?(?!.*\bIN\b(?!.*ACCESS EXCLUSIVE))'
    rf'|TRUNCATE\s+(?:TABLE\s+)?(?:ONLY\s+)?"?({_HOT})"?\b|DROP TABLE\s+(?:IF EXISTS\s+)?"?({_HOT})"?\b'
    rf'|VACUUM\s+\(?FULL.*"?({_HOT})"?\b|CLUSTER\s+"?({_HOT})"?\b|REINDEX\s+TABLE\s+"?({_HOT})"?\b)',
    re.IGNORECASE | re.DOTALL)
_ADD_NOT_NULL = re.compile(r'^ALTER TABLE\s+"?(\w+)"?\s+ADD COLUMN\s+"?(\w+)"?\s[^;]*\bNOT NULL', re.IGNORECASE)
_SET_NOT_NULL = re.compile(r'^ALTER TABLE\s+"?(\w+)"?\s+ALTER COLUMN\s+"?(\w+)"?\s+SET NOT NULL', re.IGNORECASE)
_DROP_DEFAULT = re.compile(r'^ALTER TABLE\s+"?(\w+)"?\s+ALTER COLUMN\s+"?(\w+)"?\s+DROP DEFAULT', re.IGNORECASE)
# A plain DROP INDEX takes ACCESS EXCLUSIVE on the index's table (CONCURRENTLY does not).
_DROP_INDEX = re.compile(r'DROP INDEX\s+(?!CONCURRENTLY)(?:IF EXISTS\s+)?"?(\w+)"?', re.IGNORECASE)
_CREATE_TABLE = re.compile(r'^CREATE TABLE\s+(?:IF NOT EXISTS\s+)?"?(\w+)"?', re.IGNORECASE)


@dataclass(frozen=True, order=True)
class Finding:
    """A rule one migration breaks, with the statement that breaks it."""

    app: str
    migration: str
    rule: str
    statement: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return self.app, self.migration, self.rule

    def __str__(self) -> str:
        return f"{self.app}.{self.migration}: {self.rule}: {self.statement[:200]}"


# --------------------------------------------------------------------------------------------
# Capturing what migrate runs (in a subprocess, on a scratch database)
# --------------------------------------------------------------------------------------------

def capture(out: Path) -> None:
    """Migrate the (empty) database and write ``[{app, name, atomic, statements}]`` of ACCS's migrations."""
    import os

    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
    django.setup()
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    current: dict = {}
    captured: list[dict] = []

    def progress(action: str, migration=None, fake: bool = False) -> None:
        if action == "apply_start" and migration.app_label in ACCS_APPS:
            current.update(app=migration.app_label, name=migration.name, atomic=migration.atomic, statements=[],
                           index_tables={})
        elif action == "apply_success" and current:
            captured.append(dict(current))
            current.clear()

    def record(execute, sql, params, many, context):
        if current and _changes_something(sql):
            text = connection.ops.compose_sql(sql, params) if params and not many else sql
            current["statements"].append(text.strip().rstrip(";"))
            for index in _DROP_INDEX.findall(" ".join(text.split())):
                # The SQL does not say whose index it is; the catalog does, before it goes.
                with connection.cursor() as cur:
                    cur.execute("SELECT indrelid::regclass::text FROM pg_index WHERE indexrelid = to_regclass(%s)",
                                [f'"{index}"'])
                    row = cur.fetchone()
                if row:
                    current["index_tables"][index] = row[0].strip('"')
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        executor = MigrationExecutor(connection, progress)
        executor.migrate(executor.loader.graph.leaf_nodes())
    out.write_text(json.dumps(captured))


def _changes_something(sql: str) -> bool:
    """Leave out the schema editor's introspection and Django's bookkeeping."""
    head = sql.lstrip().upper()
    return not (head.startswith(("SELECT", "SAVEPOINT", "RELEASE SAVEPOINT", "ROLLBACK TO SAVEPOINT", "SHOW"))
                or '"DJANGO_MIGRATIONS"' in head[:60] or "DJANGO_MIGRATIONS" in head[:40])


def captured_migrations(*, db_url: str, python: str = sys.executable, cwd: Path) -> list[dict]:
    """Run :func:`capture` in a fresh process against ``db_url`` and return what it wrote."""
    import os

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sql.json"
        env = {**os.environ, "ACC_DB_URL": db_url, "PYTHONPATH": str(cwd)}
        done = subprocess.run([python, "-m", "tests.migration_lint", str(out)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(out.read_text())


# --------------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------------

def squawk_findings(migrations: Iterable[dict]) -> list[Finding]:
    """Run squawk over each migration's SQL (in its transaction when the migration is atomic).

    squawk runs every rule it has; the findings of :data:`SQUAWK_RULES` are kept.
    """
    squawk = shutil.which("squawk") or str(Path(sys.executable).parent / "squawk")
    found: list[Finding] = []
    with tempfile.TemporaryDirectory() as tmp:
        files: dict[str, tuple[str, str]] = {}
        for m in migrations:
            if not m["statements"]:
                continue
            body = ";\n".join(m["statements"]) + ";\n"
            path = Path(tmp) / f"{m['app']}.{m['name']}.sql"
            path.write_text(f"BEGIN;\n{body}COMMIT;\n" if m["atomic"] else body)
            files[str(path)] = (m["app"], m["name"])
        if not files:
            return []
        done = subprocess.run([squawk, "--reporter", "json", "--pg-version", "15", *files],
                              capture_output=True, text=True, timeout=300)
        if done.returncode not in (0, 1):
            raise RuntimeError(f"squawk failed ({done.returncode}): {done.stderr[-2000:]}")
        for v in json.loads(done.stdout or "[]"):
            app, name = files[v["file"]]
            if v["rule_name"] == "syntax-error":
                raise RuntimeError(f"squawk cannot parse {app}.{name}: {v.get('message')}")
            if v["rule_name"] in SQUAWK_RULES:
                found.append(Finding(app, name, v["rule_name"], _statement_at(Path(v["file"]), v)))
    return found


def _statement_at(path: Path, violation: dict) -> str:
    lines = path.read_text().splitlines()
    line = int(violation.get("line", 0) or 0)
    return lines[line].strip() if 0 <= line < len(lines) else violation.get("message", "")


def own_findings(migrations: Iterable[dict]) -> list[Finding]:
    """The rules squawk lacks: ACCESS EXCLUSIVE on a hot table; a NOT NULL column losing its default;
    an atomic migration altering two tables that existed before it."""
    found: list[Finding] = []
    for m in migrations:
        created: set[str] = set()
        not_null: set[tuple[str, str]] = set()
        altered: list[str] = []
        for statement in (part for text in m["statements"] for part in sqlparse.split(text)):
            flat = " ".join(statement.split()).rstrip(";")
            if table := _CREATE_TABLE.match(flat):
                created.add(table.group(1))
            if (other := _ALTER_ANY.match(flat)) and other.group(1) not in created \
                    and not _WEAKER_ALTER.match(other.group(2)) and other.group(1) not in altered:
                altered.append(other.group(1))
                if m["atomic"] and len(altered) == 2:
                    found.append(Finding(m["app"], m["name"], TWO_TABLES, flat))
            alter = _ALTER_HOT.match(flat)
            if alter and alter.group(1) in created:
                continue  # a table this migration creates: no daemon uses it yet
            dropped = _DROP_INDEX.match(flat)
            if ((alter and not _WEAKER_ALTER.match(alter.group(2))) or _STRONG_HOT.match(flat)
                    or (dropped and m.get("index_tables", {}).get(dropped.group(1)) in HOT_TABLES)):
                found.append(Finding(m["app"], m["name"], HOT_LOCK, flat))
            for pattern in (_ADD_NOT_NULL, _SET_NOT_NULL):
                if (column := pattern.match(flat)) and column.group(1) not in created:
                    not_null.add((column.group(1), column.group(2)))
            if (column := _DROP_DEFAULT.match(flat)) and (column.group(1), column.group(2)) in not_null:
                found.append(Finding(m["app"], m["name"], DROPPED_DEFAULT, flat))
    return found


def lint(migrations: list[dict]) -> list[Finding]:
    """Return every finding, one per migration and rule (the first statement that breaks it)."""
    first: dict[tuple[str, str, str], Finding] = {}
    for finding in sorted([*squawk_findings(migrations), *own_findings(migrations)]):
        first.setdefault(finding.key, finding)
    return list(first.values())


if __name__ == "__main__":
    capture(Path(sys.argv[1]))
