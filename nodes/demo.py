"""The end-to-end demo: a builder and two agents as separate processes run sample jobs.

Loads the sample definitions, starts an S3-compatible server when the project can, starts
``runbuilder`` and two ``runagent`` processes, enqueues a few jobs (a failing-then-retried render,
a fan-out over hosts on an unstable simulated network, a one-step CLI job, a scheduled job),
shows progress until every job is final, prints a summary, and stops everything it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import TextIO

from django.core.management.base import OutputWrapper
from django.db.models import Count, Max, Sum
from django.utils import timezone

from accs_site.conf import reload
from events.models import Artifact
from jobs import api
from jobs.ids import short_id
from jobs.models import JOB_ACTIVE, Job
from nodes.models import Host, Node
from workflows.api import import_definitions
from workflows.demo import definitions

ROOT = Path(__file__).resolve().parent.parent
HOSTS = [f"host-{i}" for i in range(1, 6)]


def _start_storage(out: TextIO | OutputWrapper) -> dict[str, str]:
    """Start the local S3-compatible server; return the ACC_MINIO_* variables (empty if unavailable)."""
    script = ROOT / "scripts" / "s3_local.sh"
    if not script.exists():
        return {}
    try:
        subprocess.run([str(script), "start"], check=True, capture_output=True, timeout=90)
        text = subprocess.run([str(script), "env"], check=True, capture_output=True, text=True, timeout=30).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        out.write(f"  (artifact storage unavailable: {exc}; continuing without artifacts)\n")
        return {}
    env = {}
    for line in text.splitlines():
        key, sep, value = line.removeprefix("export ").partition("=")
        if sep and key.startswith("ACC_MINIO_"):
            env[key.strip()] = value.strip().strip("'\"")
    return env


class Demo:
    """Run the demo; every process it starts is stopped on the way out."""

    def __init__(self, *, out: TextIO | OutputWrapper, timeout: float = 180.0) -> None:
        self.out = out
        self.timeout = timeout
        self.procs: list[subprocess.Popen] = []
        self.log_dir = ROOT / ".local" / "demo"

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def spawn(self, name: str, *args: str, env: dict[str, str]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), *args], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.say(f"  started {name:<9} pid {proc.pid:<7} manage.py {' '.join(args)}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()

    def run(self) -> int:
        self.say("ACCS demo")
        services, workflows = import_definitions(definitions())
        self.say(f"  loaded {len(services)} services and {len(workflows)} workflows")
        storage_env = _start_storage(self.out)
        os.environ.update(storage_env)
        reload()
        if storage_env:
            self.say(f"  artifact storage: {storage_env.get('ACC_MINIO_ENDPOINT')}"
                     f" bucket {storage_env.get('ACC_MINIO_BUCKET', 'accs')}")
        node_b, _ = Node.objects.get_or_create(name="demo-b")
        for name in HOSTS:
            Host.objects.update_or_create(name=name, defaults={"node": node_b})
        env = {**os.environ, "ACC_POLL_INTERVAL_SEC": "1", "PYTHONUNBUFFERED": "1", **storage_env}
        try:
            self.spawn("builder", "runbuilder", "--tick", "0.5", env=env)
            self.spawn("agent-a", "runagent", "--node", "demo-a", "--services",
                       "ingest,audio-norm,renderer,yt-upload,echo", "--max-concurrent", "4", env=env)
            self.spawn("agent-b", "runagent", "--node", "demo-b", "--services", "renderer,host-check,echo",
                       "--max-concurrent", "4", env=env)
            since = timezone.now()
            jobs = self.enqueue()
            self.wait(jobs)
            self.summary(jobs, since)
        finally:
            self.stop()
            self.say(f"  stopped builder and agents (logs in {self.log_dir.relative_to(ROOT)})")
        return 0

    def enqueue(self) -> list[Job]:
        self.say("enqueueing jobs")
        jobs = [
            api.start_workflow("publish", step_params={"ingest": {"source": "s3://demo/episode-1.wav"}}),
            api.start_workflow("publish", step_params={"render": {"preset": "4k", "fail_rate": 1}}, priority=5),
            api.start_workflow("publish", step_params={"render": {"preset": "720p30"}},
                               scheduled_at=timezone.now() + timedelta(seconds=3)),
            api.start_service("echo", params={"message": "hello from ACCS"}),
            api.start_workflow("fleet-check", options={"hosts": HOSTS}),
        ]
        for job in jobs:
            note = " (render fails once, then retries)" if job.priority == 5 else ""
            note += " (scheduled +3 s)" if job.scheduled_at > timezone.now() else ""
            self.say(f"  {short_id(job.id)}  {job.target_name:<22}{note}")
        return jobs

    def wait(self, jobs: list[Job]) -> None:
        ids = [j.id for j in jobs]
        deadline = time.monotonic() + self.timeout
        last = ""
        while True:
            counts = dict(Job.objects.filter(id__in=ids).values_list("status").annotate(n=Count("id")))
            line = "  progress: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            if line != last:
                self.say(line)
                last = line
            if not any(counts.get(s, 0) for s in JOB_ACTIVE):
                return
            if time.monotonic() > deadline:
                self.say("  timed out waiting for the demo jobs")
                return
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a demo process exited early (code {proc.returncode}); see {self.log_dir}")
            time.sleep(0.5)

    def summary(self, jobs: list[Job], since: datetime) -> None:
        self.say("")
        self.say(f"{'job':<12}{'target':<22}{'status':<9}{'tasks':>6}{'attempts':>10}{'duration':>10}{'artifacts':>11}")
        for job in Job.objects.filter(id__in=[j.id for j in jobs]).order_by("order_seq"):
            agg = job.tasks.aggregate(n=Count("id"), attempts=Sum("attempt"), last=Max("finished_at"))
            duration = (job.finished_at - job.created_at).total_seconds() if job.finished_at else 0.0
            artifacts = Artifact.objects.filter(job=job).count()
            self.say(f"{short_id(job.id):<12}{job.target_name:<22}{job.status:<9}{agg['n']:>6}"
                     f"{agg['attempts'] or 0:>10}{duration:>9.1f}s{artifacts:>11}")
        self.say("")
        self.say("Open the admin to explore: .venv/bin/python manage.py createsuperuser; make serve "
                 "(http://127.0.0.1:8000/admin/)")
