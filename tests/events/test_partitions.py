"""Timeline partitions: created ahead, old months exported to a real S3 server, verified, then dropped.

Months are far in the past (2019) so they never meet the partitions other tests or the
migration create around today; the ``months`` fixture drops whatever a test left behind.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import call_command
from django.db import connection

from events import partitions
from events.models import Event
from events.partitions import ArchiveError, archive_partitions, ensure_partitions

pytestmark = pytest.mark.django_db(transaction=True)

NOW = datetime(2020, 6, 15, 12, 0, tzinfo=UTC)  # with 12 months' retention: months before 2019-06 are old


def _exists(table: str) -> bool:
    with connection.cursor() as cur:
        cur.execute("SELECT to_regclass(%s) IS NOT NULL", [table])
        return cur.fetchone()[0]


def _rows(table: str) -> list[tuple]:
    with connection.cursor() as cur:
        cur.execute(f"SELECT id, ts, message, data::text FROM {table} ORDER BY ts, id")
        return [(i, ts, message, json.loads(data)) for i, ts, message, data in cur.fetchall()]


def _partition_of(event_id: int) -> str:
    with connection.cursor() as cur:
        cur.execute("SELECT tableoid::regclass::text FROM accs_event WHERE id = %s", [event_id])
        return cur.fetchone()[0]


@pytest.fixture
def months():
    """Create 2019/2020 months with events: ``months(2019, 1, rows=5)`` → the partition's name."""
    made: set[str] = set()

    def make(year: int, month: int, *, rows: int) -> str:
        start = datetime(year, month, 1, tzinfo=UTC)
        with connection.cursor() as cur:
            cur.execute("SELECT accs_create_event_partition(%s)", [start])
            name = cur.fetchone()[0]
        made.add(name)
        Event.objects.bulk_create(
            Event(
                ts=start + timedelta(days=i, hours=i), type="log", source="test",
                message=f"{year}-{month:02d} #{i} ünï",
                data={"i": i, "nested": {"ok": True}},
            )
            for i in range(rows)
        )
        return name

    yield make
    with connection.cursor() as cur:
        for year in (2019, 2020):
            for month in range(1, 13):
                cur.execute(f"DROP TABLE IF EXISTS accs_event_{year}_{month:02d}")
        cur.execute("DELETE FROM accs_event_default WHERE ts < '2021-01-01'")


# --- ensure ------------------------------------------------------------------------------------


def test_ensure_partitions_creates_this_month_and_the_months_ahead_once(months):
    early = Event.objects.create(ts=datetime(2019, 12, 3, tzinfo=UTC), type="log", message="before its partition")
    assert _partition_of(early.id) == "accs_event_default"

    created = ensure_partitions(now=datetime(2019, 11, 15, tzinfo=UTC), months_ahead=2)

    assert created == ["accs_event_2019_11", "accs_event_2019_12", "accs_event_2020_01"]
    assert ensure_partitions(now=datetime(2019, 11, 15, tzinfo=UTC), months_ahead=2) == [], "idempotent"
    assert _partition_of(early.id) == "accs_event_2019_12", "rows waiting in DEFAULT moved into their month"
    later = Event.objects.create(ts=datetime(2020, 1, 31, 23, 59, tzinfo=UTC), type="log", message="new")
    assert _partition_of(later.id) == "accs_event_2020_01"


def test_ensure_partitions_reads_months_ahead_from_settings(months, monkeypatch):
    from accs_site.conf import reload

    monkeypatch.setenv("ACC_EVENT_PARTITIONS_AHEAD", "1")
    reload()
    try:
        created = ensure_partitions(now=datetime(2019, 3, 31, 23, 0, tzinfo=UTC))
        assert created == ["accs_event_2019_03", "accs_event_2019_04"]
    finally:
        monkeypatch.undo()
        reload()


# --- archive ------------------------------------------------------------------------------------


