"""The ``http`` executor: POST ``{job_id, task_id, attempt, params}`` to a local service.

The service may be started on demand by a start command and is stopped after it was idle for a
while; redirects and proxies are not followed, so a "local" request stays local.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from email.message import Message
from typing import IO, Any

from jobs.claim import ClaimedTask
from jobs.transitions import Outcome
from nodes.executors.base import MAX_RESULTS_BYTES, TAIL_CHARS, BadOutput, RunContext, _outcome, redact, render_argv
from nodes.executors.guard import Refused, check_process
from nodes.executors.processes import _kill_group, service_env
from nodes.executors.sandbox import refusal


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: a local service's 3xx could point the agent at any address."""

    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: Message,
                         newurl: str) -> urllib.request.Request | None:
        return None  # urllib then raises HTTPError with the 3xx status


# No proxies either: an http_proxy variable would send "local" requests across the network.
local_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _read_capped(response: Any, limit: int) -> bytes:
    """Read at most ``limit`` bytes; raise BadOutput when the body is larger."""
    body = response.read(limit + 1)
    if len(body) > limit:
        raise BadOutput(f"the response is larger than {limit} bytes; store big outputs as artifacts")
    return body


class HttpExecutor:
    """POST the task to a local HTTP service; start it on demand and stop it when idle.

    Redirects are not followed and proxies are not used (the request goes to the validated URL
    and nowhere else); a response larger than the results limit fails the attempt.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: dict[str, subprocess.Popen] = {}
        self._last_used: dict[str, float] = {}

    def _ensure_started(self, config: dict[str, Any]) -> None:
        command = config.get("start_command")
        if not command:
            return
        key = json.dumps(command)
        with self._lock:
            proc = self._started.get(key)
            if proc is None or proc.poll() is not None:
                argv, env = render_argv(command, {}), service_env(config)
                checked = check_process(argv, env)  # Refused fails the attempt as not_allowed (run)
                # The file executed is the one checked: nothing resolves argv[0] again.
                self._started[key] = subprocess.Popen(argv, executable=checked, start_new_session=True, env=env,
                                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self._wait_ready(config)
            self._last_used[key] = time.monotonic()

    @staticmethod
    def _wait_ready(config: dict[str, Any], timeout: float = 15.0) -> None:
        url = config.get("health_url") or config["url"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                local_opener.open(url, timeout=1).close()  # noqa: S310 - loopback only (validated)
                return
            except urllib.error.HTTPError:
                return  # it answers
            except OSError:
                time.sleep(0.1)

    def stop_idle(self, idle_seconds_for: Callable[[str], float]) -> None:
        """Stop started services idle for longer than their ``idle_stop_seconds``."""
        with self._lock:
            for key, proc in list(self._started.items()):
                if proc.poll() is None and time.monotonic() - self._last_used.get(key, 0) > idle_seconds_for(key):
                    _kill_group(proc)
                    del self._started[key]

    def run(self, task: ClaimedTask, ctx: RunContext) -> Outcome:
        config = ctx.service_config
        refused = refusal("http", config)
        if refused:
            return _outcome(task, "failed", error=refused, error_code="not_allowed", retryable=False)
        try:
            self._ensure_started(config)
        except Refused as exc:
            return _outcome(task, "failed", error=f"not allowed: {exc}", error_code="not_allowed", retryable=False)
        except (OSError, ValueError) as exc:
            return _outcome(task, "failed", error=f"cannot start the service: {exc}", error_code="spawn_failed")
        ctx.on_started(None)
        body = json.dumps({"job_id": str(task.job_id), "task_id": str(task.id), "attempt": task.attempt,
                           "task_key": task.task_key, "params": task.params}).encode()
        request = urllib.request.Request(config["url"], data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with local_opener.open(request, timeout=task.timeout_seconds) as response:  # noqa: S310
                payload = _read_capped(response, MAX_RESULTS_BYTES).decode(errors="replace")
        except urllib.error.HTTPError as exc:
            text = exc.read(TAIL_CHARS * 4).decode(errors="replace")[-TAIL_CHARS:]
            if 300 <= exc.code < 400:
                return _outcome(task, "failed", error=f"HTTP {exc.code} from the service: redirects are not followed"
                                f" (it pointed at {exc.headers.get('Location', '?')[:200]!r})",
                                error_code="http_redirect", retryable=False, stdout_tail=redact(text, ctx.secrets))
            return _outcome(task, "failed", error=f"HTTP {exc.code} from the service", error_code="http_status",
                            stdout_tail=redact(text, ctx.secrets))
        except BadOutput as exc:
            return _outcome(task, "failed", error=f"bad output: {exc}", error_code="bad_output", retryable=False)
        except TimeoutError:
            return _outcome(task, "timeout", error=f"timeout after {task.timeout_seconds}s", error_code="timeout")
        except OSError as exc:
            return _outcome(task, "failed", error=f"service unreachable: {exc}", error_code="http_unreachable")
        try:
            results = json.loads(payload) if payload.strip() else {}
        except json.JSONDecodeError:
            return _outcome(task, "failed", error="response is not JSON", error_code="bad_response",
                            stdout_tail=redact(payload[-TAIL_CHARS:], ctx.secrets))
        return _outcome(task, "succeeded", results=results)
