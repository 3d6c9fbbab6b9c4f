"""The agent loop (AGT1, AGT2): claim → run → report, on one machine.

One main thread talks to the database; worker threads run the executors and hand back what
happens (started, progress, log lines, outcome) through a queue. Each pass of the loop:

1. reports everything that happened since the last pass in ONE transaction (starts, outcomes,
   progress, log events), retrying on a transient database error;
2. heartbeats held tasks every TTL/3 and stops those it lost or was asked to cancel;
3. claims, per service, at most as many tasks as it has free slots (jobs.claim applies every
   other limit), in one short transaction, and hands them to workers;
4. sleeps until a NOTIFY on its services' channels, a worker's news, or the jittered poll timer.

No transaction or row lock is held while work runs. First SIGTERM/SIGINT: stop claiming and let
running tasks finish; second: stop them now (they are reported as interrupted and retried).
"""

from __future__ import annotations

import logging
import os
import queue
import random
import select
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg
from django.db import close_old_connections, connection, transaction
from django.db.utils import InterfaceError, OperationalError
from django.utils import timezone

from accs_site.conf import accs
from events.timeline import EventRow, write_events
from jobs import transitions
from jobs.claim import ClaimedTask, NodeLimits, ServiceSpec, claim
from jobs.notify import service_channel
from jobs.transitions import Outcome
from nodes.api import agent_identity, register_node, touch_node
from nodes.executors import RunContext, make_executors, scratch_dir, secrets_in

log = logging.getLogger("accs.agent")

SERVICE_CACHE_SECONDS = 10.0  # WF1: definition changes are picked up within ~10 s
NODE_REFRESH_SECONDS = 2.0
DISK_SAMPLE_SECONDS = 60.0
REPORT_RETRIES = 8


@dataclass
class Running:
    task: ClaimedTask
    ctx: RunContext
    started_reported: bool = False
    pid: int | None = None
    log_records: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Service:
    spec: ServiceSpec
    executor: str
    config: dict[str, Any]
    block_during: list[str]
    priority_adjust_during: dict[str, int]