def test_old_months_are_exported_verified_and_dropped(s3, months):
    jan, feb, aug = months(2019, 1, rows=5), months(2019, 2, rows=3), months(2019, 8, rows=2)
    before = {jan: _rows(jan), feb: _rows(feb)}

    results = archive_partitions(now=NOW, retention_months=12, limit=10)

    assert [r.partition for r in results] == [jan, feb], "oldest first; 2019-08 is within retention"
    assert s3.keys("archive/") == [
        "archive/events/2019_01.jsonl", "archive/events/2019_01.manifest.json",
        "archive/events/2019_02.jsonl", "archive/events/2019_02.manifest.json",
    ]
    for result in results:
        body = s3.get(result.key)
        manifest = json.loads(s3.get(result.manifest_key))
        lines = [json.loads(line) for line in body.decode().splitlines()]
        assert manifest["rows"] == len(lines) == len(before[result.partition]) == result.rows, "count = rows removed"
        assert manifest["checksum"] == result.checksum == "sha256:" + hashlib.sha256(body).hexdigest()
        assert manifest["bytes"] == len(body)
        assert (manifest["month"], manifest["from"], manifest["to"]) == (
            result.month, f"{result.month}-01T00:00:00+00:00",
            ("2019-02-01T00:00:00+00:00" if result.month == "2019-01" else "2019-03-01T00:00:00+00:00"),
        )
        assert datetime.fromisoformat(manifest["exported_at"]) > NOW
        # Every exported line is a full row, in timeline order, restorable as it was.
        assert [(row["id"], datetime.fromisoformat(row["ts"]), row["message"], row["data"]) for row in lines] == [
            (i, ts, message, data) for i, ts, message, data in before[result.partition]
        ]
        assert set(lines[0]) >= {
            "id", "ts", "job_id", "task_id", "attempt", "source", "level", "type", "message", "data"}
        assert not _exists(result.partition)
    assert Event.objects.filter(ts__lt=datetime(2019, 3, 1, tzinfo=UTC)).count() == 0
    assert _exists(aug) and len(_rows(aug)) == 2
    recorded = Event.objects.filter(type="archive", level="info").order_by("id")
    assert [(e.data["partition"], e.data["rows"], e.data["checksum"]) for e in recorded] == [
        (r.partition, r.rows, r.checksum) for r in results
    ]


def test_archive_takes_at_most_limit_months_per_call(s3, months):
    jan, feb = months(2019, 1, rows=1), months(2019, 2, rows=1)

    assert [r.partition for r in archive_partitions(now=NOW, retention_months=12, limit=1)] == [jan]
    assert _exists(feb)
    assert [r.partition for r in archive_partitions(now=NOW, retention_months=12, limit=1)] == [feb]
    assert archive_partitions(now=NOW, retention_months=12, limit=1) == [], "nothing left: idempotent"


def test_an_empty_old_month_is_archived_with_zero_rows(s3, months):
    name = months(2019, 4, rows=0)
    (result,) = archive_partitions(now=NOW, retention_months=12)
    assert (result.partition, result.rows) == (name, 0)
    assert s3.get(result.key) == b"" and json.loads(s3.get(result.manifest_key))["rows"] == 0
    assert not _exists(name)


def _assert_untouched(name: str, rows: list[tuple], error: ArchiveError, step: str) -> None:
    assert error.step == step and error.partition == name
    assert "nothing was dropped" in str(error)
    assert _exists(name), "the partition is still there"
    assert _rows(name) == rows, "with every row"
    with connection.cursor() as cur:  # and still attached, so the timeline shows the month
        cur.execute("SELECT count(*) FROM pg_inherits WHERE inhrelid = %s::regclass", [name])
        assert cur.fetchone()[0] == 1
    failure = Event.objects.get(type="archive", level="error")
    assert failure.data == {"partition": name, "step": step, "problem": error.problem}


def test_failure_during_upload_leaves_the_partition_with_all_rows(s3, months, monkeypatch):
    name = months(2019, 3, rows=4)
    rows = _rows(name)

    def upload_then_break(storage, target, data, manifest):
        from django.core.files.base import ContentFile

        storage.save(target.key, ContentFile(data.read(40)))  # half an object really reaches S3
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(partitions, "_upload", upload_then_break)
    with pytest.raises(ArchiveError, match="failed at upload: ConnectionResetError: connection reset by peer") as info:
        archive_partitions(now=NOW, retention_months=12)

    _assert_untouched(name, rows, info.value, "upload")
    assert s3.keys("archive/") == ["archive/events/2019_03.jsonl"], "no manifest: the copy is known incomplete"


