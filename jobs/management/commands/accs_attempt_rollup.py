"""``manage.py accs_attempt_rollup [--batch N]``: fold every finished attempt into the dashboard's rollups now
(jobs.attempt_rollup), batch by batch, each in its own transaction: the builder's duty does the same a few
batches every 30 s; this catches up at once after the upgrade."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from jobs.attempt_rollup import FOLD_BATCH, behind, fold


class Command(BaseCommand):
    help = ("Fold the finished attempts into the dashboard's rollups until they are caught up, in batches each in "
            "its own transaction; safe to run while the daemons (and the builder's fold) run, and to run again.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch", type=int, default=FOLD_BATCH,
                            help=f"Attempts per transaction, about (default {FOLD_BATCH}).")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["batch"] < 1:
            raise CommandError(f"--batch must be at least 1, got {options['batch']}")
        started, total = time.monotonic(), 0
        while True:
            n = fold(limit=options["batch"])
            total += n
            if n:
                self.stderr.write(f"{total} attempts folded")
            if not behind():
                break
        with connection.cursor() as cur:  # the readers' plans see the filled tables before autovacuum does
            cur.execute("ANALYZE accs_attempt_rollup, accs_attempt_node_rollup")
        self.stdout.write(f"folded {total} attempts in {time.monotonic() - started:.1f} s")
