"""Node presence: online while an agent heartbeats, offline when it stops cleanly, lost when it
falls silent; nodes that never ran anything can be retired; unknown services are refused."""

from __future__ import annotations

import signal

import pytest
from django.db import connection

from events.models import Event
from jobs import api
from nodes.api import mark_lost, register_node, retire_nodes, touch_node
from nodes.models import Node
from tests.daemons import wait_for
from tests.engine_helpers import claim_for, run_ok

pytestmark = pytest.mark.django_db(transaction=True)


def _presence(name: str) -> str:
    return Node.objects.values_list("presence", flat=True).get(name=name)


def test_an_agent_naming_an_unknown_service_is_refused_and_registers_no_node(daemons, make_service):
    make_service("resize")
    make_service("render")
    proc = daemons.agent("typo-node", "resize,rezise")
    assert proc.wait(timeout=60) == 2
    output = proc.log_path.read_text()
    assert "unknown service(s): rezise; known services: render, resize" in output
    assert "Traceback" not in output
    assert not Node.objects.filter(name="typo-node").exists(), "a typo must not leave a phantom node"


def test_a_cleanly_stopped_agent_marks_its_node_offline(daemons, make_service):
    make_service("resize")
    proc = daemons.agent("n-clean", "resize", "--poll-interval", "0.2")
    wait_for(lambda: Node.objects.filter(name="n-clean", presence="online").exists(), timeout=60,
             message="the agent registers its node")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert _presence("n-clean") == "offline"
    assert Event.objects.filter(type="node", data__node="n-clean", data__to="offline").count() == 1


def test_a_silent_node_becomes_lost_and_comes_back_online_with_its_next_heartbeat(db):
    register_node("quiet", labels={}, services=[], agent_id="h:1:a")
    register_node("chatty", labels={}, services=[], agent_id="h:2:b")
    with connection.cursor() as cur:  # ten minutes of silence on PostgreSQL's clock
        cur.execute("UPDATE accs_node SET last_seen = now() - interval '10 minutes' WHERE name = 'quiet'")
    assert mark_lost(after_seconds=300) == ["quiet"]
    assert mark_lost(after_seconds=300) == [], "marked once"
    assert (_presence("quiet"), _presence("chatty")) == ("lost", "online")
    lost = Event.objects.get(type="node", data__node="quiet", data__to="lost")
    assert "no heartbeat for 60" in lost.message and lost.level == "warn"
    touch_node("quiet", agent_id="h:1:a")
    assert _presence("quiet") == "online"
    assert Event.objects.filter(type="node", data__node="quiet", data__from="lost", data__to="online").count() == 1


def test_only_nodes_that_are_not_online_and_never_ran_a_task_can_be_retired(make_service):
    svc = make_service("resize")
    for name in ("phantom", "worked", "busy"):
        register_node(name, labels={}, services=["resize"], agent_id=f"h:{name}:x")
    api.start_service("resize")
    run_ok(claim_for(svc, agent="h:worked:x"), agent="h:worked:x")
    with connection.cursor() as cur:
        cur.execute("UPDATE accs_task SET node = 'worked'")
        cur.execute("UPDATE accs_attempt SET node = 'worked'")
        cur.execute("UPDATE accs_node SET presence = 'offline' WHERE name IN ('phantom', 'worked')")
    retired, refused = retire_nodes(["phantom", "worked", "busy", "nobody"], by="ops")
    assert retired == ["phantom"]
    assert refused == {"worked": "it has run tasks or has hosts; its history keeps it",
                       "busy": "it is online (stop its agent first)", "nobody": "no such node"}
    assert sorted(Node.objects.values_list("name", flat=True)) == ["busy", "worked"]
    assert Event.objects.filter(type="node", data__node="phantom", data__to="retired").exists()
