"""The task the fault scenario runs: a command that keeps an honest ledger of its own runs.

``python chaos/work.py SECONDS``. It takes an exclusive lock on a file named after its task for as
long as it runs: when another run of the same task already holds it, two attempts are running at
once, and it says so in the ledger. Each start and end is one appended line
``event task attempt pid monotonic-time``. stdout is the JSON result (the CLI contract).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path


def record(line: str) -> None:
    with open(os.environ["CHAOS_LEDGER"], "a") as ledger:
        ledger.write(line + "\n")


def main() -> int:
    seconds = float(sys.argv[1])
    task, attempt, pid = os.environ["ACCS_TASK_ID"], os.environ["ACCS_ATTEMPT"], os.getpid()
    locks = Path(os.environ["CHAOS_LEDGER"]).parent / "locks"
    locks.mkdir(exist_ok=True)
    with open(locks / task, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record(f"overlap {task} {attempt} {pid} {time.monotonic():.3f}")  # and run anyway
        record(f"start {task} {attempt} {pid} {time.monotonic():.3f}")
        time.sleep(seconds)
        record(f"end {task} {attempt} {pid} {time.monotonic():.3f}")
    print(json.dumps({"slept": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
