"""An attempt's page lists the files that attempt stored, with an inline view for text and JSON."""

from __future__ import annotations

import pytest
from django.urls import reverse

from events.artifacts import record_artifact
from jobs.models import Attempt, Task
from tests.ops_helpers import failed_service_job

pytestmark = pytest.mark.django_db


def test_an_attempts_page_lists_its_files_and_views_text_inline(client, root, tenants, s3):
    job = failed_service_job(tenants.acme)
    task = Task.objects.get(job=job)
    attempt = Attempt.objects.get(task=task, attempt_no=1)
    report = record_artifact(job_id=job.pk, task_id=task.pk, attempt=1, kind="output", name="report.json",
                             data=b'{"ok": false}', content_type="application/json")
    frame = record_artifact(job_id=job.pk, task_id=task.pk, attempt=1, kind="output", name="frame.png",
                            data=b"\x89PNG" + bytes(64), content_type="image/png")
    page = client.get(reverse("ops:attempt_log", args=[job.pk, attempt.pk])).content.decode()
    files = page[page.index('id="accs-attempt-files"'):]
    assert '<tr data-file="report.json">' in files and '<tr data-file="frame.png">' in files
    assert f'href="{reverse("ops:job_artifact_preview", args=[job.pk, report.pk])}"' in files
    assert reverse("ops:job_artifact_preview", args=[job.pk, frame.pk]) not in files, "a PNG is download only"
    assert f'href="{reverse("ops:job_artifact", args=[job.pk, frame.pk])}" download' in files
