"""Artifacts: files a task reads or writes, kept in object storage and recorded in the database.

The public functions other apps call. Each stored file is uploaded first, then its
:class:`~events.models.Artifact` row (size, content type, ``sha256:<hex>`` checksum) and an
``artifact`` event are written in one transaction. If that transaction fails the object stays in
the bucket without a row; rows are the truth, and an unrecorded object is never read.

When storage is not configured (``accs.minio.configured`` is False):

* :func:`record_artifact`, :func:`read_artifact` raise :class:`StorageNotConfigured`;
* :func:`stage_inputs` returns ``[]`` when the task has no inputs, and raises otherwise (the task
  cannot run without them);
* :func:`collect_outputs` and :func:`upload_attempt_log` store nothing and return ``[]`` / ``None``
  (an agent without storage still runs tasks; it logs a warning when outputs are dropped).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import mimetypes
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO, Any
from uuid import UUID

from django.db import connection, transaction
from django.db.models import Q

from accs_site.clock import db_now
from events.models import Artifact, ArtifactKind, Event, EventType, Level
from events.storage import (
    CHUNK_SIZE,
    KIND_PREFIXES,
    StorageNotConfigured,
    Upload,
    build_key,
    delete_keys,
    get_storage,
    is_configured,
    list_objects,
    sha256_of,
    validate_key,
)

log = logging.getLogger(__name__)

SOURCE = "events.artifacts"
JSONL_CONTENT_TYPE = "application/x-ndjson"
DEFAULT_CONTENT_TYPE = "application/octet-stream"
SPOOL_LIMIT = 16 * 1024 * 1024

__all__ = [
    "ChecksumMismatch",
    "StorageNotConfigured",
    "SweepResult",
    "collect_outputs",
    "delete_scheduled_objects",
    "open_artifact",
    "read_artifact",
    "record_artifact",
    "schedule_object_deletions",
    "stage_inputs",
    "sweep_orphan_objects",
    "upload_attempt_log",
]

# Artifact rows name jobs and tasks by id; their tables are read by name, so events (the floor
# below jobs) never imports the engine's models.
JOB_EXISTS_SQL = "SELECT EXISTS (SELECT 1 FROM accs_job WHERE id = %s)"
TASK_OF_SQL = "SELECT job_id, task_key FROM accs_task WHERE id = %s"

# Only keys under these prefixes are artifacts; archives (archive/, retention/) are never swept.
ARTIFACT_PREFIXES = tuple(sorted(f"{prefix}/" for prefix in KIND_PREFIXES.values()))


class ChecksumMismatch(Exception):
    """An object's bytes no longer match the checksum recorded when it was stored."""

    def __init__(self, *, bucket: str, key: str, expected: str, actual: str) -> None:
        self.bucket, self.key, self.expected, self.actual = bucket, key, expected, actual
        super().__init__(
            f"checksum mismatch for s3://{bucket}/{key}: recorded {expected}, stored object has {actual}"
        )


def record_artifact(
    *,
    job_id: UUID | str,
    task_id: UUID | str | None,
    attempt: int | None,
    kind: str,
    name: str,
    data: bytes | IO[bytes],
    content_type: str | None = None,
) -> Artifact:
    """Upload ``data`` and record it as an artifact of a job (and task); return the row.

    ``name`` is the file name under the task's folder (it may contain ``/``). ``task_id=None``
    is allowed for inputs of the whole job. Storing the same key again (a retried task writing
    the same output) replaces the object and updates its row.
    Raise ValueError for a bad name or a task that is not the job's, and
    :class:`StorageNotConfigured` when there is no storage.
    """
    if kind not in KIND_PREFIXES:
        raise ValueError(f"artifact kind must be one of {sorted(KIND_PREFIXES)}, got {kind!r}")
    task_key = _task_key_of(job_id, task_id)
    return _store(
        job_id=job_id, task_id=task_id, task_key=task_key, attempt=attempt, kind=kind, name=name,
        data=data, content_type=content_type,
    )


