"""What every executor shares: the attempt's context, the secrets it redacts, cleaning its output.

Each executor's ``run(task, ctx)`` (:class:`Executor`) blocks in a worker thread and returns an
Outcome; it reports start (pid), progress and log lines through :class:`RunContext`, which the
agent batches into the database. What a task prints is cleaned before it reaches the database
(:func:`sanitize_outcome`): NUL characters are stripped, NaN and Infinity are refused, sizes are
capped, so one task's output can never make a report fail. The agent's secrets and secret params
are redacted from tails, errors and log lines, and :func:`not_allowed` refuses, before each run,
what the site's ``ACC_ALLOWED_*`` lists do not name.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from accs_site.conf import known_secrets
from accs_site.redaction import SECRET_KEY_RE, redact, secrets_in  # noqa: F401 (re-exported: the executors use them by these names)
from jobs.claim import ClaimedTask
from jobs.transitions import Outcome
from workflows.validation import argv_fields, input_path, not_allowed_problems, validator_errors

TAIL_CHARS = 4000

KILL_GRACE_SECONDS = 3.0
# Results are one JSON document in a jsonb column; a task that needs more stores an artifact.
MAX_RESULTS_BYTES = 1_000_000
MAX_LOG_LINE_CHARS = 8000
MAX_ERROR_CHARS = 2000
# What a task's process inherits from the agent's environment; nothing else (least privilege:
# the agent's database URL, secret key, storage keys and tokens never reach a task).
INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "HOME", "TMPDIR", "TZ", "PYTHONPATH",
                 "DJANGO_SETTINGS_MODULE")


def agent_secrets() -> list[str]:
    """Return the agent's own secrets (:func:`accs_site.conf.known_secrets`), which no task output,
    error or log line may carry into the database."""
    return known_secrets()


@dataclass
class RunContext:
    """What an executor may do while it runs: report start, progress and log lines, see cancel."""

    task: ClaimedTask
    service_config: dict[str, Any]
    on_started: Callable[[int | None], None]
    on_progress: Callable[[float], None]
    on_log: Callable[[str, str], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    secrets: list[str] = field(default_factory=list)
    output_dir: str | None = None
    input_dir: str | None = None
    # The attempt's params file (ACCS_PARAMS_FILE) and the scratch folder that holds it, written once
    # by the first process executor that needs it (nodes.executors.processes.params_file).
    params_dir: str | None = None
    params_file: str | None = None
    # How long a stopped process group gets between SIGTERM and SIGKILL; the agent shortens it
    # when the lease is at stake (another agent may start the task soon).
    kill_grace: float = KILL_GRACE_SECONDS
    # Why the agent asked the attempt to stop: "cancel" (an operator), "shutdown", "lease".
    stop_reason: str = ""
    log_records: list[dict[str, Any]] = field(default_factory=list)
    node: str = ""
    agent_id: str = ""
    #: The outputs of the steps this task depends on, ``{parent step key: output}`` (a fanned-out
    #: parent's as a list, in task order); see :mod:`jobs.inputs`.
    inputs: dict[str, Any] = field(default_factory=dict)
    #: The JSON Schema the step's output must meet, when its workflow step declares one.
    output_schema: dict[str, Any] | None = None
    #: The scratch folder of the ``ACCS_INPUTS`` file, once written (removed with the attempt).
    inputs_dir: str | None = None

    def task_output(self, parent: str) -> Any:
        """Return the output of the parent step ``parent`` (a list for a fanned-out parent)."""
        if parent not in self.inputs:
            raise KeyError(f"{parent!r} is not a step this task depends on (its parents: {sorted(self.inputs)})")
        return self.inputs[parent]

    def log(self, message: str, *, level: str = "info") -> None:
        text = clean_text(redact(str(message), self.secrets))[:MAX_LOG_LINE_CHARS]
        self.log_records.append({"ts": _utc_now(), "level": level, "message": text})
        self.on_log(level, text)

    def progress(self, value: float) -> None:
        try:
            value = float(value)
        except (TypeError, ValueError):
            return
        if math.isfinite(value):
            self.on_progress(value)

    def stop(self, reason: str, *, kill_grace: float | None = None) -> None:
        """Ask the attempt to stop (the first reason given wins)."""
        if not self.stop_reason:
            self.stop_reason = reason
        if kill_grace is not None:
            self.kill_grace = min(self.kill_grace, kill_grace)
        self.cancel.set()


def _utc_now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat()


# --------------------------------------------------------------------------------------------
# Cleaning output before it reaches the database
# --------------------------------------------------------------------------------------------

class BadOutput(ValueError):
    """A task's output that can never be stored (NaN, too large, not JSON)."""


