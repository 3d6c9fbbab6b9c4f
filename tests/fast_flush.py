"""Empty the database after a transactional test by truncating only the tables the test wrote.

Django's teardown of a transactional test runs ``manage.py flush``: one TRUNCATE of every table (each
TRUNCATE gives the table and every index of it new files), then the post_migrate signal, which creates
the content types and permissions it has just removed again. On this project's 48 tables that was about
0.2 CPU-s a test (PostgreSQL's and Python's), this one 0.07-0.08, and a run has some 340 transactional tests.

This teardown leaves the database as Django's does for every table a test can see the difference in:

* every table with a row in it is truncated (with CASCADE, so an empty table whose foreign key points
  at one is emptied too, as flush's one statement would);
* the content types, the permissions and the migration records are kept: flush would delete them and
  the signal write the same rows again;
* the post_migrate signal is sent as flush sends it, to every receiver but the two that rewrite those
  rows (so the Tasks backend still forgets the services it cached).

Tests that ask for ``available_apps`` or a serialized rollback keep Django's own teardown.
``ACCS_TEST_FAST_FLUSH=0`` keeps Django's for every test.
"""

from __future__ import annotations

import os

from django.contrib.auth.management import create_permissions
from django.contrib.contenttypes.management import create_contenttypes
from django.core.management.sql import emit_post_migrate_signal
from django.db import connections, transaction
from django.db.models.signals import post_migrate
from django.test import TransactionTestCase

#: Rows written by migrate and by post_migrate, never by a test: the same after flush as before it.
KEPT = frozenset({"django_migrations", "django_content_type", "auth_permission"})

# Django's own teardown and helpers are private, so django-stubs does not declare them.
_django_teardown = TransactionTestCase._fixture_teardown  # type: ignore[attr-defined]


def _flushed_tables(alias: str) -> list[str]:
    """The tables flush would truncate (the models' tables that exist now), less :data:`KEPT`.

    Read at every teardown, as flush does (3 ms): a test that migrated backwards or forwards leaves
    other tables than the run started with.
    """
    names = connections[alias].introspection.django_table_names(only_existing=True, include_views=False)
    return sorted(set(names) - KEPT)


def empty_written_tables(alias: str) -> list[str]:
    """Truncate the tables of ``alias`` that hold a row; return their names."""
    conn = connections[alias]
    quote = conn.ops.quote_name
    tables = _flushed_tables(alias)
    with transaction.atomic(using=alias), conn.cursor() as cur:
        cur.execute("SELECT " + ", ".join(f"EXISTS (SELECT FROM {quote(t)})" for t in tables))
        written = [t for t, has_rows in zip(tables, cur.fetchone(), strict=True) if has_rows]
        if written:
            cur.execute(f"TRUNCATE {', '.join(quote(t) for t in written)} CASCADE")
    return written


def _post_migrate_without_rewrites(alias: str) -> None:
    """Send post_migrate as flush does, without the receivers that recreate content types and permissions."""
    post_migrate.disconnect(create_contenttypes)
    post_migrate.disconnect(dispatch_uid="django.contrib.auth.management.create_permissions")
    try:
        emit_post_migrate_signal(0, False, alias)
    finally:
        post_migrate.connect(create_contenttypes)
        post_migrate.connect(create_permissions, dispatch_uid="django.contrib.auth.management.create_permissions")


def _fixture_teardown(self: TransactionTestCase) -> None:
    if self.available_apps is not None or self.serialized_rollback:
        _django_teardown(self)
        return
    for alias in self._databases_names(include_mirrors=False):  # type: ignore[attr-defined]
        empty_written_tables(alias)
        _post_migrate_without_rewrites(alias)


def install() -> None:
    """Make transactional tests' teardown :func:`_fixture_teardown`; ``ACCS_TEST_FAST_FLUSH=0`` keeps Django's."""
    if os.environ.get("ACCS_TEST_FAST_FLUSH") != "0":
        TransactionTestCase._fixture_teardown = _fixture_teardown  # type: ignore[attr-defined]