def _task_key_of(job_id: UUID | str, task_id: UUID | str | None) -> str | None:
    """Return the key of the job's task ``task_id`` (None for the whole job); raise ValueError when
    the job or the task does not exist, or the task is another job's."""
    with connection.cursor() as cur:
        if task_id is None:
            cur.execute(JOB_EXISTS_SQL, [_as_uuid(job_id, what="job")])
            if not cur.fetchone()[0]:
                raise ValueError(f"job {job_id} does not exist")
            return None
        cur.execute(TASK_OF_SQL, [_as_uuid(task_id, what="task")])
        row = cur.fetchone()
    if row is None:
        raise ValueError(f"task {task_id} does not exist")
    if str(row[0]) != str(job_id):
        raise ValueError(f"task {task_id} belongs to job {row[0]}, not to job {job_id}")
    return row[1]


def _as_uuid(value: UUID | str, *, what: str) -> UUID:
    try:
        return value if isinstance(value, UUID) else UUID(str(value))
    except ValueError:
        raise ValueError(f"{what} id {value!r} is not a UUID") from None


def read_artifact(artifact: Artifact) -> bytes:
    """Return an artifact's bytes after checking them against its recorded checksum.

    Raise :class:`ChecksumMismatch` when the stored object changed, FileNotFoundError when it is
    gone, :class:`StorageNotConfigured` when there is no storage.
    """
    return b"".join(open_artifact(artifact))


def open_artifact(artifact: Artifact) -> Generator[bytes, None, None]:
    """Open an artifact for streaming: return a generator of its bytes, in chunks (closing it stops the read).

    The object is opened now, so a missing object raises FileNotFoundError here (and no storage
    raises :class:`StorageNotConfigured`), before a caller has sent anything. The iterator checks
    the bytes against the recorded checksum and raises :class:`ChecksumMismatch` after the last
    chunk when they differ, so a changed object is never delivered as if it were whole.
    """
    return _open_checked(get_storage(bucket=artifact.bucket, action=f"read artifact {artifact.key}"), artifact)


def _open_checked(storage: Any, artifact: Artifact) -> Generator[bytes, None, None]:
    try:
        body = storage.bucket.Object(validate_key(artifact.key)).get()["Body"]
    except storage.connection.meta.client.exceptions.NoSuchKey:
        raise FileNotFoundError(f"artifact object s3://{artifact.bucket}/{artifact.key} is missing") from None
    return _checked_chunks(body, artifact)


def _checked_chunks(body: Any, artifact: Artifact) -> Generator[bytes, None, None]:
    digest = hashlib.sha256()
    try:
        for chunk in body.iter_chunks(CHUNK_SIZE):
            digest.update(chunk)
            yield chunk
    finally:
        body.close()
    actual = f"sha256:{digest.hexdigest()}"
    if actual != artifact.checksum:
        raise ChecksumMismatch(bucket=artifact.bucket, key=artifact.key, expected=artifact.checksum, actual=actual)


def collect_outputs(
    *,
    job_id: UUID | str,
    task_id: UUID | str,
    task_key: str,
    attempt: int,
    directory: str | os.PathLike[str],
) -> list[Artifact]:
    """Store every regular file left in ``directory`` (recursively) as an output artifact.

    Keys are ``outputs/{job_id}/{task_key}/{path relative to directory}``. Symbolic links are
    skipped: a task must not be able to publish files from outside its work directory. Without
    storage, store nothing and return ``[]`` (a warning names how many files were not kept).
    """
    root = Path(directory)
    files = sorted(_regular_files(root))
    if not is_configured():
        if files:
            log.warning(
                "artifact storage is not configured; %d output file(s) of task %s not stored",
                len(files), task_key, extra={"job_id": job_id, "task_id": task_id, "attempt": attempt},
            )
        return []
    stored: list[Artifact] = []
    for path in files:
        name = safe_output_name(path.relative_to(root).as_posix())
        try:
            with path.open("rb") as fh:
                stored.append(
                    _store(
                        job_id=job_id, task_id=task_id, task_key=task_key, attempt=attempt,
                        kind=ArtifactKind.OUTPUT, name=name, data=fh,
                    )
                )
        except ValueError as exc:
            # One file the store refuses (a name too long) must not cost the others or the attempt's log.
            log.warning("output file %r of task %s not stored: %s", name, task_key, exc,
                        extra={"job_id": job_id, "task_id": task_id, "attempt": attempt})
    return stored


def safe_output_name(name: str) -> str:
    """Return a file name a task wrote, usable as an object key: control characters and backslashes
    become ``%XX`` escapes; every other name stays as it is."""
    return "".join(f"%{ord(ch):02X}" if ord(ch) < 32 or ord(ch) == 127 or ch == "\\" else ch for ch in name)


