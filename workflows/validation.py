"""Validation of services and workflows.

One set of rules serves the admin form (``Model.clean``), the Python API (:mod:`workflows.api`)
and imports. Every problem names where it is (which step, which field) and what is wrong; callers
validate everything before writing anything.

The rules read the definitions they are given and import no models: :mod:`workflows.models` calls
them from ``clean``, and what apps above still hold by a service's key (jobs, triggers) is asked
through the finders they register (:func:`register_service_users`).
"""

from __future__ import annotations

import json
import os
import re
import string
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, models, transaction

from accs_site.conf import ANY, DEMO_ONLY, accs
from accs_site.redaction import is_secret_name, redact_params

if TYPE_CHECKING:  # jsonschema is imported where a schema is checked (daemons start without it)
    from jsonschema import Draft202012Validator

STEP_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
#: A governor condition's name (workflows.governor): what block_during and priority_adjust_during name.
CONDITION_NAME_RE = re.compile(r"^[-a-zA-Z0-9_]{1,100}$")
CALLABLE_RE = re.compile(r"^[A-Za-z_][\w.]*[:.][A-Za-z_]\w*$")
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
FAN_OUT_VALUES = ("hosts",)
#: What each task of a step fanning out over a parent's list finds among its inputs besides its parents'
#: outputs: its item of the list and the item's place in it (from 0).
FAN_OUT_ITEM_INPUTS = ("item", "index")
FAN_OUT_EXAMPLE = '{"over": "$.pick.parcels"}'
# An argv placeholder reading the step's inputs: ``{inputs.<parent step key>.<name>...}`` (a number
# picks an element of a list), ``{inputs.item}`` for a step fanning out over a list.
INPUT_PLACEHOLDER_RE = re.compile(r"^inputs(\.[A-Za-z0-9_-]+)+$")
STEP_FIELDS = frozenset({"key", "service", "depends_on", "default_params", "fan_out", "on_failure", "always",
                         "output_schema", "when"})
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Names the agent sets itself (the task contract) or keeps for itself (its settings).
RESERVED_ENV_PREFIXES = ("ACC_", "ACCS_")
# Variables that make a program load or run other code than the one allowed (a dynamic loader's
# preload, an interpreter's start-up file or warnings hook, a shell's start-up file, the search path
# that decides which program a name is, a browser or pager a library may launch). A service's env
# never sets them, whatever ACC_ALLOWED_TASK_ENV lists: the agent passes its own PATH, PYTHONPATH and
# DJANGO_SETTINGS_MODULE, and a task that needs another must be a program that sets it itself.
LOADER_ENV_NAMES = frozenset({
    "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "PROMPT_COMMAND", "IFS", "CDPATH", "GLOBIGNORE",
    "PATH", "BROWSER", "PAGER", "EDITOR", "VISUAL", "LESSOPEN", "LESSCLOSE", "MANPAGER", "GIT_PAGER",
    "GIT_SSH", "GIT_SSH_COMMAND", "GIT_EXEC_PATH", "GIT_CONFIG_GLOBAL", "GIT_ASKPASS", "SSH_ASKPASS",
    "DJANGO_SETTINGS_MODULE", "NODE_OPTIONS", "NODE_PATH", "RUBYOPT", "RUBYLIB", "JAVA_TOOL_OPTIONS",
    "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "CLASSPATH", "OPENSSL_CONF", "OPENSSL_ENGINES", "GCONV_PATH",
    "LOCPATH", "NLSPATH", "HOSTALIASES", "RES_OPTIONS", "LOCALDOMAIN", "TMPDIR", "HOME", "SHELL",
    "MALLOC_CONF", "MALLOC_CHECK_", "TERMINFO", "TERMCAP", "XDG_CONFIG_HOME", "XDG_CONFIG_DIRS",
})
LOADER_ENV_PREFIXES = ("LD_", "DYLD_", "PYTHON", "PERL", "BASH_FUNC_", "LUA_", "R_", "TCL", "GLIBC_",
                       "GCONV_", "ACC_", "ACCS_")


class StepFailurePolicy(models.TextChoices):
    """What a workflow step failing for good (its task in final error) does to the job."""

    FAIL_JOB = "fail_job", "Fail the job (its dependents and unstarted steps are skipped)"
    CONTINUE = "continue", "Continue (its dependents are skipped, independent steps go on; the job ends partial)"


# Who still names a service by its key: given the key, a finder returns one description per user
# ("workflow deploy v2", "3 unfinished job(s)"). Each app holding such names registers one from its
# AppConfig.ready(), so a rename is refused without this module importing the apps above it.
ServiceUsersFinder = Callable[[str], list[str]]
_service_users_finders: list[ServiceUsersFinder] = []


