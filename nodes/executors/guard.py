"""The last check before a process starts: what runs is what the site allowed.

Service rows are validated when they are saved, and the agent asks the allow-lists again before
each attempt (:func:`nodes.executors.base.not_allowed`); both read *templates*. This module reads
what is actually about to be executed: the rendered argv, with argv[0] resolved the way exec will
resolve it and then through every symlink, and the whole environment the child gets. Every place
that spawns a process for a row's sake (the command executor, a process-isolated python callable
and its warm pool, an http service's start command, a node's wake script) calls
:func:`check_process` right before it spawns, so a param (``../../usr/bin/touch``), a symlink out
of an allowed directory, a row written straight into the database or an env name the site never
allowed is refused there, whatever validation saw.

The promises, each checked on the values passed to exec:

* the program is one ``ACC_ALLOWED_EXECUTABLES`` names (a listed name found on the child's PATH, a
  listed path, or a file whose path *and* real path lie inside a listed directory), or the agent's
  own interpreter running the agent's own code (``program="agent"``);
* no argument and no variable carries a NUL (exec would cut it silently or refuse);
* every variable is the agent's own (the same value the agent has), a task contract name
  (``ACCS_*``), or a name ``ACC_ALLOWED_TASK_ENV`` lets services set that loads no code.

:func:`check_process` returns the file it checked, and the caller executes exactly that file
(``Popen(executable=...)``, or inside the sandbox's argv): a symlink on the way to the program that is
swapped between the check and the exec cannot change what runs.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import Literal

from accs_site.conf import ANY, DEMO_ONLY, accs
from workflows.validation import env_name_refusal, executable_allowed

#: The names the agent sets itself for every attempt (the task contract).
CONTRACT_ENV_PREFIX = "ACCS_"


class Refused(Exception):
    """A process the site's allow-lists refuse; the message names the setting and the value."""


def check_process(argv: Sequence[str], env: Mapping[str, str] | None, *,
                  program: Literal["service", "agent"] = "service") -> str:
    """Return the file to execute for ``argv`` with ``env``; raise :class:`Refused` unless it is allowed to run.

    The file returned is the one checked: argv[0] found as exec would find it and resolved through every
    symlink (the agent's own interpreter stays the path the agent runs it by: :func:`check_executable`).
    Spawn it as ``Popen(argv, executable=<it>)`` so argv[0] keeps its name and nothing resolves again.

    ``program="agent"`` is for the agent's own interpreter running the agent's own runner (a
    process-isolated python callable, checked against ``ACC_ALLOWED_CALLABLES`` before the run):
    its argv[0] is then required to be exactly that interpreter.
    """
    if not argv:
        raise Refused("an empty argv: nothing to run")
    for arg in argv:
        if "\x00" in arg:
            raise Refused(f"argument {_short(arg)!r} holds a NUL character")
    child_env = dict(os.environ) if env is None else dict(env)
    if program == "agent":
        if argv[0] != sys.executable:
            raise Refused(f"{argv[0]!r} is not the agent's own interpreter")
        checked = sys.executable
    else:
        checked = check_executable(list(argv), child_env)
    check_env(child_env)
    return checked


def resolve(program: str, env: Mapping[str, str]) -> str | None:
    """Return the path exec will run for ``program`` (a name is looked up on the child's PATH), or None."""
    if "/" in program:
        return program if os.path.isabs(program) else None
    return shutil.which(program, path=env.get("PATH", os.defpath))


def check_executable(argv: list[str], env: Mapping[str, str]) -> str:
    """Return the file to execute for ``argv[0]``, resolved once; raise :class:`Refused` unless it is allowed.

    That file is the real path of argv[0] as exec would find it, the one the allow-list was asked about.
    The agent's own interpreter is the exception: it is run by the path the agent runs it by (a
    virtualenv's interpreter finds its packages through that path, its real path would leave them
    behind), and no task can change the agent's interpreter without owning the agent. A program that is
    not found (only a site that allows any program lets one through) is returned as given: exec fails.
    """
    allowed = accs.allowed_executables
    listed = ",".join(allowed)
    program = argv[0]
    path = resolve(program, env)
    real = os.path.realpath(path) if path is not None else None
    checked = program if program == sys.executable or real is None else real
    if ANY in allowed:
        return checked
    template = ["python", *argv[1:]] if program == sys.executable else argv
    if DEMO_ONLY in allowed and executable_allowed(template[0], (DEMO_ONLY,), argv=template):
        return checked
    if path is None or real is None:
        raise Refused(f"{program!r} is not found (PATH of the task) or is a relative path; "
                      f"ACC_ALLOWED_EXECUTABLES={listed}")
    if _allowed_path(program, path, real, allowed):
        return checked
    shown = f"{program!r}" + (f" (runs {real!r})" if real != program else "")
    raise Refused(f"{shown} is not an executable this site allows (ACC_ALLOWED_EXECUTABLES={listed})")


def _allowed_path(program: str, path: str, real: str, allowed: Sequence[str]) -> bool:
    """Return whether a listed entry allows ``program`` found at ``path`` whose real path is ``real``."""
    lexical = os.path.normpath(path)
    for entry in allowed:
        if entry == "python" and program == sys.executable:
            return True  # "python" in a template is the agent's own interpreter (render_argv)
        if "/" not in entry:
            # A listed name runs what the agent's PATH finds for it (the task's PATH is the agent's).
            if program == entry:
                return True
        elif entry.endswith("/"):
            inside = os.path.realpath(entry.rstrip("/") or "/")
            if lexical.startswith(entry) and (real == inside or real.startswith(inside.rstrip("/") + "/")):
                return True
        elif lexical == entry:
            return True
    return False


def check_env(env: Mapping[str, str]) -> None:
    """Raise :class:`Refused` for a variable that is neither the agent's own, nor the task contract's,
    nor one the site lets services set."""
    for name, value in env.items():
        if "\x00" in name or "\x00" in value:
            raise Refused(f"environment variable {_short(name)!r} holds a NUL character")
        if os.environ.get(name) == value:
            continue  # the agent's own variable, passed on unchanged
        if name.startswith(CONTRACT_ENV_PREFIX):
            continue
        refusal = env_name_refusal(name)
        if refusal:
            raise Refused(f"environment: {refusal}")


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