def stage_inputs(
    *,
    job_id: UUID | str,
    task_id: UUID | str,
    directory: str | os.PathLike[str],
) -> list[Path]:
    """Download the task's input artifacts (and the job-wide ones) into ``directory``; return the paths.

    Each file lands at its name relative to ``inputs/{job_id}/{task_key}/``; a task's own input
    wins over a job-wide input of the same name. Every file is checked against its checksum
    before it appears under its final name. With no inputs recorded, return ``[]`` (also without
    storage); raise :class:`StorageNotConfigured` when there are inputs but no storage.
    """
    artifacts = list(
        Artifact.objects.filter(job_id=job_id, kind=ArtifactKind.INPUT)
        .filter(Q(task_id=task_id) | Q(task__isnull=True))
        .order_by("created_at", "id")
    )
    if not artifacts:
        return []
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    # Job-wide inputs first, so that a task's own input of the same name overwrites them.
    artifacts.sort(key=lambda a: a.task_id is not None)
    staged: dict[Path, None] = {}  # ordered set: an overridden job-wide input is listed once
    for artifact in artifacts:
        target = _input_target(root, artifact)
        storage = get_storage(bucket=artifact.bucket, action=f"stage input {artifact.key}")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".accs-staging-")
        try:
            with os.fdopen(fd, "wb") as fh:
                _download(storage, artifact, fh)
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        staged[target] = None
    return list(staged)


def upload_attempt_log(
    *,
    job_id: UUID | str,
    task_id: UUID | str,
    task_key: str,
    attempt: int,
    records: list[dict[str, Any]],
) -> Artifact | None:
    """Store one attempt's log records as ``logs/{job_id}/{task_key}/attempt-{attempt}.jsonl``.

    One JSON object per line, in the order given (values JSON cannot express are written with
    ``str``). Without storage, store nothing and return None.
    """
    if not is_configured():
        return None
    body = "".join(json.dumps(record, default=str, ensure_ascii=False) + "\n" for record in records)
    return _store(
        job_id=job_id, task_id=task_id, task_key=task_key, attempt=attempt, kind=ArtifactKind.LOG,
        name=f"attempt-{attempt}", data=body.encode(), content_type=JSONL_CONTENT_TYPE,
    )


SCHEDULE_DELETIONS_SQL = """
-- One statement per batch; a key already waiting stays as it is.
INSERT INTO accs_object_deletion (bucket, key, created_at)
SELECT d.bucket, d.key, now() FROM unnest(%(buckets)s::text[], %(keys)s::text[]) AS d(bucket, key)
ON CONFLICT (bucket, key) DO NOTHING
"""


def schedule_object_deletions(cur: Any, objects: Iterable[tuple[str, str]], *,
                              on_commit: Callable[[int], None] | None = None) -> None:
    """Record the objects ``(bucket, key)`` of artifact rows deleted in the caller's transaction.

    Their objects are deleted once that transaction commits (and by every later
    :func:`delete_scheduled_objects` until it succeeds), never before: a transaction that rolls
    back (a leader fenced off at its final check) deletes nothing, and no row ever names a missing
    object. ``on_commit``, if given, receives how many objects the deletion after the commit removed.
    """
    pending = sorted(set(objects))
    if not pending:
        return
    cur.execute(SCHEDULE_DELETIONS_SQL, {"buckets": [b for b, _ in pending], "keys": [k for _, k in pending]})

    def after_commit() -> None:
        deleted = delete_scheduled_objects(limit=len(pending), only=pending)
        if on_commit is not None:
            on_commit(deleted)

    transaction.on_commit(after_commit, robust=True)


