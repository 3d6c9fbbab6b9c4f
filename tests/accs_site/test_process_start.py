"""What a process of the site loads at start: the daemons, the commands and the process-isolated
task children (each runs ``django.setup()``) do not import the HTTP API's framework, which only the
web serves; the web still finds Swagger UI's bundled files (tests/accs_site/test_serving.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.daemons import ROOT

# What a process that serves no HTTP API has no use for: django-ninja, and behind it pydantic and
# Django's test client (django-ninja's settings module imports django.test).
WEB_ONLY = ("ninja", "pydantic", "django.test")

LOADED = (
    "import json, sys, django; django.setup(); "
    "from django.core.management import load_command_class; "
    "load_command_class('nodes', 'runagent'); load_command_class('jobs', 'runbuilder'); "
    f"print(json.dumps([name for name in {list(WEB_ONLY)!r} if name in sys.modules]))"
)


def test_a_daemon_start_imports_none_of_the_http_apis_framework():
    env = {"DJANGO_SETTINGS_MODULE": "accs_site.settings", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", LOADED], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [], (
        "django.setup() and the daemons' commands imported the HTTP API's framework: "
        "list accs_site.ninja_assets.NinjaAssetsConfig rather than \"ninja\", import ninja only in HTTP modules")


@pytest.mark.django_db
def test_the_swagger_page_is_the_bundled_copy_not_the_cdns(client):
    html = client.get("/api/v1/docs").content.decode()
    assert "/static/ninja/swagger-ui-bundle" in html and "cdn.jsdelivr" not in html
