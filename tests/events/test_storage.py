"""Artifacts in a real S3 server over HTTP: keys, round trips, checksums, staging, no-storage mode."""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from pathlib import Path

import pytest

from events.artifacts import (
    ChecksumMismatch,
    collect_outputs,
    read_artifact,
    record_artifact,
    stage_inputs,
    upload_attempt_log,
)
from events.models import Artifact, Event
from events.storage import StorageNotConfigured, build_key

pytestmark = pytest.mark.django_db

JOB = "0b7e2f9c-5f4e-4f36-9a51-3d8e0f1c2a77"


# --- keys ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((JOB, "render", "input"), {"name": "scene.blend"}, f"inputs/{JOB}/render/scene.blend"),
        ((JOB, "render", "output", "png"), {"name": "frame-001"}, f"outputs/{JOB}/render/frame-001.png"),
        ((JOB, "render", "output", "png"), {"name": "frame-001.png"}, f"outputs/{JOB}/render/frame-001.png"),
        ((JOB, "render", "output"), {"name": "plots/a.svg"}, f"outputs/{JOB}/render/plots/a.svg"),
        ((JOB, "render", "log"), {"name": "attempt-2"}, f"logs/{JOB}/render/attempt-2.jsonl"),
        ((uuid.UUID(JOB), "render", "log", "txt"), {"name": "x"}, f"logs/{JOB}/render/x.jsonl"),
        ((JOB, None, "input"), {"name": "config.json"}, f"inputs/{JOB}/_job/config.json"),
    ],
)
def test_build_key_follows_the_seed_convention(args, kwargs, expected):
    assert build_key(*args, **kwargs) == expected


def test_build_key_without_name_makes_a_unique_one():
    first, second = build_key(JOB, "t", "output", "json"), build_key(JOB, "t", "output", "json")
    assert first != second
    assert first.startswith(f"outputs/{JOB}/t/") and first.endswith(".json")


@pytest.mark.parametrize(
    ("task_key", "kind", "name", "problem"),
    [
        ("t", "output", "../../etc/passwd", "'..'"),
        ("t", "output", "a/../b", "'..'"),
        ("t", "output", "./a", "'.'"),
        ("t", "output", "/etc/passwd", "absolute"),
        ("t", "output", "a//b", "empty path segment"),
        ("t", "output", "dir/", "empty path segment"),
        ("t", "output", "a\\b", "backslash"),
        ("t", "output", "bad\x00name", "control characters"),
        ("t", "output", "x" * 1100, "longer than"),
        ("a/b", "output", "x", "task_key may not contain '/'"),
        ("..", "output", "x", "task_key may not contain '..'"),
        ("", "output", "x", "task_key has an empty path segment"),
        ("t", "thumbnail", "x", "kind must be one of"),
        (None, "output", "x", "needs a task_key"),
    ],
)
def test_build_key_rejects_unsafe_keys_naming_the_problem(task_key, kind, name, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        build_key(JOB, task_key, kind, name=name)


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture
def job(make_service, default_tenant):
    from jobs.models import Job

    return Job.objects.create(tenant=default_tenant, service=make_service("render"))


def _task(job, key: str):
    from jobs.models import Task

    return Task.objects.create(
        job=job, tenant_id=job.tenant_id, task_key=key, step_key=key, service_id=job.service_id, order_seq=1,
    )


@pytest.fixture
def task(job):
    return _task(job, "render")


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --- round trips -----------------------------------------------------------------------------


def test_recorded_artifact_round_trips_and_is_recorded_with_size_type_checksum_and_event(s3, job, task):
    data = os.urandom(3 * 1024 * 1024 + 17)  # more than one download chunk

    artifact = record_artifact(job_id=job.id, task_id=task.id, attempt=1, kind="output", name="frame.png", data=data)

    artifact.refresh_from_db()
    assert artifact.key == f"outputs/{job.id}/render/frame.png"
    assert (artifact.bucket, artifact.size_bytes, artifact.checksum) == (s3.bucket, len(data), _sha(data))
    assert artifact.content_type == "image/png"
    assert s3.get(artifact.key) == data, "the bucket holds exactly the bytes given"
    head = s3.client.head_object(Bucket=s3.bucket, Key=artifact.key)
    assert head["ContentType"] == "image/png" and "ContentEncoding" not in head
    assert read_artifact(artifact) == data
    event = Event.objects.get(task=task, type="artifact")
    assert (event.job_id, event.attempt) == (job.id, 1)
    assert event.data["artifact_id"] == artifact.pk and event.data["checksum"] == artifact.checksum


def test_bucket_is_created_when_missing(s3, job, task):
    assert s3.bucket not in {b["Name"] for b in s3.client.list_buckets()["Buckets"]}
    record_artifact(job_id=job.id, task_id=task.id, attempt=1, kind="output", name="x.txt", data=b"x")
    assert s3.bucket in {b["Name"] for b in s3.client.list_buckets()["Buckets"]}


def test_record_artifact_reads_file_objects_and_streams(s3, job, task, tmp_path):
    path = tmp_path / "result.json"
    path.write_bytes(b'{"ok": true}')
    with path.open("rb") as fh:
        fh.read(3)  # a half-read file is still stored whole
        from_file = record_artifact(job_id=job.id, task_id=task.id, attempt=1, kind="output", name="result.json",
                                    data=fh)
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"streamed bytes")
    os.close(write_fd)
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        from_pipe = record_artifact(job_id=job.id, task_id=task.id, attempt=1, kind="output", name="pipe.bin",
                                    data=pipe)

    assert s3.get(from_file.key) == b'{"ok": true}' and from_file.checksum == _sha(b'{"ok": true}')
    assert from_file.content_type == "application/json"
    assert s3.get(from_pipe.key) == b"streamed bytes" and from_pipe.size_bytes == 14