def delete_scheduled_objects(*, limit: int, only: Sequence[tuple[str, str]] | None = None) -> int:
    """Delete up to ``limit`` scheduled objects (oldest first, or just ``only``), then their to-do rows.

    Return how many objects went. Each row is removed after its object's deletion succeeded; a
    failure (storage down) is logged and the row waits for the next pass. Running it twice, or
    concurrently, deletes an object twice, which S3 takes as success: nothing else is repeated.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    with connection.cursor() as cur:
        if only is None:
            cur.execute("SELECT id, bucket, key FROM accs_object_deletion ORDER BY id LIMIT %s", [limit])
        else:
            cur.execute("SELECT d.id, d.bucket, d.key FROM accs_object_deletion d"
                        " JOIN unnest(%s::text[], %s::text[]) AS o(bucket, key) ON o.bucket = d.bucket"
                        " AND o.key = d.key ORDER BY d.id LIMIT %s",
                        [[b for b, _ in only], [k for _, k in only], limit])
        rows = cur.fetchall()
    by_bucket: dict[str, dict[str, int]] = defaultdict(dict)
    for row_id, bucket, key in rows:
        by_bucket[bucket][key] = row_id
    done: list[int] = []
    for bucket, ids in sorted(by_bucket.items()):
        try:
            failed = set(delete_keys(get_storage(bucket=bucket, action=f"delete {len(ids)} artifact object(s)"), ids))
        except Exception as exc:  # noqa: BLE001 - the to-do rows stay; the next pass tries again
            log.warning("could not delete %d artifact object(s) in bucket %s (%s); the next pass will",
                        len(ids), bucket, exc)
            continue
        if failed:
            log.warning("could not delete %d artifact object(s) in bucket %s, e.g. %s; the next pass will",
                        len(failed), bucket, sorted(failed)[0])
        done += [row_id for key, row_id in ids.items() if key not in failed]
    if done:
        with connection.cursor() as cur:
            cur.execute("DELETE FROM accs_object_deletion WHERE id = ANY(%s)", [done])
    return len(done)


@dataclass(frozen=True)
class SweepResult:
    """One pass of the orphan sweep: how many keys it looked at, which it deleted, where to go on."""

    examined: int
    deleted: list[str]
    next_marker: str | None  # None: the pass reached the last artifact key; the next pass starts over


def sweep_orphan_objects(*, limit: int, grace_seconds: float, start_after: str | None = None,
                         now: datetime | None = None) -> SweepResult:
    """Delete artifact objects of the default bucket that no artifact row records; look at ``limit`` keys.

    An object is deleted when its key has the artifact layout (``inputs/``, ``outputs/``,
    ``logs/`` + job + task + name), no row names it, and it was last written more than
    ``grace_seconds`` before PostgreSQL's clock: younger ones may belong to an upload whose row
    is not written yet. Keys are visited in order from ``start_after``; pass the result's
    ``next_marker`` to the next call so a large bucket is swept over several passes. ``now``
    defaults to PostgreSQL's clock. Without storage, do nothing.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if not is_configured():
        return SweepResult(examined=0, deleted=[], next_marker=None)
    storage = get_storage(action="sweep orphan artifact objects")
    listed = _list_artifact_objects(storage, start_after=start_after, limit=limit)
    if now is None:
        with connection.cursor() as cur:
            now = db_now(cur)
    cutoff = now - timedelta(seconds=grace_seconds)
    old = [o["Key"] for o in listed if o["LastModified"] < cutoff and _has_artifact_layout(o["Key"])]
    recorded = set(Artifact.objects.filter(bucket=storage.bucket_name, key__in=old).values_list("key", flat=True))
    orphans = [key for key in old if key not in recorded]
    failed = set(delete_keys(storage, orphans)) if orphans else set()
    deleted = [key for key in orphans if key not in failed]
    if deleted:
        log.info("deleted %d orphan artifact object(s) of bucket %s", len(deleted), storage.bucket_name)
    next_marker = listed[-1]["Key"] if len(listed) >= limit else None
    return SweepResult(examined=len(listed), deleted=deleted, next_marker=next_marker)


def _list_artifact_objects(storage: Any, *, start_after: str | None, limit: int) -> list[dict[str, Any]]:
    """List up to ``limit`` objects under the artifact prefixes, in key order, after ``start_after``."""
    listed: list[dict[str, Any]] = []
    for prefix in ARTIFACT_PREFIXES:
        if start_after and start_after > prefix and not start_after.startswith(prefix):
            continue  # the marker is past this prefix
        after = start_after if start_after and start_after.startswith(prefix) else None
        objects = list_objects(storage, prefix=prefix, start_after=after, limit=limit - len(listed))
        listed += objects
        if len(listed) >= limit:
            break
    return listed