def register_service_users(finder: ServiceUsersFinder) -> None:
    """Add ``finder`` to those :func:`service_users` asks (once, however often it is registered)."""
    if finder not in _service_users_finders:
        _service_users_finders.append(finder)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a definition: ``where`` names the step or field."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class DefinitionError(ValidationError):
    """A service or workflow definition is invalid; ``problems`` lists every reason."""

    def __init__(self, problems: list[Problem], *, field: str | None = None) -> None:
        self.problems = problems
        messages = [str(p) for p in problems]
        super().__init__({field: messages} if field else messages)


def _json_path(path: Iterable[Any]) -> str:
    parts = [str(p) for p in path]
    return ".".join(parts) if parts else "(root)"


def schema_errors(schema: Mapping[str, Any], instance: Any, *, partial: bool = False) -> list[str]:
    """Return readable JSON Schema violations of ``instance``; ``partial`` ignores ``required``."""
    if partial and isinstance(schema, Mapping) and "required" in schema:
        schema = {k: v for k, v in schema.items() if k != "required"}
    from jsonschema import Draft202012Validator

    return validator_errors(Draft202012Validator(schema), instance)


def validator_errors(validator: Draft202012Validator, instance: Any) -> list[str]:
    """Return ``validator``'s violations of ``instance`` as readable lines, by path, no secret quoted."""
    return [
        f"{_json_path(err.absolute_path)}: {_error_words(err)}"
        for err in sorted(validator.iter_errors(instance), key=lambda e: list(map(str, e.absolute_path)))
    ]


def _error_words(err: Any) -> str:
    """The schema's words for ``err``, unless they would quote a secret: jsonschema's messages repr the
    failing value, and these texts reach callers, logs and a trigger's stored last error. A value under
    a secret-looking name (or a value holding one) is described by the rule it broke instead."""
    if any(is_secret_name(part) for part in err.absolute_path) or redact_params(err.instance) != err.instance:
        return f"the value (hidden: a secret) fails the schema's {err.validator!r} rule: {err.validator_value!r}"
    return str(err.message)


def argv_fields(arg: str) -> list[tuple[str, str | None]]:
    """Split one argv element into (literal text, placeholder name or None) pairs.

    Only plain ``{name}`` fields are placeholders: attribute access, indexing, format specs and
    conversions are refused (they would let params reach Python objects or build huge strings).
    Raise ValueError naming the field.
    """
    try:
        parsed = list(string.Formatter().parse(arg))
    except ValueError as exc:
        raise ValueError(f"{arg!r}: {exc}; {LITERAL_BRACES_HINT}") from None
    pieces: list[tuple[str, str | None]] = []
    for literal, field, spec, conversion in parsed:
        if field is None:
            pieces.append((literal, None))
            continue
        if field == "" or field.isdigit():
            raise ValueError(f"positional placeholder in {arg!r}; name it ({{param}}) or {LITERAL_BRACES_HINT}")
        if INPUT_PLACEHOLDER_RE.match(field) and not spec and not conversion:
            pieces.append((literal, field))
            continue
        if not field.isidentifier() or spec or conversion:
            shown = field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ValueError(f"{{{shown}}} in {arg!r} is not a plain {{name}} placeholder (or {{inputs.<step>.<name>}};"
                             f" no attributes, indexing, conversions or format specs); {LITERAL_BRACES_HINT}")
        pieces.append((literal, field))
    return pieces


def argv_placeholders(argv: Iterable[str]) -> set[str]:
    """Return the ``{name}`` placeholders used in an argv template (ValueError for any other field)."""
    return {name for arg in argv for _, name in argv_fields(arg) if name}


def input_path(placeholder: str) -> list[str] | None:
    """Return the path an ``{inputs.<step>.<name>...}`` placeholder reads (``["pick", "items"]``), else None."""
    if not INPUT_PLACEHOLDER_RE.match(placeholder):
        return None
    return placeholder.split(".")[1:]


def param_placeholders(argv: Iterable[str]) -> set[str]:
    """Return the placeholders of an argv template that params fill (not those reading the step's inputs)."""
    return {name for name in argv_placeholders(argv) if input_path(name) is None}


def program_problems(argv: list[str], *, field: str) -> list[Problem]:
    """Refuse a placeholder in argv[0]: params choose arguments, never the program that runs."""
    try:
        pieces = argv_fields(argv[0]) if argv else []
    except ValueError:
        return []  # the placeholder syntax problem is reported once, by the caller
    if any(name for _, name in pieces):
        return [Problem(field, f"argv[0] {argv[0]!r} has a placeholder: params may fill arguments, never choose"
                               " the program (list each program as its own service)")]
    return []


