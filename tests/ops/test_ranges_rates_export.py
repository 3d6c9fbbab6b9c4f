"""The time range shared by the dashboard and the lists, success and failure per node and service over it,
exports of the filtered lists, and actions over a whole filtered list (issue 37, items 4 and 7)."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.admin.models import LogEntry
from hypothesis import given, settings, strategies as st

from jobs import api
from jobs.models import Attempt, AttemptStatus, Job, JobStatus
from ops.timerange import PRESETS, RangeError, TimeRange, parse_range
from tests.ops_helpers import make_user, pipeline_scene, two_tenants

NOW = datetime(2026, 11, 28, 13, 0, tzinfo=UTC)
SECRET = "s3cr3t-VALUE-never-shown"


# --------------------------------------------------------------------------------------------
# The range itself
# --------------------------------------------------------------------------------------------

@given(key=st.sampled_from(sorted(PRESETS)))
def test_a_preset_reaches_back_its_length_from_now_and_round_trips(key):
    chosen = parse_range({"range": key}, now=NOW)
    assert chosen is not None and chosen.since == NOW - PRESETS[key][0] and chosen.until is None
    assert parse_range(chosen.params(), now=NOW) == chosen


@settings(deadline=None)
@given(start=st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)),
       minutes=st.integers(min_value=-10_000, max_value=10_000))
def test_a_custom_range_must_end_after_it_starts(start, minutes):
    start = start.replace(second=0, microsecond=0)
    end = start + timedelta(minutes=minutes)
    params = {"range": "custom", "from": start.strftime("%Y-%m-%dT%H:%M"), "to": end.strftime("%Y-%m-%dT%H:%M")}
    if minutes <= 0:
        with pytest.raises(RangeError, match="ends .* before it starts"):
            parse_range(params, now=NOW)
        return
    chosen = parse_range(params, now=NOW)
    assert chosen is not None and chosen.since < chosen.until
    assert (chosen.until - chosen.since) == timedelta(minutes=minutes)
    since, until = chosen.bounded(now=NOW)
    assert since < until <= NOW


@given(text=st.text(max_size=20))
def test_bad_input_is_refused_naming_the_parameter(text):
    for params, name in (({"range": text}, "range"), ({"range": "custom", "from": text}, "from"),
                         ({"range": "custom", "from": "2026-01-01T00:00", "to": text}, "to")):
        try:
            chosen = parse_range(params, now=NOW)
        except RangeError as exc:
            assert name in str(exc)
        else:
            assert chosen is None or isinstance(chosen, TimeRange)


@pytest.mark.django_db
def test_the_range_chosen_on_the_dashboard_is_the_lists_range_until_another_is_chosen(client, root):
    tenants = two_tenants()
    from tests.ops_helpers import _service

    _service("svc")
    old = api.start_service("svc", tenant=tenants.acme)
    Job.objects.filter(pk=old.pk).update(created_at=NOW - timedelta(days=30))
    new = api.start_service("svc", tenant=tenants.acme)
    page = client.get("/admin/dashboard/?range=1h&refresh=60").content.decode()
    assert 'data-range="1h"' in page and "Last 1 h" in page
    listed = client.get("/admin/jobs/job/").content.decode()  # no range in the URL: the session's
    assert new.pk.hex[-10:] in listed.replace("-", "") and str(old.pk)[-10:] not in listed
    everything = client.get("/admin/jobs/job/?range=all").content.decode()
    assert str(old.pk)[-10:] in everything
    # A dashboard card's list counts what is there now, and does not forget the range picked.
    assert "range=any" in client.get("/admin/dashboard/?range=6h").content.decode()
    client.get("/admin/jobs/job/?range=any")
    assert 'data-range="6h"' in client.get("/admin/dashboard/").content.decode()


@pytest.mark.django_db
def test_a_bad_range_is_named_on_the_page_and_the_list_still_shows(client, root):
    page = client.get("/admin/jobs/job/?range=custom&from=yesterday", follow=True)
    assert page.status_code == 200
    assert "from=&#x27;yesterday&#x27; is not a time" in page.content.decode()


# --------------------------------------------------------------------------------------------
# Success and failure per node and service
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db
def test_rates_per_node_and_service_count_the_attempts_of_the_range(client, root):
    from django.utils import timezone

    from ops.rates import rates

    tenants = two_tenants()
    pipeline_scene(tenants)
    now = timezone.now()
    found = rates(since=now - timedelta(hours=1), until=now + timedelta(seconds=1))
    attempts = list(Attempt.objects.select_related("task__service"))
    for row in found.nodes:
        mine = [a for a in attempts if (a.node or "(no node)") == row.name]
        assert row.total == len(mine)
        assert row.succeeded == sum(a.status == AttemptStatus.SUCCEEDED for a in mine)
        assert row.failed == sum(a.status in (AttemptStatus.FAILED, AttemptStatus.TIMEOUT) for a in mine)
    render = next(r for r in found.services if r.name == "render")
    assert (render.succeeded, render.failed) == (3, 2)
    assert found.services[0].failure_rate == max(r.failure_rate or 0 for r in found.services), "worst first"
    # A tenant's view counts its own tenant's attempts only.
    acme = rates(since=now - timedelta(hours=1), until=now + timedelta(seconds=1), tenant_ids={tenants.acme.id})
    assert "globex-sync" not in {r.name for r in acme.services}
    # Outside the range nothing is counted.
    assert rates(since=now - timedelta(days=2), until=now - timedelta(days=1)).nodes == []
    with pytest.raises(ValueError, match="must start before it ends"):
        rates(since=now, until=now)


@pytest.mark.django_db
def test_the_attempts_list_filters_by_node_and_service_and_links_its_rows(client, root):
    from workflows.models import Service

    pipeline_scene(two_tenants())
    render = Service.objects.get(key="render")
    page = client.get(f"/admin/jobs/attempt/?service={render.pk}&status__exact=failed").content.decode()
    failed_renders = Attempt.objects.filter(task__service=render, status="failed")
    assert failed_renders.count() == 2
    for attempt in failed_renders:
        assert f"/admin/jobs/attempt/{attempt.pk}/change/" in page
        assert f"/admin/jobs/task/{attempt.task_id}/change/" in page
        assert f"/admin/jobs/job/{attempt.task.job_id}/change/" in page
    assert page.count('class="field-attempt_no"') == 2
    by_node = client.get("/admin/jobs/attempt/?node=node-t").content.decode()
    assert by_node.count('class="field-attempt_no"') == Attempt.objects.filter(node="node-t").count() > 0


# --------------------------------------------------------------------------------------------
# Exports
# --------------------------------------------------------------------------------------------

def _body(response) -> str:
    assert response.status_code == 200, response.content[:500]
    assert response.streaming, "an export is streamed"
    return b"".join(response.streaming_content).decode()


@pytest.fixture
def secret_jobs(db):
    """A job with a secret param in each tenant; acme's admin, ann."""
    from tests.ops_helpers import _service

    tenants = two_tenants()
    _service("deploy")
    mine = api.start_service("deploy", tenant=tenants.acme, params={"api_token": SECRET, "env": "prod"})
    theirs = api.start_service("deploy", tenant=tenants.globex, params={"password": SECRET, "env": "globex-only"})
    make_user("ann", tenants={tenants.acme: "admin"})
    return mine, theirs


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["/admin/jobs/job/export.{}", "/admin/jobs/task/export.{}",
                                 "/admin/jobs/task/export.{}?status__exact=error", "/admin/events/event/export.{}",
                                 "/admin/jobs/attempt/export.{}"])
