"""Object storage (S3 / MinIO): key conventions and the storage backend.

Keys name the job and the task's key, so one job's objects share a prefix::

    inputs/{job_id}/{task_key}/{name}
    outputs/{job_id}/{task_key}/{name}.{ext}
    logs/{job_id}/{task_key}/{name}.jsonl

The backend is django-storages' ``S3Storage`` (:mod:`events.s3_backend`, which imports boto3 only
then) built from ``accs.minio`` on first use, never at import time, and rebuilt when those settings
change (tests and daemons call ``accs_site.conf.reload()``). The bucket is created when it is missing.
"""

from __future__ import annotations

import functools
import hashlib
import io
import threading
import uuid
from collections.abc import Iterable, Iterator
from typing import IO, TYPE_CHECKING, Any
from uuid import UUID

from django.core.exceptions import ImproperlyConfigured
from django.core.files import File

from accs_site.conf import MinioSettings, accs

if TYPE_CHECKING:  # boto3 is imported when storage is first used (events.s3_backend), not with this module
    from storages.backends.s3 import S3Storage

    from events.s3_backend import ArtifactStorage

KIND_PREFIXES = {"input": "inputs", "output": "outputs", "log": "logs"}
LOG_EXTENSION = "jsonl"
# Task keys are step keys (first character a letter or digit), so this folder name cannot
# collide with a task: it holds inputs that belong to the whole job.
JOB_WIDE_TASK_KEY = "_job"
MAX_KEY_LENGTH = 1000  # Artifact.key's column; S3 itself allows 1024 bytes
CHUNK_SIZE = 1024 * 1024


class Upload(File):
    """A file to store, with the Content-Type S3Storage gives the object."""

    def __init__(self, file: Any, *, name: str, content_type: str) -> None:
        super().__init__(file, name=name)
        self.content_type = content_type


class StorageNotConfigured(ImproperlyConfigured):
    """Artifact storage was needed but ACC_MINIO_ENDPOINT/ACCESS_KEY/SECRET_KEY are not set."""

    def __init__(self, action: str) -> None:
        super().__init__(
            f"cannot {action}: artifact storage is not configured "
            "(set ACC_MINIO_ENDPOINT, ACC_MINIO_ACCESS_KEY and ACC_MINIO_SECRET_KEY)"
        )


def _check_segment(segment: str, *, what: str, key: str) -> None:
    if segment == "":
        raise ValueError(f"{what} has an empty path segment in {key!r} (leading, trailing or doubled '/')")
    if segment in (".", ".."):
        raise ValueError(f"{what} may not contain {segment!r} segments: {key!r}")
    if "\\" in segment:
        raise ValueError(f"{what} may not contain backslashes: {key!r}")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in segment):
        raise ValueError(f"{what} may not contain control characters: {key!r}")


