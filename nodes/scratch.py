"""Attempts' scratch folders (``ACCS_OUTPUT_DIR``, ``ACCS_INPUT_DIR``) and their leftovers.

An attempt's folders are removed when it ends. An agent killed with ``kill -9`` (or a crash, or
a reboot) leaves them behind, so each folder's name carries the pid of the agent that made it,
and every agent, when it starts and then every hour, removes the folders of agents that are gone:

* a folder whose agent process is gone is left over; so is one whose pid now belongs to a process
  that started after the folder was made (the pid was reused, or the machine rebooted);
* a folder named without an agent (made by an older ACCS) is left over once it has not changed
  for a day;
* a live agent's folder is never touched, however old: it belongs to an attempt still running.

The folders sit in one folder per OS user, ``<temp>/accs-scratch-<uid>`` (:func:`scratch_root`), which
other users may pass through but not list (mode 0711); each attempt's folder is its owner's alone
(0700) and its name ends in 128 random bits, so it cannot be guessed. That keeps other OS users out.
Attempts of the same OS user own the parent folder too and so can list it: what keeps an attempt
from another's files is the per-service sandbox (:mod:`nodes.executors.sandbox`), in which an
attempt sees its own folders only.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from pathlib import Path

from jobs.claim import ClaimedTask
from jobs.ids import short_id

# accs-<the task's short id>-<attempt>-<agent pid>-<random>; older ACCS: the id's first 8 hex digits, and
# before that no agent pid.
NAME = re.compile(r"accs-[0-9a-f]{8,12}-\d+-(?:(?P<pid>\d+)-)?[A-Za-z0-9_]+")
UNKNOWN_OWNER_MAX_AGE_SECONDS = 86_400.0


PARENT_MODE = 0o711


def scratch_dir(task: ClaimedTask) -> str:
    """Return a fresh folder (0700) for an attempt's files, named after the task, attempt and this agent, and
    unguessable."""
    prefix = f"accs-{short_id(task.id)}-{task.attempt}-{os.getpid()}-{secrets.token_hex(16)}"
    return tempfile.mkdtemp(prefix=prefix, dir=scratch_root())


def scratch_root(*, base: str | None = None) -> Path:
    """Return this OS user's folder of attempt folders in the temp folder, made when missing (0711).

    Raise OSError when that name is taken by something else than this user's folder (another user
    may have made it first in a shared /tmp): attempts must not write where another user can look.
    """
    root = Path(base or tempfile.gettempdir()) / f"accs-scratch-{os.getuid()}"
    try:
        os.mkdir(root, PARENT_MODE)
    except FileExistsError:
        pass
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise OSError(f"{root} is not a folder of this OS user (uid {os.getuid()}); remove it so attempts can "
                      "have their scratch folders there")
    if stat.S_IMODE(info.st_mode) != PARENT_MODE:
        os.chmod(root, PARENT_MODE)  # the umask may have narrowed it: others must still pass through
    return root


def leftovers(*, root: str | None = None, now: float | None = None) -> list[Path]:
    """Return the scratch folders under ``root`` (the temp folder) and in its :func:`scratch_root` that no
    live agent owns (folders older ACCS made sit in the temp folder itself)."""
    base = Path(root or tempfile.gettempdir())
    now = time.time() if now is None else now
    found = []
    entries = []
    for folder in (base, base / f"accs-scratch-{os.getuid()}"):
        try:
            entries += list(os.scandir(folder))
        except OSError:
            continue
    for entry in entries:
        match = NAME.fullmatch(entry.name)
        if not match or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue  # removed meanwhile
        if info.st_uid != os.getuid():
            continue  # another user's: not ours to judge
        pid = match.group("pid")
        if pid is None:
            if now - info.st_mtime >= UNKNOWN_OWNER_MAX_AGE_SECONDS:
                found.append(Path(entry.path))
        elif int(pid) != os.getpid() and not _agent_since(int(pid), info.st_ctime):
            found.append(Path(entry.path))
    return sorted(found)


def remove_leftovers(*, root: str | None = None, now: float | None = None) -> list[Path]:
    """Remove the scratch folders no live agent owns; return those removed."""
    removed = []
    for path in leftovers(root=root, now=now):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed


def _agent_since(pid: int, made_at: float) -> bool:
    """Return whether process ``pid`` was already running at ``made_at`` (epoch seconds).

    The folder's maker had that pid then, so a process that has it and is older is the maker.
    """
    try:
        started = _process_start(pid)
    except OSError:
        return False
    # A second's slack: the folder's time and the process's start come from different clocks.
    return started is None or started <= made_at + 1


def _process_start(pid: int) -> float | None:
    """Return when process ``pid`` started (epoch seconds), from /proc; None when unknown."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[-1].split()
    try:
        ticks = int(fields[19])  # field 22 of stat: start time in clock ticks after boot
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
    except (IndexError, ValueError, StopIteration, OSError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")
