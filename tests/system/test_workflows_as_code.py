"""Workflows as code in a team's own site (tests/embedded_site/shop/pipelines.py): ``accs_sync`` stores
the four-step pipeline (a fan-out over a parent's list, a branch), the site's real agents run it, an edit
becomes version 2 while a version 1 job finishes on version 1, and ``accs_sync --check`` reports drift."""

from __future__ import annotations

import uuid

from tests.daemons import Daemons, wait_for
from tests.system import test_embedded_site as embedded
from tests.system.test_embedded_site import MANAGE, manage, query

site_env = embedded.site_env  # a fresh database migrated by the site's manage.py, for this module

WORKFLOW_LINE = 'code.workflow("ship-order"'
SERVICES = "shop-pick,shop-label,shop-finish,task-default-shop-tasks-receipt"


def _line_of(text: str) -> int:
    lines = (MANAGE.parent / "shop" / "pipelines.py").read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if line.startswith(text))


def _tasks(env, job_id: str) -> dict[str, tuple[str, dict]]:
    rows = query(env, "SELECT task_key, status, results FROM accs_task WHERE job_id = %s", uuid.UUID(job_id))
    return {key: (status, results) for key, status, results in rows}


def test_code_pipeline_is_synced_run_by_real_agents_and_versioned_on_change(site_env, tmp_path):
    drift = manage(site_env, "accs_sync", "--check")
    assert drift.returncode == 1, "an empty database differs from the code"
    assert "create workflow ship-order v1: 4 steps" in drift.stdout, drift.stdout

    planned = manage(site_env, "accs_sync", "--plan")
    assert planned.returncode == 0 and "create service shop-pick" in planned.stdout, planned.stderr
    assert query(site_env, "SELECT count(*) FROM accs_workflow")[0][0] == 0, "--plan writes nothing"

    synced = manage(site_env, "accs_sync")
    assert synced.returncode == 0, synced.stderr
    assert manage(site_env, "accs_sync", "--check").returncode == 0, "in step after the sync"
    assert query(site_env, "SELECT version, defined_in FROM accs_workflow WHERE name = 'ship-order'") == [
        (1, f"shop.pipelines:{_line_of(WORKFLOW_LINE)}")]

    started = manage(site_env, "ship_order", "R-1")
    assert started.returncode == 0, started.stderr
    first = started.stdout.strip()

    ups = {"SHOP_PIPELINE_CARRIER": "ups"}
    assert manage(site_env, "accs_sync", "--check", extra=ups).returncode == 1, "the edit is drift"
    edited = manage(site_env, "accs_sync", extra=ups)
    assert edited.returncode == 0 and "new version workflow ship-order v2: step ship changed" in edited.stdout, (
        edited.stdout + edited.stderr)
    assert manage(site_env, "accs_sync", "--check", extra=ups).returncode == 0
    second = manage(site_env, "ship_order", "R-2", "--items", "0", extra=ups).stdout.strip()

    daemons = Daemons(site_env, tmp_path, manage_py=MANAGE)
    try:
        daemons.builder()
        daemons.agent("shop-node", SERVICES)
        wait_for(lambda: query(site_env, "SELECT count(*) FROM accs_job WHERE status = 'done'")[0][0] == 2,
                 timeout=90, message="both ship-order jobs done by the site's agent")
    finally:
        daemons.stop_all()

    versions = dict(query(site_env, "SELECT j.id::text, w.version FROM accs_job j JOIN accs_workflow w "
                                    "ON w.id = j.workflow_id"))
    assert versions == {first: 1, second: 2}, "the first job ran on the version it started with"
    one, two = _tasks(site_env, first), _tasks(site_env, second)
    assert set(one) == {"pick", "label[0]", "label[1]", "receipt", "ship"}, "one label task per parcel"
    assert all(status == "done" for status, _ in one.values())
    assert one["pick"][1] == {"picked": "R-1", "items": 2, "parcels": ["R-1/1", "R-1/2"]}, "default params from code"
    assert [one[f"label[{i}]"][1] for i in (0, 1)] == [{"label": "R-1/1", "n": 1, "of": 2},
                                                       {"label": "R-1/2", "n": 2, "of": 2}], (
        "each label task got its parcel in argv ({inputs.item}) and its index and pick's output in ACCS_INPUTS")
    assert one["receipt"][1] == {"return_value": "receipt for from-code: 2 item(s)"}, (
        "the @task step got its kwargs and, in inputs=, pick's output")
    assert one["ship"][1] == {"closed": "R-1", "carrier": "post", "labels": ["R-1/1", "R-1/2"],
                              "receipt": "receipt for from-code: 2 item(s)"}, "ship gathered the labels in order"
    # The second order is empty: no parcel to label (the fan-out is skipped), its receipt's condition does
    # not hold, and the always step still closes it.
    assert two["label"][0] == "skipped" and two["receipt"][0] == "skipped"
    assert two["ship"] == ("done", {"closed": "R-2", "carrier": "ups", "labels": [], "receipt": None})
    skips = dict(query(site_env, "SELECT t.step_key, e.message FROM accs_event e JOIN accs_task t ON t.id = e.task_id "
                                 "WHERE t.job_id = %s AND e.data->>'to' = 'skipped'", uuid.UUID(second)))
    assert skips == {"receipt": "task waiting → skipped (condition did not hold: $.pick.items > 0)",
                     "label": "task waiting → skipped (fan_out over an empty list: $.pick.parcels)"}