def test_an_export_never_shows_another_tenants_rows_or_a_secret(client, secret_jobs, url):
    from django.contrib.auth import get_user_model

    mine, theirs = secret_jobs
    client.force_login(get_user_model().objects.get(username="ann"))
    for fmt in ("csv", "json"):
        body = _body(client.get(url.format(fmt)))
        assert SECRET not in body
        assert str(theirs.pk) not in body and "globex-only" not in body
        if "job/" in url or "task/export" in url and "error" not in url:
            assert str(mine.pk) in body and "***" in body, "the tenant's own rows, secrets as ***"
    root = make_user("root", superuser=True)
    client.force_login(root)
    for fmt in ("csv", "json"):
        assert SECRET not in _body(client.get(url.format(fmt))), "secrets are redacted for superusers too"


@pytest.mark.django_db
def test_an_export_has_the_lists_rows_under_its_filters_in_both_formats(client, root):
    tenants = two_tenants()
    pipeline_scene(tenants)
    query = "status__exact=error"
    rows = list(csv.DictReader(io.StringIO(_body(client.get(f"/admin/jobs/job/export.csv?{query}")))))
    listed = json.loads(_body(client.get(f"/admin/jobs/job/export.json?{query}")))
    wanted = {str(pk) for pk in Job.objects.filter(status=JobStatus.ERROR).values_list("pk", flat=True)}
    assert {r["id"] for r in rows} == {r["id"] for r in listed} == wanted
    assert client.get("/admin/jobs/job/export.xml").status_code == 400


