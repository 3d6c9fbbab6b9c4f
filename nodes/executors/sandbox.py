"""What a task's process can reach of the agent and of other attempts.

* The agent is not dumpable (:func:`close_agent_process`, at its start): its ``/proc/<pid>/environ``,
  memory and file descriptors are closed to processes of the same OS user, tasks included. A task's
  process becomes dumpable again when it executes its program (the kernel resets the flag on exec), so
  the agent still reads its tasks' environment to find orphans.
* An attempt's scratch folders are unguessable and sit in a folder nobody can list
  (:mod:`nodes.scratch`); that keeps attempts of the same OS user from finding each other's files.
* The strong isolation is opt-in, per service: ``"sandbox": "bwrap"`` in a command service's
  ``executor_config`` runs each attempt in a bubblewrap sandbox (:func:`wrap`), where it sees only its
  scratch folders (read-write; its params folder read-only), the executable the guard checked,
  read-only system paths and a few files of ``/etc``, in new namespaces: its own process ids (the
  agent's ``/proc`` is not there), no network but its own loopback unless ``"sandbox_network": true``,
  no capabilities. ``"sandbox_paths"`` lists further
  paths it may read. A service that asks for the sandbox on a node without ``bwrap`` is refused
  (:class:`SandboxUnavailable`), never run without it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from workflows.validation import sandbox_problems

PR_SET_DUMPABLE = 4
#: System folders a sandboxed task reads (a folder that is a symlink, as on merged-/usr systems, stays one).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: What of /etc a program needs to load its libraries, name users, resolve names and check certificates.
ETC_PATHS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/passwd",
             "/etc/group", "/etc/nsswitch.conf", "/etc/localtime", "/etc/ssl", "/etc/ca-certificates",
             "/etc/hosts", "/etc/host.conf", "/etc/gai.conf", "/etc/resolv.conf", "/etc/mime.types")


class SandboxUnavailable(Exception):
    """A service asks for a sandbox this node cannot make: the attempt is refused, never run without it."""


def close_agent_process() -> bool:
    """Make this process non-dumpable, so processes of the same OS user (its tasks) cannot read its
    environment, memory or file descriptors through /proc or ptrace; return whether that was done (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - a libc without dlopen(NULL)
        return False
    return libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0


def refusal(executor: str, config: dict[str, Any]) -> str | None:
    """Return why an executor other than ``command`` must not run a service that asks for a sandbox, or None
    (the row may never have been validated: it is refused, never run without the sandbox)."""
    if config.get("sandbox") is None:
        return None
    return f"not allowed: the service asks for a sandbox, which only command services have (not {executor})"


def wrap(argv: list[str], *, config: dict[str, Any], executable: str, folders: Iterable[str | None] = (),
         readable: Iterable[str | None] = ()) -> tuple[str, list[str]]:
    """Return the file to execute and the argv that run ``argv`` in the sandbox the service asks for
    (``executable`` and ``argv`` themselves when it asks for none).

    ``executable`` is the file the guard checked for argv[0] (:func:`nodes.executors.guard.check_process`):
    in the sandbox it is what bubblewrap executes and shows, so nothing between the check and the exec
    resolves argv[0] again. ``folders`` are the attempt's scratch folders, the only ones it may write;
    ``readable`` are folders it may only read (its params). Raise :class:`SandboxUnavailable` when the
    sandbox cannot be made here.
    """
    if config.get("sandbox") is None:
        return executable, argv
    # The row may never have been validated: a sandbox that would show what it hides is no sandbox.
    problems = sandbox_problems("command", config)
    if problems:
        raise SandboxUnavailable("; ".join(str(p) for p in problems))
    tool = shutil.which("bwrap")
    if tool is None:
        raise SandboxUnavailable("the service asks for the bwrap sandbox and bubblewrap (bwrap) is not installed on "
                                 "this node; install it (Debian: apt-get install bubblewrap) or move the service")
    if not os.path.isabs(executable):
        raise SandboxUnavailable(f"{argv[0]!r} is not found in the PATH, so the sandbox cannot show it to the task")
    options = bwrap_options(executable, config=config, folders=[f for f in folders if f],
                            readable=[r for r in readable if r])
    # bubblewrap (0.8) executes its argv[0]: the checked file is both the program and its name there.
    return tool, [tool, *options, "--", executable, *argv[1:]]


def bwrap_options(program: str, *, config: dict[str, Any], folders: Sequence[str],
                  readable: Sequence[str] = ()) -> list[str]:
    """Return bubblewrap's options for a task running ``program`` with ``folders`` writable and ``readable``
    folders read-only."""
    # A user namespace even when the agent is root, and no capabilities in it: root in the sandbox
    # can mount nothing and reaches nothing the bind mounts below do not show.
    options = ["--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL", "--die-with-parent",
               "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    if config.get("sandbox_network") is True:
        options.append("--share-net")
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            options += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            options += ["--ro-bind", path, path]
    for path in ETC_PATHS:
        options += ["--ro-bind-try", path, path]
    for path in _readable(program, config):
        options += ["--ro-bind", path, path]
    for folder in folders:
        options += ["--bind", folder, folder]
    for folder in readable:
        options += ["--ro-bind", folder, folder]
    options += ["--chdir", folders[0] if folders else "/"]
    return options


def _readable(program: str, config: dict[str, Any]) -> list[str]:
    """Return the paths outside the system folders a sandboxed ``program`` reads: itself (and where its
    symlinks lead), the agent's Python when it is that interpreter, and the service's ``sandbox_paths``."""
    paths = [program, os.path.realpath(program)]
    if os.path.realpath(program) == os.path.realpath(sys.executable):
        # The interpreter finds its standard library and its virtualenv's packages from these.
        paths = [sys.prefix, sys.base_prefix, *paths]
    extra = config.get("sandbox_paths")
    paths += [str(p) for p in extra] if isinstance(extra, list) else []
    # A path inside one already shown is not bound again (bubblewrap cannot bind onto a symlink there).
    found: list[str] = []
    for path in paths:
        if not any(path == shown or path.startswith(shown.rstrip("/") + "/") for shown in (*SYSTEM_PATHS, *found)):
            found.append(path)
    return found
