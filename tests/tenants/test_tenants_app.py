"""Tenancy is its own bottom app (``tenants``): the move keeps every table and row, an upgraded
database ends where a fresh one does, old import paths keep working with a warning, and the
definitions below the engine (workflows, events) import nothing of it."""

from __future__ import annotations

import ast
import hashlib
import importlib
import os
import subprocess
import sys
import uuid
import warnings
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.utils import timezone

import jobs.models
import tenants.models
from accs_site import checks
from events.artifacts import record_artifact
from jobs import api, transitions, triggers
from tests import forkserver
from tests.daemons import ROOT
from workflows.api import create_workflow
from workflows.validation import DefinitionError, validate_service

MOVED_TABLES = ("accs_tenant", "accs_tenant_membership", "accs_api_token", "accs_api_throttle")
RAW_TOKEN = "accs_upgrade-test-token-0123456789"


# --------------------------------------------------------------------------------------------
# The migration: an upgrade from the last schema with tenancy in jobs
# --------------------------------------------------------------------------------------------

@pytest.fixture
def empty_database():
    """A database of its own (the test database is already migrated to the latest state)."""
    name = f"accs_upgrade_{uuid.uuid4().hex[:8]}"
    admin_url = os.environ["ACC_DB_URL"]
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"{admin_url.rsplit('/', 1)[0]}/{name}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _manage(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ACC_DB_URL": url, "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": "accs_site.settings"}
    return forkserver.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def _seed_tenancy_rows(url: str) -> dict[str, int]:
    """Write a tenant, a member, a token and a permission on the tenant model, as 0.1.0 left them."""
    with psycopg.connect(url, autocommit=True) as conn:
        tenant = conn.execute(
            "INSERT INTO accs_tenant (id, slug, name, timezone, max_in_flight, min_priority, max_priority, created_at)"
            " VALUES (gen_random_uuid(), 'acme', 'Acme', 'UTC', 0, -1000, 1000, now()) RETURNING id").fetchone()[0]
        user = conn.execute(
            "INSERT INTO auth_user (password, is_superuser, username, first_name, last_name, email, is_staff,"
            " is_active, date_joined) VALUES ('!', false, 'ops', '', '', '', true, true, now()) RETURNING id"
        ).fetchone()[0]
        conn.execute("INSERT INTO accs_tenant_membership (user_id, tenant_id, role) VALUES (%s, %s, 'viewer')",
                     (user, tenant))
        conn.execute("INSERT INTO accs_api_token (user_id, name, prefix, digest, created_at, scopes)"
                     " VALUES (%s, 'ci', %s, %s, now(), '{read}')",
                     (user, RAW_TOKEN[:12], hashlib.sha256(RAW_TOKEN.encode()).hexdigest()))
        content_type = conn.execute(
            "SELECT id FROM django_content_type WHERE app_label = 'jobs' AND model = 'tenant'").fetchone()[0]
        conn.execute("INSERT INTO auth_user_user_permissions (user_id, permission_id)"
                     " SELECT %s, id FROM auth_permission WHERE content_type_id = %s AND codename = 'view_tenant'",
                     (user, content_type))
    return {"content_type": content_type}


