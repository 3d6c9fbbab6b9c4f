"""``manage.py runagent --node NAME --services a,b [--max-concurrent N] [--once]``."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from accs_site.conf import accs, parse_labels
from nodes.agent import Agent


class Command(BaseCommand):
    help = "Run an agent: claim tasks of the given services on this node and run them."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--node", default=None, help="Node name (default: ACC_NODE_NAME or the hostname).")
        parser.add_argument("--services", required=True, help="Comma-separated service keys.")
        parser.add_argument("--max-concurrent", type=int, default=4, help="Tasks run at once (default 4).")
        parser.add_argument("--labels", default=None, help="key=value,... (default: ACC_NODE_LABELS).")
        parser.add_argument("--once", action="store_true", help="Exit when no work is left.")
        parser.add_argument("--poll-interval", type=float, default=None, help="Seconds between polls (fallback).")
        parser.add_argument("--lease-seconds", type=float, default=None, help="Lease TTL (default ACC_HEARTBEAT_TTL_SEC).")
        parser.add_argument("--claim-batch", type=int, default=None, help="Most tasks claimed per statement.")

    def handle(self, *args, **options) -> None:
        services = [s.strip() for s in options["services"].split(",") if s.strip()]
        if not services:
            raise CommandError("--services needs at least one service key")
        if options["max_concurrent"] < 1:
            raise CommandError("--max-concurrent must be at least 1")
        labels = parse_labels("--labels", options["labels"]) if options["labels"] else accs.node_labels
        agent = Agent(node=options["node"] or accs.node_name, services=services,
                      max_concurrent=options["max_concurrent"], once=options["once"], labels=labels,
                      poll_interval=options["poll_interval"], lease_seconds=options["lease_seconds"],
                      claim_batch=options["claim_batch"])
        agent.install_signal_handlers()
        raise SystemExit(agent.run())
