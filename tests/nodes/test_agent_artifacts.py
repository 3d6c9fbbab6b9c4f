"""Artifacts and the attempt's log through a real agent: inputs staged, outputs and the attempt's log stored in S3."""

from __future__ import annotations

import json
import os

import pytest

from events.artifacts import read_artifact, record_artifact
from events.models import Artifact, Event
from jobs import api
from tests.daemons import Daemons, wait_all_final

pytestmark = pytest.mark.django_db(transaction=True)

SCRIPT = (
    "import os, sys, pathlib; "
    "src = pathlib.Path(os.environ['ACCS_INPUT_DIR'], 'source.txt').read_text(); "
    "print('reading ' + src.strip(), file=sys.stderr); print('rendering', file=sys.stderr); "
    "print('done', file=sys.stderr); "
    "pathlib.Path(os.environ['ACCS_OUTPUT_DIR'], 'out.txt').write_text(src.upper()); "
    "print(chr(123) + chr(125))"
)


def test_command_task_gets_inputs_and_leaves_output_and_log_artifacts(s3, make_service, db_url, tmp_path):
    make_service("shout", executor="command", executor_config={"argv": ["python", "-c", SCRIPT]})
    job = api.start_service("shout")
    task = job.tasks.get()
    record_artifact(job_id=job.id, task_id=task.id, attempt=None, kind="input", name="source.txt", data=b"hello s3\n")
    env = {**os.environ, "ACC_DB_URL": db_url, "ACC_POLL_INTERVAL_SEC": "0.5", "PYTHONUNBUFFERED": "1"}
    daemons = Daemons(env, tmp_path)  # built after the s3 fixture set ACC_MINIO_*, so the agent stores artifacts
    try:
        daemons.agent("n1", "shout")
        wait_all_final(db_url, timeout=60)
    finally:
        daemons.stop_all()
    task.refresh_from_db()
    assert task.status == "done", task.error_message
    output = Artifact.objects.get(task=task, kind="output")
    assert output.key.startswith(f"outputs/{job.id}/shout/") and read_artifact(output) == b"HELLO S3\n"
    log = Artifact.objects.get(task=task, kind="log")
    assert log.key == f"logs/{job.id}/shout/attempt-1.jsonl"
    lines = [json.loads(line)["message"] for line in read_artifact(log).decode().splitlines()]
    assert lines[:3] == ["reading hello s3", "rendering", "done"], "stderr lines in order in the log artifact"
    timeline = list(Event.objects.filter(task=task, type="log").order_by("id").values_list("message", flat=True))
    assert timeline == ["reading hello s3", "rendering", "done"], "and as log events, in order"
    assert set(s3.keys()) >= {output.key, log.key}, "artifact rows match objects in the bucket"
