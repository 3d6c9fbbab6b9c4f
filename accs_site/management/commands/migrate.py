"""``manage.py migrate``: Django's, which also tells when the database is newer than this code.

A database migrated by a newer release has ACCS migrations applied whose files this code lacks.
Django alone says "No migrations to apply" and passes ``--check``; this command prints one line
naming them, and with ``--check`` fails with it (exit code 1), so a rollback is not taken for
done while the schema is ahead of the code. Plain ``migrate`` goes on (the web unit runs it before
starting, and the previous release's code works on the newer schema).

Each statement waits for a lock at most ``--lock-timeout`` seconds (``ACC_MIGRATE_LOCK_TIMEOUT_SEC``),
and a migration whose wait timed out is tried again, up to ``--lock-tries`` tries
(``ACC_MIGRATE_LOCK_TRIES``): see :mod:`accs_site.migrate_locks`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.core.management.commands import migrate as django_migrate
from django.core.management.commands.migrate import Command as DjangoMigrate
from django.db import connections
from django.db.migrations.executor import MigrationExecutor

from accs_site.conf import accs
from accs_site.daemon import newer_migrations
from accs_site.migrate_locks import BoundedLocks, LockPolicy, MigrationLockTimeout, RetryingExecutor


def newer_schema_line(newer: list[str]) -> str:
    """Return the one line saying the database is ahead of this code, naming its migrations."""
    shown = ", ".join(newer[:5]) + (f" and {len(newer) - 5} more" if len(newer) > 5 else "")
    return (f"the database is newer than this code: {len(newer)} applied ACCS migration(s) it does not have "
            f"({shown}); a newer release migrated it. To roll the schema back, run that release's "
            "`manage.py migrate APP MIGRATION` first (docs/deploy.md, Rolling back)")


class Command(DjangoMigrate):
    help = DjangoMigrate.help + (" Says (and with --check fails) when the database is newer than this code. Each "
                                 "statement waits for a lock at most --lock-timeout seconds; a migration whose wait "
                                 "timed out is tried again, --lock-tries tries in all.")

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--lock-timeout", type=float, default=None, metavar="SECONDS",
                            help="the longest any statement waits for a lock (default ACC_MIGRATE_LOCK_TIMEOUT_SEC, 2)")
        parser.add_argument("--lock-tries", type=int, default=None, metavar="N",
                            help="tries of a migration whose lock wait timed out (default ACC_MIGRATE_LOCK_TRIES, 5)")

    def handle(self, *args: Any, **options: Any) -> None:
        newer = newer_migrations(database=options["database"])
        if newer:
            if options["check_unapplied"]:
                raise CommandError(newer_schema_line(newer), returncode=1)
            self.stderr.write(newer_schema_line(newer))
        try:
            policy = LockPolicy(
                timeout_s=accs.migrate_lock_timeout_sec if options["lock_timeout"] is None else options["lock_timeout"],
                tries=accs.migrate_lock_tries if options["lock_tries"] is None else options["lock_tries"])
        except ValueError as exc:
            raise CommandError(str(exc), returncode=2) from None
        bounded = BoundedLocks(connection=connections[options["database"]], policy=policy,
                               note=lambda line: self.stdout.write(f" {line}"))
        try:
            with bounded.active(), _executor(bounded):
                super().handle(*args, **options)
        except MigrationLockTimeout as exc:
            raise CommandError(str(exc), returncode=1) from None


@contextmanager
def _executor(bounded: BoundedLocks) -> Iterator[None]:
    """Let Django's migrate build a :class:`RetryingExecutor` (it names its executor class at module level)."""
    executor = type("BoundedExecutor", (RetryingExecutor,), {"bounded": bounded})
    django_migrate.MigrationExecutor = executor  # type: ignore[attr-defined]
    try:
        yield
    finally:
        django_migrate.MigrationExecutor = MigrationExecutor  # type: ignore[attr-defined]
