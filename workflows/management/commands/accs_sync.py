"""``manage.py accs_sync [--plan] [--check] [--allow-destructive] [MODULE ...]``: store the code's definitions."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from workflows.code import discover
from workflows.sync import DestructiveChange, Plan, apply, plan
from workflows.validation import DefinitionError


class Command(BaseCommand):
    help = ("Compare the services and workflows defined in each installed app's pipelines module with the "
            "database, print the plan and apply it in one transaction (a changed workflow becomes a new version).")

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("modules", nargs="*",
                            help="Dotted modules to read (default: <app>.pipelines of every app).")
        parser.add_argument("--plan", action="store_true", help="Print the plan; write nothing.")
        parser.add_argument("--check", action="store_true",
                            help="Write nothing; exit with status 1 when the database differs from the code.")
        parser.add_argument("--allow-destructive", action="store_true",
                            help="Deactivate code-defined services that unfinished jobs or triggers still name.")

    def handle(self, *args: str, **options: Any) -> None:
        definitions = discover(options["modules"] or None)
        try:
            if options["plan"] or options["check"]:
                planned = plan(definitions)
            else:
                planned = apply(definitions, allow_destructive=options["allow_destructive"])
        except DefinitionError as exc:
            raise CommandError("invalid definitions, nothing written:\n  "
                               + "\n  ".join(str(p) for p in exc.problems)) from None
        except DestructiveChange as exc:
            raise CommandError(f"refusing a destructive change, nothing written: {exc}; "
                               "rerun with --allow-destructive to apply it") from None
        self._print(planned, applied=not (options["plan"] or options["check"]), verbose=options["verbosity"] >= 2)
        if options["check"] and planned.changes:
            raise CommandError(f"the database differs from the code ({len(planned.changes)} change(s)); "
                               "run manage.py accs_sync", returncode=1)

    def _print(self, planned: Plan, *, applied: bool, verbose: bool) -> None:
        self.stdout.write(self.style.MIGRATE_HEADING("Applied:" if applied else "Planned operations:"))
        if not planned.changes:
            self.stdout.write("  No changes: the database matches the code.")
        for action in planned.actions:
            if action.changes or verbose:
                self.stdout.write(f"  {action}")
        unchanged = len(planned.actions) - len(planned.changes)
        if unchanged and not verbose:
            self.stdout.write(f"  {unchanged} definition(s) unchanged (-v 2 lists them)")
