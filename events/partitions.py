"""The timeline's monthly partitions: create them ahead of time, archive and drop old ones.

Small, bounded, idempotent steps for the builder's leader to call each tick (Oban's Pruner and
River's maintenance services are the model):

* :func:`ensure_partitions` creates the partitions for this month and the next
  ``ACC_EVENT_PARTITIONS_AHEAD`` months with the migration's ``accs_create_event_partition``.
* :func:`archive_partitions` takes up to ``limit`` months older than ``ACC_EVENT_RETENTION_MONTHS``
  and, for each, exports its rows to object storage as JSONL plus a manifest, reads both back to
  verify row count and checksum, and only then detaches and drops the partition. Any failure
  drops nothing and raises :class:`ArchiveError` naming the month and the step.

Rows are read in a transaction of their own and the upload happens outside any transaction, so
nothing is locked while bytes travel. The drop transaction re-counts the detached partition and
gives up if a (back-dated) event arrived meanwhile; the next tick exports again.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from accs_site.conf import accs
from events.models import Event, Level
from events.storage import Upload, get_storage, is_configured, iter_object

log = logging.getLogger(__name__)

PARENT_TABLE = "accs_event"
PARTITION_NAME = re.compile(r"^accs_event_(\d{4})_(\d{2})$")
ARCHIVE_PREFIX = "archive/events"
ARCHIVE_FORMAT = "accs.events.jsonl/1"
EVENT_TYPE = "archive"
SOURCE = "events.partitions"
FETCH_SIZE = 5000
SPOOL_LIMIT = 32 * 1024 * 1024
# DETACH takes an exclusive lock on the whole timeline; rather fail this tick than queue every
# event insert behind a long-running reader.
DETACH_LOCK_TIMEOUT = "5s"


@dataclass(frozen=True)
class EventPartition:
    """One monthly partition of the timeline: rows with ``start <= ts < end`` (UTC)."""

    name: str
    start: datetime
    end: datetime

    @classmethod
    def for_month(cls, when: datetime) -> EventPartition:
        start = month_start(when)
        return cls(name=f"{PARENT_TABLE}_{start:%Y_%m}", start=start, end=add_months(start, 1))

    @property
    def month(self) -> str:
        return f"{self.start:%Y-%m}"

    @property
    def key(self) -> str:
        return f"{ARCHIVE_PREFIX}/{self.start:%Y_%m}.jsonl"

    @property
    def manifest_key(self) -> str:
        return f"{ARCHIVE_PREFIX}/{self.start:%Y_%m}.manifest.json"


@dataclass(frozen=True)
class ArchiveResult:
    """What archiving one month did."""

    partition: str
    month: str
    rows: int
    bytes: int
    checksum: str
    bucket: str
    key: str
    manifest_key: str


class ArchiveError(Exception):
    """Archiving a month failed at ``step``; the partition and its rows are still in place."""

    def __init__(self, *, partition: str, step: str, problem: str) -> None:
        self.partition, self.step, self.problem = partition, step, problem
        super().__init__(f"archiving {partition} failed at {step}: {problem}; nothing was dropped")


@dataclass(frozen=True)
class _Target:
    key: str
    manifest_key: str


@dataclass
class _Export:
    rows: int
    bytes: int
    checksum: str
    max_id: int | None


def month_start(when: datetime) -> datetime:
    """Return the first instant of ``when``'s UTC month."""
    when = when.astimezone(UTC)
    return when.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def add_months(when: datetime, months: int) -> datetime:
    """Return the first instant of the UTC month ``months`` after ``when``'s month."""
    start = month_start(when)
    index = start.year * 12 + start.month - 1 + months
    return start.replace(year=index // 12, month=index % 12 + 1)


def list_partitions() -> list[EventPartition]:
    """Return the timeline's monthly partitions, oldest first (the DEFAULT partition is not one)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = %s::regclass",
            [PARENT_TABLE],
        )
        names = [row[0] for row in cur.fetchall()]
    partitions = []
    for name in names:
        # accs_create_event_partition names each partition after its month and bounds it to
        # exactly that UTC month, so the name is the bound (no parsing of pg_get_expr output).
        match = PARTITION_NAME.match(name)
        if match:
            year, month = int(match[1]), int(match[2])
            partitions.append(EventPartition.for_month(datetime(year, month, 1, tzinfo=UTC)))
    return sorted(partitions, key=lambda p: p.start)


def partitions_to_create(*, now: datetime | None = None, months_ahead: int | None = None) -> list[str]:
    """Return the names of the partitions :func:`ensure_partitions` would create."""
    now = now or timezone.now()
    ahead = accs.event_partitions_ahead if months_ahead is None else months_ahead
    existing = {p.name for p in list_partitions()}
    wanted = [EventPartition.for_month(add_months(now, m)).name for m in range(ahead + 1)]
    return [name for name in wanted if name not in existing]


def ensure_partitions(*, now: datetime | None = None, months_ahead: int | None = None) -> list[str]:
    """Create the partitions for ``now``'s month and ``months_ahead`` more; return those created.

    Idempotent: a month that has its partition is left alone, so a second call returns ``[]``.
    ``months_ahead`` defaults to ``ACC_EVENT_PARTITIONS_AHEAD``.
    """
    now = now or timezone.now()
    ahead = accs.event_partitions_ahead if months_ahead is None else months_ahead
    created = []
    missing = set(partitions_to_create(now=now, months_ahead=ahead))
    for m in range(ahead + 1):
        partition = EventPartition.for_month(add_months(now, m))
        if partition.name not in missing:
            continue
        with transaction.atomic(), connection.cursor() as cur:
            # The function also moves the month's rows out of the DEFAULT partition.
            cur.execute("SELECT accs_create_event_partition(%s)", [partition.start])
        created.append(partition.name)
        log.info("created event partition %s", partition.name)
    return created


def partitions_to_archive(*, now: datetime | None = None, retention_months: int | None = None) -> list[EventPartition]:
    """Return the partitions older than the retention period, oldest first.

    With retention ``R`` the current month and the ``R`` months before it are kept.
    """
    now = now or timezone.now()
    retention = accs.event_retention_months if retention_months is None else retention_months
    if retention < 1:
        raise ValueError(f"retention_months must be at least 1, got {retention}")
    cutoff = add_months(now, -retention)
    return [p for p in list_partitions() if p.end <= cutoff]


def archive_partitions(
    *,
    now: datetime | None = None,
    retention_months: int | None = None,
    limit: int = 1,
) -> list[ArchiveResult]:
    """Archive and drop up to ``limit`` partitions older than the retention period, oldest first.

    Return one result per dropped month. Stop at the first failure and raise
    :class:`ArchiveError` (that month and every later one stay in place). Without artifact storage
    archive nothing and return ``[]``: old months are kept, never dropped unexported.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    due = partitions_to_archive(now=now, retention_months=retention_months)[:limit]
    if not due:
        return []
    if not is_configured():
        log.warning("%d event partition(s) are due for archiving, but artifact storage is not configured", len(due))
        return []
    return [archive_partition(partition) for partition in due]


def archive_partition(partition: EventPartition) -> ArchiveResult:
    """Export one partition to object storage, verify the copy, then detach and drop the partition."""
    try:
        return _archive(partition)
    except ArchiveError as exc:
        _record_failure(exc)
        raise


def _archive(partition: EventPartition) -> ArchiveResult:
    storage = _step(partition, "storage", lambda: get_storage(action=f"archive {partition.name}"))
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_LIMIT) as spool:
        export = _step(partition, "export", lambda: _export(partition, spool))
        exported_at = timezone.now()
        target = _step(partition, "upload", lambda: _choose_target(storage, partition, export, exported_at))
        manifest = {
            "format": ARCHIVE_FORMAT,
            "table": PARENT_TABLE,
            "partition": partition.name,
            "month": partition.month,
            "from": partition.start.isoformat(),
            "to": partition.end.isoformat(),
            "rows": export.rows,
            "bytes": export.bytes,
            "checksum": export.checksum,
            "max_id": export.max_id,
            "object": target.key,
            "exported_at": exported_at.isoformat(),
        }
        _step(partition, "upload", lambda: _upload(storage, target, spool, manifest))
    _step(partition, "verify", lambda: _verify(storage, target, manifest))
    result = ArchiveResult(
        partition=partition.name, month=partition.month, rows=export.rows, bytes=export.bytes,
        checksum=export.checksum, bucket=storage.bucket_name, key=target.key, manifest_key=target.manifest_key,
    )
    _step(partition, "drop", lambda: _drop(partition, export, result))
    log.info("archived event partition %s (%d rows) to %s", partition.name, export.rows, target.key)
    return result


