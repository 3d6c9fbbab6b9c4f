"""Every ACCS migration is safe under the previous release's running daemons, or reviewed here.

The lint (:mod:`tests.migration_lint`: squawk over the SQL ``migrate`` really runs, plus two rules of
ours) fails on an index built or dropped without CONCURRENTLY, an ACCESS EXCLUSIVE lock on
accs_job, accs_task, accs_event or accs_attempt, NOT NULL without a default on a table old code
writes, a column or table dropped or renamed, a constraint added without NOT VALID, an atomic
migration altering two existing tables (a deadlock with a daemon locking them in the other order). A migration
that must break a rule is listed in :data:`REVIEWED` with why it is safe, or what the CHANGELOG
tells operators about it; an entry that no longer matches a finding fails too, so the list stays true.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from hypothesis import given, strategies as st

from tests import migration_lint
from tests.daemons import ROOT
from tests.migration_lint import DROPPED_DEFAULT, HOT_LOCK, HOT_TABLES, TWO_TABLES, Finding, lint, own_findings

# Applied on every site that runs a release already; they run only on an empty database, where no
# daemon runs. Kept here because they break the rules as written today.
SHIPPED = "shipped in 0.1.0: every running site applied it before; it runs only on an empty database"

REVIEWED: dict[tuple[str, str, str], str] = {
    **{("jobs", migration, rule): SHIPPED for migration, rules in {
        "0002_attempt_task_index_covered_by_unique": (HOT_LOCK, "adding-foreign-key-constraint",
                                                      "constraint-missing-not-valid",
                                                      "require-concurrent-index-deletion"),
        "0003_job_steps_partial_interrupted": (HOT_LOCK, "adding-foreign-key-constraint", "adding-required-field",
                                               "constraint-missing-not-valid", TWO_TABLES),
        "0004_scheduled_retries_and_claim_indexes": (HOT_LOCK, "constraint-missing-not-valid",
                                                     "require-concurrent-index-creation",
                                                     "require-concurrent-index-deletion"),
        "0006_job_waiting_status": (HOT_LOCK, "constraint-missing-not-valid", "require-concurrent-index-creation",
                                    "require-concurrent-index-deletion"),
        "0007_step_failure_policy": ("constraint-missing-not-valid",),
        "0008_retention": ("require-concurrent-index-creation",),
        "0009_redrive": ("require-concurrent-index-creation",),
    }.items() for rule in rules},
    ("nodes", "0002_node_presence", "constraint-missing-not-valid"): SHIPPED,
    ("nodes", "0002_node_presence", DROPPED_DEFAULT): SHIPPED,
    ("workflows", "0002_flow_control", "constraint-missing-not-valid"): SHIPPED,
    ("workflows", "0002_flow_control", DROPPED_DEFAULT): SHIPPED,
    # New in 0.2.0: they run during the upgrade, under the previous release's daemons.
    ("jobs", "0011_token_scopes", DROPPED_DEFAULT):
        "NOT safe alone: from 0011 until tenants.0002_token_scopes_db_default (the same migrate run) the previous "
        "release's token creation fails on scopes NOT NULL; tenants.0002 gives scopes a database default",
    ("jobs", "0013_tenant_fairness", HOT_LOCK):
        "NOT safe: DROP INDEX task_claim_idx holds ACCESS EXCLUSIVE on accs_task until the migration commits, "
        "through the rebuild of the index over the whole table (history included): claims and reports wait. "
        "CHANGELOG 0.2.0 names it (to be corrected: it grows with accs_task, not the queue)",
    ("jobs", "0013_tenant_fairness", "require-concurrent-index-deletion"):
        "NOT safe: the same DROP INDEX task_claim_idx (see the access-exclusive entry)",
    ("jobs", "0013_tenant_fairness", "require-concurrent-index-creation"):
        "NOT safe: task_claim_idx is rebuilt without CONCURRENTLY on accs_task (and event_receipt_created_idx on "
        "accs_event_receipt): writes wait for the build; CHANGELOG 0.2.0 names it",
    ("jobs", "0013_tenant_fairness", "constraint-missing-not-valid"):
        "safe: the CHECK tenant_priority_band_valid scans accs_tenant (one row per tenant) in milliseconds",
    ("jobs", "0013_tenant_fairness", "adding-field-with-default"):
        "safe: a constant default (-1000) on accs_tenant is a catalog change since PostgreSQL 11, no rewrite",
    ("jobs", "0017_cockpit_scale", "require-concurrent-index-creation"):
        "NOT safe: task_dead_letter_count_idx is built without CONCURRENTLY, holding SHARE on accs_task while it "
        "reads the whole table: claims and reports wait for the build (not yet in the CHANGELOG)",
    ("jobs", "0022_lean_indexes", HOT_LOCK):
        "NOT safe: AlterField(db_index=False) on Job.service and Job.workflow drops and re-adds their foreign keys "
        "(ACCESS EXCLUSIVE on accs_job for the drop) and drops their indexes without CONCURRENTLY (ACCESS "
        "EXCLUSIVE on accs_job); the migration is non-atomic, so each lock ends with its statement "
        "(not yet in the CHANGELOG)",
    ("jobs", "0022_lean_indexes", "require-concurrent-index-deletion"):
        "NOT safe: the foreign keys' indexes are dropped without CONCURRENTLY (see the access-exclusive entry)",
    ("jobs", "0022_lean_indexes", "adding-foreign-key-constraint"):
        "NOT safe: the re-added foreign keys are validated over every job under SHARE ROW EXCLUSIVE on accs_job, "
        "accs_service and accs_workflow: job inserts and updates wait for the scan",
    ("jobs", "0022_lean_indexes", "constraint-missing-not-valid"):
        "NOT safe: the same re-added foreign keys, validated at once rather than NOT VALID then VALIDATE",
    ("jobs", "0026_approval_principals", HOT_LOCK):
        "safe: ADD COLUMN approval_barred (nullable, no default) on accs_job changes the catalog only; ACCESS "
        "EXCLUSIVE is held for milliseconds once granted (it queues behind a long transaction on accs_job)",
    ("jobs", "0026_approval_principals", "adding-foreign-key-constraint"):
        "safe: the new column accs_trigger.updated_by is NULL in every row, so its foreign key validates at once",
    ("jobs", "0038_attempt_task_refs", HOT_LOCK):
        "safe: ADD COLUMN service_id and tenant_id (nullable, no default, no foreign key) on accs_attempt change "
        "the catalog only, each in its own transaction; ACCESS EXCLUSIVE is held for milliseconds once granted "
        "(the wait bounded by accs_site.migrate_locks)",
    ("jobs", "0039_limit_keys", HOT_LOCK):
        "safe: ADD COLUMN limit_key (nullable, no default) on accs_task changes the catalog only, under "
        "lock_timeout 5s so the migration fails rather than queue the daemons behind it",
    ("jobs", "0039_limit_keys", "require-concurrent-index-creation"):
        "safe: limit_key_head_emptied_idx is built on accs_limit_key_head, created empty by the same migration",
    ("jobs", "0040_attempt_claimable_at", HOT_LOCK):
        "safe: ADD COLUMN claimable_at (nullable, no default, no index) on accs_attempt changes the catalog only, "
        "in its own transaction; ACCESS EXCLUSIVE is held for milliseconds once granted (the wait bounded by "
        "accs_site.migrate_locks)",
    ("workflows", "0004_service_lease_seconds", "constraint-missing-not-valid"):
        "safe: the CHECK service_lease_at_least_3 scans accs_service (definitions, a few rows) in milliseconds",
}


@pytest.fixture(scope="module")
def scratch_db_url() -> Iterator[str]:
    """An empty database on the test server, for ``migrate`` to run on from the start."""
    url = urlsplit(os.environ["ACC_DB_URL"])
    name = f"accs_lint_{uuid.uuid4().hex[:10]}"
    admin = urlunsplit(url._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(url._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def captured(scratch_db_url) -> list[dict]:
    """What ``migrate`` ran for each ACCS migration, from an empty database to this code's schema."""
    return migration_lint.captured_migrations(db_url=scratch_db_url, cwd=ROOT)


