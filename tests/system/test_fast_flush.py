"""The transactional tests' teardown (tests/fast_flush.py) leaves the database as Django's flush would."""

from __future__ import annotations

import os

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.db import connection, transaction
from django.db.models.signals import post_migrate
from django.test import TransactionTestCase

from jobs import api
from jobs.models import Job
from jobs.tasks_backend import task_services
from tenants.models import Tenant
from tests import fast_flush

pytestmark = pytest.mark.django_db(transaction=True)


def _rows_left() -> dict[str, int]:
    counts = {}
    with connection.cursor() as cur:
        for table in fast_flush._flushed_tables("default"):
            cur.execute(f"SELECT count(*) FROM {connection.ops.quote_name(table)}")
            counts[table] = cur.fetchone()[0]
    return {t: n for t, n in counts.items() if n}


def test_every_table_a_test_wrote_is_emptied_and_the_migrations_rows_are_kept(default_tenant, make_service):
    make_service("svc")
    job = api.start_service("svc", params={})
    User.objects.create(username="ops")
    kinds, perms = ContentType.objects.count(), Permission.objects.count()
    assert {"accs_job", "accs_task", "accs_event", "auth_user", "accs_service"} <= set(_rows_left())

    written = fast_flush.empty_written_tables("default")

    if os.environ.get("ACCS_TEST_FAST_FLUSH") != "0":
        assert TransactionTestCase._fixture_teardown is fast_flush._fixture_teardown
    assert {"accs_job", "accs_task", "accs_event", "auth_user", "accs_service"} <= set(written)
    assert _rows_left() == {}, "a table still holds rows after the teardown"
    assert not Job.objects.filter(pk=job.pk).exists()
    assert (ContentType.objects.count(), Permission.objects.count()) == (kinds, perms)
    with connection.cursor() as cur:  # the migrations' record is the one flush keeps too
        cur.execute("SELECT count(*) FROM django_migrations")
        assert cur.fetchone()[0] > 0


def test_a_table_referenced_by_an_empty_one_is_emptied_through_the_cascade(default_tenant):
    # accs_tenant alone holds a row; the many tables whose foreign keys point at it are empty, and a
    # TRUNCATE of it alone would be refused without CASCADE.
    written = fast_flush.empty_written_tables("default")
    assert "accs_tenant" in written
    assert _rows_left() == {}


def test_the_signal_still_reaches_the_other_receivers_and_the_two_are_connected_again(default_tenant,
                                                                                        make_service):
    service = make_service("svc")
    task_services.put("some.task", service)
    assert task_services.get("some.task") is not None
    before = len(post_migrate.receivers)

    fast_flush._post_migrate_without_rewrites("default")

    assert task_services.get("some.task") is None, "the Tasks backend kept a service the flush removed"
    assert len(post_migrate.receivers) == before
    assert ContentType.objects.exists()


class _Undo(Exception):
    pass


def test_a_table_a_test_took_away_is_not_asked_for(default_tenant):
    # A test that migrated backwards leaves other tables than the run started with; the teardown
    # looks at the tables as they are then, as flush does.
    fast_flush.empty_written_tables("default")
    with pytest.raises(_Undo), transaction.atomic():
        Tenant.objects.create(slug="other", name="Other")
        with connection.cursor() as cur:
            cur.execute("ALTER TABLE accs_limit_key_held RENAME TO accs_limit_key_held_away")
        written = fast_flush.empty_written_tables("default")
        assert "accs_tenant" in written and "accs_limit_key_held" not in written
        raise _Undo
