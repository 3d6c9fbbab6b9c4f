"""One time format everywhere: Django's own date columns (every changelist, every read-only field) and
``accs_status`` say a moment the way the ACCS pages do, ``2026-11-28 13:04:39 UTC``, as a ``<time>`` the
display-zone picker rewrites."""

from __future__ import annotations

import re
from datetime import UTC, timedelta

import pytest
from django.contrib import admin
from django.db import models
from django.urls import reverse
from django.utils import timezone
from hypothesis import given, settings, strategies as st

from accs_site.admin_kit import display_for_field, when_ago_html, when_text
from jobs.models import LeaderTerm, Trigger
from ops.overview import overview, recent_failures
from ops.status import status_lines
from tests.ops_helpers import pipeline_scene, system_scene
from workflows.models import Service

pytestmark = pytest.mark.django_db

#: Django's own way (``Nov. 28, 2026, 1:04 p.m.``), which no ACCS page shows.
DJANGO_DEFAULT = re.compile(r"\b(Jan|Feb|March|April|May|June|July|Aug|Sept|Oct|Nov|Dec)\w*\.? \d{1,2}, \d{4}"
                            r"|\d (a|p)\.m\.|\bnoon\b|\bmidnight\b")
TIME = re.compile(r'<time class="accs-when" datetime="[^"]+">\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</time>')


def scene(tenants) -> None:
    pipeline_scene(tenants)
    system_scene(now=timezone.now())
    now = timezone.now()
    Trigger.objects.create(tenant=tenants.acme, label="nightly", trigger_type="schedule", cron_expr="0 2 * * *",
                           timezone="Europe/Oslo", service=Service.objects.first(),
                           next_run_at=now + timedelta(hours=3), last_fired_at=now - timedelta(hours=21))


def test_every_changelist_says_its_moments_the_one_way(client, root, tenants):
    scene(tenants)
    for model in admin.site._registry:
        url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
        body = client.get(url).content.decode()
        assert not DJANGO_DEFAULT.search(body), (url, DJANGO_DEFAULT.search(body).group(0))


@pytest.mark.parametrize(("url", "least"), [
    ("admin:jobs_job_changelist", 4),           # each job's creation, with its age
    ("admin:jobs_trigger_changelist", 2),       # the next run and the last firing
    ("admin:nodes_node_changelist", 2),         # each node's heartbeat
    ("admin:jobs_outage_changelist", 2),        # Django's own columns: began, ended
    ("admin:jobs_leaderterm_changelist", 4),    # acquired, expires
])
def test_the_lists_date_columns_are_time_elements_in_utc(client, root, tenants, url, least):
    scene(tenants)
    body = client.get(reverse(url)).content.decode()
    assert len(TIME.findall(body)) >= least, body[body.find('id="result_list"'):][:1500]


def test_a_read_only_date_field_is_said_the_one_way(client, root, tenants):
    scene(tenants)
    term = LeaderTerm.objects.order_by("fence").first()
    body = client.get(reverse("admin:jobs_leaderterm_change", args=[term.pk])).content.decode()
    assert TIME.search(body) and not DJANGO_DEFAULT.search(body)


def test_a_relative_age_keeps_the_moment_beside_it():
    now = timezone.now()
    past = when_ago_html(now - timedelta(minutes=7))
    assert TIME.search(past) and "7 min ago" in past
    assert "in " in when_ago_html(now + timedelta(hours=3)) and when_ago_html(None, never="never") == "never"


@settings(max_examples=60, deadline=None)
@given(st.datetimes(timezones=st.timezones()))
def test_any_aware_moment_in_any_zone_is_shown_as_the_same_instant_in_utc(moment):
    html = display_for_field(moment, models.DateTimeField(), "—")
    match = re.search(r'datetime="([^"]+)">([^<]+) UTC<', html)
    assert match, html
    shown = match.group(2)
    assert shown == when_text(moment)[:-4]
    # Compared in UTC: Python never calls a moment of a repeated (DST) hour equal across zones.
    assert timezone.datetime.fromisoformat(match.group(1)).astimezone(UTC) == moment.astimezone(UTC)


def test_other_fields_and_empty_moments_are_left_to_django():
    assert display_for_field(None, models.DateTimeField(), "—") == "—"
    assert display_for_field(3, models.IntegerField(), "—") == "3"


def test_accs_status_says_its_moments_the_one_way(tenants):
    pipeline_scene(tenants)
    data = overview()
    data.failures = recent_failures(limit=10)
    lines = status_lines(data, took=0.0)
    assert re.search(r"status at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", lines[0]), lines[0]
    dead = [line for line in lines if "DEAD" in line]
    assert dead and all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC ", line) for line in dead), dead
