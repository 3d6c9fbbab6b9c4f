"""Old import paths of modules and names that moved, kept for one release.

In 0.2.0 the read side (dashboard, overview, metrics, DAG pictures) moved from ``events`` to the
``ops`` app, and tenants, memberships, API tokens, scoping and authentication moved from ``jobs``
to the ``tenants`` app. A site's settings, URLs or code that still name ``events.metrics`` or
``jobs.models.Tenant`` (say) keep working until 0.3.0, with a ``DeprecationWarning`` naming the
new path. This module is the one way the old paths are kept.
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


def forward_names(old: str, new: str, names: frozenset[str]) -> Callable[[str], Any]:
    """Return a module ``__getattr__`` for ``old`` that serves ``names`` from ``new``, warning at each use.

    For a module of which only some names moved: the rest of ``old`` stays as it is, and an
    unknown name is still an AttributeError.
    """

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        # stacklevel 2: the line that reads the old name, not this function.
        warnings.warn(f"{old}.{name} moved to {new}; import it from {new} ({old}.{name} is removed in ACCS "
                      f"{REMOVED_IN})", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    return __getattr__
