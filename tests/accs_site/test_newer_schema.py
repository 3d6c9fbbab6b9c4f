"""A database migrated by a newer release: ``migrate --check`` fails naming it, daemons keep running.

A fake row in django_migrations stands for a migration only a newer release has (a rollback of
the code without the schema). Expand/contract means the previous release's daemons work on that
schema, so only ``migrate --check`` refuses it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from django.db import connection
from hypothesis import given, settings, strategies as st

from accs_site import daemon
from accs_site.management.commands.migrate import newer_schema_line
from tests import forkserver
from tests.daemons import ROOT

FUTURE = ("jobs", "9999_from_a_newer_release")


def _applied(app: str, name: str) -> None:
    with connection.cursor() as cur:
        cur.execute("INSERT INTO django_migrations (app, name, applied) VALUES (%s, %s, now())", [app, name])


def _manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return forkserver.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.django_db
def test_a_schema_in_step_with_the_code_has_no_newer_migration():
    assert daemon.newer_migrations() == []


@pytest.fixture
def future_migration_applied() -> Iterator[None]:
    """A migration of a newer release recorded as applied, removed afterwards: the flush between tests
    leaves ``django_migrations`` alone, so the row would make every later test's database "newer"."""
    _applied(*FUTURE)
    try:
        yield
    finally:
        with connection.cursor() as cur:
            cur.execute("DELETE FROM django_migrations WHERE app = %s AND name = %s", list(FUTURE))


@pytest.mark.django_db(transaction=True)
def test_migrate_check_fails_on_a_newer_schema_with_one_line_and_daemons_still_start(subprocess_env, request):
    assert _manage("migrate", "--check", env=subprocess_env).returncode == 0
    request.getfixturevalue("future_migration_applied")

    checked = _manage("migrate", "--check", env=subprocess_env)
    assert checked.returncode == 1
    [line] = [x for x in checked.stderr.splitlines() if x.strip()]
    assert "the database is newer than this code" in line and "jobs.9999_from_a_newer_release" in line, line

    # Plain migrate (the web unit's ExecStartPre) says it and goes on.
    plain = _manage("migrate", "--noinput", env=subprocess_env)
    assert plain.returncode == 0, plain.stderr
    assert "jobs.9999_from_a_newer_release" in plain.stderr and "No migrations to apply" in plain.stdout

    # The daemons' start-up check and the readiness probe accept the newer schema.
    daemon.check_schema()
    assert daemon.missing_migrations() == []
    once = _manage("runbuilder", "--once", env=subprocess_env)
    assert once.returncode == 0, once.stderr


migration_names = st.from_regex(r"[0-9]{4}_[a-z_]{1,30}", fullmatch=True)


@pytest.mark.django_db
@settings(max_examples=20, deadline=None)
@given(accs=st.lists(st.tuples(st.sampled_from(["jobs", "nodes", "tenants", "workflows", "events"]),
                               migration_names.map(lambda n: f"9{n}")), max_size=4, unique=True),
       site=st.lists(st.tuples(st.sampled_from(["auth", "shop"]), migration_names), max_size=2, unique=True))
def test_only_applied_accs_migrations_without_a_file_count_as_newer(accs, site):
    with connection.cursor() as cur:
        cur.execute("SAVEPOINT example")
        try:
            for app, name in [*accs, *site]:
                _applied(app, name)
            # A site's own apps may keep rows of migrations they deleted: only ACCS's count.
            assert daemon.newer_migrations() == sorted(f"{app}.{name}" for app, name in accs)
        finally:
            cur.execute("ROLLBACK TO SAVEPOINT example")


def test_the_line_names_the_first_migrations_and_counts_the_rest():
    names = [f"jobs.{9000 + i}_x" for i in range(8)]
    line = newer_schema_line(names)
    assert "8 applied ACCS migration(s)" in line and "jobs.9004_x and 3 more" in line and "jobs.9005_x" not in line
    assert "\n" not in line