def option_params_problems(value: Any, used: set[str]) -> list[Problem]:
    """Check ``option_params``: the params whose values may start with '-' (become options of the tool)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return [Problem("executor_config.option_params", 'expected a list of param names, e.g. ["flags"]')]
    unknown = sorted(set(value) - used)
    if unknown:
        return [Problem("executor_config.option_params", f"{unknown} are not placeholders of argv")]
    return []


# Argv elements are rendered with str.format, so literal braces (JSON, shell-like ${VAR}) are doubled.
LITERAL_BRACES_HINT = ('write literal braces doubled ({{ for {, }} for }): '
                       'the element {{"mode": "fast"}} renders {"mode": "fast"}')


def service_problems(service) -> list[Problem]:
    """Return every problem with a service definition (model instance or any object with its fields)."""
    problems: list[Problem] = []
    schema = service.params_schema if service.params_schema is not None else {}
    if not isinstance(schema, dict):
        problems.append(Problem("params_schema", "must be a JSON object (a JSON Schema)"))
    else:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            problems.append(Problem("params_schema", f"not a valid JSON Schema: {exc.message}"))
    config = service.executor_config if service.executor_config is not None else {}
    if not isinstance(config, dict):
        problems.append(Problem("executor_config", "must be a JSON object"))
        config = {}
    executor = service.executor
    if executor == "command":
        argv = config.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            problems.append(Problem("executor_config.argv", "a command service needs a non-empty list of strings"))
        else:
            try:
                used = param_placeholders(argv)
            except ValueError as exc:
                problems.append(Problem("executor_config.argv", f"bad placeholder syntax: {exc}"))
                used = set()
            declared = set((schema.get("properties") or {}).keys()) if isinstance(schema, dict) else set()
            unknown = sorted(used - declared) if declared or used else []
            if unknown:
                problems.append(
                    Problem("executor_config.argv", f"placeholders {unknown} are not properties of params_schema")
                )
            problems += program_problems(argv, field="executor_config.argv")
            problems += option_params_problems(config.get("option_params"), used)
    elif executor == "python":
        target = config.get("callable")
        if not isinstance(target, str) or not CALLABLE_RE.match(target):
            problems.append(Problem("executor_config.callable",
                                    "expected a dotted path such as 'package.module:function'"))
    elif executor == "http":
        problems += local_url_problems(config.get("url"), field="executor_config.url")
        if config.get("health_url") is not None:
            problems += local_url_problems(config.get("health_url"), field="executor_config.health_url")
        start = config.get("start_command")
        if start is not None and (not isinstance(start, list) or not all(isinstance(a, str) for a in start)):
            problems.append(Problem("executor_config.start_command", "must be a list of strings (argv, no shell)"))
        elif start:
            problems += program_problems(start, field="executor_config.start_command")
    elif executor == "simulate":
        for rate in ("error_rate", "timeout_rate"):
            value = config.get(rate, 0)
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                problems.append(Problem(f"executor_config.{rate}", "must be a number between 0 and 1"))
    else:
        problems.append(Problem("executor", f"unknown executor {executor!r}"))
    if executor in ("command", "python", "http"):
        problems += env_problems(config.get("env"))
    already = {p.where for p in problems}  # one message per field: a malformed URL need not be "not allowed" too
    problems += [p for p in not_allowed_problems(executor, config) if p.where not in already]
    if not (1 <= (service.cpu_weight or 0) <= 5):
        problems.append(Problem("cpu_weight", f"must be between 1 and 5, got {service.cpu_weight}"))
    if (service.timeout_seconds or 0) < 1:
        problems.append(Problem("timeout_seconds", "must be at least 1"))
    if (service.max_attempts or 0) < 1:
        problems.append(Problem("max_attempts", "must be at least 1"))
    base = service.backoff_base_seconds
    if base is not None and base < 0:
        problems.append(Problem("backoff_base_seconds", "must not be negative"))
    if service.backoff_cap_seconds is not None and base is not None and service.backoff_cap_seconds < base:
        problems.append(Problem("backoff_cap_seconds", "must be at least backoff_base_seconds"))
    if not isinstance(service.priority_adjust_during, dict) or not all(
        isinstance(v, int) for v in (service.priority_adjust_during or {}).values()
    ):
        problems.append(Problem("priority_adjust_during", 'expected {"condition": integer, ...}'))
    else:
        problems += condition_names_problems(list(service.priority_adjust_during or {}),
                                             field="priority_adjust_during")
    problems += condition_names_problems(service.block_during, field="block_during")
    problems += flow_control_problems(service)
    problems += key_change_problems(service)
    problems += sandbox_problems(executor, config)
    return problems


#: The sandboxes a service may ask for (``"sandbox": "bwrap"``), by the name of the tool that makes them;
#: nodes.executors.sandbox makes them.
SANDBOXES = ("bwrap",)
#: What a sandbox has its own of, or hides: "sandbox_paths" may not show the host's.
SANDBOX_HIDDEN = ("/proc", "/sys", "/dev", "/tmp")


def sandbox_problems(executor: str, config: Mapping[str, Any]) -> list[Problem]:
    """Check a service's sandbox settings: a known sandbox, on a command service, with absolute read-only paths."""
    kind = config.get("sandbox")
    if kind is None:
        return [Problem(f"executor_config.{key}", 'only means something with "sandbox": "bwrap"')
                for key in ("sandbox_paths", "sandbox_network") if key in config]
    if kind not in SANDBOXES:
        return [Problem("executor_config.sandbox", f"expected one of {list(SANDBOXES)}, got {kind!r}")]
    problems = []
    if executor != "command":
        problems.append(Problem("executor_config.sandbox",
                                f"the sandbox runs command services; a {executor} service cannot have one"))
    extra = config.get("sandbox_paths", [])
    if not isinstance(extra, list) or not all(
            isinstance(p, str) and os.path.isabs(p) and os.path.normpath(p) == p for p in extra):
        problems.append(Problem("executor_config.sandbox_paths", "expected a list of absolute, normalised paths"))
    else:
        shown = [p for p in extra if p == "/" or any(p == h or p.startswith(h + "/") for h in SANDBOX_HIDDEN)]
        if shown:
            problems.append(Problem("executor_config.sandbox_paths",
                                    f"{shown} would show the sandbox what it hides (the whole file system, or "
                                    f"one of {list(SANDBOX_HIDDEN)}: processes, devices, other attempts' folders)"))
    if not isinstance(config.get("sandbox_network", False), bool):
        problems.append(Problem("executor_config.sandbox_network", "expected true or false"))
    return problems