def _step(partition: EventPartition, step: str, action: Any) -> Any:
    try:
        return action()
    except ArchiveError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure must keep the partition, and say where
        raise ArchiveError(partition=partition.name, step=step, problem=f"{type(exc).__name__}: {exc}") from exc


def _export(partition: EventPartition, out: Any) -> _Export:
    """Write the partition's rows to ``out`` as JSONL (``row_to_json``, ordered by ts, id)."""
    digest = hashlib.sha256()
    rows = size = 0
    max_id: int | None = None
    table = connection.ops.quote_name(partition.name)  # the name matched PARTITION_NAME
    # A server-side cursor inside one transaction: one snapshot, bounded memory on big months.
    with transaction.atomic():
        with connection.cursor() as cur:
            # row_to_json renders timestamptz in the session time zone; pin it so archives agree.
            cur.execute("SET LOCAL TimeZone = 'UTC'")
        with connection.chunked_cursor() as cur:
            cur.execute(f"SELECT e.id, row_to_json(e)::text FROM {table} e ORDER BY e.ts, e.id")
            while batch := cur.fetchmany(FETCH_SIZE):
                for row_id, text in batch:
                    line = text.encode() + b"\n"
                    digest.update(line)
                    out.write(line)
                    rows += 1
                    size += len(line)
                    max_id = row_id if max_id is None else max(max_id, row_id)
    out.seek(0)
    return _Export(rows=rows, bytes=size, checksum=f"sha256:{digest.hexdigest()}", max_id=max_id)


