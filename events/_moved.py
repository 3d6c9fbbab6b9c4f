"""Old import paths of modules that moved out of ``events``, kept for one release.

The read side (dashboard, overview, metrics, DAG pictures) moved to the ``ops`` app in 0.2.0. A
site's settings or URLs that still name ``events.metrics`` (say) keep working until 0.3.0, with a
``DeprecationWarning`` naming the new path. This module is the one place the old names live.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType
from typing import Any, Callable

REMOVED_IN = "0.3.0"


def forward(old: str, new: str) -> Callable[[str], Any]:
    """Warn that ``old`` moved to ``new``; return a module ``__getattr__`` that reads from ``new``.

    The warning points at the code that imported the old path (stacklevel 3 skips this function
    and the shim module's body, which the import system runs on the importer's behalf).
    """
    warnings.warn(f"{old} moved to {new}; import {new} instead ({old} is removed in ACCS {REMOVED_IN})",
                  DeprecationWarning, stacklevel=3)
    # A shim in events importing ops goes against the app order on purpose, for one release only:
    # imported lazily here, so nothing in events loads ops unless a site names an old path.
    target: ModuleType = importlib.import_module(new)

    def __getattr__(name: str) -> Any:
        return getattr(target, name)

    return __getattr__
