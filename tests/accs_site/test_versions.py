"""One release string, shown where operators look: every daemon reports it, and old ones are named.

``accs_site.version.VERSION`` is the source; pyproject.toml and the CHANGELOG's top heading must say
the same. Agents write it on their node row, the leading builder in its lease holder, the web in
``/metrics``; ``accs_status``, the dashboard and a database check name daemons of another release.
"""

from __future__ import annotations

import re
import tomllib
from datetime import timedelta

import pytest
from django.core import checks
from django.urls import reverse
from django.utils import timezone
from hypothesis import given, strategies as st

from accs_site.version import VERSION, VERSION_PATTERN
from jobs.leader import default_holder, holder_version
from jobs.models import LeaderLease
from nodes.api import register_node
from nodes.models import Node
from nodes.releases import other_release_daemons
from ops.overview import overview
from ops.status import status_lines
from tests.daemons import ROOT

OLD = "0.1.0"


def test_pyproject_and_the_changelog_heading_carry_the_code_release():
    assert VERSION_PATTERN.fullmatch(VERSION)
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == VERSION
    heading = next(line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## "))
    assert re.findall(r"\d+\.\d+\.\d+\S*?(?=\)|\s|$)", heading) == [VERSION], heading


@given(host=st.from_regex(r"[a-z0-9][a-z0-9.-]{0,30}", fullmatch=True), pid=st.integers(1, 2**22),
       suffix=st.from_regex(r"[0-9a-f]{6}", fullmatch=True),
       version=st.one_of(st.just(""), st.from_regex(VERSION_PATTERN, fullmatch=True).filter(lambda v: " " not in v)))
def test_a_lease_holder_name_gives_back_the_release_it_was_written_with(host, pid, suffix, version):
    holder = f"{host}:{pid}:{suffix}" + (f" {version}" if version else "")
    assert holder_version(holder) == version
    assert int(holder.split(":")[1]) == pid  # what operators and the fleet tests read from it still holds


def test_this_builder_names_its_release_in_its_lease_holder():
    assert holder_version(default_holder()) == VERSION


@pytest.mark.django_db
def test_an_agent_registers_its_node_with_this_release():
    assert register_node("fresh-agent", labels={}, services=["s"], agent_id="h:1:x").version == VERSION
    assert Node.objects.get(name="fresh-agent").version == VERSION


def _online(name: str, *, version: str, seen_ago: timedelta = timedelta(seconds=5), presence: str = "online") -> None:
    Node.objects.create(name=name, version=version, presence=presence, awake_state="awake",
                        last_seen=timezone.now() - seen_ago)


@pytest.mark.django_db
def test_agents_and_the_leader_of_another_release_are_named_and_the_check_warns():
    _online("old-agent", version=OLD)
    _online("blank-agent", version="")
    _online("new-agent", version=VERSION)
    _online("gone-agent", version=OLD, seen_ago=timedelta(days=2))
    _online("stopped-agent", version=OLD, presence="offline")
    LeaderLease.objects.create(name="builder", holder="b1:42:abcdef", fence=1, acquired_at=timezone.now(),
                               expires_at=timezone.now() + timedelta(seconds=30))
    found = {(d.kind, d.name, d.version) for d in other_release_daemons()}
    assert found == {("agent", "old-agent", OLD), ("agent", "blank-agent", ""), ("builder", "b1:42:abcdef", "")}
    [warning] = [m for m in checks.run_checks(tags=[checks.Tags.database], databases=["default"])
                 if m.id == "accs.W040"]
    assert warning.level == checks.WARNING
    assert "agent old-agent (0.1.0)" in warning.msg and "builder b1:42:abcdef (no release" in warning.msg
    assert "new-agent" not in warning.msg and "gone-agent" not in warning.msg and "stopped-agent" not in warning.msg
    # The web unit's check before gunicorn starts (no database) never fails on a rolling upgrade.
    assert not [m for m in checks.run_checks(include_deployment_checks=True) if m.id == "accs.W040"]


@pytest.mark.django_db
def test_a_fleet_all_on_this_release_passes_the_check():
    _online("new-agent", version=VERSION)
    LeaderLease.objects.update_or_create(name="builder", defaults={
        "holder": default_holder(), "fence": 7, "acquired_at": timezone.now(),
        "expires_at": timezone.now() + timedelta(seconds=30)})
    assert other_release_daemons() == []
    assert not [m for m in checks.run_checks(tags=[checks.Tags.database], databases=["default"])
                if m.id == "accs.W040"]


@pytest.mark.django_db
def test_accs_status_shows_this_release_and_names_online_nodes_of_another():
    _online("old-agent", version=OLD)
    _online("new-agent", version=VERSION)
    lines = status_lines(overview(), took=0.01, database="accs")
    assert lines[0].startswith(f"ACCS {VERSION} status at ")
    assert f"online on another release than this code ({VERSION}): old-agent (0.1.0)" in lines


@pytest.mark.django_db
def test_the_dashboard_marks_nodes_of_another_release(admin_client):
    _online("old-agent", version=OLD)
    _online("new-agent", version=VERSION)
    body = admin_client.get(reverse("ops:dashboard")).content.decode()
    assert f"this code is release {VERSION}" in body
    def row(node: str) -> str:
        start = body.index(f'data-node="{node}"')
        return body[start:body.index("</tr>", start)]

    assert "other release" in row("old-agent") and "other release" not in row("new-agent")