def local_url_problems(url: Any, *, field: str) -> list[Problem]:
    """Return what is wrong with the URL of a local (loopback) http service."""
    try:
        parsed = urlparse(url) if isinstance(url, str) else None
        parsed and parsed.port  # noqa: B018 - parsing the port raises for a bad one
    except ValueError:
        parsed = None
    if not parsed or parsed.scheme not in ("http", "https") or not parsed.hostname:
        return [Problem(field, "expected an http(s) URL of the local service")]
    if parsed.hostname not in LOOPBACK_HOSTS:
        return [Problem(field, f"must be a local service (loopback), got host {parsed.hostname!r}")]
    return []


def env_problems(env: Any) -> list[Problem]:
    """Check a service's extra environment: ``{"NAME": "value"}`` with names the site allows
    (ACC_ALLOWED_TASK_ENV), never a loader variable nor the agent's own names."""
    if env is None:
        return []
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        return [Problem("executor_config.env", 'expected {"NAME": "text value", ...}')]
    problems = []
    for name in env:
        refusal = env_name_refusal(name)
        if refusal:
            problems.append(Problem("executor_config.env", refusal))
    return problems


def env_name_refusal(name: str) -> str | None:
    """Return why a service's env may not set ``name`` (None when it may)."""
    if not ENV_NAME_RE.match(name):
        return f"{name!r} is not an environment variable name"
    if name.startswith(RESERVED_ENV_PREFIXES):
        return f"{name!r}: names starting with ACC_ or ACCS_ are the agent's (its settings and the task contract)"
    if name in LOADER_ENV_NAMES or name.upper().startswith(LOADER_ENV_PREFIXES):
        return (f"{name!r} changes which code a program loads or runs (a loader, interpreter or shell "
                "variable); no service may set it")
    if not env_name_allowed(name, accs.allowed_task_env):
        listed = ",".join(accs.allowed_task_env) or "unset"
        return f"{name!r} is not a variable this site lets services set (ACC_ALLOWED_TASK_ENV={listed})"
    return None


def env_name_allowed(name: str, allowed: Iterable[str]) -> bool:
    """Return whether ``name`` is listed, or starts with a listed prefix written ``PREFIX*``."""
    return any(name == entry or (entry.endswith("*") and name.startswith(entry[:-1])) for entry in allowed)


# --------------------------------------------------------------------------------------------
# Site allow-lists: what this site lets agents run, whatever a definition says
# --------------------------------------------------------------------------------------------

DEMO_TOOL_ARGS = ["-m", "workflows.demo.tool"]
#: The Tasks framework's adapter (``jobs.tasks_backend.ADAPTER``): a service that names it runs the
#: ``@task`` function in its ``task`` key, which the allow-list must name.
TASKS_ADAPTER = "jobs.tasks_backend:run_task"


def is_demo_tool(argv: list[str]) -> bool:
    """Return whether ``argv`` runs the project's own demo tool with the agent's interpreter."""
    return (len(argv) >= 3 and argv[0] in ("python", sys.executable) and argv[1:3] == DEMO_TOOL_ARGS)


def executable_allowed(program: str, allowed: Iterable[str], *, argv: list[str] | None = None) -> bool:
    """Return whether argv[0] ``program`` is a listed name, a listed path or inside a listed directory
    (``@demo``: the demo tool, when ``argv`` is that tool's)."""
    allowed = tuple(allowed)
    if ANY in allowed:
        return True
    if DEMO_ONLY in allowed and argv is not None and is_demo_tool(argv):
        return True
    if "/" not in program:
        return program in allowed
    path = os.path.normpath(program)
    if not os.path.isabs(path) or program.startswith("//"):
        return False  # a relative path depends on the agent's working directory; list it as a name or path
    return any(path == entry or (entry.endswith("/") and path.startswith(entry)) for entry in allowed)


