"""``manage.py`` for race tests: ACCS's commands with a hook at the instant a task's command exits.

The hook makes one race deterministic: a stop landing between a task's process exiting and the
agent's worker noticing that exit. With ``ACCS_TEST_HOOK=second_sigterm_after_exit``, the first
time a worker finds a task's command exited, the agent process gets SIGTERM and the worker waits
until the agent has asked the attempt to stop; only then does the worker see the exit. Everything
else is the real agent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def install_second_sigterm_after_exit() -> None:
    from nodes import executors

    asked_to_stop = threading.Event()
    original_stop = executors.RunContext.stop

    def stop(self, reason: str, **options) -> None:
        original_stop(self, reason, **options)
        asked_to_stop.set()

    class HookedPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.is_task = bool((kwargs.get("env") or {}).get("ACCS_TASK_ID"))
            self.hooked = False

        def poll(self):
            code = super().poll()
            if code is None or not self.is_task or self.hooked:
                return code
            self.hooked = True
            os.kill(os.getpid(), signal.SIGTERM)  # the operator's second SIGTERM lands now
            if not asked_to_stop.wait(30):
                sys.stderr.write("hook: the agent never asked the attempt to stop\n")
            return None  # the worker has not seen the exit yet

    executors.RunContext.stop = stop
    subprocess.Popen = HookedPopen


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # not tests/: the repository root, as with the real manage.py
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
    import django

    django.setup()
    if os.environ.get("ACCS_TEST_HOOK") == "second_sigterm_after_exit":
        install_second_sigterm_after_exit()
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
