"""A real S3-compatible server over HTTP for tests (scripts/s3_local.sh) and a bucket a test looks into.

The ``s3_server`` (session) and ``s3`` (per test) fixtures in tests/conftest.py use these:
``start_server`` starts MinIO or moto's server on 127.0.0.1 and returns its ACC_MINIO_* settings;
``s3`` points ACCS at a bucket of its own through the environment, reloads ``accs_site.conf`` and
hands the test an ``S3`` (a plain boto3 client for looking behind ACCS's back). The environment is
restored afterwards, so tests that do not ask for ``s3`` see no storage.
"""

from __future__ import annotations

import os
import subprocess
import sys
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


def start_server() -> dict[str, str]:
    """Start the local S3 server (idempotent) and return its ACC_MINIO_* variables."""
    env = dict(os.environ, ACC_S3_PYTHON=sys.executable)
    started = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=120)
    if started.returncode != 0:
        pytest.fail(f"scripts/s3_local.sh start failed:\n{started.stderr}")
    out = subprocess.run([str(SCRIPT), "env"], env=env, check=True, capture_output=True, text=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def client(settings: dict[str, str]) -> Any:
    """Return a boto3 client for the server ``settings`` (ACC_MINIO_* variables) name."""
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


def remove_bucket(client: Any, bucket: str) -> None:
    # Keep a long-lived shared server small; a bucket the test never created is fine.
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=bucket, Key=obj["Key"])
        client.delete_bucket(Bucket=bucket)
    except client.exceptions.NoSuchBucket:
        pass