def clean_text(text: str) -> str:
    """Strip NUL characters, which PostgreSQL text and jsonb cannot hold."""
    return text.replace("\x00", "") if "\x00" in text else text


def _reject_constant(name: str) -> Any:
    raise BadOutput(f"results contain {name}, which JSON (and PostgreSQL) cannot store")


def clean_results(value: Any, *, depth: int = 0) -> Any:
    """Return ``value`` with NUL stripped from every string (keys too); refuse NaN and Infinity."""
    if depth > 200:
        raise BadOutput("results are nested too deeply")
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadOutput(f"results contain {value}, which JSON (and PostgreSQL) cannot store")
        return value
    if isinstance(value, dict):
        return {clean_text(str(k)): clean_results(v, depth=depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_results(v, depth=depth + 1) for v in value]
    return value


def parse_results(stdout: str) -> Any:
    """Parse a command's stdout as one JSON value; raise BadOutput when it cannot be stored."""
    if not stdout.strip():
        return {}
    if len(stdout.encode(errors="replace")) > MAX_RESULTS_BYTES:
        raise BadOutput(
            f"stdout is larger than {MAX_RESULTS_BYTES} bytes; store big outputs as files in ACCS_OUTPUT_DIR"
        )
    try:
        return json.loads(stdout, parse_constant=_reject_constant)
    except json.JSONDecodeError:
        raise BadOutput("stdout is not JSON (the CLI contract wants one JSON value)") from None


def sanitize_outcome(outcome: Outcome, *, secrets: Sequence[str] = ()) -> Outcome:
    """Make an outcome storable: clean text fields, redact ``secrets`` from them, check results;
    bad results fail the attempt.

    A result that cannot be stored becomes a final failure (``bad_output``): running the task
    again would print the same thing.
    """
    secrets = list(secrets)
    outcome.error = redact(clean_text(outcome.error or ""), secrets)[:MAX_ERROR_CHARS]
    outcome.stdout_tail = redact(clean_text(outcome.stdout_tail or ""), secrets)[-TAIL_CHARS:]
    outcome.stderr_tail = redact(clean_text(outcome.stderr_tail or ""), secrets)[-TAIL_CHARS:]
    if outcome.results is None:
        return outcome
    try:
        outcome.results = clean_results(outcome.results)
        size = len(json.dumps(outcome.results, default=str, allow_nan=False))
    except (BadOutput, ValueError, TypeError, RecursionError) as exc:
        return bad_output(outcome, str(exc))
    if size > MAX_RESULTS_BYTES:
        return bad_output(outcome, f"results are {size} bytes, more than {MAX_RESULTS_BYTES}; "
                                   "store big outputs as artifacts")
    return outcome


def bad_output(outcome: Outcome, reason: str) -> Outcome:
    """Return a final failure of ``outcome``'s attempt for output that cannot be stored."""
    return Outcome(task_id=outcome.task_id, attempt=outcome.attempt, status="failed",
                   error=clean_text(f"bad output: {reason}")[:MAX_ERROR_CHARS], error_code="bad_output",
                   retryable=False, exit_code=outcome.exit_code, stdout_tail=outcome.stdout_tail,
                   stderr_tail=outcome.stderr_tail)


class Executor(Protocol):
    def run(self, task: ClaimedTask, ctx: RunContext) -> Outcome: ...


def _outcome(task: ClaimedTask, status: str, **fields: Any) -> Outcome:
    return Outcome(task_id=task.id, attempt=task.attempt, status=status, **fields)


class OptionInjection(ValueError):
    """A param whose value would be read as an option of the tool (it starts with '-')."""


def _arg_text(value: Any) -> str:
    """Return a value as the text of one argument: JSON for an object or a list, "" for null."""
    return json.dumps(value) if isinstance(value, (dict, list)) else ("" if value is None else str(value))


def _input_text(name: str, path: list[str], inputs: Mapping[str, Any]) -> str:
    """Return the text of an ``{inputs.<step>.<name>...}`` placeholder: the value at ``path`` in the step's
    inputs (a number picks an element of a list); ValueError naming what is missing."""
    value: Any = inputs
    for depth, part in enumerate(path):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            where = "the step's inputs" if depth == 0 else "inputs." + ".".join(path[:depth])
            raise ValueError(f"argv placeholder {{{name}}} has no value: {where} has no {part!r}")
    return _arg_text(value)


def render_argv(template: list[str], params: dict[str, Any], *, option_params: Iterable[str] = (),
                inputs: Mapping[str, Any] | None = None) -> list[str]:
    """Render each argv element's plain ``{name}`` fields from params, and its ``{inputs.<step>.<name>}``
    fields from the outputs of the steps the task depends on (``inputs``); each stays one argument.

    Anything else (attributes, indexing, conversions, format specs) is refused, even in a row written to
    the database without validation. Neither params nor inputs choose the program (a placeholder in
    argv[0] is refused) or become options: an element whose leading ``-`` comes from a param is refused
    unless it follows a literal ``--`` element or the param is one of ``option_params`` (the service's
    ``executor_config.option_params``); one whose leading ``-`` comes from an input only after ``--``.
    """
    values = {k: _arg_text(v) for k, v in params.items()}
    for arg in template:
        for _, name in argv_fields(arg):
            path = input_path(name) if name else None
            if path is not None and name:
                values[name] = _input_text(name, path, inputs or {})
    options = {name for name in option_params if input_path(name) is None}
    out = []
    after_separator = False
    for index, arg in enumerate(template):
        pieces = argv_fields(arg)
        if index == 0 and any(name for _, name in pieces):
            raise ValueError(f"argv[0] {arg!r} has a placeholder: params may fill arguments, never choose the program")
        rendered = []
        leader: str | None = None  # the param that put the element's first character there
        for literal, name in pieces:
            rendered.append(literal)
            if name is not None:
                if name not in values:
                    raise ValueError(f"argv placeholder {name!r} has no value in params")
                if leader is None and not "".join(rendered) and values[name]:
                    leader = name
                rendered.append(values[name])
        text = "".join(rendered)
        if leader is not None and text.startswith("-") and not after_separator and leader not in options:
            if input_path(leader) is not None:
                raise OptionInjection(
                    f"{{{leader}}} is {_clip(values[leader])!r}, which starts with '-' and would be read as an"
                    " option of the tool; put '--' before it in argv (a step's inputs never become options)")
            raise OptionInjection(
                f"param {leader!r} is {_clip(values[leader])!r}, which starts with '-' and would be read as an"
                " option of the tool; put '--' before it in argv or list it in executor_config.option_params")
        after_separator = after_separator or arg == "--"
        out.append(text)
    if out and out[0] == "python":
        out[0] = sys.executable  # the agent's own interpreter, so demo tools need no PATH set-up
    return out


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def not_allowed(task: ClaimedTask, executor: str, config: dict[str, Any]) -> Outcome | None:
    """Return a final failure (``not_allowed``) when this site's allow-lists refuse the service's
    executor config, else None. The agent asks before every run: a row written to the database
    without validation, or an allow-list narrowed since, must not run."""
    problems = not_allowed_problems(executor, config)
    if not problems:
        return None
    return _outcome(task, "failed", error="not allowed: " + "; ".join(str(p) for p in problems),
                    error_code="not_allowed", retryable=False)

def output_violation(outcome: Outcome, schema: dict[str, Any] | None) -> Outcome:
    """Return a final failure (``bad_output``) of a succeeded attempt whose results break its step's
    output ``schema``, naming each violation; else ``outcome`` itself. Running it again would return the same."""
    if schema is None or outcome.status != "succeeded":
        return outcome
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        problems = validator_errors(Draft202012Validator(schema), outcome.results)
    except SchemaError as exc:  # a row written without validation: say so rather than crash the report
        return bad_output(outcome, f"the step's output_schema is not a valid JSON Schema: {exc.message}")
    if not problems:
        return outcome
    return bad_output(outcome, "the output does not match the step's output_schema: " + "; ".join(problems[:5]))


def remove_scratch(ctx: RunContext) -> None:
    """Remove the attempt's scratch directories (after its outputs were collected)."""
    for directory in (ctx.output_dir, ctx.input_dir, ctx.params_dir, ctx.inputs_dir):
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