def test_an_upgrade_from_jobs_0013_keeps_tables_rows_and_permissions_and_ends_where_a_fresh_migrate_does(
        empty_database):
    url = empty_database
    # As an 0.1.0 site left it: Django's own apps up to date, jobs at its last migration before the move.
    for app, target in (("auth", None), ("contenttypes", None), ("jobs", "0013")):
        old = _manage(url, "migrate", app, *([target] if target else []), "--noinput")
        assert old.returncode == 0, old.stdout + old.stderr
    assert "[ ] 0001_initial" in _manage(url, "showmigrations", "tenants").stdout
    seeded = _seed_tenancy_rows(url)

    upgraded = _manage(url, "migrate", "--noinput")
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    assert "Applying tenants.0001_initial... OK" in upgraded.stdout
    assert "Applying jobs.0014_move_tenancy_to_tenants... OK" in upgraded.stdout

    with psycopg.connect(url, autocommit=True) as conn:
        for table in MOVED_TABLES:
            assert conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] == table, f"{table} kept its name"
        assert conn.execute("SELECT to_regclass('tenants_tenant')").fetchone()[0] is None
        assert conn.execute("SELECT count(*) FROM accs_tenant_membership").fetchone()[0] == 1
        # The content type itself moved (same id), so the permission granted on it still holds.
        labels = conn.execute("SELECT app_label FROM django_content_type WHERE id = %s",
                              (seeded["content_type"],)).fetchone()
        assert labels == ("tenants",)
        left = conn.execute("SELECT model FROM django_content_type WHERE app_label = 'jobs'"
                            " AND model IN ('tenant', 'tenantmembership', 'apitoken', 'apithrottle')").fetchall()
        assert left == [], f"content types left behind in jobs: {left}"

    read = _manage(url, "shell", "-c", (
        "from django.contrib.auth.models import User; from tenants.auth import user_for_token; "
        "from tenants.models import Tenant; u = User.objects.get(username='ops'); "
        f"print('perm', u.has_perm('tenants.view_tenant'), 'token', user_for_token({RAW_TOKEN!r}), "
        "'members', [m.user.username for m in Tenant.objects.get(slug='acme').memberships.all()])"))
    assert read.returncode == 0, read.stderr
    assert "perm True token ops members ['ops']" in read.stdout, read.stdout

    pending = _manage(url, "makemigrations", "--check", "--dry-run")
    assert pending.returncode == 0 and "No changes detected" in pending.stdout, pending.stdout + pending.stderr


def test_going_back_to_jobs_0013_gives_the_content_types_back_to_jobs(empty_database):
    url = empty_database
    assert _manage(url, "migrate", "--noinput").returncode == 0
    back = _manage(url, "migrate", "tenants", "zero", "--noinput")
    assert back.returncode == 0, back.stdout + back.stderr
    with psycopg.connect(url, autocommit=True) as conn:
        labels = {row[0] for row in conn.execute(
            "SELECT app_label FROM django_content_type WHERE model IN ('tenant', 'apitoken')")}
        assert labels == {"jobs"}
        assert conn.execute("SELECT to_regclass('accs_tenant')").fetchone()[0] == "accs_tenant"


@pytest.mark.django_db
def test_the_engines_foreign_keys_still_point_at_the_tenant_table():
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT conrelid::regclass::text FROM pg_constraint"
                    " WHERE contype = 'f' AND confrelid = 'accs_tenant'::regclass ORDER BY 1")
        referencing = [row[0] for row in cur.fetchall()]
    assert referencing == ["accs_event_receipt", "accs_job", "accs_start", "accs_task", "accs_tenant_membership",
                           "accs_trigger"]


# --------------------------------------------------------------------------------------------
# Old import paths, and a site that does not install the app
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(jobs.models.MOVED_TO_TENANTS))
def test_a_moved_name_still_reads_from_jobs_models_with_a_deprecation_warning(name):
    with pytest.warns(DeprecationWarning, match=rf"jobs\.models\.{name} moved to tenants\.models"):
        old = getattr(jobs.models, name)
    assert old is getattr(tenants.models, name)


def test_the_warning_names_the_line_that_imports_the_old_name():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from jobs.models import Tenant  # noqa: F401
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]


def test_a_name_that_never_was_in_jobs_models_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchModel'"):
        jobs.models.NoSuchModel  # noqa: B018


@pytest.mark.parametrize(("old", "new", "name"), [
    ("jobs.auth", "tenants.auth", "BearerToken"), ("jobs.accounts", "tenants.accounts", "issue_token"),
    ("jobs.scoping", "tenants.scoping", "scope"), ("jobs.throttle", "tenants.throttle", "TokenThrottle"),
])
def test_a_moved_module_still_imports_from_jobs_with_a_deprecation_warning(old, new, name):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}; import {new} instead"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_a_site_without_the_tenants_app_is_told_to_add_it(monkeypatch):
    monkeypatch.setattr(settings, "INSTALLED_APPS", [a for a in settings.INSTALLED_APPS if a != "tenants"])
    problems = checks.check_accs_apps()
    assert [p.id for p in problems] == ["accs.E004"]
    assert "lacks 'tenants'" in problems[0].msg