@pytest.fixture(scope="module")
def findings(captured) -> list[Finding]:
    return lint(captured)


# The tests reading the capture run on one worker (make test), so ``migrate`` from an empty database
# runs once (about 20 s of CPU).
_ONE_CAPTURE = pytest.mark.xdist_group("migration-lint-capture")


@_ONE_CAPTURE
def test_every_migration_that_breaks_a_rule_is_reviewed(findings):
    unreviewed = [str(f) for f in findings if f.key not in REVIEWED]
    assert not unreviewed, (
        "these migrations would lock hot tables or break the previous release's running daemons:\n  "
        + "\n  ".join(unreviewed)
        + "\nmake them safe (CONCURRENTLY in a non-atomic migration, NOT VALID then VALIDATE, a db_default, "
          "expand now and contract a release later), or add a reviewed entry saying why it is safe or what "
          "the CHANGELOG says")


@_ONE_CAPTURE
def test_every_reviewed_entry_still_matches_a_finding(findings):
    found = {f.key for f in findings}
    assert not [key for key in REVIEWED if key not in found], "stale reviewed entries"


@_ONE_CAPTURE
def test_the_lint_reads_migrations_of_every_accs_app(captured):
    apps = {m["app"] for m in captured}
    assert {"tenants", "events", "workflows", "jobs", "nodes"} <= apps
    assert ("tenants", "0002_token_scopes_db_default") in {(m["app"], m["name"]) for m in captured}


