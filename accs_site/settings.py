"""Django settings for ACCS.

Only Django's own settings live here, read from ``ACC_*`` environment variables through
django-environ. ACCS's operational settings (backoff, heartbeat TTL, node identity...) are read
lazily by :mod:`accs_site.conf` and validated by system checks (:mod:`accs_site.checks`).
"""

import importlib.util
import warnings
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from accs_site.conf import DEV_SECRET_KEY, accs, proxy_ssl_header, trusted_origins
from accs_site.daemon import connect_options
from accs_site.localdb import local_pg_url

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env")  # optional; real environment variables win

# The project-local server of scripts/pg_local.sh, found the way that script finds it.
LOCAL_DB_URL = local_pg_url(BASE_DIR)


def _database_from_url(name: str, default: str) -> dict:
    """Parse a database URL setting, naming the variable when it is malformed."""
    raw = env.str(name, default=default)
    # Seed 000 writes SQLAlchemy-style URLs (postgresql+psycopg://); accept them too.
    raw = raw.replace("postgresql+psycopg://", "postgresql://", 1)
    try:
        cfg = environ.Env.db_url_config(raw)
    except Exception as exc:  # noqa: BLE001 - django-environ raises several types
        raise ImproperlyConfigured(f"{name} is not a valid database URL: {exc}") from exc
    if cfg.get("ENGINE") != "django.db.backends.postgresql":
        raise ImproperlyConfigured(
            f"{name} must point at PostgreSQL (postgres://user@host:port/db), got {raw.split(':', 1)[0]}://"
        )
    if not cfg.get("NAME"):
        raise ImproperlyConfigured(f"{name} has no database name: {raw}")
    return cfg


