"""Where the project-local PostgreSQL of ``scripts/pg_local.sh`` listens, read the way the script reads it.

Kept apart from the settings module so tests and tools can ask the same question.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_PORT = "25329"


def local_pg_dir(checkout: Path) -> Path:
    """Return the server's folder: ``ACC_PG_DIR`` (relative to the checkout) or ``.local/pg``."""
    raw = (os.environ.get("ACC_PG_DIR") or "").strip()
    return (checkout / raw) if raw else checkout / ".local" / "pg"


def local_pg_port(checkout: Path) -> str:
    """Return ``ACC_PG_PORT``, else the port the script last started on, else 25329."""
    raw = (os.environ.get("ACC_PG_PORT") or "").strip()
    if raw:
        return raw
    remembered = local_pg_dir(checkout) / "port"
    try:
        return remembered.read_text().strip() or DEFAULT_PORT
    except OSError:
        return DEFAULT_PORT


def local_pg_url(checkout: Path) -> str:
    """Return the URL ``scripts/pg_local.sh url`` prints for this checkout."""
    name = (os.environ.get("ACC_PG_DBNAME") or "").strip() or "accs"
    return f"postgres://postgres@127.0.0.1:{local_pg_port(checkout)}/{name}"