def callable_allowed(target: str, allowed: Iterable[str]) -> bool:
    """Return whether the callable ``module:function`` (or dotted) comes from an allowed module prefix."""
    allowed = tuple(allowed)
    if ANY in allowed:
        return True
    module = target.partition(":")[0] if ":" in target else target.rpartition(".")[0]
    return any(module == prefix or module.startswith(prefix + ".") for prefix in allowed)


def url_allowed(url: str, allowed: Iterable[str]) -> bool:
    """Return whether ``url`` has the scheme, host (and port, when the prefix names one) and path of a prefix."""
    try:
        target = urlparse(url)
        port = target.port
    except ValueError:
        return False
    for entry in allowed:
        prefix = urlparse(entry)
        if (target.scheme == prefix.scheme and target.hostname == prefix.hostname
                and (prefix.port is None or port == prefix.port) and target.path.startswith(prefix.path)):
            return True
    return False


def not_allowed_problems(executor: str, config: Mapping[str, Any]) -> list[Problem]:
    """Return what in an executor config this site's allow-lists refuse (ACC_ALLOWED_*)."""
    problems: list[Problem] = []
    argv_fields_ = (("executor_config.argv", config.get("argv")),) if executor == "command" else ()
    if executor == "http":
        argv_fields_ = (("executor_config.start_command", config.get("start_command")),)
    for where, argv in argv_fields_:
        if isinstance(argv, list) and argv and isinstance(argv[0], str):
            if not executable_allowed(argv[0], accs.allowed_executables, argv=argv):
                problems.append(Problem(where, f"{argv[0]!r} is not an executable this site allows"
                                               f" (ACC_ALLOWED_EXECUTABLES={','.join(accs.allowed_executables)})"))
    # "task" is the function a Django Tasks service's adapter callable runs: it must be allowed, and so
    # must the callable unless it is ACCS's own adapter (which runs nothing but that allowed function).
    for key in ("callable", "task") if executor == "python" else ():
        target = config.get(key)
        if key == "callable" and target == TASKS_ADAPTER and isinstance(config.get("task"), str):
            continue
        if isinstance(target, str) and not callable_allowed(target, accs.allowed_callables):
            listed = ",".join(accs.allowed_callables)
            problems.append(Problem(f"executor_config.{key}", f"{target!r} is not from a module this site allows"
                                                              f" (ACC_ALLOWED_CALLABLES={listed})"))
    for key in ("url", "health_url") if executor == "http" else ():
        url = config.get(key)
        if isinstance(url, str) and not url_allowed(url, accs.allowed_http_urls):
            listed = ",".join(accs.allowed_http_urls)
            problems.append(Problem(f"executor_config.{key}",
                                    f"{url!r} does not start with a URL this site allows "
                                    f"(ACC_ALLOWED_HTTP_URLS={listed})"))
    return problems


def wake_problems(*, method: str, script: str, provider_ref: str) -> list[Problem]:
    """Return what this site's allow-lists refuse in a node's wake settings (its script is a program the
    builder runs; its provider URL is a request the builder sends)."""
    problems: list[Problem] = []
    if method == "script":
        if not script or not os.path.isabs(script):
            problems.append(Problem("script", "expected the absolute path of the wake script"))
        elif not executable_allowed(script, accs.allowed_executables):
            problems.append(Problem("script", f"{script!r} is not an executable this site allows"
                                              f" (ACC_ALLOWED_EXECUTABLES={','.join(accs.allowed_executables)})"))
    if method == "provider" and not url_allowed(provider_ref, accs.allowed_http_urls):
        problems.append(Problem("provider_ref", f"{provider_ref!r} does not start with a URL this site allows"
                                                f" (ACC_ALLOWED_HTTP_URLS={','.join(accs.allowed_http_urls)})"))
    return problems


PARAMS_PATH_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


def flow_control_problems(service) -> list[Problem]:
    """Check the rate limits and the per-key cap: a limit with a key needs a params path, and so on."""
    problems: list[Problem] = []
    if (service.rate_period_seconds or 0) < 1:
        problems.append(Problem("rate_period_seconds", "must be at least 1"))
    for key_field, limit_field in (("rate_key", "rate_key_limit"), ("concurrency_key", "concurrency_key_limit")):
        path, limit = getattr(service, key_field) or "", getattr(service, limit_field) or 0
        if path and not PARAMS_PATH_RE.match(path):
            problems.append(Problem(key_field, f"{path!r} is not a params path: expected names joined by dots,"
                                               " e.g. customer_id or customer.id"))
        if limit and not path:
            problems.append(Problem(key_field, f"{limit_field} is {limit}: name the params path that gives the key"))
        if path and not limit:
            problems.append(Problem(limit_field, f"{key_field} is {path!r}: give the limit per key (at least 1)"))
    if service.rate_limit and service.rate_key_limit and service.rate_key_limit > service.rate_limit:
        problems.append(Problem("rate_key_limit", f"{service.rate_key_limit} per key is more than the service's"
                                                  f" rate_limit of {service.rate_limit}: it could never be reached"))
    return problems


