"""Run one attempt whose process writes hundreds of megabytes without a newline, in this process, and
print (as JSON) how much the reading process's peak memory grew and what the attempt reported.

Run as ``python -m tests.nodes.output_harness CASE`` (a process of its own, so the peak is this
attempt's alone); tests/nodes/test_bounded_output.py reads the answer.
"""

from __future__ import annotations

import json
import resource
import sys
import uuid
from typing import Any

MEGABYTES = 200
# Writes a progress-looking line of MEGABYTES without a newline to stderr, then a real progress line and
# a short line.
STDERR_LINES = (
    "import sys\n"
    "chunk = b'9' * (1 << 20)\n"
    "write = sys.stderr.buffer.write\n"
    "write(b'::progress:: 0.')\n"
    f"for _ in range({MEGABYTES}): write(chunk)\n"
    "write(b'\\n::progress:: 0.5\\nafter the long line\\n')\n"
    "sys.stderr.flush()\n"
)
STDERR_WRITER = STDERR_LINES + "print('{\"ok\": 1}')\n"
STDOUT_WRITER = (
    "import sys\n"
    "chunk = b'[' * (1 << 20)\n"
    f"for _ in range({MEGABYTES}): sys.stdout.buffer.write(chunk)\n"
)


def write_stderr(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    """A process-isolated python task's version of STDERR_WRITER."""
    exec(STDERR_LINES, {})  # noqa: S102 - the test's own text
    return {"ok": 1}


def peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def main(case: str) -> None:
    import django

    django.setup()
    from jobs.claim import ClaimedTask
    from nodes.executors import PythonExecutor, RunContext, run_process
    from nodes.executors.python import WarmPool

    logs: list[str] = []
    progress: list[float] = []
    task = ClaimedTask(id=uuid.uuid4(), job_id=uuid.uuid4(), task_key="t", attempt=1, params={},
                       timeout_seconds=600, host=None, service_key="s")
    config: dict[str, Any] = {"callable": "tests.nodes.output_harness:write_stderr", "isolation": "process"}
    ctx = RunContext(task=task, service_config=config, on_started=lambda pid: None, on_progress=progress.append,
                     on_log=lambda level, text: logs.append(text))
    before = peak_kib()
    if case == "stderr":
        outcome = run_process(task, ctx, [sys.executable, "-c", STDERR_WRITER])
    elif case == "stdout":
        outcome = run_process(task, ctx, [sys.executable, "-c", STDOUT_WRITER])
    elif case == "warm":
        pool = WarmPool(size=1)
        sys.modules["nodes.executors.python"].warm_pool = pool  # type: ignore[attr-defined]
        outcome = PythonExecutor().run(task, ctx)
        warm = bool(pool.zygotes())
        pool.close()
        if not warm:
            raise SystemExit("the attempt did not run in a warm child")
    else:
        raise SystemExit(f"unknown case {case!r}")
    print(json.dumps({"grew_kib": peak_kib() - before, "status": outcome.status, "error": outcome.error,
                      "results": outcome.results, "progress": progress,
                      "logs": [line[:100] + " … " + line[-60:] if len(line) > 200 else line for line in logs],
                      "longest_log": max((len(line) for line in logs), default=0)}))


if __name__ == "__main__":
    main(sys.argv[1])
