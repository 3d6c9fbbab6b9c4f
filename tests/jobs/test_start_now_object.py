"""The one-statement start returns its Job without reading it back: no query besides its own
statement, the object saying what the row says, its tenant and service attached."""

from __future__ import annotations

import pytest

from jobs import api
from jobs.models import Job

pytestmark = pytest.mark.django_db


def test_a_warm_start_reads_nothing_back_and_returns_the_stored_job(make_service, default_tenant,
                                                               django_assert_num_queries):
    make_service("obj", params_schema={"type": "object", "properties": {"n": {"type": "integer"}}})
    api.start_service("obj", params={"n": 0})  # definitions cached, the start function planned
    # The start's own statement runs on a psycopg cursor of Django's connection, which Django does
    # not count: any ORM query (a read-back, a relation fetched) would be.
    with django_assert_num_queries(0):
        job = api.start_service("obj", params={"n": 1}, correlation_id="c-1")
        assert (job.tenant.slug, job.service.key, job.workflow) == ("default", "obj", None)
    stored = Job.objects.get(pk=job.pk)
    assert job.was_created is True and job._state.adding is False and job._state.db == "default"
    for field in Job._meta.concrete_fields:
        assert getattr(job, field.attname) == getattr(stored, field.attname), field.attname
