"""Create upcoming timeline partitions, then archive and drop months past the retention period."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from accs_site.conf import accs
from events import partitions
from events.storage import is_configured


class Command(BaseCommand):
    help = (
        "Create the event partitions for this month and ACC_EVENT_PARTITIONS_AHEAD more, then export "
        "months older than ACC_EVENT_RETENTION_MONTHS to object storage as JSONL, verify and drop them."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true",
                            help="Show what would be created and archived; change nothing.")
        parser.add_argument("--limit", type=int, default=12, help="Archive at most this many months (default 12).")
        parser.add_argument("--retention-months", type=int, default=None, help="Override ACC_EVENT_RETENTION_MONTHS.")
        parser.add_argument("--months-ahead", type=int, default=None, help="Override ACC_EVENT_PARTITIONS_AHEAD.")

    def handle(self, *args: Any, dry_run: bool, limit: int, retention_months: int | None, months_ahead: int | None,
               **options: Any) -> None:
        if limit < 1:
            raise CommandError("--limit must be at least 1")
        if retention_months is not None and retention_months < 1:
            raise CommandError("--retention-months must be at least 1")
        if months_ahead is not None and not 0 <= months_ahead <= 24:
            raise CommandError("--months-ahead must be between 0 and 24")
        retention = accs.event_retention_months if retention_months is None else retention_months
        ahead = accs.event_partitions_ahead if months_ahead is None else months_ahead
        verb = "would create" if dry_run else "created"

        missing = partitions.partitions_to_create(months_ahead=ahead)
        created = missing if dry_run else partitions.ensure_partitions(months_ahead=ahead)
        for name in created:
            self.stdout.write(f"{verb} partition {name}")
        if not created:
            self.stdout.write(f"partitions ready for this month and {ahead} ahead")

        due = partitions.partitions_to_archive(retention_months=retention)[:limit]
        if not due:
            self.stdout.write(f"nothing to archive (retention {retention} months)")
            return
        if not is_configured():
            self.stdout.write(self.style.WARNING(
                f"{len(due)} month(s) due for archiving, but artifact storage is not configured "
                "(ACC_MINIO_*); keeping them"
            ))
            return
        for number, partition in enumerate(due, start=1):
            prefix = f"[{number}/{len(due)}] {partition.month}"
            if dry_run:
                self.stdout.write(f"{prefix}: would archive {partition.name} to {partition.key} and drop it")
                continue
            self.stdout.write(f"{prefix}: exporting {partition.name} …")
            try:
                result = partitions.archive_partition(partition)
            except partitions.ArchiveError as exc:
                raise CommandError(str(exc)) from exc
            self.stdout.write(self.style.SUCCESS(
                f"{prefix}: archived {result.rows} rows ({result.bytes} bytes, {result.checksum}) "
                f"to s3://{result.bucket}/{result.key}; partition dropped"
            ))
