"""ACCS's operational settings: one typed object, read lazily from ``ACC_*`` variables.

Nothing is read at import time. Each property parses its variable the first time it is used and
raises :class:`SettingError` naming the variable when the value is malformed. The system check in
:mod:`accs_site.checks` touches every property, so a bad value stops ``manage.py`` at start-up.

The module works in any Django site, not only in ``accs_site``: a variable missing from the
environment is looked up in the optional Django setting ``ACCS`` (a dict keyed by the same names,
e.g. ``ACCS = {"ACC_HEARTBEAT_TTL_SEC": 60}``), so an embedding site may keep ACCS's settings in its
own settings file. The environment wins, so operators can still override a value per process.

Tests and daemons may call :func:`reload` after changing the environment.
"""

from __future__ import annotations

import math
import os
import re
import socket
from dataclasses import dataclass
from functools import cached_property
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

LOG_FORMATS = ("auto", "text", "json")
DB_POOLERS = ("none", "pgbouncer")
ANY = "*"
#: The default of the executable allow-list: nothing but the project's own demo tool
#: (``python -m workflows.demo.tool``), so a site that never set the list runs no one's program by accident.
DEMO_ONLY = "@demo"
# The hosts a default site lets http services live on: the agent's own machine.
LOOPBACK_URL_PREFIXES = ("http://127.0.0.1", "http://localhost", "http://[::1]",
                         "https://127.0.0.1", "https://localhost", "https://[::1]")
_BARE_EXECUTABLE_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")
_MODULE_PREFIX_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_ENV_ENTRY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\*?$")


class SettingError(ImproperlyConfigured):
    """A malformed ACC_* variable; ``variable`` names it."""

    def __init__(self, variable: str, problem: str) -> None:
        self.variable = variable
        super().__init__(f"{variable}: {problem}")


