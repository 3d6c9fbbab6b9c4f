"""``manage.py accs_attempt_refs [--batch N]``: copy each attempt's task service and tenant onto the
attempts written before the upgrade that copies them (jobs.attempt_refs), online, in small batches."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.attempt_refs import FILL_BATCH, fill_missing


class Command(BaseCommand):
    help = ("Fill the service and tenant of the attempts written before they were copied onto attempts, in "
            "batches each in its own transaction; safe to run while the daemons run, and to run again.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch", type=int, default=FILL_BATCH,
                            help=f"Attempts per transaction (default {FILL_BATCH}).")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["batch"] < 1:
            raise CommandError(f"--batch must be at least 1, got {options['batch']}")
        filled = fill_missing(batch=options["batch"], progress=lambda n: self.stderr.write(f"{n} attempts filled"))
        self.stdout.write(f"filled {filled} attempts")
