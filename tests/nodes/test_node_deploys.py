"""Agents' deploys are dated: a node whose agent starts on another release than the node last reported
gets one deploy row, in the same transaction as the node row; the system timeline shows it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.urls import reverse
from django.utils import timezone
from hypothesis import given, settings, strategies as st

from nodes.api import register_node
from nodes.models import Node, NodeDeploy
from ops.system_timeline import system_timeline

pytestmark = pytest.mark.django_db


def start(name: str, version: str, *, agent: str = "h:1:a") -> Node:
    return register_node(name, labels={}, services=[], agent_id=agent, version=version)


def test_a_node_started_on_another_release_gets_one_dated_deploy_row():
    start("edge-1", "0.2.0")
    assert not NodeDeploy.objects.exists(), "a new node has no release to change from"
    start("edge-1", "0.2.0", agent="h:2:b")
    assert not NodeDeploy.objects.exists(), "a restart on the same release is no deploy"
    node = start("edge-1", "0.3.0", agent="h:3:c")
    deploy = NodeDeploy.objects.get()
    assert (deploy.node_name, deploy.previous_version, deploy.version, deploy.agent_id) == \
        ("edge-1", "0.2.0", "0.3.0", "h:3:c")
    assert deploy.started_at == node.last_seen, "stamped by the registration's clock"


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["", "0.2.0", "0.3.0", "0.3.1"]), min_size=1, max_size=8))
def test_deploy_rows_are_exactly_the_release_changes_in_order(versions):
    NodeDeploy.objects.all().delete()
    Node.objects.filter(name="gen").delete()
    for version in versions:
        start("gen", version)
    changes = [(a, b) for a, b in zip(versions, versions[1:], strict=False) if a != b]
    rows = list(NodeDeploy.objects.filter(node_name="gen").order_by("id").values_list("previous_version", "version"))
    assert rows == changes


def test_a_rolled_back_registration_leaves_neither_the_release_nor_its_deploy():
    start("edge-2", "0.2.0")
    with pytest.raises(RuntimeError), transaction.atomic():
        start("edge-2", "0.3.0")
        raise RuntimeError("the agent's start-up failed after registering")
    assert Node.objects.get(name="edge-2").version == "0.2.0"
    assert not NodeDeploy.objects.exists()
    start("edge-2", "0.3.0")
    assert NodeDeploy.objects.count() == 1, "the next start records it"


def test_the_system_timeline_shows_a_nodes_deploy_linked_to_the_node():
    start("gpu-1", "0.2.0")
    start("gpu-1", "0.3.0")
    now = timezone.now()
    entries = [e for e in system_timeline(since=now - timedelta(hours=1), until=now + timedelta(seconds=5))
               if e.kind == "deploy"]
    assert [e.text for e in entries] == ["node gpu-1 runs ACCS 0.3.0 (was 0.2.0)"]
    assert entries[0].url == reverse("admin:nodes_node_change", args=["gpu-1"])
    assert system_timeline(since=now - timedelta(hours=3), until=now - timedelta(hours=2)) == []
