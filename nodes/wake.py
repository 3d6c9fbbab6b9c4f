"""Node wake: the WakeProvider interface and its three implementations."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import urllib.request
from datetime import datetime, timedelta
from typing import Protocol

from django.db import connection
from django.utils import timezone

from accs_site.conf import accs
from events.timeline import EventRow, write_events
from nodes.executors.base import INHERITED_ENV
from nodes.executors.guard import Refused, check_process
from nodes.executors.http import local_opener
from nodes.models import Node, WakeMethod
from workflows.validation import url_allowed

log = logging.getLogger("accs.wake")

WAKE_AHEAD = timedelta(minutes=5)
REWAKE_AFTER = timedelta(minutes=2)


class WakeProvider(Protocol):
    def wake(self, node: Node) -> bool: ...


def magic_packet(mac: str) -> bytes:
    """Return the Wake-on-LAN magic packet for ``mac`` (6 × 0xFF, then the MAC 16 times)."""
    digits = mac.replace(":", "").replace("-", "").lower()
    if len(digits) != 12 or any(c not in "0123456789abcdef" for c in digits):
        raise ValueError(f"not a MAC address: {mac!r}")
    return b"\xff" * 6 + bytes.fromhex(digits) * 16


class WakeOnLan:
    """Send a magic packet over UDP to the node's ``wake_address`` (host:port, default broadcast:9)."""

    def wake(self, node: Node) -> bool:
        host, _, port = (node.wake_address or "255.255.255.255:9").rpartition(":")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            if host.endswith(".255"):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            sock.sendto(magic_packet(node.mac), (host, int(port or 9)))
        return True


class ProviderApi:
    """POST ``{"node": name, "action": "wake"}`` to the provider URL in ``provider_ref``.

    The URL must start with one ``ACC_ALLOWED_HTTP_URLS`` lists, checked when it is used; redirects
    are not followed and proxy variables are ignored, so the request goes to that URL and nowhere else.
    """

    def wake(self, node: Node) -> bool:
        if not url_allowed(node.provider_ref, accs.allowed_http_urls):
            raise Refused(f"{node.provider_ref!r} does not start with a URL this site allows"
                          f" (ACC_ALLOWED_HTTP_URLS={','.join(accs.allowed_http_urls)})")
        body = json.dumps({"node": node.name, "action": "wake"}).encode()
        request = urllib.request.Request(node.provider_ref, data=body,
                                         headers={"Content-Type": "application/json"}, method="POST")
        with local_opener.open(request, timeout=10) as response:  # noqa: S310 - checked against the allow-list
            return 200 <= response.status < 300


class ShellScript:
    """Run the node's ``script`` with the node name as its only argument (argv, no shell).

    The script is checked like a task's program (``ACC_ALLOWED_EXECUTABLES``, resolved through
    symlinks) and runs with a task's inherited environment, never the builder's own settings (its
    database URL and keys).
    """

    def wake(self, node: Node) -> bool:
        if node.name.startswith("-"):
            raise Refused(f"node name {node.name!r} starts with '-' and would be read as an option of the script")
        argv = [node.script, node.name]
        env = {name: os.environ[name] for name in INHERITED_ENV if name in os.environ}
        checked = check_process(argv, env)  # the file executed is the one checked
        return subprocess.run(argv, executable=checked, env=env, timeout=30, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


PROVIDERS: dict[str, WakeProvider] = {WakeMethod.WOL: WakeOnLan(), WakeMethod.PROVIDER: ProviderApi(),
                                      WakeMethod.SCRIPT: ShellScript()}

NEEDED_LABELS_SQL = """
-- Services with required labels that have work due within the wake horizon: queued tasks, or
-- queued jobs (not yet instantiated) whose target service needs labels. Bounded by LIMITs so a
-- tick costs what is due, not the table size.
SELECT DISTINCT s.required_labels::text FROM accs_service s
 WHERE s.required_labels <> '{}'::jsonb AND (
       EXISTS (SELECT 1 FROM accs_task t WHERE t.service_id = s.id AND t.status = 'queued'
                 AND t.next_attempt_at <= %(horizon)s)
    OR EXISTS (SELECT 1 FROM accs_job j WHERE j.service_id = s.id AND j.status = 'queued'
                 AND j.scheduled_at <= %(horizon)s)
    OR EXISTS (SELECT 1 FROM accs_job j JOIN accs_workflow w ON w.id = j.workflow_id
                WHERE j.status = 'queued' AND j.scheduled_at <= %(horizon)s
                  AND w.steps @> jsonb_build_array(jsonb_build_object('service', s.key))))
"""


def _offers(labels: dict, needed: dict) -> bool:
    return all(str(labels.get(k)) == str(v) for k, v in needed.items())


def wake_nodes(*, now: datetime | None = None, stale_after: timedelta = timedelta(minutes=6),
               providers: dict[str, WakeProvider] | None = None) -> list[str]:
    """Wake sleeping nodes that offer labels needed by work due within 5 minutes. Return their names."""
    now = now or timezone.now()
    providers = providers or PROVIDERS
    with connection.cursor() as cur:
        cur.execute(NEEDED_LABELS_SQL, {"horizon": now + WAKE_AHEAD})
        needs = [json.loads(r[0]) for r in cur.fetchall()]
    if not needs:
        return []
    nodes = list(Node.objects.all())
    awake = [n for n in nodes if n.last_seen and n.last_seen > now - stale_after]
    woken: list[str] = []
    for needed in needs:
        if any(_offers(n.labels, needed) for n in awake):
            continue
        for node in nodes:
            if node in awake or not _offers(node.labels, needed) or node.wake_method == WakeMethod.NONE:
                continue
            if node.last_wake_at and node.last_wake_at > now - REWAKE_AFTER:
                continue
            provider = providers.get(node.wake_method)
            try:
                ok = bool(provider and provider.wake(node))
                error = ""
            except Exception as exc:  # noqa: BLE001 - a failed wake is recorded, the builder goes on
                ok, error = False, str(exc)
            Node.objects.filter(pk=node.pk).update(last_wake_at=now)
            write_events([EventRow(type="node", source="builder", level="info" if ok else "warn",
                                   message=f"wake {node.name} via {node.wake_method}: "
                                           f"{'sent' if ok else 'failed ' + error}",
                                   data={"node": node.name, "method": node.wake_method, "needed_labels": needed})])
            log.info("wake %s via %s: %s", node.name, node.wake_method, ok, extra={"node": node.name})
            if ok:
                woken.append(node.name)
                break
    return woken
