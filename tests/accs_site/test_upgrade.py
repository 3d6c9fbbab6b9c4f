"""Upgrading an embedding site: old import paths keep working for a release, with a warning, and
the system checks name what the site must change (an app it lacks, URLs it does not wire)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from django.conf import settings

from accs_site import checks
from tests.daemons import ROOT

MOVED = [("events.metrics", "ops.metrics", "metrics_view"), ("events.dashboard", "ops.dashboard", "dashboard_view"),
         ("events.overview", "ops.overview", "queue_depth"), ("events.dag", "ops.dag", "render_svg")]


@pytest.mark.parametrize(("old", "new", "name"), MOVED)
def test_a_moved_module_still_imports_from_its_old_path_with_a_deprecation_warning(old, new, name):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}; import {new} instead"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_a_site_whose_urls_name_events_metrics_starts_and_is_told_what_to_change():
    done = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "manage.py", "check"], cwd=ROOT,
                          env={**_env(), "DJANGO_SETTINGS_MODULE": "tests.old_site.settings"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # The warning names the line of the site's code that imports the old path, not the shim.
    assert "tests/old_site/urls.py:7: DeprecationWarning" in done.stderr
    assert "events.metrics moved to ops.metrics" in done.stderr
    assert "accs.W003" in done.stderr and 'include("ops.urls")' in done.stderr, done.stderr


def test_a_site_without_the_ops_app_is_told_to_add_it(monkeypatch):
    monkeypatch.setattr(settings, "INSTALLED_APPS", [a for a in settings.INSTALLED_APPS if a != "ops"])
    problems = checks.check_accs_apps()
    assert [p.id for p in problems] == ["accs.E004"]
    assert "lacks 'ops'" in problems[0].msg and "Add 'ops' to INSTALLED_APPS" in problems[0].hint


def test_this_site_passes_the_app_and_url_checks():
    assert checks.check_accs_apps() == [] and checks.check_ops_urls() == []


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"} | {"PYTHONPATH": str(ROOT)}