@pytest.mark.django_db
def test_an_export_reads_in_keyset_batches_never_the_whole_set(django_assert_num_queries):
    from accs_site.admin_kit import export_rows
    from tests.ops_helpers import _service

    tenants = two_tenants()
    _service("svc")
    for _ in range(20):
        api.start_service("svc", tenant=tenants.acme)
    rows = export_rows(Job.objects.all(), ("id", "status"), redacted=(), batch=7)
    first = next(rows)
    with django_assert_num_queries(2):  # the rest of the first batch costs nothing; then two more batches
        rest = list(rows)
    ids = [first["id"], *(r["id"] for r in rest)]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == 20


# --------------------------------------------------------------------------------------------
# Actions over the whole filtered list
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db
def test_an_action_over_the_filtered_list_covers_more_than_a_page_after_a_count(client, monkeypatch):
    from accs_site import admin_kit
    from tests.ops_helpers import _service

    tenants = two_tenants()
    _service("svc")
    mine = [api.start_service("svc", tenant=tenants.acme) for _ in range(130)]
    theirs = api.start_service("svc", tenant=tenants.globex)
    client.force_login(make_user("ann", tenants={tenants.acme: "admin", tenants.globex: "viewer"}))
    monkeypatch.setattr(admin_kit, "FILTER_BATCH", 40)
    url = "/admin/jobs/job/?status__exact=waiting&range=all"
    form = {"action": "cancel_jobs", "select_across": "1", "index": "0", "_selected_action": str(mine[0].pk)}
    asked = client.post(url, form).content.decode()
    assert 'data-count="131"' in asked, "the count covers every row of the filter, not the page's 100"
    assert Job.objects.filter(status=JobStatus.CANCELED).count() == 0, "nothing happens before the confirmation"
    done = client.post(url, {**form, "confirm": "yes"}, follow=True)
    assert Job.objects.filter(pk__in=[j.pk for j in mine], status=JobStatus.CANCELED).count() == 130
    assert Job.objects.get(pk=theirs.pk).status == JobStatus.WAITING, "a viewer's tenant is left alone"
    said = " ".join(str(m) for m in done.context["messages"])
    assert "130 changed" in said and "1 not permitted" in said, said
    entries = LogEntry.objects.filter(object_id=None)
    assert entries.count() == 1 and "Cancel: 130 of 130 jobs" in entries.get().change_message
    assert "4 batch(es)" in entries.get().change_message


_values = st.one_of(st.none(), st.integers(), st.text(max_size=30),
                    st.dictionaries(st.text(min_size=1, max_size=10), st.text(max_size=10), max_size=3))


@given(rows=st.lists(st.fixed_dictionaries({"a": _values, "b": _values}), max_size=20))
def test_a_streamed_export_reads_back_as_the_rows_it_was_given(rows):
    from accs_site.admin_kit import _cell, stream_export

    def body(fmt: str) -> str:
        response = stream_export(iter([dict(r) for r in rows]), ("a", "b"), fmt=fmt, filename="x")
        return b"".join(part if isinstance(part, bytes) else part.encode() for part in response.streaming_content
                        ).decode()

    assert json.loads(body("json")) == rows
    read = list(csv.reader(io.StringIO(body("csv"), newline="")))
    assert read[0] == ["a", "b"]
    assert read[1:] == [[_cell(r["a"]), _cell(r["b"])] for r in rows]
    with pytest.raises(ValueError, match="unknown export format 'xml'"):
        stream_export(iter([]), ("a",), fmt="xml", filename="x")