def _has_artifact_layout(key: str) -> bool:
    parts = key.split("/", 3)  # kind prefix / job / task_key / name
    return len(parts) == 4 and f"{parts[0]}/" in ARTIFACT_PREFIXES and all(parts)


# --- internals -------------------------------------------------------------------------------


def _store(
    *,
    job_id: UUID | str,
    task_id: UUID | str | None,
    task_key: str | None,
    attempt: int | None,
    kind: str,
    name: str,
    data: bytes | IO[bytes],
    content_type: str | None = None,
) -> Artifact:
    key = build_key(job_id, task_key, kind, name=name)
    storage = get_storage(action=f"store {kind} artifact {key}")
    if content_type is None:
        guessed = mimetypes.guess_type(key)[0] or DEFAULT_CONTENT_TYPE
        content_type = JSONL_CONTENT_TYPE if kind == ArtifactKind.LOG else guessed
    with _seekable(data) as fileobj:
        fileobj.seek(0)  # S3Storage uploads from the start, so the checksum must cover the same bytes
        checksum, size = sha256_of(fileobj)
        upload = Upload(fileobj, name=key, content_type=content_type)
        saved = storage.save(key, upload)
    if saved != key:  # file_overwrite=True keeps names; a difference would orphan the object
        raise RuntimeError(f"storage renamed {key!r} to {saved!r}")

    with transaction.atomic():
        artifact = Artifact(
            job_id=job_id, task_id=task_id, attempt=attempt, kind=kind, bucket=storage.bucket_name, key=key,
            size_bytes=size, content_type=content_type, checksum=checksum,
        )
        # One statement, safe under concurrency: a re-stored key replaces its row's facts.
        (artifact,) = Artifact.objects.bulk_create(
            [artifact],
            update_conflicts=True,
            unique_fields=["bucket", "key"],
            update_fields=["task", "attempt", "kind", "size_bytes", "content_type", "checksum", "created_at"],
        )
        Event.objects.create(
            job_id=job_id, task_id=task_id, attempt=attempt, source=SOURCE, level=Level.INFO,
            type=EventType.ARTIFACT, message=f"stored {kind} {key} ({size} bytes)",
            data={
                "artifact_id": artifact.pk, "kind": kind, "bucket": artifact.bucket, "key": key,
                "size_bytes": size, "content_type": content_type, "checksum": checksum,
            },
        )
    return artifact


class _seekable:
    """Context manager giving a seekable binary file for bytes, seekable files or streams."""

    def __init__(self, data: bytes | IO[bytes]) -> None:
        self.data = data
        self.spool: IO[bytes] | None = None

    def __enter__(self) -> IO[bytes]:
        if isinstance(self.data, (bytes, bytearray, memoryview)):
            return io.BytesIO(bytes(self.data))
        if hasattr(self.data, "seekable") and self.data.seekable():
            return self.data
        # A pipe or socket: the checksum needs two passes, so keep a copy (on disk when large).
        self.spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_LIMIT)
        while chunk := self.data.read(CHUNK_SIZE):
            self.spool.write(chunk)
        self.spool.seek(0)
        return self.spool

    def __exit__(self, *exc: object) -> None:
        if self.spool is not None:
            self.spool.close()


def _download(storage: Any, artifact: Artifact, out: IO[bytes]) -> None:
    for chunk in _open_checked(storage, artifact):
        out.write(chunk)


def _regular_files(root: Path) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(root):  # os.walk does not follow directory links
        base = Path(dirpath)
        for filename in filenames:
            path = base / filename
            if path.is_symlink():
                log.warning("skipping symbolic link %s in outputs", path)
                continue
            if path.is_file():
                yield path
        dirnames[:] = [d for d in dirnames if not (base / d).is_symlink()]


def _input_target(root: Path, artifact: Artifact) -> Path:
    parts = artifact.key.split("/", 3)  # inputs / job / task_key-or-_job / name
    if len(parts) != 4 or parts[0] != KIND_PREFIXES["input"] or not parts[3]:
        raise ValueError(f"input artifact {artifact.pk} has a key outside inputs/{{job}}/{{task}}/: {artifact.key!r}")
    target = (root / parts[3]).resolve()
    # Keys are validated when stored; this also guards rows written by other means.
    if not target.is_relative_to(root.resolve()):
        raise ValueError(f"input artifact key {artifact.key!r} would be staged outside {root}")
    return target