# --------------------------------------------------------------------------------------------
# The lint itself catches each rule (and lets the safe forms through)
# --------------------------------------------------------------------------------------------

def _migration(*statements: str, atomic: bool = True, index_tables: dict[str, str] | None = None) -> dict:
    return {"app": "demo", "name": "0001_x", "atomic": atomic, "statements": list(statements),
            "index_tables": index_tables or {}}


UNSAFE = [
    ('CREATE INDEX "i" ON "accs_task" ("tenant_id")', "require-concurrent-index-creation"),
    ('DROP INDEX "i"', "require-concurrent-index-deletion"),
    ('ALTER TABLE "accs_job" ADD COLUMN "x" integer NOT NULL', "adding-required-field"),
    ('ALTER TABLE "accs_job" ALTER COLUMN "x" SET NOT NULL', "adding-not-nullable-field"),
    ('ALTER TABLE "accs_service" DROP COLUMN "x"', "ban-drop-column"),
    ('ALTER TABLE "accs_service" RENAME COLUMN "x" TO "y"', "renaming-column"),
    ('ALTER TABLE "accs_service" ADD CONSTRAINT "c" CHECK ("x" > 0)', "constraint-missing-not-valid"),
    ('ALTER TABLE "accs_service" ALTER COLUMN "x" TYPE bigint', "changing-column-type"),
]


@pytest.mark.parametrize(("statement", "rule"), UNSAFE)
def test_squawk_catches_each_unsafe_operation(statement, rule):
    assert rule in {f.rule for f in migration_lint.squawk_findings([_migration(statement)])}


def test_the_safe_forms_pass():
    safe = _migration('CREATE INDEX CONCURRENTLY "i" ON "accs_task" ("tenant_id")',
                      'DROP INDEX CONCURRENTLY "j"',
                      'ALTER TABLE "accs_service" ADD CONSTRAINT "c" CHECK ("x" > 0) NOT VALID',
                      'ALTER TABLE "accs_service" VALIDATE CONSTRAINT "c"', atomic=False)
    with_default = _migration('ALTER TABLE "accs_api_token" ALTER COLUMN "scopes" SET DEFAULT \'{read}\'')
    assert migration_lint.lint([safe, with_default]) == []


def test_a_not_null_column_losing_its_default_is_caught():
    dropped = _migration('ALTER TABLE "accs_api_token" ADD COLUMN "scopes" varchar(20)[] DEFAULT \'{read}\' NOT NULL',
                         'ALTER TABLE "accs_api_token" ALTER COLUMN "scopes" DROP DEFAULT')
    assert [f.rule for f in own_findings([dropped])] == [DROPPED_DEFAULT]
    new_table = _migration('CREATE TABLE "t" ("a" int)', 'ALTER TABLE "t" ADD COLUMN "b" int DEFAULT 1 NOT NULL',
                           'ALTER TABLE "t" ALTER COLUMN "b" DROP DEFAULT')
    assert own_findings([new_table]) == [], "no old code writes a table this migration creates"


def test_a_plain_drop_index_on_a_hot_table_is_an_access_exclusive_lock():
    statement = 'DROP INDEX IF EXISTS "task_claim_idx"'
    assert [f.rule for f in own_findings([_migration(statement, index_tables={"task_claim_idx": "accs_task"})])] \
        == [HOT_LOCK]
    assert own_findings([_migration(statement, index_tables={"task_claim_idx": "accs_node"})]) == []
    assert own_findings([_migration('DROP INDEX CONCURRENTLY "task_claim_idx"',
                                    index_tables={"task_claim_idx": "accs_task"})]) == []


# ALTER TABLE actions and whether they take ACCESS EXCLUSIVE (PostgreSQL's ALTER TABLE page).
ACTIONS = [
    ('ADD COLUMN "x" integer NULL', True),
    ('DROP CONSTRAINT "c"', True),
    ('ADD CONSTRAINT "c" CHECK ("x" > 0)', True),
    ('ALTER COLUMN "x" TYPE bigint', True),
    ('VALIDATE CONSTRAINT "c"', False),
    ('ADD CONSTRAINT "f" FOREIGN KEY ("x") REFERENCES "accs_service" ("id") NOT VALID', False),
    ("SET (fillfactor = 90)", False),
    ('ALTER COLUMN "x" SET STATISTICS 500', False),
]