class Agent:
    """Run tasks of ``services`` on node ``node`` with at most ``max_concurrent`` at once."""

    def __init__(self, *, node: str, services: list[str], max_concurrent: int = 4, once: bool = False,
                 labels: dict[str, str] | None = None, poll_interval: float | None = None,
                 lease_seconds: float | None = None, claim_batch: int | None = None) -> None:
        self.node = node
        self.service_keys = services
        self.max_concurrent = max_concurrent
        self.once = once
        self.labels = labels or {}
        self.poll_interval = poll_interval or accs.poll_interval_sec
        self.lease_seconds = float(lease_seconds or accs.heartbeat_ttl_sec)
        self.claim_batch = claim_batch or max_concurrent
        self.agent_id = agent_identity()
        self.source = f"agent:{node}"
        self.executors = make_executors()
        self.pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="accs-task")
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.running: dict[UUID, Running] = {}
        self.pending_outcomes: list[Outcome] = []
        self.pending_started: list[tuple[UUID, int, int | None]] = []
        self.pending_progress: dict[UUID, tuple[int, float]] = {}
        self.pending_logs: list[EventRow] = []
        self.stopping = False
        self.stop_now = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._services: dict[str, Service] = {}
        self._services_at = 0.0
        self._node_state = "active"
        self._node_limits: dict[str, Any] = {}
        self._node_at = 0.0
        self._heartbeat_at = 0.0
        self._disk_at = 0.0
        self._paused = False
        self._active_conditions: set[str] = set()
        self._listen: psycopg.Connection | None = None
        self.stats = {"claimed": 0, "done": 0, "failed": 0, "fenced": 0}

    # ------------------------------------------------------------------ lifecycle
    def install_signal_handlers(self) -> None:
        def handle(signum, frame) -> None:
            if self.stopping:
                self.stop_now = True
                log.warning("second signal: stopping running tasks now", extra={"node": self.node})
            else:
                self.stopping = True
                log.info("signal received: no new claims, draining %d running task(s)", len(self.running),
                         extra={"node": self.node})
            self._wake()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def run(self) -> int:
        """Run until stopped (or, with ``once``, until no work is left). Return an exit code."""
        register_node(self.node, labels=self.labels, services=self.service_keys, agent_id=self.agent_id)
        self._load_services(force=True)
        self._open_listen()
        log.info("agent %s started on node %s for %s (max %d)", self.agent_id, self.node,
                 ",".join(self.service_keys), self.max_concurrent, extra={"node": self.node})
        try:
            while True:
                close_old_connections()
                self._flush_reports()
                self._maintain()
                if self.stop_now:
                    for item in self.running.values():
                        item.ctx.cancel.set()
                claimed = 0 if self.stopping else self._claim()
                if self.stopping and not self.running and not self._has_pending():
                    break
                if self.once and not claimed and not self.running and not self._has_pending():
                    break
                if not claimed:
                    self._wait()
        finally:
            self._flush_reports()
            self.pool.shutdown(wait=False, cancel_futures=True)
            if self._listen is not None:
                self._listen.close()
            log.info("agent stopped: %s", self.stats, extra={"node": self.node})
        return 0

    # ------------------------------------------------------------------ services and node
    def _load_services(self, *, force: bool = False) -> None:
        if not force and time.monotonic() - self._services_at < SERVICE_CACHE_SECONDS:
            return
        from workflows.models import Service as ServiceModel

        found = {}
        for s in ServiceModel.objects.filter(key__in=self.service_keys, is_active=True):
            found[s.key] = Service(ServiceSpec(s.id, s.key, s.cpu_weight, s.max_concurrent, s.exclusive_per_host),
                                   s.executor, s.executor_config or {}, list(s.block_during or []),
                                   dict(s.priority_adjust_during or {}))
        missing = set(self.service_keys) - set(found)
        if missing and force:
            log.warning("services not found or inactive: %s", ",".join(sorted(missing)), extra={"node": self.node})
        self._services, self._services_at = found, time.monotonic()

    def _limits(self) -> NodeLimits:
        per_service = dict(self._node_limits.get("max_concurrency") or {})
        for key in self.service_keys:
            env_cap = accs.max_concurrency_for(key)
            if env_cap is not None:
                per_service[key] = env_cap
        return NodeLimits(self.node, int(self._node_limits.get("slot_cap") or accs.slot_cap),
                          int(self._node_limits.get("cpu_budget") or accs.cpu_budget), per_service)

    def _maintain(self) -> None:
        now = time.monotonic()
        if now - self._node_at >= NODE_REFRESH_SECONDS:
            self._node_state, self._node_limits = touch_node(self.node, agent_id=self.agent_id)
            self._node_at = now
            self._load_services()
            self._paused = self._claiming_paused()
            self._active_conditions = self._governor()
        if self.running and now - self._heartbeat_at >= self.lease_seconds / 3:
            self._heartbeat()
            self._heartbeat_at = now
        if now - self._disk_at >= DISK_SAMPLE_SECONDS:
            self._disk_at = now
            self._sample_disk()

    def _sample_disk(self) -> None:
        try:
            from nodes.disk import sample_disk
        except ImportError:
            return
        try:
            sample_disk(self.node, os.getcwd())
        except Exception:  # noqa: BLE001 - a failed sample must not stop the agent
            log.exception("disk sample failed", extra={"node": self.node})

    def _claiming_paused(self) -> bool:
        if self._node_state != "active":
            return True
        try:
            from nodes.disk import claiming_paused
        except ImportError:
            return False
        return claiming_paused(self.node)

    def _governor(self) -> set[str]:
        try:
            from workflows.governor import active_conditions
        except ImportError:
            return set()
        return set(active_conditions())

    # ------------------------------------------------------------------ claiming
    def _claim(self) -> int:
        free = self.max_concurrent - len(self.running)
        if free <= 0 or self._paused:
            return 0
        active = self._active_conditions
        order = []
        for key in self.service_keys:
            service = self._services.get(key)
            if service is None or any(c in active for c in service.block_during):
                continue
            adjust = sum(v for c, v in service.priority_adjust_during.items() if c in active)
            order.append((-adjust, self.service_keys.index(key), service))
        limits = self._limits()
        total = 0
        for _, _, service in sorted(order, key=lambda o: (o[0], o[1])):
            if free <= 0:
                break
            tasks = claim(service.spec, limits, agent_id=self.agent_id, free_slots=min(free, self.claim_batch),
                          lease_seconds=self.lease_seconds, pid=os.getpid())
            for task in tasks:
                self._start(task, service)
            free -= len(tasks)
            total += len(tasks)
        if total:
            self.stats["claimed"] += total
            log.debug("claimed %d task(s)", total, extra={"node": self.node})
        return total

    def _start(self, task: ClaimedTask, service: Service) -> None:
        inbox, wake = self.inbox, self._wake

        def on_started(pid: int | None) -> None:
            inbox.put(("started", task.id, pid))

        def on_progress(value: float) -> None:
            inbox.put(("progress", task.id, value))
            wake()

        def on_log(level: str, message: str) -> None:
            inbox.put(("log", task.id, level, message))

        ctx = RunContext(task=task, service_config=service.config, on_started=on_started, on_progress=on_progress,
                         on_log=on_log, secrets=secrets_in(task.params))
        if service.executor == "command":
            ctx.output_dir = scratch_dir(task)
        self.running[task.id] = Running(task, ctx)
        executor = self.executors[service.executor]

        def work() -> None:
            try:
                if ctx.output_dir and accs.minio.configured:
                    self._stage_inputs(task, ctx)
                outcome = executor.run(task, ctx)
            except Exception as exc:  # noqa: BLE001 - an executor bug fails the attempt, not the agent
                log.exception("executor crashed", extra={"task_id": task.id, "job_id": task.job_id})
                outcome = Outcome(task_id=task.id, attempt=task.attempt, status="failed", error=f"executor error: {exc}")
            inbox.put(("done", task.id, outcome))
            wake()

        self.pool.submit(work)

    # ------------------------------------------------------------------ reporting
    def _has_pending(self) -> bool:
        return bool(self.pending_outcomes or self.pending_started or self.pending_progress or self.pending_logs)

    def _drain_inbox(self) -> None:
        # Empty the wake pipe first: a worker that queues a message after this point also writes
        # a new wake byte, so the next select() returns at once instead of sleeping a full poll.
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                break
            kind, task_id = message[0], message[1]
            item = self.running.get(task_id)
            if kind == "started" and item is not None:
                item.pid = message[2]
                item.started_reported = True
                self.pending_started.append((task_id, item.task.attempt, message[2]))
            elif kind == "progress" and item is not None:
                self.pending_progress[task_id] = (item.task.attempt, message[2])
            elif kind == "log" and item is not None:
                level, text = message[2], message[3]
                item.log_records.append({"ts": timezone.now().isoformat(), "level": level, "message": text})
                self.pending_logs.append(EventRow(type="log", message=text[:2000], job_id=item.task.job_id,
                                                  task_id=task_id, attempt=item.task.attempt, source=self.source,
                                                  level=level))
            elif kind == "done" and item is not None:
                outcome: Outcome = message[2]
                if not item.started_reported:
                    self.pending_started.append((task_id, item.task.attempt, item.pid))
                    item.started_reported = True
                self._attach_artifacts(item, outcome)
                self.pending_outcomes.append(outcome)
                self.pending_progress.pop(task_id, None)
                del self.running[task_id]

    @staticmethod
    def _stage_inputs(task: ClaimedTask, ctx: RunContext) -> None:
        """Download the task's input artifacts into a fresh directory (ACCS_INPUT_DIR)."""
        from events import artifacts

        ctx.input_dir = scratch_dir(task)
        artifacts.stage_inputs(job_id=task.job_id, task_id=task.id, directory=ctx.input_dir)

    def _attach_artifacts(self, item: Running, outcome: Outcome) -> None:
        """Upload output files and the attempt's log when artifact storage is configured (ART1)."""
        if not accs.minio.configured:
            return
        try:
            from events import artifacts
        except ImportError:
            return
        task = item.task
        try:
            if item.ctx.output_dir:
                artifacts.collect_outputs(job_id=task.job_id, task_id=task.id, task_key=task.task_key,
                                          attempt=task.attempt, directory=item.ctx.output_dir)
            records = item.log_records + [{"ts": timezone.now().isoformat(), "level": "info",
                                           "message": f"attempt {task.attempt} ended: {outcome.status}"}]
            artifacts.upload_attempt_log(job_id=task.job_id, task_id=task.id, task_key=task.task_key,
                                         attempt=task.attempt, records=records)
        except Exception:  # noqa: BLE001 - storage trouble must not lose the outcome
            log.exception("artifact upload failed", extra={"task_id": task.id, "job_id": task.job_id})

    def _flush_reports(self) -> None:
        self._drain_inbox()
        if not self._has_pending():
            return
        outcomes, started = self.pending_outcomes, self.pending_started
        progress = [(tid, att, value) for tid, (att, value) in self.pending_progress.items()]
        logs = self.pending_logs
        for attempt in range(REPORT_RETRIES):
            try:
                with transaction.atomic():
                    if logs:
                        write_events(logs)
                    result = transitions.report(outcomes, started=started, agent_id=self.agent_id, source=self.source)
                    if progress:
                        transitions.report_progress(progress, source=self.source)
                break
            except (OperationalError, InterfaceError) as exc:
                delay = min(5.0, 0.1 * 2 ** attempt) * random.uniform(0.5, 1.0)
                log.warning("report failed (%s); retrying in %.2fs", exc, delay, extra={"node": self.node})
                connection.close()
                time.sleep(delay)
        else:
            log.error("giving up reporting %d outcome(s) for now; leases will expire and rescue them",
                      len(outcomes), extra={"node": self.node})
            return
        self.pending_outcomes, self.pending_started, self.pending_progress, self.pending_logs = [], [], {}, []
        self.stats["done"] += len(result.done)
        self.stats["failed"] += len(result.failed) + len(result.retried)
        self.stats["fenced"] += len(result.fenced)
        for o in outcomes:
            if o.task_id in result.fenced:
                log.warning("report fenced: task %s attempt %s is no longer ours", o.task_id, o.attempt,
                            extra={"task_id": o.task_id, "node": self.node})
            elif o.status != "succeeded":
                log.info("task %s attempt %s %s: %s", o.task_id, o.attempt, o.status, o.error,
                         extra={"task_id": o.task_id, "node": self.node})

    def _heartbeat(self) -> None:
        held = [(tid, item.task.attempt) for tid, item in self.running.items()]
        try:
            lost, cancel = transitions.heartbeat(held, agent_id=self.agent_id, lease_seconds=self.lease_seconds)
        except (OperationalError, InterfaceError) as exc:
            log.warning("heartbeat failed: %s", exc, extra={"node": self.node})
            connection.close()
            return
        for tid, _attempt in lost | cancel:
            item = self.running.get(tid)
            if item is not None:
                log.warning("stopping task %s (%s)", tid, "cancel requested" if (tid, _attempt) in cancel else "lease lost",
                            extra={"task_id": tid, "node": self.node})
                item.ctx.cancel.set()

    # ------------------------------------------------------------------ waiting
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _open_listen(self) -> None:
        try:
            settings = connection.settings_dict
            self._listen = psycopg.connect(
                host=settings["HOST"], port=settings["PORT"] or None, dbname=settings["NAME"],
                user=settings["USER"], password=settings["PASSWORD"] or None, autocommit=True)
            for key in self.service_keys:
                self._listen.execute(f'LISTEN "{service_channel(key)}"')
        except psycopg.Error as exc:
            log.warning("LISTEN unavailable (%s); polling only", exc, extra={"node": self.node})
            self._listen = None

    def _wait(self) -> None:
        timeout = self.poll_interval * random.uniform(0.8, 1.2)
        if self.running:
            timeout = min(timeout, self.lease_seconds / 3)
        fds = [self._wake_r]
        if self._listen is not None:
            fds.append(self._listen.fileno())
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except (OSError, ValueError):
            ready = []
        if self._listen is not None and self._listen.fileno() in ready:
            try:
                for _ in self._listen.notifies(timeout=0, stop_after=1000):
                    pass
            except psycopg.Error as exc:
                log.warning("LISTEN connection lost (%s); reconnecting", exc, extra={"node": self.node})
                self._listen.close()
                self._open_listen()
