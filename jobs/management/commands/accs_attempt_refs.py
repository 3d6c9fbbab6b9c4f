"""``manage.py accs_attempt_refs [--batch N] [--claimable]``: copy each attempt's task service, tenant and
claimable time onto the attempts written before the upgrade that copies them (jobs.attempt_refs), online,
in small batches."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.attempt_refs import FILL_BATCH, fill_claimable, fill_missing


class Command(BaseCommand):
    help = ("Fill the service, tenant and claimable time of the attempts written before they were copied onto "
            "attempts, in batches each in its own transaction; safe to run while the daemons run, and to run again.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch", type=int, default=FILL_BATCH,
                            help=f"Attempts per transaction (default {FILL_BATCH}).")
        parser.add_argument("--claimable", action="store_true",
                            help="Also walk every attempt for a claimable time its task still holds: for a site "
                                 "whose attempts got their service and tenant before jobs.0040 copied the time.")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["batch"] < 1:
            raise CommandError(f"--batch must be at least 1, got {options['batch']}")
        filled = fill_missing(batch=options["batch"], progress=lambda n: self.stderr.write(f"{n} attempts filled"))
        self.stdout.write(f"filled {filled} attempts")
        if options["claimable"]:
            timed = fill_claimable(batch=options["batch"], progress=lambda walked, n: self.stderr.write(
                f"{walked} attempts read, {n} claimable times filled"))
            self.stdout.write(f"filled the claimable time of {timed} attempts")
