"""Node wake (loopback only), cheap builder ticks, and the http / simulate executors."""

from __future__ import annotations

import json
import socket
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from django.db import connection
from django.utils import timezone

from jobs import admission, api, transitions
from jobs.models import Task
from nodes.executors import RunContext, SimulateExecutor
from nodes.models import Node
from nodes.wake import magic_packet, wake_nodes
from tests.daemons import wait_all_final

pytestmark = pytest.mark.django_db


class _Recorder(BaseHTTPRequestHandler):
    bodies: list = []

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        reply = json.dumps({"echo": body.get("params", body)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http_server():
    _Recorder.bodies = []
    server = HTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.fixture
def gpu_service(make_service):
    return make_service("gpu-render", required_labels={"gpu": "true"})


def test_wake_on_lan_sends_the_magic_packet_to_a_loopback_listener(gpu_service):
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.settimeout(5)
    port = listener.getsockname()[1]
    Node.objects.create(name="sleepy", labels={"gpu": "true"}, wake_method="wol", mac="aa:bb:cc:dd:ee:ff",
                        wake_address=f"127.0.0.1:{port}", awake_state="sleep")
    api.start_service("gpu-render", scheduled_at=timezone.now() + timedelta(minutes=3))
    assert wake_nodes() == ["sleepy"]
    packet, _ = listener.recvfrom(200)
    assert packet == magic_packet("aa:bb:cc:dd:ee:ff") and packet[:6] == b"\xff" * 6 and len(packet) == 102
    assert wake_nodes() == [], "not woken again within the re-wake interval"
    listener.close()


def test_no_wake_when_an_awake_node_offers_the_labels(gpu_service):
    Node.objects.create(name="up", labels={"gpu": "true"}, last_seen=timezone.now())
    Node.objects.create(name="sleepy", labels={"gpu": "true"}, wake_method="script", script="/bin/true")
    api.start_service("gpu-render")
    assert wake_nodes() == []


def test_no_wake_for_work_beyond_five_minutes(gpu_service):
    Node.objects.create(name="sleepy", labels={"gpu": "true"}, wake_method="script", script="/bin/true")
    api.start_service("gpu-render", scheduled_at=timezone.now() + timedelta(minutes=30))
    assert wake_nodes() == []


def test_provider_api_and_script_wake(gpu_service, http_server, tmp_path):
    url = f"http://127.0.0.1:{http_server.server_port}/wake"
    Node.objects.create(name="cloud", labels={"gpu": "true"}, wake_method="provider", provider_ref=url)
    api.start_service("gpu-render")
    assert wake_nodes() == ["cloud"]
    assert _Recorder.bodies == [{"node": "cloud", "action": "wake"}]
    marker = tmp_path / "woken"
    script = tmp_path / "wake.sh"
    script.write_text(f"#!/bin/sh\necho \"$1\" > {marker}\n")
    script.chmod(0o755)
    Node.objects.filter(name="cloud").update(wake_method="none")
    Node.objects.create(name="rack", labels={"gpu": "true"}, wake_method="script", script=str(script))
    assert wake_nodes() == ["rack"]
    assert marker.read_text().strip() == "rack"


def test_builder_due_scan_uses_the_partial_due_index(make_service):
    make_service("svc")
    api.start_many([api.JobSpec(service="svc", scheduled_at=timezone.now() + timedelta(days=1)) for _ in range(3000)])
    with connection.cursor() as cur:
        cur.execute("ANALYZE accs_job")
        cur.execute("EXPLAIN " + admission.DUE_UNLIMITED_SQL, {"now": timezone.now(), "limit": 500})
        plan = "\n".join(r[0] for r in cur.fetchall())
    assert "job_due_idx" in plan, plan
    assert transitions.start_due_jobs() == [], "nothing due: nothing started"


def test_simulate_executor_is_deterministic_per_seed_task_and_attempt(make_service):
    from jobs.claim import ClaimedTask

    config = {"seed": 3, "error_rate": 0.5, "timeout_rate": 0.1, "min_delay_ms": 0, "max_delay_ms": 1}
    outcomes = []
    for _ in range(2):
        row = []
        for i in range(40):
            task = ClaimedTask(id=f"00000000-0000-0000-0000-{i:012d}", job_id="j", task_key="t", attempt=1,
                               params={}, timeout_seconds=1, host=f"h{i}", service_key="sim")
            ctx = RunContext(task=task, service_config=config, on_started=lambda pid: None,
                             on_progress=lambda v: None, on_log=lambda level, m: None)
            row.append(SimulateExecutor().run(task, ctx).status)
        outcomes.append(row)
    assert outcomes[0] == outcomes[1], "same seed, task and attempt → same outcome"
    assert {"succeeded", "failed"} <= set(outcomes[0]), "an unstable network: some calls fail"


@pytest.mark.django_db(transaction=True)
def test_http_executor_posts_the_task_to_a_local_service(make_service, http_server, daemons, db_url):
    url = f"http://127.0.0.1:{http_server.server_port}/run"
    make_service("remote", executor="http", executor_config={"url": url},
                 params_schema={"type": "object", "properties": {"x": {"type": "integer"}}})
    job = api.start_service("remote", params={"x": 7})
    daemons.agent("n1", "remote")
    wait_all_final(db_url, timeout=30)
    task = Task.objects.get(job=job)
    assert task.status == "done" and task.results == {"echo": {"x": 7}}
    assert _Recorder.bodies[0]["task_id"] == str(task.id) and _Recorder.bodies[0]["attempt"] == 1
