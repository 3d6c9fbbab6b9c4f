"""Attempts' scratch folders (``ACCS_OUTPUT_DIR``, ``ACCS_INPUT_DIR``) and their leftovers.

An attempt's folders are removed when it ends. An agent killed with ``kill -9`` (or a crash, or
a reboot) leaves them behind, so each folder's name carries the pid of the agent that made it,
and every agent, when it starts and then every hour, removes the folders of agents that are gone:

* a folder whose agent process is gone is left over; so is one whose pid now belongs to a process
  that started after the folder was made (the pid was reused, or the machine rebooted);
* a folder named without an agent (made by an older ACCS) is left over once it has not changed
  for a day;
* a live agent's folder is never touched, however old: it belongs to an attempt still running.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from jobs.claim import ClaimedTask
from jobs.ids import short_id

# accs-<the task's short id>-<attempt>-<agent pid>-<random>; older ACCS: the id's first 8 hex digits, and
# before that no agent pid.
NAME = re.compile(r"accs-[0-9a-f]{8,12}-\d+-(?:(?P<pid>\d+)-)?[A-Za-z0-9_]+")
UNKNOWN_OWNER_MAX_AGE_SECONDS = 86_400.0


def scratch_dir(task: ClaimedTask) -> str:
    """Return a fresh folder for an attempt's files, named after the task, attempt and this agent."""
    return tempfile.mkdtemp(prefix=f"accs-{short_id(task.id)}-{task.attempt}-{os.getpid()}-")


def leftovers(*, root: str | None = None, now: float | None = None) -> list[Path]:
    """Return the scratch folders under ``root`` (the temp folder) that no live agent owns."""
    base = Path(root or tempfile.gettempdir())
    now = time.time() if now is None else now
    found = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
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
