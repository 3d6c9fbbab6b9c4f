"""The ``command`` executor: argv from the service template, params rendered as separate arguments.

The CLI contract itself (results on stdout, log lines and progress on stderr, the exit code) is
:func:`nodes.executors.processes.run_process`.
"""

from __future__ import annotations

from jobs.claim import ClaimedTask
from jobs.transitions import Outcome
from nodes.executors.base import RunContext, _outcome, render_argv
from nodes.executors.processes import run_process


class CommandExecutor:
    """Run a CLI tool following the ACCS contract (no shell, own process group)."""

    def run(self, task: ClaimedTask, ctx: RunContext) -> Outcome:
        try:
            options = ctx.service_config.get("option_params")
            argv = render_argv(ctx.service_config.get("argv", []), task.params,
                               option_params=options if isinstance(options, list) else (), inputs=ctx.inputs)
        except ValueError as exc:
            return _outcome(task, "failed", error=str(exc), retryable=False, error_code="bad_params")
        return run_process(task, ctx, argv)