def test_gzip_output_is_stored_as_is_without_content_encoding(s3, job, task):
    import gzip

    data = gzip.compress(b"payload" * 100)
    artifact = record_artifact(job_id=job.id, task_id=task.id, attempt=1, kind="output", name="bundle.tar.gz",
                               data=data)
    head = s3.client.head_object(Bucket=s3.bucket, Key=artifact.key)
    assert "ContentEncoding" not in head, "clients would unzip it and break the checksum"
    assert read_artifact(artifact) == data


def test_storing_the_same_key_again_replaces_the_object_and_updates_its_row(s3, job, task):
    first = record_artifact(job_id=job.id, task_id=task.id, attempt=1, kind="output", name="out.txt", data=b"first")
    second = record_artifact(job_id=job.id, task_id=task.id, attempt=2, kind="output", name="out.txt", data=b"second!")

    assert second.pk == first.pk
    row = Artifact.objects.get(key=first.key)
    assert (row.attempt, row.size_bytes, row.checksum) == (2, 7, _sha(b"second!"))
    assert read_artifact(row) == b"second!"
    assert Event.objects.filter(task=task, type="artifact").count() == 2


def test_checksum_mismatch_is_detected_when_the_object_is_tampered_with(s3, job, task):
    artifact = record_artifact(job_id=job.id, task_id=task.id, attempt=1, kind="output", name="report.csv",
                               data=b"a,b\n1,2\n")
    s3.put(artifact.key, b"a,b\n1,3\n")  # behind ACCS's back

    with pytest.raises(ChecksumMismatch, match=f"checksum mismatch for s3://{s3.bucket}/{artifact.key}") as info:
        read_artifact(artifact)
    assert info.value.expected == _sha(b"a,b\n1,2\n")
    assert info.value.actual == _sha(b"a,b\n1,3\n")


def test_reading_an_artifact_whose_object_is_gone_says_so(s3, job, task):
    artifact = record_artifact(job_id=job.id, task_id=task.id, attempt=1, kind="output", name="gone.txt", data=b"x")
    s3.client.delete_object(Bucket=s3.bucket, Key=artifact.key)
    with pytest.raises(FileNotFoundError, match="is missing"):
        read_artifact(artifact)


def test_record_artifact_rejects_a_task_of_another_job_before_uploading(s3, job, task, make_service, default_tenant):
    from jobs.models import Job

    other = Job.objects.create(tenant=default_tenant, service=job.service)
    with pytest.raises(ValueError, match=f"belongs to job {job.id}, not to job {other.id}"):
        record_artifact(job_id=other.id, task_id=task.id, attempt=1, kind="output", name="x", data=b"x")
    with pytest.raises(ValueError, match="does not exist"):
        record_artifact(job_id=job.id, task_id=uuid.uuid4(), attempt=1, kind="output", name="x", data=b"x")
    with pytest.raises(ValueError, match=r"'\.\.'"):
        record_artifact(job_id=job.id, task_id=task.id, attempt=1, kind="output", name="../x", data=b"x")
    assert s3.bucket not in {b["Name"] for b in s3.client.list_buckets()["Buckets"]}, "nothing was uploaded"
    assert not Artifact.objects.exists()


# --- the engine's helpers ------------------------------------------------------------------------


def test_collected_outputs_and_logs_match_the_objects_in_the_bucket(s3, job, task, tmp_path):
    work = tmp_path / "work"
    (work / "plots").mkdir(parents=True)
    (work / "result.json").write_text('{"frames": 2}')
    (work / "plots" / "a.svg").write_text("<svg/>")
    (work / "empty.txt").write_bytes(b"")
    secret = tmp_path / "secret.txt"
    secret.write_text("not an output")
    (work / "link.txt").symlink_to(secret)  # must not publish files from outside the work dir
    (work / "linked-dir").symlink_to(tmp_path, target_is_directory=True)

    outputs = collect_outputs(job_id=job.id, task_id=task.id, task_key="render", attempt=1, directory=work)
    log_artifact = upload_attempt_log(
        job_id=job.id, task_id=task.id, task_key="render", attempt=1,
        records=[{"level": "info", "msg": "started"}, {"level": "info", "msg": "ünïcode", "n": 2}],
    )

    prefix = f"outputs/{job.id}/render/"
    assert sorted(a.key for a in outputs) == [prefix + "empty.txt", prefix + "plots/a.svg", prefix + "result.json"]
    rows = {a.key: a for a in Artifact.objects.filter(job=job)}
    assert sorted(rows) == s3.keys(), "every row has its object and every object has its row"
    for key, row in rows.items():
        body = s3.get(key)
        assert (row.size_bytes, row.checksum) == (len(body), _sha(body)), key
    assert log_artifact.key == f"logs/{job.id}/render/attempt-1.jsonl"
    assert (log_artifact.kind, log_artifact.content_type) == ("log", "application/x-ndjson")
    lines = s3.get(log_artifact.key).decode().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"level": "info", "msg": "started"}, {"level": "info", "msg": "ünïcode", "n": 2}]


