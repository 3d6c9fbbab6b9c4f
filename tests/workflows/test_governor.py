"""Resource governor and disk watch: conditions with expiry, claim adjustments, disk levels."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from events.models import Event
from jobs import api
from nodes.disk import KEEP_SAMPLES, claiming_paused, level_for, sample_disk
from nodes.models import DiskSample, Node
from workflows import governor
from workflows.models import GovernorCondition
from workflows.validation import DefinitionError

pytestmark = pytest.mark.django_db


def test_raised_condition_holds_until_cleared_and_each_change_is_an_event():
    api.raise_condition("live_session", reason="studio is live", by="alice")
    assert governor.active_conditions() == {"live_session"}
    assert api.clear_condition("live_session", by="bob") is True
    assert governor.active_conditions() == set()
    assert api.clear_condition("live_session", by="bob") is False, "clearing twice changes nothing"
    messages = list(Event.objects.filter(type="governor").order_by("id").values_list("message", flat=True))
    assert messages == ["governor condition live_session raised by alice until cleared: studio is live",
                        "governor condition live_session cleared by bob"]


def test_condition_with_expiry_stops_holding_and_expiry_is_recorded_once():
    now = timezone.now()
    governor.raise_condition("backup", reason="nightly", expires_at=now + timedelta(minutes=10), by="cron", now=now)
    assert governor.active_conditions(now + timedelta(minutes=9)) == {"backup"}
    assert governor.active_conditions(now + timedelta(minutes=10)) == set()
    assert governor.expire_conditions(now + timedelta(minutes=5)) == []
    assert governor.expire_conditions(now + timedelta(minutes=11)) == ["backup"]
    assert governor.expire_conditions(now + timedelta(minutes=12)) == [], "an expiry is recorded once"
    assert Event.objects.filter(type="governor", data__to="expired").count() == 1
    cond = GovernorCondition.objects.get(name="backup")
    assert not cond.holds(now + timedelta(minutes=1)), "an expired-and-recorded condition no longer holds"


def test_raising_again_rearms_a_cleared_condition():
    governor.raise_condition("maint", reason="one", by="a")
    governor.clear_condition("maint", "a")
    governor.raise_condition("maint", reason="two", by="b")
    assert governor.active_conditions() == {"maint"}
    assert GovernorCondition.objects.get(name="maint").reason == "two"


def test_raise_condition_rejects_bad_names_and_past_expiry():
    with pytest.raises(DefinitionError, match="name"):
        governor.raise_condition("not a slug!", reason="", by="x")
    with pytest.raises(DefinitionError, match="expires_at"):
        governor.raise_condition("x", reason="", by="x", expires_at=timezone.now() - timedelta(seconds=1))
    assert not GovernorCondition.objects.exists()


def test_condition_raised_in_a_rolled_back_transaction_does_not_exist():
    with pytest.raises(RuntimeError), transaction.atomic():
        api.raise_condition("live_session", reason="", by="x")
        raise RuntimeError("caller rolls back")
    assert governor.active_conditions() == set() and not Event.objects.filter(type="governor").exists()


def test_claim_adjustments_block_and_reprioritise_only_while_conditions_hold(make_service):
    heavy = make_service("whisper", block_during=["live_session"], priority_adjust_during={"live_session": -3})
    light = make_service("render", priority_adjust_during={"live_session": -1, "backup": -2})
    assert governor.claim_adjustments(heavy, set()) == (False, 0)
    assert governor.claim_adjustments(heavy, {"live_session"}) == (True, -3)
    assert governor.claim_adjustments(light, {"live_session"}) == (False, -1)
    assert governor.claim_adjustments(light, {"live_session", "backup"}) == (False, -3)
    assert governor.claim_adjustments(light, {"other"}) == (False, 0)


# --------------------------------------------------------------------------------------------
# Disk watch
# --------------------------------------------------------------------------------------------

GB = 10**9


def usage(pct: float, total: int = 100 * GB) -> tuple[int, int, int]:
    used = int(total * pct / 100)
    return total, used, total - used


@pytest.fixture
def node(db):
    return Node.objects.create(name="node-1")


@pytest.mark.parametrize(("pct", "level"), [
    (0, "ok"), (84.99, "ok"), (85, "warning"), (89.9, "warning"), (90, "critical"), (94.99, "critical"),
    (95, "emergency"), (100, "emergency"),
])
def test_disk_levels_follow_seed_001_thresholds(pct, level):
    assert level_for(pct) == level


def test_disk_level_changes_raise_events_once_and_emergency_pauses_claiming(node):
    for pct in (50, 86, 87, 91, 96, 97, 80):
        sample_disk("node-1", "/data", usage=usage(pct))
        if pct == 96:
            assert claiming_paused("node-1") is True
    assert claiming_paused("node-1") is False
    events = list(Event.objects.filter(type="disk").order_by("id").values_list("level", "data__from", "data__to"))
    assert events == [("warn", "ok", "warning"), ("warn", "warning", "critical"), ("error", "critical", "emergency"),
                      ("info", "emergency", "ok")]
    node.refresh_from_db()
    assert node.disk_level == "ok"
    assert list(DiskSample.objects.order_by("ts", "id").values_list("level", flat=True)) == [
        "ok", "warning", "warning", "critical", "emergency", "emergency", "ok"]


def test_disk_keeps_only_the_last_thousand_samples_per_node(node):
    Node.objects.create(name="node-2")
    start = timezone.now()
    DiskSample.objects.bulk_create([
        DiskSample(node_id="node-1", ts=start + timedelta(seconds=i), path="/", total_bytes=1, used_bytes=0, used_pct=0)
        for i in range(KEEP_SAMPLES + 5)])
    sample_disk("node-2", "/", usage=usage(10), now=start)
    newest = sample_disk("node-1", "/", usage=usage(10), now=start + timedelta(hours=1))
    assert DiskSample.objects.filter(node_id="node-1").count() == KEEP_SAMPLES
    assert DiskSample.objects.filter(node_id="node-1").order_by("ts").first().ts == start + timedelta(seconds=6)
    assert DiskSample.objects.filter(node_id="node-1").order_by("-ts").first().pk == newest.pk
    assert DiskSample.objects.filter(node_id="node-2").count() == 1, "other nodes' samples are untouched"


def test_sample_disk_measures_a_real_path_and_refuses_unknown_nodes(node, tmp_path):
    sample = sample_disk("node-1", str(tmp_path))
    assert sample.total_bytes > 0 and 0 <= sample.used_pct <= 100
    with pytest.raises(LookupError, match="no node"):
        sample_disk("ghost", str(tmp_path), usage=usage(10))