def service_users(key: str) -> list[str]:
    """Return what still names the service ``key`` (workflows' steps, unfinished jobs, triggers), as
    the registered finders describe it."""
    return [user for finder in _service_users_finders for user in finder(key)]


def key_change_problems(service) -> list[Problem]:
    """Refuse renaming a service away from a key that workflows or unfinished jobs still use.

    Workflow steps name their service by key; a rename would leave them pointing at nothing and
    their next job could not be instantiated.
    """
    pk = getattr(service, "pk", None)
    if not pk:
        return []
    # The key as stored, read through the instance's own model.
    old = type(service)._default_manager.filter(pk=pk).values_list("key", flat=True).first()
    if old is None or old == service.key:
        return []
    users = service_users(old)
    if not users:
        return []
    return [Problem("key", f"service {old!r} cannot be renamed: still used by {', '.join(users[:5])}"
                           + (f" and {len(users) - 5} more" if len(users) > 5 else ""))]


def condition_names_problems(names: Any, *, field: str) -> list[Problem]:
    """Name each entry that cannot be a governor condition's name: it would silently never match one.

    The admin's field takes names separated by commas; one typed as JSON (``["live_session"]``, the
    style of the neighbouring fields) arrives as a single name with brackets and quotes.
    """
    if names is None:
        return []
    if not isinstance(names, (list, tuple)):
        return [Problem(field, "expected a list of governor condition names")]
    bad = [n for n in names if not isinstance(n, str) or not CONDITION_NAME_RE.match(n)]
    if not bad:
        return []
    return [Problem(field, f"{', '.join(repr(n) for n in bad)} is not a governor condition name (1-100 letters, "
                           "digits, '-' or '_'); list names separated by commas, without brackets or quotes, "
                           "e.g. live_session,backup")]


def validate_service(service) -> None:
    """Raise :class:`DefinitionError` when the service definition is invalid."""
    problems = service_problems(service)
    if problems:
        raise DefinitionError(problems)


def find_cycle(graph: Mapping[str, list[str]]) -> list[str] | None:
    """Return one dependency cycle as a path (first node repeated at the end), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = {node: WHITE for node in graph}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = GREY
        stack.append(node)
        for dep in graph.get(node, []):
            if dep not in colour:
                continue
            if colour[dep] == GREY:
                return stack[stack.index(dep):] + [dep]
            if colour[dep] == WHITE:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        colour[node] = BLACK
        return None

    for node in graph:
        if colour[node] == WHITE:
            found = visit(node)
            if found:
                return found
    return None


def step_problems(steps: Any, services: Mapping[str, Any]) -> list[Problem]:
    """Return every problem with a workflow's steps; ``services`` maps known keys to services."""
    if not isinstance(steps, list) or not steps:
        return [Problem("steps", "a workflow needs a non-empty list of steps")]
    problems: list[Problem] = []
    keys: list[str] = []
    for index, step in enumerate(steps):
        where = f"step #{index + 1}"
        if not isinstance(step, dict):
            problems.append(Problem(where, "must be an object {key, service, depends_on, default_params}"))
            continue
        key = step.get("key")
        if not isinstance(key, str) or not STEP_KEY_RE.match(key):
            problems.append(Problem(where, f"key {key!r} must be 1-100 letters, digits, '_', '-' or '.'"))
            continue
        keys.append(key)
        unknown_fields = sorted(set(step) - STEP_FIELDS)
        if unknown_fields:
            problems.append(Problem(f"step '{key}'", f"unknown fields {unknown_fields}"))
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    for key in duplicates:
        problems.append(Problem(f"step '{key}'", "duplicate step key"))
    known_keys = set(keys)
    by_key = {step["key"]: step for step in steps if isinstance(step, dict) and step.get("key") in known_keys}
    graph: dict[str, list[str]] = {}
    for step in steps:
        if not isinstance(step, dict) or not isinstance(step.get("key"), str) or step["key"] not in known_keys:
            continue
        key = step["key"]
        where = f"step '{key}'"
        service_key = step.get("service")
        service = services.get(service_key) if isinstance(service_key, str) else None
        if service is None:
            problems.append(Problem(where, f"unknown service {service_key!r}"))
        elif not service.is_active:
            problems.append(Problem(where, f"service {service_key!r} is not active"))
        deps = step.get("depends_on", [])
        if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
            problems.append(Problem(where, "depends_on must be a list of step keys"))
            deps = []
        for dep in deps:
            if dep == key:
                problems.append(Problem(where, "depends on itself"))
            elif dep not in known_keys:
                problems.append(Problem(where, f"depends on unknown step {dep!r}"))
        graph[key] = [d for d in deps if d in known_keys and d != key]
        params = step.get("default_params", {})
        if not isinstance(params, dict):
            problems.append(Problem(where, "default_params must be an object"))
        elif has_nul(params):
            problems.append(Problem(where, "default_params hold a NUL character (\\u0000), which PostgreSQL cannot "
                                           "store in JSON"))
        elif (size := len(json.dumps(params).encode())) > accs.max_params_bytes:
            # Every start of the workflow would be refused: say so when it is saved.
            problems.append(Problem(where, f"default_params are {size:,} bytes of JSON, more than the limit of "
                                           f"{accs.max_params_bytes:,} bytes (ACC_MAX_PARAMS_BYTES) every start is "
                                           "held to; pass large inputs as artifacts"))
        elif service is not None and isinstance(service.params_schema, dict):
            for err in schema_errors(service.params_schema, params, partial=True):
                problems.append(Problem(where, f"default_params.{err}"))
        problems += fan_out_problems(step.get("fan_out"), deps, by_key, where=where)
        problems += argv_input_problems(service, deps, over_items=isinstance(step.get("fan_out"), dict), where=where)
        problems += policy_problems(step, where=where)
        problems += output_schema_problems(step.get("output_schema"), where=where)
        problems += when_problems(step.get("when"), deps, where=where)
    cycle = find_cycle(graph)
    if cycle:
        problems.append(Problem("steps", "dependency cycle: " + " → ".join(cycle)))
    return problems