@given(table=st.sampled_from([*HOT_TABLES, "accs_node", "accs_service", "accs_task_x", "accs_tenant"]),
       action=st.sampled_from(ACTIONS), only=st.booleans(), quoted=st.booleans())
def test_access_exclusive_is_flagged_exactly_on_hot_tables(table, action, only, quoted):
    text, strong = action
    name = f'"{table}"' if quoted else table
    statement = f"ALTER TABLE {'ONLY ' if only else ''}{name} {text}"
    flagged = [f for f in own_findings([_migration(statement)]) if f.rule == HOT_LOCK]
    assert bool(flagged) == (strong and table in HOT_TABLES), statement


@given(table=st.sampled_from(HOT_TABLES), mode=st.sampled_from(["", " IN ACCESS EXCLUSIVE MODE", " IN SHARE MODE",
                                                                  " IN ROW EXCLUSIVE MODE"]))
def test_an_explicit_lock_table_is_flagged_only_in_access_exclusive_mode(table, mode):
    flagged = own_findings([_migration(f"LOCK TABLE {table}{mode}")])
    assert bool(flagged) == (mode in ("", " IN ACCESS EXCLUSIVE MODE"))


@given(first=st.sampled_from(["accs_service", "accs_workflow", "accs_job", "accs_trigger"]),
       second=st.sampled_from(["accs_service", "accs_workflow", "accs_job", "accs_trigger"]),
       atomic=st.booleans(), second_is_weak=st.booleans(), first_is_new=st.booleans())
def test_an_atomic_migration_altering_two_existing_tables_is_caught(first, second, atomic, second_is_weak,
                                                                   first_is_new):
    statements = [*([f'CREATE TABLE "{first}" ("id" int)'] if first_is_new else []),
                  f'ALTER TABLE "{first}" ADD COLUMN "a" integer NULL',
                  f'ALTER TABLE "{second}" ' + ('VALIDATE CONSTRAINT "c"' if second_is_weak
                                               else 'ADD COLUMN "b" integer NULL')]
    flagged = [f for f in own_findings([_migration(*statements, atomic=atomic)]) if f.rule == TWO_TABLES]
    # One transaction holding one table's strong lock while it asks for another's is the deadlock's shape.
    assert bool(flagged) == (atomic and first != second and not second_is_weak and not first_is_new), statements


# --------------------------------------------------------------------------------------------
# The CHANGELOG says, for each migration the previous release lacks, whether it is safe under it
# --------------------------------------------------------------------------------------------

SAFE = re.compile(r"safe under the previous release(?:'s daemons)?:?\**:?\s*\**\s*(yes|no)\b", re.IGNORECASE)


def _new_migrations() -> list[str]:
    """``app.NNNN`` of the ACCS migration files this tree has and PREVIOUS_RELEASE (the Makefile's) lacks."""
    previous = re.search(r"^PREVIOUS_RELEASE \?= (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)
    then = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", previous], capture_output=True,
                          text=True, check=True).stdout.split()
    now = [str(p.relative_to(ROOT)) for app in migration_lint.ACCS_APPS
           for p in (ROOT / app / "migrations").glob("[0-9][0-9][0-9][0-9]_*.py")]
    return sorted(f"{Path(p).parts[0]}.{Path(p).stem[:4]}" for p in set(now) - set(then))


def _release_items() -> list[str]:
    """The bullet items (sub-items apart) of the CHANGELOG's newest release section."""
    text = (ROOT / "CHANGELOG.md").read_text()
    section = re.split(r"^## ", text, flags=re.MULTILINE)[1]
    return re.split(r"^\s*- ", section, flags=re.MULTILINE)[1:]


def test_the_changelog_says_for_each_new_migration_whether_it_is_safe_under_the_previous_release():
    new = _new_migrations()
    assert new, "this release has migrations the previous one lacks (else PREVIOUS_RELEASE is stale)"
    items = _release_items()
    unsaid = [m for m in new if not any(m in item and SAFE.search(item) for item in items)]
    assert not unsaid, (f"CHANGELOG.md's release section names no 'safe under the previous release: yes/no' in "
                        f"the item about: {unsaid}")


@given(verdict=st.sampled_from(["yes", "no"]), daemons=st.booleans(), bold=st.booleans())
def test_the_changelog_verdict_is_read_in_the_forms_it_is_written(verdict, daemons, bold):
    phrase = f"Safe under the previous release{chr(39) + 's daemons' if daemons else ''}: {verdict}"
    assert SAFE.search(f"adds a column. {'**' + phrase + '**' if bold else phrase}.").group(1) == verdict
