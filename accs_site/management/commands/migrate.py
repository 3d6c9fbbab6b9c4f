"""``manage.py migrate``: Django's, which also tells when the database is newer than this code.

A database migrated by a newer release has ACCS migrations applied whose files this code lacks.
Django alone says "No migrations to apply" and passes ``--check``; this command prints one line
naming them, and with ``--check`` fails with it (exit code 1), so a rollback is not taken for
done while the schema is ahead of the code. Plain ``migrate`` goes on (the web unit runs it before
starting, and the previous release's code works on the newer schema).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError
from django.core.management.commands.migrate import Command as DjangoMigrate

from accs_site.daemon import newer_migrations


def newer_schema_line(newer: list[str]) -> str:
    """Return the one line saying the database is ahead of this code, naming its migrations."""
    shown = ", ".join(newer[:5]) + (f" and {len(newer) - 5} more" if len(newer) > 5 else "")
    return (f"the database is newer than this code: {len(newer)} applied ACCS migration(s) it does not have "
            f"({shown}); a newer release migrated it. To roll the schema back, run that release's "
            "`manage.py migrate APP MIGRATION` first (docs/deploy.md, Rolling back)")


class Command(DjangoMigrate):
    help = DjangoMigrate.help + " Says (and with --check fails) when the database is newer than this code."

    def handle(self, *args: Any, **options: Any) -> None:
        newer = newer_migrations(database=options["database"])
        if newer:
            if options["check_unapplied"]:
                raise CommandError(newer_schema_line(newer), returncode=1)
            self.stderr.write(newer_schema_line(newer))
        super().handle(*args, **options)