def test_a_site_without_the_tenants_app_stops_with_one_sentence_saying_so(tmp_path):
    (tmp_path / "no_tenants_site.py").write_text(
        "from accs_site.settings import *  # noqa: F401,F403\n"
        "INSTALLED_APPS = [a for a in INSTALLED_APPS if a != 'tenants']  # noqa: F405\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "DJANGO_SETTINGS_MODULE": "no_tenants_site"}
    done = forkserver.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert "INSTALLED_APPS lacks 'tenants'" in done.stderr and "moved out of 'jobs'" in done.stderr, done.stderr


# --------------------------------------------------------------------------------------------
# The floors: tenancy at the bottom, definitions and the timeline below the engine
# --------------------------------------------------------------------------------------------

ACCS_APPS = {"accs_site", "tenants", "events", "workflows", "jobs", "nodes", "ops"}


def _accs_imports(path: Path) -> set[str]:
    """Return the ACCS apps a file imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else (
            [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
        found |= {name.split(".")[0] for name in names} & ACCS_APPS
    return found


@pytest.mark.parametrize(("folder", "allowed"), [
    ("tenants", {"accs_site", "tenants"}),
    ("events", {"accs_site", "tenants", "events"}),
])
def test_a_bottom_app_imports_nothing_above_it(folder, allowed):
    above = {str(p.relative_to(ROOT)): _accs_imports(p) - allowed for p in sorted((ROOT / folder).rglob("*.py"))}
    assert {path: apps for path, apps in above.items() if apps} == {}


@pytest.mark.parametrize("module", ["workflows/models.py", "workflows/validation.py", "workflows/api.py"])
def test_definitions_import_nothing_of_the_engine(module):
    assert _accs_imports(ROOT / module) <= {"accs_site", "tenants", "events", "workflows"}


def test_the_models_and_their_validation_do_not_import_each_other():
    assert "workflows" not in _accs_imports(ROOT / "workflows" / "validation.py")


# --------------------------------------------------------------------------------------------
# What the engine holds by a service's key is asked through the finder jobs registers
# --------------------------------------------------------------------------------------------

def test_a_service_an_unfinished_job_names_cannot_be_renamed_away(make_service, default_tenant):
    service = make_service("busy")
    api.start_service("busy", scheduled_at=timezone.now() + timedelta(hours=1))
    service.key = "busy-2"
    with pytest.raises(DefinitionError, match=r"cannot be renamed: still used by 1 unfinished job\(s\)"):
        validate_service(service)


def test_a_service_a_trigger_names_cannot_be_renamed_away(make_service, default_tenant):
    service = make_service("fired")
    triggers.create_trigger(tenant=default_tenant, label="on ping", trigger_type="event", event_name="ping",
                            service="fired")
    service.key = "fired-2"
    with pytest.raises(DefinitionError, match="still used by trigger 'on ping'"):
        validate_service(service)


def test_a_rename_lists_workflows_before_what_the_engine_holds(make_service, default_tenant):
    service = make_service("shared")
    create_workflow(name="uses-shared", steps=[{"key": "s", "service": "shared", "depends_on": []}])
    api.start_service("shared", scheduled_at=timezone.now() + timedelta(hours=1))
    service.key = "shared-2"
    with pytest.raises(DefinitionError) as excinfo:
        validate_service(service)
    assert "still used by workflow uses-shared v1, 1 unfinished job(s)" in str(excinfo.value)


# --------------------------------------------------------------------------------------------
# Artifacts name jobs and tasks by id, checked without the engine's models
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db
def test_an_artifact_of_a_missing_job_or_task_or_a_malformed_id_is_refused_by_name():
    with pytest.raises(ValueError, match="does not exist"):
        record_artifact(job_id=uuid.uuid4(), task_id=None, attempt=None, kind="input", name="a", data=b"x")
    with pytest.raises(ValueError, match="task .* does not exist"):
        record_artifact(job_id=uuid.uuid4(), task_id=uuid.uuid4(), attempt=1, kind="output", name="a", data=b"x")
    with pytest.raises(ValueError, match="job id 'nope' is not a UUID"):
        record_artifact(job_id="nope", task_id=None, attempt=None, kind="input", name="a", data=b"x")


def test_an_artifact_for_another_jobs_task_is_refused(make_service, default_tenant):
    make_service("one")
    first = api.start_service("one")
    second = api.start_service("one")
    transitions.start_due_jobs()
    task = first.tasks.get()
    with pytest.raises(ValueError, match=f"belongs to job {first.id}, not to job {second.id}"):
        record_artifact(job_id=second.id, task_id=task.id, attempt=1, kind="output", name="a", data=b"x")
