"""The accs_status picture is drawn by ops.status, which tests read without a terminal or the command."""

from __future__ import annotations

import pytest
from django.core.management.color import color_style

from accs_site.version import VERSION
from ops.overview import overview, recent_failures
from ops.status import status_lines
from tests.ops_helpers import pipeline_scene

pytestmark = pytest.mark.django_db

HEADINGS = ["Why isn't it moving?", "Queues per tenant (jobs | tasks)", "Services", "Nodes (an online node is SUSPECT",
            "Governor conditions", "Recent failures"]


def test_status_lines_draw_every_section_in_order_from_an_overview(tenants):
    pipeline_scene(tenants)
    data = overview()
    data.failures = recent_failures(limit=10)
    lines = status_lines(data, took=0.012, database="accs on db:5432")
    assert lines[0].startswith(f"ACCS {VERSION} status at ") and lines[0].endswith("— database accs on db:5432")
    starts = [next(i for i, line in enumerate(lines) if line.startswith(h)) for h in HEADINGS]
    assert starts == sorted(starts), "the sections come in their order"
    assert any(line.startswith("edge-2 ") and "online SUSPECT" in line for line in lines)
    assert any("DEAD" in line and "out of memory" in line for line in lines)
    assert lines[-1] == "read in 12 ms"


def test_status_lines_colour_only_when_given_a_style(tenants):
    pipeline_scene(tenants)
    data = overview()
    plain = status_lines(data, took=0.0)
    assert not any("\x1b[" in line for line in plain)
    coloured = status_lines(data, took=0.0, style=color_style(force_color=True))
    assert any("\x1b[" in line for line in coloured)