def fan_out_problems(fan_out: Any, deps: list[str], steps: Mapping[str, Any], *, where: str) -> list[Problem]:
    """Check a step's ``fan_out``: ``"hosts"`` (one task per host of the job's options), or ``{"over": path}``
    (one task per item of the list a jsonpath finds in one parent's output, made when the parents are done)."""
    if fan_out is None or fan_out in FAN_OUT_VALUES:
        return []
    over = fan_out.get("over") if isinstance(fan_out, dict) and set(fan_out) == {"over"} else None
    if not isinstance(over, str) or not over.strip() or len(over) > WHEN_MAX_CHARS:
        return [Problem(where, f'fan_out must be "hosts", {{"over": "<jsonpath to a list in a parent\'s output>"}} '
                               f"(e.g. {FAN_OUT_EXAMPLE}) or absent, got {fan_out!r}")]
    if not deps:
        return [Problem(where, f"fan_out over {over!r} reads a parent's output; the step has no depends_on")]
    named = when_parents(over)
    problems = []
    if len(named) != 1:
        problems.append(Problem(where, f"fan_out over {over!r} must read one parent's output: start the path with "
                                       f"$.<parent step key>, e.g. {FAN_OUT_EXAMPLE}"))
    missing = sorted(named - set(deps))
    if missing:
        problems.append(Problem(where, f"fan_out reads {missing}, which it does not depend on (depends_on: {deps})"))
    clash = sorted(set(deps) & set(FAN_OUT_ITEM_INPUTS))
    if clash:
        problems.append(Problem(where, f"a step fanning out over a list finds its item as inputs "
                                       f"{list(FAN_OUT_ITEM_INPUTS)}: it cannot depend on steps keyed {clash}"))
    syntax = jsonpath_error(over)
    if syntax:
        problems.append(Problem(where, f"fan_out over {over!r} is not a jsonpath PostgreSQL accepts: {syntax}"))
    elif len(named) == 1 and not missing:
        problems += _fan_out_type_problems(over, steps.get(next(iter(named))), where=where)
    return problems


# A plain path into a parent's output: $.step.name."other name" (no filters, wildcards or indexes).
SIMPLE_PATH_RE = re.compile(r'^\$((?:\s*\.\s*(?:"(?:[^"\\]|\\.)*"|[A-Za-z_][A-Za-z0-9_]*))+)\s*$')
PATH_SEGMENT_RE = re.compile(r'\.\s*(?:"((?:[^"\\]|\\.)*)"|([A-Za-z_][A-Za-z0-9_]*))')


def _fan_out_type_problems(over: str, parent: Any, *, where: str) -> list[Problem]:
    """Refuse a fan-out over what the parent's ``output_schema`` says is not a list (when it says)."""
    match = SIMPLE_PATH_RE.match(over)
    schema = parent.get("output_schema") if isinstance(parent, dict) else None
    if match is None or not isinstance(schema, dict):
        return []
    names = [quoted or bare for quoted, bare in PATH_SEGMENT_RE.findall(match.group(1))][1:]
    for name in names:
        properties = schema.get("properties") if isinstance(schema, dict) else None
        schema = properties.get(name) if isinstance(properties, dict) else None
        if not isinstance(schema, dict):
            return []
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if kinds and "array" not in kinds:
        return [Problem(where, f"fan_out over {over!r}: step {parent['key']!r}'s output_schema says it is "
                               f"{' or '.join(sorted(kinds))}, not a list")]
    return []