# The development key is public: `manage.py check --deploy` (and so the web unit of deploy/) refuses
# it, or any placeholder, when DEBUG is off (accs_site.checks). Agents and builders never need it.
SECRET_KEY = env.str("ACC_SECRET_KEY", default=DEV_SECRET_KEY)
DEBUG = env.bool("ACC_DEBUG", default=False)
ALLOWED_HOSTS = env.list("ACC_ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "[::1]", "testserver"])

# Behind a TLS-terminating proxy (docs/deploy.md, docs/security.md): which header says the request
# came over HTTPS, the origins the browser's forms may post from, cookies sent over HTTPS only,
# HSTS, and the redirect of plain HTTP (the liveness probe and the scrape stay reachable on it).
SECURE_PROXY_SSL_HEADER = proxy_ssl_header("ACC_PROXY_SSL_HEADER", env.str("ACC_PROXY_SSL_HEADER", default=""))
CSRF_TRUSTED_ORIGINS = trusted_origins("ACC_CSRF_TRUSTED_ORIGINS", env.list("ACC_CSRF_TRUSTED_ORIGINS", default=[]))
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = env.bool("ACC_SECURE_COOKIES", default=False)
SECURE_HSTS_SECONDS = env.int("ACC_HSTS_SECONDS", default=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("ACC_HSTS_INCLUDE_SUBDOMAINS", default=False)
SECURE_HSTS_PRELOAD = env.bool("ACC_HSTS_PRELOAD", default=False)
SECURE_SSL_REDIRECT = env.bool("ACC_SSL_REDIRECT", default=False)
SECURE_REDIRECT_EXEMPT = [r"^api/v1/health$", r"^api/v1/ready$", r"^metrics$"]

INSTALLED_APPS = [
    # Above the admin, so its admin/base_site.html override adds the Dashboard link and styles everywhere.
    "ops",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    # runserver leaves static files to WhiteNoise too, so it serves them as gunicorn does.
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    # django-ninja's templates and static files (Swagger UI at /api/v1/docs from local assets), without
    # importing django-ninja in every process (the daemons never serve the API): accs_site/ninja_assets.py.
    "accs_site.ninja_assets.NinjaAssetsConfig",
    "accs_site",
    "tenants",
    "workflows",
    "jobs",
    "nodes",
    "events",
    # Django 6 ships the Tasks framework (django.tasks); on Django 5.2 the django-tasks backport provides it.
    *([] if importlib.util.find_spec("django.tasks") else ["django_tasks"]),
]

# Django's Tasks API: @task functions run on ACCS agents (jobs/tasks_backend.py, docs/embedding.md).
# QUEUES=[] accepts any queue name: each queue is a set of services agents are started for.
TASKS = {"default": {"BACKEND": "jobs.tasks_backend.AccsTaskBackend", "QUEUES": []}}

MIDDLEWARE = [
    # Outermost, so every error under /api/ (a 404, an oversized body, a middleware's 400) is JSON.
    "accs_site.middleware.ErrorResponseMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Static files (the admin's styles, Swagger UI) from the app itself, under any server.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # Marks GET/HEAD requests read-only for the replica router (no effect without ACC_READ_DB_URL).
    "accs_site.dbrouter.ReadReplicaMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "accs_site.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],  # each ACCS app carries its templates
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "accs_site.wsgi.application"

_db = _database_from_url("ACC_DB_URL", LOCAL_DB_URL)
_db["CONN_MAX_AGE"] = env.int("ACC_DB_CONN_MAX_AGE", default=600)
_db["CONN_HEALTH_CHECKS"] = True
_db.setdefault("OPTIONS", {})
_db["OPTIONS"].setdefault("application_name", "accs")
# Connect timeout and TCP keepalives on every connection, web and daemons alike: a dead server or
# a cut network is noticed in seconds, not after the kernel's ~15 minutes of retransmissions.
# The daemons add statement timeouts of their own (accs_site.daemon.configure_daemon_session).
for _key, _value in connect_options().items():
    _db["OPTIONS"].setdefault(_key, _value)
# Behind a transaction-mode pooler (ACC_DB_POOLER=pgbouncer, docs/deploy.md) a server session
# serves other clients between transactions: no prepared statement survives to the next
# transaction, and a server-side cursor cannot outlive its transaction.
_pooler = env.str("ACC_DB_POOLER", default="").strip().lower()
if _pooler and _pooler != "none":
    _db["OPTIONS"]["prepare_threshold"] = None
    _db["DISABLE_SERVER_SIDE_CURSORS"] = True
DATABASES = {"default": _db}
# An optional streaming replica: the cockpit's and the API's read-only queries go there
# (accs_site.dbrouter: safe-method requests, outside any transaction, ACCS's models only).
if accs.read_db_url:
    _replica = _database_from_url("ACC_READ_DB_URL", accs.read_db_url)
    _replica["CONN_MAX_AGE"] = _db["CONN_MAX_AGE"]
    _replica["CONN_HEALTH_CHECKS"] = True
    _replica["OPTIONS"] = {**_db["OPTIONS"], **_replica.get("OPTIONS", {}), "application_name": "accs-read"}
    # Tests make no test database on the replica: it streams the primary's.
    _replica["TEST"] = {"MIRROR": "default"}
    DATABASES["replica"] = _replica
    DATABASE_ROUTERS = ["accs_site.dbrouter.ReadReplicaRouter"]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# WhiteNoise serves each file from where Django's finders find it (the apps' static/ folders), so
# a fresh clone, runserver, gunicorn and the Docker image need no collectstatic step. STATIC_ROOT
# is only for those who still collect (a CDN or a proxy in front); WhiteNoise serves it too when
# it exists, and a never-collected one is not worth a warning at every start.
STATIC_ROOT = BASE_DIR / ".local" / "static"
WHITENOISE_USE_FINDERS = True
warnings.filterwarnings("ignore", message=r"No directory at: .*static", category=UserWarning)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # Readable lines on a terminal, JSON lines elsewhere; ACC_LOG_FORMAT=text|json decides instead.
    "formatters": {"console": {"()": "events.logging.console_formatter"}},
    "handlers": {
        "stdout": {"class": "logging.StreamHandler", "formatter": "console"},
        # Records with a job_id also land on the job's timeline.
        "timeline": {"class": "events.logging.EventBridgeHandler", "level": "INFO"},
    },
    "root": {"handlers": ["stdout"], "level": env.str("ACC_LOG_LEVEL", default="INFO")},
    "loggers": {
        "django.db.backends": {"level": "INFO"},
        "accs": {"handlers": ["timeline"], "level": env.str("ACC_LOG_LEVEL", default="INFO")},
    },
}
