"""``manage.py runbuilder [--tick SECONDS] [--batch N] [--lease-seconds S] [--once]``.

Bad options and settings are refused before anything starts: one line on stderr, exit code 2
(:mod:`accs_site.cli`).
"""

from __future__ import annotations

from accs_site.cli import OperatorCommand, bounded
from accs_site.daemon import ensure_daemon_logging
from jobs.builder import Builder
from jobs.leader import LEASE_SECONDS


class Command(OperatorCommand):
    help = "Run a builder: start due jobs; the elected leader also runs maintenance (leases, cron, partitions, wake)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--tick", type=bounded(float, above=0, minimum=0.01, maximum=3600), default=1.0,
                            help="Seconds between ticks without a NOTIFY, 0.01-3600 (default: %(default)s).")
        parser.add_argument("--batch", type=bounded(int, minimum=1, maximum=10000), default=500,
                            help="Most jobs started per statement, 1-10000 (default: %(default)s).")
        parser.add_argument("--lease-seconds", type=bounded(float, above=0, minimum=1, maximum=600),
                            default=LEASE_SECONDS, help="Length of the leader lease, 1-600: a dead leader is "
                                                        "replaced this long after its last renewal "
                                                        "(default: %(default)s).")
        parser.add_argument("--once", action="store_true", help="Run one tick (and all maintenance) and exit.")

    def handle(self, *args, **options) -> None:
        ensure_daemon_logging()
        builder = Builder(tick_seconds=options["tick"], batch=options["batch"], once=options["once"],
                          lease_seconds=options["lease_seconds"])
        builder.install_signal_handlers()
        raise SystemExit(builder.run())