def _raw(name: str) -> str | None:
    """Return the stripped value of ``name`` from the environment, else from ``settings.ACCS``; None if unset."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        value = _from_django_settings(name)
    return None if value is None or value.strip() == "" else value.strip()


def is_set(name: str) -> bool:
    """Return whether the setting ``name`` is given (environment or ``settings.ACCS``), not left to its default."""
    return _raw(name) is not None


def _django_settings_names() -> list[str]:
    from django.conf import settings

    table = getattr(settings, "ACCS", None) if settings.configured else None
    return list(table) if isinstance(table, dict) else []


def _from_django_settings(name: str) -> str | None:
    from django.conf import settings

    if not settings.configured:
        return None
    table = getattr(settings, "ACCS", None) or {}
    if not isinstance(table, dict):
        raise SettingError("ACCS", f"the Django setting ACCS must be a dict of ACC_* names, got {type(table).__name__}")
    value = table.get(name)
    return None if value is None else str(value)


def _int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    raw = _raw(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingError(name, f"expected a whole number, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise SettingError(name, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SettingError(name, f"must be at most {maximum}, got {value}")
    return value


def _float(name: str, default: float, *, minimum: float = 0.0, maximum: float | None = None) -> float:
    raw = _raw(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(name, f"expected a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise SettingError(name, f"expected a finite number, got {raw!r}")
    if value < minimum:
        raise SettingError(name, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SettingError(name, f"must be at most {maximum}, got {value}")
    return value


def _bool(name: str, default: bool) -> bool:
    raw = _raw(name)
    if raw is None:
        return default
    value = raw.lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingError(name, f"expected true or false, got {raw!r}")


def parse_labels(name: str, raw: str | None) -> dict[str, str]:
    """Parse ``gpu=true,zone=eu`` into a dict; a part without ``=`` is an error naming ``name``."""
    labels: dict[str, str] = {}
    if not raw:
        return labels
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise SettingError(name, f"expected key=value pairs separated by commas, got {part!r}")
        labels[key.strip()] = value.strip()
    return labels


def _entries(name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    """Split a comma-separated list setting; unset means ``default``."""
    raw = _raw(name)
    if raw is None:
        return default
    entries = tuple(part.strip() for part in raw.split(",") if part.strip())
    if not entries:
        raise SettingError(name, "expected a comma-separated list (or * for anything)")
    return entries


def _executable_entry(name: str, entry: str) -> str:
    """Accept ``*``, a bare program name, an absolute path, or a directory ending in ``/``."""
    if entry in (ANY, DEMO_ONLY) or _BARE_EXECUTABLE_RE.match(entry):
        return entry
    if not entry.startswith("/"):
        raise SettingError(name, f"{entry!r} is neither a program name (no '/') nor an absolute path")
    normal = os.path.normpath(entry) + ("/" if entry.endswith("/") and entry != "/" else "")
    if normal != entry:
        raise SettingError(name, f"{entry!r} is not a normal absolute path (write {normal!r})")
    return entry


def _module_entry(name: str, entry: str) -> str:
    """Accept ``*`` or a dotted module prefix such as ``myapp.tasks``."""
    if entry == ANY or _MODULE_PREFIX_RE.match(entry):
        return entry
    raise SettingError(name, f"{entry!r} is not a module prefix (dotted names such as myapp.tasks) or *")


def _url_entry(name: str, entry: str) -> str:
    """Accept an ``http(s)://host[:port][/path]`` prefix."""
    try:
        parts = urlsplit(entry)
        parts.port  # noqa: B018 - parsing the port raises for a bad one
    except ValueError as exc:
        raise SettingError(name, f"{entry!r} is not a URL prefix: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise SettingError(name, f"{entry!r} is not a URL prefix such as http://127.0.0.1:8080/run")
    return entry


#: The public key a development checkout runs with; refused in production (accs_site.checks).
DEV_SECRET_KEY = "accs-dev-only-insecure-key-change-me"
#: Words that mark a key copied from an example instead of generated.
PLACEHOLDER_WORDS = ("change-me", "changeme", "change_me", "insecure", "placeholder", "example", "secret-key")


def is_placeholder(value: str | None) -> bool:
    """Return whether a secret is empty, the development key, or copied from an example."""
    lowered = (value or "").lower()
    return not value or value == DEV_SECRET_KEY or any(word in lowered for word in PLACEHOLDER_WORDS)


def is_weak_secret_key(key: str) -> bool:
    """Return whether a secret key is a placeholder or too short or plain to sign sessions (Django's own bar)."""
    return is_placeholder(key) or len(key) < 50 or len(set(key)) < 5


def proxy_ssl_header(name: str, raw: str) -> tuple[str, str] | None:
    """Parse ``X-Forwarded-Proto: https`` into Django's ``SECURE_PROXY_SSL_HEADER``; None when empty."""
    if not raw.strip():
        return None
    header, sep, value = raw.partition(":")
    if not sep or not header.strip() or not value.strip():
        raise SettingError(name, f"expected 'Header-Name: value', e.g. 'X-Forwarded-Proto: https', got {raw!r}")
    return "HTTP_" + header.strip().upper().replace("-", "_"), value.strip()


def trusted_origins(name: str, origins: list[str]) -> list[str]:
    """Check CSRF trusted origins are full origins (scheme and host), as Django requires."""
    for origin in origins:
        if not origin.startswith(("https://", "http://")) or "/" in origin.split("://", 1)[1].rstrip("/"):
            raise SettingError(name, f"expected origins such as https://accs.example.com, got {origin!r}")
    return origins


@dataclass(frozen=True)
class MinioSettings:
    endpoint: str | None
    access_key: str | None
    secret_key: str | None
    bucket: str
    region: str

    @property
    def configured(self) -> bool:
        return bool(self.endpoint and self.access_key and self.secret_key)


class AccsSettings:
    """Typed view of the ACC_* environment. Every property is parsed on first use."""

    @cached_property
    def node_name(self) -> str:
        return _raw("ACC_NODE_NAME") or socket.gethostname()

    @cached_property
    def node_labels(self) -> dict[str, str]:
        return parse_labels("ACC_NODE_LABELS", _raw("ACC_NODE_LABELS"))

    @cached_property
    def max_concurrency(self) -> dict[str, int]:
        """Per-service caps from ``ACC_MAX_CONCURRENCY_<SERVICE>`` (service key upper-cased, - → _)."""
        caps: dict[str, int] = {}
        prefix = "ACC_MAX_CONCURRENCY_"
        for name in sorted(set(os.environ) | set(_django_settings_names())):
            if name.startswith(prefix) and len(name) > len(prefix):
                caps[name[len(prefix):].lower()] = _int(name, 0, minimum=0)
        return caps

    def max_concurrency_for(self, service_key: str) -> int | None:
        """Return the env cap for a service key, or None when no variable names it."""
        return self.max_concurrency.get(service_key.replace("-", "_").lower())

    @cached_property
    def backoff_base_sec(self) -> float:
        return _float("ACC_BACKOFF_BASE_SEC", 15.0)

    @cached_property
    def backoff_cap_sec(self) -> float:
        return _float("ACC_BACKOFF_CAP_SEC", 3600.0)

    @cached_property
    def max_refunded_attempts(self) -> int:
        """How many interrupted attempts of a task (agent shutdown, database outage) are queued again
        without counting against ``max_attempts``; each one after that counts like a failure."""
        return _int("ACC_MAX_REFUNDED_ATTEMPTS", 3, minimum=0, maximum=1000)

    @cached_property
    def heartbeat_ttl_sec(self) -> int:
        return _int("ACC_HEARTBEAT_TTL_SEC", 120, minimum=3)

    @cached_property
    def claim_lock_wait_sec(self) -> float:
        """How long an agent's claim waits for any lock (a capped service's, its node's, a row's)
        before it gives up, claims the other services without waiting and tries again later."""
        return _float("ACC_CLAIM_LOCK_WAIT_SEC", 5.0, minimum=0.01, maximum=3600.0)

    @cached_property
    def migrate_lock_timeout_sec(self) -> float:
        """How long each statement ``manage.py migrate`` runs waits for a lock before it gives up (and the
        migration is tried again): the daemons' statements queue behind that wait, so it bounds their stall."""
        return _float("ACC_MIGRATE_LOCK_TIMEOUT_SEC", 2.0, minimum=0.05, maximum=600.0)

    @cached_property
    def migrate_lock_tries(self) -> int:
        """How many times ``manage.py migrate`` tries a migration whose lock wait timed out before it fails."""
        return _int("ACC_MIGRATE_LOCK_TRIES", 5, minimum=1, maximum=100)

    @cached_property
    def node_lost_after_sec(self) -> float:
        """How long an online node may stay silent before the builder marks it lost."""
        return _float("ACC_NODE_LOST_AFTER_SEC", 600.0, minimum=10.0)

    @cached_property
    def notify_channel_prefix(self) -> str:
        prefix = _raw("ACC_NOTIFY_CHANNEL_PREFIX") or "accs_"
        if not prefix.replace("_", "").isalnum() or len(prefix) > 30:
            raise SettingError("ACC_NOTIFY_CHANNEL_PREFIX", f"use letters, digits and '_' only (≤30), got {prefix!r}")
        return prefix

    @cached_property
    def slot_cap(self) -> int:
        return _int("ACC_SLOT_CAP", 20, minimum=1, maximum=1000)

    @cached_property
    def cpu_budget(self) -> int:
        return _int("ACC_CPU_BUDGET", 8, minimum=1, maximum=1000)

    @cached_property
    def warm_pool_size(self) -> int:
        """Warm parents per agent for process-isolated python services (docs/executors.md); 0: none."""
        return _int("ACC_WARM_POOL_SIZE", 4, minimum=0, maximum=64)

    @cached_property
    def max_params_bytes(self) -> int:
        """The largest params a task may be started with, in bytes of JSON (docs/executors.md, "Params").

        2 MiB by default: a start with the largest params still fits in an HTTP API request under
        Django's default ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (2.5 MB).
        """
        return _int("ACC_MAX_PARAMS_BYTES", 2 * 1024 * 1024, minimum=1024, maximum=64 * 1024 * 1024)

    @cached_property
    def max_fan_out_items(self) -> int:
        """The most tasks a step fanning out over a parent's list may make (docs/workflows-as-code.md); a
        longer list fails the step's task, naming this limit, before any task of it is made."""
        return _int("ACC_MAX_FAN_OUT_ITEMS", 1000, minimum=1, maximum=100_000)

    @cached_property
    def poll_interval_sec(self) -> float:
        return _float("ACC_POLL_INTERVAL_SEC", 2.0, minimum=0.01)

    @cached_property
    def db_pooler(self) -> str | None:
        """The pooler in front of PostgreSQL (``pgbouncer``), or None for direct connections (``none``)."""
        value = (_raw("ACC_DB_POOLER") or "none").lower()
        if value not in DB_POOLERS:
            raise SettingError("ACC_DB_POOLER", f"expected one of {', '.join(DB_POOLERS)}, got {value!r}")
        return None if value == "none" else value

    @cached_property
    def listen_db_url(self) -> str | None:
        """A direct PostgreSQL URL for the daemons' LISTEN connection when ACC_DB_URL goes through a pooler."""
        value = _raw("ACC_LISTEN_DB_URL")
        if value and not value.startswith(("postgres://", "postgresql://")):
            raise SettingError("ACC_LISTEN_DB_URL", f"expected a postgres:// URL, got {value.split(':', 1)[0]}://")
        return value

    @cached_property
    def read_db_url(self) -> str | None:
        """A streaming replica for the cockpit's and the API's read-only queries (accs_site.dbrouter), or None."""
        value = _raw("ACC_READ_DB_URL")
        if value and not value.startswith(("postgres://", "postgresql://")):
            raise SettingError("ACC_READ_DB_URL", f"expected a postgres:// URL, got {value.split(':', 1)[0]}://")
        return value

    @cached_property
    def event_retention_months(self) -> int:
        return _int("ACC_EVENT_RETENTION_MONTHS", 12, minimum=1)

    @cached_property
    def event_partitions_ahead(self) -> int:
        return _int("ACC_EVENT_PARTITIONS_AHEAD", 2, minimum=1, maximum=24)

    @cached_property
    def retention_days(self) -> int:
        """Days a finished job is kept (a tenant may say otherwise); 0 keeps jobs for ever."""
        return _int("ACC_RETENTION_DAYS", 30, minimum=0)

    @cached_property
    def retention_dead_days(self) -> int:
        """Days a job that ended in error (a dead letter) is kept; 0 keeps them for ever."""
        return _int("ACC_RETENTION_DEAD_DAYS", 90, minimum=0)

    @cached_property
    def retention_export(self) -> bool:
        """Export pruned jobs to object storage as JSONL before deleting them."""
        return _bool("ACC_RETENTION_EXPORT", False)

    @cached_property
    def retention_batch(self) -> int:
        """Jobs pruned per transaction (and per exported object)."""
        return _int("ACC_RETENTION_BATCH", 500, minimum=1, maximum=10_000)

    @cached_property
    def event_receipt_retention_hours(self) -> int:
        """Hours a receipt of an HTTP event is kept, so a repeated delivery within them fires nothing."""
        return _int("ACC_EVENT_RECEIPT_RETENTION_HOURS", 168, minimum=1)

    @cached_property
    def orphan_grace_sec(self) -> int:
        """Age an artifact object without a row must reach before the sweep deletes it."""
        return _int("ACC_ORPHAN_GRACE_SEC", 3600, minimum=60)

    @cached_property
    def narrow_starts(self) -> bool:
        """Write a start that needs nothing decided before it runs as one narrow row, widened into its
        job when an agent claims it or the builder ages it out (jobs.narrow). Off: every start writes
        its job, task, step and event rows at once. Turn it on once every agent and builder runs a
        release that widens narrow starts."""
        return _bool("ACC_NARROW_STARTS", False)

    @cached_property
    def narrow_widen_after_sec(self) -> float:
        """The age at which the builder widens a narrow start no claim has taken."""
        return _float("ACC_NARROW_WIDEN_AFTER_SEC", 1.0, minimum=0.0)

    @cached_property
    def allow_self_approval(self) -> bool:
        """Let the user who started an approval-gated job approve it too (off: another approver must)."""
        return _bool("ACC_ALLOW_SELF_APPROVAL", False)

    @cached_property
    def tenant_max_in_flight(self) -> int:
        """The ``max_in_flight`` a new tenant gets; 0 = unlimited. A capped tenant's jobs are admitted by
        the builder (counted under a lock) rather than started in the caller's statement."""
        return _int("ACC_TENANT_MAX_IN_FLIGHT", 0, minimum=0)

    @cached_property
    def api_rate_limit(self) -> int:
        """Requests one API token may make per window (``ACC_API_RATE_WINDOW_SEC``); 0 = no limit."""
        return _int("ACC_API_RATE_LIMIT", 1200, minimum=0)

    @cached_property
    def api_rate_window_sec(self) -> int:
        return _int("ACC_API_RATE_WINDOW_SEC", 60, minimum=1, maximum=86_400)

    @cached_property
    def metrics_token(self) -> str | None:
        return _raw("ACC_METRICS_TOKEN")

    @cached_property
    def log_format(self) -> str:
        """How log lines look: ``text`` for people, ``json`` for collectors, ``auto`` (text on a terminal)."""
        value = (_raw("ACC_LOG_FORMAT") or "auto").lower()
        if value not in LOG_FORMATS:
            raise SettingError("ACC_LOG_FORMAT", f"expected one of {', '.join(LOG_FORMATS)}, got {value!r}")
        return value

    @cached_property
    def allowed_executables(self) -> tuple[str, ...]:
        """What a command's argv[0], an http service's start command and a node's wake script may name.

        Program names (looked up on the agent's PATH), absolute paths, directories ending in
        ``/``, or ``*`` for anything, only when written. Unset, nothing runs but the project's own
        demo tool (``@demo``, which may also be written beside other entries).
        """
        name = "ACC_ALLOWED_EXECUTABLES"
        return tuple(_executable_entry(name, e) for e in _entries(name, (DEMO_ONLY,)))

    @cached_property
    def allowed_callables(self) -> tuple[str, ...]:
        """Module prefixes a python service's callable may come from (``*`` allows any, only when written;
        unset, none)."""
        name = "ACC_ALLOWED_CALLABLES"
        return tuple(_module_entry(name, e) for e in _entries(name, ()))

    @cached_property
    def allowed_task_env(self) -> tuple[str, ...]:
        """Names a service's ``env`` may set in its tasks' environment: names, or prefixes ending in ``*``
        (``MYAPP_*``). Unset, none. Loader variables (``LD_*``, ``PYTHON*``, ``BASH_ENV``, ``PATH``…)
        are refused whatever this lists."""
        name = "ACC_ALLOWED_TASK_ENV"
        entries = _entries(name, ())
        for entry in entries:
            if not _ENV_ENTRY_RE.match(entry):
                raise SettingError(name, f"{entry!r} is not a variable name or a prefix ending in * (MYAPP_*)")
        return entries

    @cached_property
    def allowed_http_urls(self) -> tuple[str, ...]:
        """URL prefixes an http service's url and health_url must start with (default: loopback, any port)."""
        name = "ACC_ALLOWED_HTTP_URLS"
        return tuple(_url_entry(name, e) for e in _entries(name, LOOPBACK_URL_PREFIXES))

    @cached_property
    def minio(self) -> MinioSettings:
        endpoint = _raw("ACC_MINIO_ENDPOINT")
        if endpoint and not endpoint.startswith(("http://", "https://")):
            raise SettingError("ACC_MINIO_ENDPOINT", f"expected an http(s):// URL, got {endpoint!r}")
        return MinioSettings(
            endpoint=endpoint,
            access_key=_raw("ACC_MINIO_ACCESS_KEY"),
            secret_key=_raw("ACC_MINIO_SECRET_KEY"),
            bucket=_raw("ACC_MINIO_BUCKET") or "accs",
            region=_raw("ACC_MINIO_REGION") or "us-east-1",
        )

    def all_properties(self) -> list[str]:
        return [name for name, value in type(self).__dict__.items() if isinstance(value, cached_property)]


accs = AccsSettings()

MIN_SECRET_CHARS = 3  # shorter values would blank out ordinary text


def known_secrets() -> list[str]:
    """Return this process's secret values (database URL and password, secret key, storage secret,
    metrics token), longest first: what task output, errors and stored log lines must never carry."""
    from django.conf import settings  # settings are read when asked, never at import (module docstring)

    database = settings.DATABASES.get("default", {}) if settings.configured else {}
    values = [os.environ.get("ACC_DB_URL"), database.get("PASSWORD"), getattr(settings, "SECRET_KEY", None),
              accs.minio.secret_key, accs.metrics_token]
    found = {str(v) for v in values if v and len(str(v)) >= MIN_SECRET_CHARS}
    return sorted(found, key=len, reverse=True)


def reload() -> AccsSettings:
    """Forget parsed values so the next access reads the environment again."""
    for name in accs.all_properties():
        accs.__dict__.pop(name, None)
    return accs