def _choose_target(storage: Any, partition: EventPartition, export: _Export, exported_at: datetime) -> _Target:
    """Return where to store this export, never over an archive of different rows.

    The usual place is ``archive/events/YYYY_MM.jsonl``. A manifest there that describes other
    rows means the month was archived and dropped before (and events for it were written again):
    that copy may be the only one, so this export goes next to it under a timestamped name.
    A retry of the same rows (after a failed verify or drop) reuses the usual place.
    """
    usual = _Target(key=partition.key, manifest_key=partition.manifest_key)
    try:
        existing = json.loads(b"".join(iter_object(storage, usual.manifest_key)))
    except storage.connection.meta.client.exceptions.NoSuchKey:
        return usual  # none, or only a data object whose upload never finished (no manifest)
    if existing.get("checksum") == export.checksum:
        return usual
    stamp = exported_at.astimezone(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    base = f"{ARCHIVE_PREFIX}/{partition.start:%Y_%m}.{stamp}"
    return _Target(key=f"{base}.jsonl", manifest_key=f"{base}.manifest.json")


def _upload(storage: Any, target: _Target, data: Any, manifest: dict[str, Any]) -> None:
    """Store the rows, then the manifest (the manifest last: its presence means the data is whole)."""
    storage.save(target.key, Upload(data, name=target.key, content_type="application/x-ndjson"))
    body = Upload(io.BytesIO(json.dumps(manifest, indent=2).encode()), name=target.manifest_key,
                  content_type="application/json")
    storage.save(target.manifest_key, body)


def _verify(storage: Any, target: _Target, manifest: dict[str, Any]) -> None:
    """Read both objects back and compare them with what was exported."""
    partition = manifest["partition"]
    stored_manifest = json.loads(b"".join(iter_object(storage, target.manifest_key)))
    if stored_manifest != manifest:
        raise ArchiveError(partition=partition, step="verify",
                           problem="the stored manifest differs from the one written")
    digest = hashlib.sha256()
    rows = size = 0
    for chunk in iter_object(storage, target.key):
        digest.update(chunk)
        rows += chunk.count(b"\n")
        size += len(chunk)
    checksum = f"sha256:{digest.hexdigest()}"
    if (rows, size, checksum) != (manifest["rows"], manifest["bytes"], manifest["checksum"]):
        raise ArchiveError(
            partition=partition, step="verify",
            problem=(
                f"stored object has {rows} rows, {size} bytes, {checksum}; "
                f"exported {manifest['rows']} rows, {manifest['bytes']} bytes, {manifest['checksum']}"
            ),
        )


def _drop(partition: EventPartition, export: _Export, result: ArchiveResult) -> None:
    """Detach and drop the partition, and record it, in one transaction."""
    table = connection.ops.quote_name(partition.name)
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(f"SET LOCAL lock_timeout = '{DETACH_LOCK_TIMEOUT}'")
        # Detach first: from here on no insert can reach the partition, so the count below is final.
        cur.execute(f"ALTER TABLE {PARENT_TABLE} DETACH PARTITION {table}")
        cur.execute(f"SELECT count(*), max(id) FROM {table}")
        rows, max_id = cur.fetchone()
        if (rows, max_id) != (export.rows, export.max_id):
            # Raising rolls the DETACH back: the partition stays attached with every row.
            raise ArchiveError(
                partition=partition.name, step="drop",
                problem=f"the partition changed after export ({rows} rows now, {export.rows} exported)",
            )
        cur.execute(f"DROP TABLE {table}")
        Event.objects.create(
            source=SOURCE, level=Level.INFO, type=EVENT_TYPE,
            message=f"archived events of {partition.month} ({export.rows} rows) to s3://{result.bucket}/{result.key}",
            data=asdict(result),
        )


def _record_failure(exc: ArchiveError) -> None:
    """Put the failure on the timeline, where operators look; never mask the original error."""
    try:
        with transaction.atomic():
            Event.objects.create(
                source=SOURCE, level=Level.ERROR, type=EVENT_TYPE, message=str(exc),
                data={"partition": exc.partition, "step": exc.step, "problem": exc.problem},
            )
    except Exception:  # noqa: BLE001
        log.exception("could not record the archive failure of %s", exc.partition)
