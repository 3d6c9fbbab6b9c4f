"""Run ``manage.py`` with this process's wall clock shifted (tests only).

``python tests/skewed_clock.py SECONDS manage-args...``: time.time() and datetime.now() read
SECONDS ahead (negative: behind) of the machine's clock and keep ticking; the monotonic clock is
untouched. Used to prove that no time which coordinates processes comes from a process's clock.
"""

from __future__ import annotations

import datetime
import runpy
import sys
from pathlib import Path

import time_machine

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    skew = float(sys.argv[1])
    sys.path.insert(0, str(ROOT))
    time_machine.travel(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=skew),
                        tick=True).start()
    sys.argv = [str(ROOT / "manage.py"), *sys.argv[2:]]
    runpy.run_path(str(ROOT / "manage.py"), run_name="__main__")