def validate_key(key: str) -> str:
    """Return ``key`` when it is a safe relative object key; raise ValueError naming the problem."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, got {key!r}")
    if key.startswith("/"):
        raise ValueError(f"object key must be relative, not absolute: {key!r}")
    if len(key.encode()) > MAX_KEY_LENGTH:
        raise ValueError(f"object key is longer than {MAX_KEY_LENGTH} bytes: {key[:80]!r}…")
    for segment in key.split("/"):
        _check_segment(segment, what="object key", key=key)
    return key


def build_key(
    job_id: UUID | str,
    task_key: str | None,
    kind: str,
    ext: str | None = None,
    name: str | None = None,
) -> str:
    """Return the object key of an artifact, following the layout in the module docstring.

    ``kind`` is ``input``, ``output`` or ``log``. ``name`` may contain ``/`` (an output's path
    inside the task's work directory); when omitted, a fresh unique name is used. ``ext`` is
    appended unless ``name`` already ends with it; logs always end in ``.jsonl``.
    ``task_key=None`` stores a job-wide input under ``{JOB_WIDE_TASK_KEY}``.
    """
    if kind not in KIND_PREFIXES:
        raise ValueError(f"artifact kind must be one of {sorted(KIND_PREFIXES)}, got {kind!r}")
    job = str(job_id).strip()
    if not job:
        raise ValueError("job_id is empty")
    if "/" in job:
        raise ValueError(f"job_id may not contain '/': {job!r}")
    _check_segment(job, what="job_id", key=job)
    if task_key is None:
        if kind != "input":
            raise ValueError(f"a {kind} artifact needs a task_key (only inputs may belong to the whole job)")
        task_key = JOB_WIDE_TASK_KEY
    if "/" in task_key:
        raise ValueError(f"task_key may not contain '/': {task_key!r}")
    _check_segment(task_key, what="task_key", key=task_key)

    if kind == "log":
        ext = LOG_EXTENSION
    if ext is not None:
        ext = ext.lstrip(".")
        if not ext or "/" in ext:
            raise ValueError(f"ext must be a file extension such as 'json', got {ext!r}")
    if name is None:
        name = uuid.uuid4().hex
    if name.startswith("/"):
        raise ValueError(f"artifact name must be relative, not absolute: {name!r}")
    if ext and not name.endswith(f".{ext}"):
        name = f"{name}.{ext}"
    return validate_key(f"{KIND_PREFIXES[kind]}/{job}/{task_key}/{name}")


_bucket_lock = threading.Lock()


@functools.lru_cache(maxsize=8)
def _storage_for(settings: MinioSettings, bucket: str) -> ArtifactStorage:
    from events.s3_backend import ArtifactStorage  # boto3 loads on first use of storage, not with this module

    storage = ArtifactStorage(
        bucket_name=bucket,
        endpoint_url=settings.endpoint,
        access_key=settings.access_key,
        secret_key=settings.secret_key,
        region_name=settings.region,
        # MinIO and other self-hosted servers are addressed by path, not by virtual host.
        addressing_style="path",
        signature_version="s3v4",
        file_overwrite=True,  # keys are chosen by build_key; never let the backend rename one
        default_acl=None,
        querystring_auth=True,
    )
    with _bucket_lock:
        _ensure_bucket(storage, region=settings.region)
    return storage


def _ensure_bucket(storage: S3Storage, *, region: str) -> None:
    from botocore.exceptions import ClientError  # boto3 loads on first use of storage, not with this module

    client = storage.connection.meta.client
    try:
        client.head_bucket(Bucket=storage.bucket_name)
        return
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
    kwargs: dict[str, Any] = {"Bucket": storage.bucket_name}
    if region != "us-east-1":  # S3 rejects an explicit LocationConstraint for its default region
        kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
    try:
        client.create_bucket(**kwargs)
    except ClientError as exc:
        # Another process created it between our HEAD and CREATE.
        if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise


def is_configured() -> bool:
    """Return whether artifact storage is configured."""
    return accs.minio.configured


def get_storage(*, bucket: str | None = None, action: str = "use artifact storage") -> ArtifactStorage:
    """Return the storage for ``bucket`` (default ``ACC_MINIO_BUCKET``), creating the bucket if missing.

    Raise :class:`StorageNotConfigured` when storage is not configured; ``action`` says what the
    caller was trying to do, for the error message.
    """
    settings = accs.minio
    if not settings.configured:
        raise StorageNotConfigured(action)
    return _storage_for(settings, bucket or settings.bucket)


def iter_object(storage: S3Storage, key: str) -> Iterator[bytes]:
    """Yield an object's bytes in chunks, without holding the whole object in memory."""
    body = storage.bucket.Object(validate_key(key)).get()["Body"]
    try:
        yield from body.iter_chunks(CHUNK_SIZE)
    finally:
        body.close()


DELETE_BATCH = 1000  # S3's limit of keys per DeleteObjects request


def delete_keys(storage: S3Storage, keys: Iterable[str]) -> list[str]:
    """Delete objects by key, up to 1,000 per request; return the keys that could not be deleted.

    A key that does not exist counts as deleted (S3 deletes are idempotent).
    """
    client = storage.connection.meta.client
    pending, failed = sorted(set(keys)), []
    for start in range(0, len(pending), DELETE_BATCH):
        chunk = pending[start:start + DELETE_BATCH]
        answer = client.delete_objects(
            Bucket=storage.bucket_name, Delete={"Objects": [{"Key": key} for key in chunk], "Quiet": True}
        )
        failed += [error["Key"] for error in answer.get("Errors", [])]
    return failed


def list_objects(storage: S3Storage, *, prefix: str, start_after: str | None, limit: int) -> list[dict[str, Any]]:
    """Return up to ``limit`` objects under ``prefix`` after ``start_after``, in key order.

    Each object is S3's listing entry (``Key``, ``LastModified``, ``Size``...).
    """
    kwargs: dict[str, Any] = {"Bucket": storage.bucket_name, "Prefix": prefix, "MaxKeys": limit}
    if start_after:
        kwargs["StartAfter"] = start_after
    return storage.connection.meta.client.list_objects_v2(**kwargs).get("Contents", [])


def save_verified(storage: S3Storage, key: str, body: bytes, *, content_type: str) -> str:
    """Store ``body`` under ``key``, read the object back and compare; return its ``sha256:<hex>``.

    Raise OSError when the stored bytes differ (and whatever the storage raises when it fails).
    """
    upload = Upload(io.BytesIO(body), name=validate_key(key), content_type=content_type)
    saved = storage.save(key, upload)
    if saved != key:
        raise OSError(f"storage renamed {key!r} to {saved!r}")
    expected = f"sha256:{hashlib.sha256(body).hexdigest()}"
    digest = hashlib.sha256()
    for chunk in iter_object(storage, key):
        digest.update(chunk)
    if f"sha256:{digest.hexdigest()}" != expected:
        raise OSError(f"the stored copy of s3://{storage.bucket_name}/{key} differs from the bytes written")
    return expected


def sha256_of(fileobj: IO[bytes]) -> tuple[str, int]:
    """Return (``sha256:<hex>``, size) of a file's remaining bytes, then rewind it to where it was."""
    start = fileobj.tell()
    digest = hashlib.sha256()
    size = 0
    while chunk := fileobj.read(CHUNK_SIZE):
        digest.update(chunk)
        size += len(chunk)
    fileobj.seek(start)
    return f"sha256:{digest.hexdigest()}", size


def __getattr__(name: str) -> Any:
    """``events.storage.ArtifactStorage`` still resolves (it moved to :mod:`events.s3_backend`), with a warning."""
    if name == "ArtifactStorage":
        import warnings

        from events.s3_backend import ArtifactStorage  # the old name resolves lazily, as the class now loads

        warnings.warn("events.storage.ArtifactStorage moved to events.s3_backend.ArtifactStorage; "
                      "the old name goes in 0.3", DeprecationWarning, stacklevel=2)
        return ArtifactStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