def test_copy_that_differs_from_the_export_fails_verification_and_drops_nothing(s3, months, monkeypatch):
    name = months(2019, 3, rows=4)
    rows = _rows(name)
    real_upload = partitions._upload

    def upload_then_corrupt(storage, target, data, manifest):
        real_upload(storage, target, data, manifest)
        whole = s3.get(target.key)
        s3.put(target.key, whole[: whole.rindex(b"\n", 0, -1) + 1])  # the last row goes missing

    monkeypatch.setattr(partitions, "_upload", upload_then_corrupt)
    with pytest.raises(ArchiveError, match=r"failed at verify: stored object has 3 rows, .*exported 4 rows") as info:
        archive_partitions(now=NOW, retention_months=12)

    _assert_untouched(name, rows, info.value, "verify")


def test_event_written_to_the_month_during_archiving_keeps_the_partition(s3, months, monkeypatch):
    name = months(2019, 3, rows=2)
    real_verify = partitions._verify

    def verify_while_a_late_event_arrives(storage, target, manifest):
        real_verify(storage, target, manifest)
        Event.objects.create(ts=datetime(2019, 3, 30, tzinfo=UTC), type="log", message="back-dated")

    monkeypatch.setattr(partitions, "_verify", verify_while_a_late_event_arrives)
    with pytest.raises(
        ArchiveError, match=r"failed at drop: the partition changed after export \(3 rows now, 2 exported\)"
    ) as info:
        archive_partitions(now=NOW, retention_months=12)

    _assert_untouched(name, _rows(name), info.value, "drop")
    assert len(_rows(name)) == 3
    monkeypatch.undo()
    (result,) = archive_partitions(now=NOW, retention_months=12)
    assert result.rows == 3 and not _exists(name), "the next pass archives the month whole"


def test_a_month_archived_again_never_overwrites_the_earlier_archive(s3, months):
    name = months(2019, 1, rows=3)
    (first,) = archive_partitions(now=NOW, retention_months=12)
    first_body = s3.get(first.key)
    months(2019, 1, rows=2)  # back-dated events for the month, given a partition again

    (second,) = archive_partitions(now=NOW, retention_months=12)

    assert first.key == "archive/events/2019_01.jsonl" and s3.get(first.key) == first_body
    assert json.loads(s3.get(first.manifest_key))["rows"] == 3
    assert re.fullmatch(r"archive/events/2019_01\.\d{8}T\d{12}Z\.jsonl", second.key), second.key
    assert json.loads(s3.get(second.manifest_key))["object"] == second.key
    assert second.rows == 2 and len(s3.get(second.key).splitlines()) == 2
    assert not _exists(name)


def test_without_storage_old_months_are_kept(months, monkeypatch):
    from accs_site.conf import reload

    for var in ("ACC_MINIO_ENDPOINT", "ACC_MINIO_ACCESS_KEY", "ACC_MINIO_SECRET_KEY"):
        monkeypatch.delenv(var, raising=False)
    reload()
    name = months(2019, 1, rows=2)
    try:
        assert archive_partitions(now=NOW, retention_months=12) == []
    finally:
        monkeypatch.undo()
        reload()
    assert len(_rows(name)) == 2


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="limit must be at least 1"):
        archive_partitions(now=NOW, limit=0)
    with pytest.raises(ValueError, match="retention_months must be at least 1"):
        archive_partitions(now=NOW, retention_months=0)


# --- the command ----------------------------------------------------------------------------------


def test_archive_events_command_dry_run_changes_nothing_then_run_archives(s3, months, capsys):
    name = months(2019, 5, rows=3)

    call_command("archive_events", "--dry-run", "--retention-months", "12")
    out = capsys.readouterr().out
    assert f"2019-05: would archive {name} to archive/events/2019_05.jsonl and drop it" in out
    assert _exists(name) and s3.keys() == []

    call_command("archive_events", "--retention-months", "12")
    out = capsys.readouterr().out
    assert "2019-05: exporting accs_event_2019_05" in out
    assert "2019-05: archived 3 rows" in out
    assert f"to s3://{s3.bucket}/archive/events/2019_05.jsonl; partition dropped" in out
    assert not _exists(name)
    call_command("archive_events", "--retention-months", "12")
    assert "nothing to archive" in capsys.readouterr().out
