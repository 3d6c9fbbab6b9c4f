"""S3 fixtures: a real S3-compatible server over HTTP (scripts/s3_local.sh), a fresh bucket per test.

``s3_server`` (session) starts MinIO or moto's server on 127.0.0.1 and returns its ACC_MINIO_*
settings. ``s3`` (per test) points ACCS at a bucket of its own through the environment, reloads
``accs_site.conf`` and hands the test a plain boto3 client for looking behind ACCS's back. The
environment is restored afterwards, so tests that do not ask for ``s3`` see no storage.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "s3_local.sh"


@dataclass(frozen=True)
class S3:
    """The bucket a test stores into, and a boto3 client that bypasses ACCS."""

    endpoint: str
    bucket: str
    client: Any

    def keys(self, prefix: str = "") -> list[str]:
        """Return every key in the bucket under ``prefix``, sorted (none while the bucket does not exist)."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        try:
            return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))
        except self.client.exceptions.NoSuchBucket:
            return []

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body)


@pytest.fixture(scope="session")
def s3_server() -> dict[str, str]:
    """Start the local S3 server (idempotent) and return its ACC_MINIO_* variables."""
    env = dict(os.environ, ACC_S3_PYTHON=sys.executable)
    started = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=120)
    if started.returncode != 0:
        pytest.fail(f"scripts/s3_local.sh start failed:\n{started.stderr}")
    out = subprocess.run([str(SCRIPT), "env"], env=env, check=True, capture_output=True, text=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _client(settings: dict[str, str]) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=settings["ACC_MINIO_ENDPOINT"],
        aws_access_key_id=settings["ACC_MINIO_ACCESS_KEY"],
        aws_secret_access_key=settings["ACC_MINIO_SECRET_KEY"],
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
    )


@pytest.fixture
def s3(s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    """Point ACCS at a fresh, not yet created bucket (ACCS creates it on first use)."""
    from accs_site.conf import reload

    bucket = f"accs-test-{uuid.uuid4().hex[:16]}"
    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ACC_MINIO_BUCKET", bucket)
    monkeypatch.setenv("ACC_MINIO_REGION", "us-east-1")
    reload()
    client = _client(s3_server)
    yield S3(endpoint=s3_server["ACC_MINIO_ENDPOINT"], bucket=bucket, client=client)
    monkeypatch.undo()
    reload()
    _remove_bucket(client, bucket)


def _remove_bucket(client: Any, bucket: str) -> None:
    # Keep a long-lived shared server small; a bucket the test never created is fine.
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=bucket, Key=obj["Key"])
        client.delete_bucket(Bucket=bucket)
    except client.exceptions.NoSuchBucket:
        pass