def test_stage_inputs_downloads_the_tasks_and_the_jobs_inputs(s3, job, task, tmp_path):
    other_task = _task(job, "encode")
    record_artifact(job_id=job.id, task_id=None, attempt=None, kind="input", name="config.json", data=b"job-wide")
    record_artifact(job_id=job.id, task_id=None, attempt=None, kind="input", name="shared/lut.bin", data=b"\x00\x01")
    record_artifact(job_id=job.id, task_id=task.id, attempt=None, kind="input", name="config.json", data=b"task's own")
    record_artifact(job_id=job.id, task_id=other_task.id, attempt=None, kind="input", name="other.txt",
                    data=b"not ours")
    record_artifact(job_id=job.id, task_id=task.id, attempt=1, kind="output", name="out.txt", data=b"an output")

    staged = stage_inputs(job_id=job.id, task_id=task.id, directory=tmp_path / "in")

    root = tmp_path / "in"
    assert sorted(p.relative_to(root).as_posix() for p in staged) == ["config.json", "shared/lut.bin"]
    assert (root / "config.json").read_bytes() == b"task's own", "a task's own input wins over the job's"
    assert (root / "shared" / "lut.bin").read_bytes() == b"\x00\x01"
    staged = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert staged == ["config.json", "shared/lut.bin"]


def test_stage_inputs_refuses_a_tampered_input_and_leaves_no_file(s3, job, task, tmp_path):
    artifact = record_artifact(job_id=job.id, task_id=task.id, attempt=None, kind="input", name="model.bin",
                               data=b"weights")
    s3.put(artifact.key, b"evil weights")

    with pytest.raises(ChecksumMismatch):
        stage_inputs(job_id=job.id, task_id=task.id, directory=tmp_path)
    assert list(tmp_path.iterdir()) == [], "neither the file nor its partial download is left behind"


def test_stage_inputs_with_no_inputs_returns_nothing(s3, job, task, tmp_path):
    assert stage_inputs(job_id=job.id, task_id=task.id, directory=tmp_path / "in") == []


# --- without storage -------------------------------------------------------------------------------


@pytest.fixture
def no_storage(monkeypatch):
    from accs_site.conf import reload

    for name in ("ACC_MINIO_ENDPOINT", "ACC_MINIO_ACCESS_KEY", "ACC_MINIO_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    reload()
    yield
    monkeypatch.undo()
    reload()


def test_without_storage_engine_helpers_are_no_ops_and_explicit_calls_fail_clearly(
    no_storage, job, task, tmp_path, caplog
):
    (tmp_path / "out.txt").write_text("dropped")

    assert collect_outputs(job_id=job.id, task_id=task.id, task_key="render", attempt=1, directory=tmp_path) == []
    assert "1 output file(s) of task render not stored" in caplog.text
    assert upload_attempt_log(job_id=job.id, task_id=task.id, task_key="render", attempt=1, records=[{"m": 1}]) is None
    assert stage_inputs(job_id=job.id, task_id=task.id, directory=tmp_path / "in") == []
    with pytest.raises(StorageNotConfigured, match=r"cannot store output artifact .*\(set ACC_MINIO_ENDPOINT"):
        record_artifact(job_id=job.id, task_id=task.id, attempt=1, kind="output", name="x", data=b"x")
    assert not Artifact.objects.exists() and not Event.objects.filter(type="artifact").exists()


def test_without_storage_staging_recorded_inputs_fails_clearly(no_storage, job, task, tmp_path):
    Artifact.objects.create(
        job=job, task=task, kind="input", bucket="accs", key=f"inputs/{job.id}/render/a.txt", size_bytes=1,
        checksum=_sha(b"a"),
    )
    with pytest.raises(StorageNotConfigured, match="cannot stage input"):
        stage_inputs(job_id=job.id, task_id=task.id, directory=Path(tmp_path))


def test_the_moved_storage_class_still_resolves_by_its_old_name_with_a_warning():
    import events.storage as storage
    from events.s3_backend import ArtifactStorage

    with pytest.warns(DeprecationWarning, match="moved to events.s3_backend"):
        assert storage.ArtifactStorage is ArtifactStorage
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        storage.Nope  # noqa: B018
