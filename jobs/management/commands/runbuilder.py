"""``manage.py runbuilder [--tick SECONDS] [--batch N] [--once]``."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from jobs.builder import Builder


class Command(BaseCommand):
    help = "Run a builder: start due jobs; the elected leader also runs maintenance (leases, cron, partitions, wake)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--tick", type=float, default=1.0, help="Seconds between ticks without a NOTIFY.")
        parser.add_argument("--batch", type=int, default=500, help="Most jobs started per statement.")
        parser.add_argument("--once", action="store_true", help="Run one tick (and all maintenance) and exit.")

    def handle(self, *args, **options) -> None:
        if options["tick"] <= 0 or options["batch"] < 1:
            raise CommandError("--tick must be positive and --batch at least 1")
        builder = Builder(tick_seconds=options["tick"], batch=options["batch"], once=options["once"])
        builder.install_signal_handlers()
        raise SystemExit(builder.run())