def argv_input_problems(service: Any, deps: list[str], *, over_items: bool, where: str) -> list[Problem]:
    """Check that each ``{inputs.<step>...}`` placeholder of a command step's argv reads a step it depends on
    (or ``item`` / ``index``, for a step fanning out over a list): any other would never have a value."""
    config = getattr(service, "executor_config", None)
    argv = config.get("argv") if isinstance(config, dict) and getattr(service, "executor", None) == "command" else None
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return []
    try:
        placeholders = argv_placeholders(argv)
    except ValueError:
        return []  # the service's own problem
    readable = set(deps) | (set(FAN_OUT_ITEM_INPUTS) if over_items else set())
    problems = []
    for name in sorted(placeholders):
        path = input_path(name)
        if path is not None and path[0] not in readable:
            problems.append(Problem(where, f"argv placeholder {{{name}}} of service {service.key!r} reads "
                                           f"{path[0]!r}, which is not among the step's inputs "
                                           f"({sorted(readable) or 'it has no depends_on'})"))
    return problems


def has_nul(value: Any, *, depth: int = 0) -> bool:
    """Return whether a JSON value holds a NUL character in a string or key (jsonb cannot store one)."""
    if depth > 200:
        return False
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(has_nul(k) or has_nul(v, depth=depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return any(has_nul(v, depth=depth + 1) for v in value)
    return False


def output_schema_problems(schema: Any, *, where: str) -> list[Problem]:
    """Check a step's ``output_schema``: absent, or a JSON Schema its output is validated against when it succeeds."""
    if schema is None:
        return []
    if not isinstance(schema, dict):
        return [Problem(where, "output_schema must be a JSON object (a JSON Schema) or absent")]
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return [Problem(where, f"output_schema is not a valid JSON Schema: {exc.message}")]
    return []


# The parent steps a condition names: each ``$.name`` or ``$."name"`` at the root of its paths.
WHEN_PARENT_RE = re.compile(r'\$\s*\.\s*(?:"((?:[^"\\]|\\.)*)"|([A-Za-z_][A-Za-z0-9_]*))')
WHEN_MAX_CHARS = 2000
WHEN_EXAMPLE = '"$.check.healthy == true" or "$.\\"fetch-all\\".count > 0"'


def when_parents(when: str) -> set[str]:
    """Return the step keys a condition reads (``$.key`` or ``$."key"`` at the root of a path)."""
    return {quoted or bare for quoted, bare in WHEN_PARENT_RE.findall(when)}


def when_problems(when: Any, deps: list[str], *, where: str) -> list[Problem]:
    """Check a step's ``when``: a PostgreSQL jsonpath predicate over ``{parent step key: output}`` that
    names only the steps it depends on. It is evaluated when the step's tasks would be queued; when it
    does not hold (false, or no boolean at all) they are skipped."""
    if when is None:
        return []
    if not isinstance(when, str) or not when.strip() or len(when) > WHEN_MAX_CHARS:
        return [Problem(where, f"when must be a jsonpath predicate of at most {WHEN_MAX_CHARS} characters over "
                               f"the parents' outputs, e.g. {WHEN_EXAMPLE}, or absent")]
    if not deps:
        return [Problem(where, "when is a condition over the outputs of the steps it depends on; it has no "
                               "depends_on")]
    named = when_parents(when)
    problems = []
    if not named:
        problems.append(Problem(where, f"when {when!r} reads no parent step's output: start each path with "
                                       f"$.<parent step key>, e.g. {WHEN_EXAMPLE}"))
    missing = sorted(named - set(deps))
    if missing:
        problems.append(Problem(where, f"when reads {missing}, which it does not depend on (depends_on: {deps})"))
    syntax = jsonpath_error(when)
    if syntax:
        problems.append(Problem(where, f"when is not a jsonpath PostgreSQL accepts: {syntax}"))
    return problems


def jsonpath_error(text: str) -> str | None:
    """Return PostgreSQL's complaint about ``text`` as a jsonpath, or None: the database evaluates the
    condition, so it is the one asked (in a savepoint, so a refusal leaves the caller's transaction usable)."""
    try:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SELECT %s::jsonpath", [text])
    except DatabaseError as exc:
        return (str(exc).splitlines() or ["syntax error"])[0]
    return None


def policy_problems(step: Mapping[str, Any], *, where: str) -> list[Problem]:
    """Return what is wrong with a step's failure policy (``on_failure``) and its ``always`` flag."""
    problems = []
    allowed = list(StepFailurePolicy.values)
    on_failure = step.get("on_failure")
    if on_failure is not None and on_failure not in allowed:
        problems.append(Problem(where, f"on_failure must be one of {allowed} or absent, got {on_failure!r}"))
    always = step.get("always")
    if always is not None and not isinstance(always, bool):
        problems.append(Problem(where, f"always must be true or false (a JSON boolean) or absent, got {always!r}"))
    return problems


def validate_workflow(workflow, services: Mapping[str, Any] | None = None) -> None:
    """Raise :class:`DefinitionError` (on the ``steps`` field) when a workflow is invalid.

    ``services`` maps service keys to services; without it, the workflow's own
    ``step_services()`` reads those its steps name.
    """
    if services is None:
        services = workflow.step_services()
    problems = step_problems(workflow.steps, services)
    if (workflow.version or 0) < 1:
        problems.append(Problem("version", "must be at least 1"))
    if problems:
        raise DefinitionError(problems, field="steps")
