"""``manage.py runagent --node NAME --services a,b [--max-concurrent N] [--once]``.

Bad options and settings are refused before anything starts: one line on stderr, exit code 2
(:mod:`accs_site.cli`).
"""

from __future__ import annotations

import re

from accs_site.cli import OperatorCommand, bounded, usage_error
from accs_site.conf import SettingError, accs, parse_labels
from accs_site.daemon import ensure_daemon_logging
from nodes.agent import Agent
from nodes.models import Node

# Node names appear in URLs, log lines and NOTIFY payloads: keep them to hostname-like words.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def node_name_problem(name: str) -> str | None:
    """Return why ``name`` cannot name a node, or None when it can."""
    limit = Node._meta.get_field("name").max_length
    if limit is not None and len(name) > limit:
        return f"is {len(name)} characters long; at most {limit} are allowed"
    if not NODE_NAME.fullmatch(name):
        return (f"{name!r} has characters a node name cannot have; use letters, digits, '.', '_' and '-', "
                "starting with a letter or digit")
    return None


class Command(OperatorCommand):
    help = "Run an agent: claim tasks of the given services on this node and run them."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--node", default=None, help="Node name (default: ACC_NODE_NAME, else the hostname).")
        parser.add_argument("--services", required=True, help="Comma-separated service keys.")
        parser.add_argument("--max-concurrent", type=bounded(int, minimum=1, maximum=1000), default=4,
                            help="Tasks run at once, 1-1000 (default: %(default)s).")
        parser.add_argument("--labels", default=None, help="key=value,... (default: ACC_NODE_LABELS).")
        parser.add_argument("--once", action="store_true", help="Exit when no work is left.")
        parser.add_argument("--poll-interval", type=bounded(float, above=0, minimum=0.01, maximum=3600),
                            default=None, help="Seconds between polls when no NOTIFY arrives, 0.01-3600 "
                                               "(default: ACC_POLL_INTERVAL_SEC, else 2).")
        parser.add_argument("--lease-seconds", type=bounded(float, above=0, minimum=3, maximum=86400),
                            default=None, help="Lease TTL in seconds, 3-86400; heartbeats come every third of it "
                                               "(default: ACC_HEARTBEAT_TTL_SEC, else 120).")
        parser.add_argument("--drain-seconds", type=bounded(float, minimum=0, maximum=7 * 86400), default=None,
                            help="After the first SIGTERM, let running tasks finish for at most this long, then "
                                 "stop them and hand them back as interrupted (default: as long as they take). "
                                 "Keep it below the supervisor's stop timeout (TimeoutStopSec).")
        parser.add_argument("--database-wait", type=bounded(float, minimum=0, maximum=86400), default=None,
                            help="Seconds to wait for PostgreSQL at start before giving up with exit code 3 "
                                 "(default: 30 with --once, else until it answers).")
        parser.add_argument("--claim-batch", type=bounded(int, minimum=1, maximum=1000), default=None,
                            help="Most tasks claimed per statement, 1-1000 (default: --max-concurrent).")

    def handle(self, *args, **options) -> None:
        ensure_daemon_logging()
        services = [s.strip() for s in options["services"].split(",") if s.strip()]
        if not services:
            raise usage_error("--services needs at least one service key")
        node = options["node"] or accs.node_name
        problem = node_name_problem(node)
        if problem:
            source = "--node" if options["node"] else "ACC_NODE_NAME (or the hostname)"
            raise usage_error(f"{source}: the node name {problem}")
        try:
            labels = parse_labels("--labels", options["labels"]) if options["labels"] else accs.node_labels
        except SettingError as exc:
            raise usage_error(str(exc)) from None
        agent = Agent(node=node, services=services, max_concurrent=options["max_concurrent"], once=options["once"],
                      labels=labels, poll_interval=options["poll_interval"], lease_seconds=options["lease_seconds"],
                      claim_batch=options["claim_batch"], drain_seconds=options["drain_seconds"],
                      database_wait=options["database_wait"])
        agent.install_signal_handlers()
        raise SystemExit(agent.run())
