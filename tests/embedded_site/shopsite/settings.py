"""A team's own site ("shop") with ACCS installed, written the way docs/embedding.md says.

Deliberately unlike accs_site: Django's default auto field, its own database variable, the ACCS
apps listed after its own, no ``accs_site`` app, ACCS settings kept in the ``ACCS`` dict.
"""

import os

import environ

SECRET_KEY = "embedded-site-test-only"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "shop",
    # ACCS
    "tenants",
    "workflows",
    "jobs",
    "nodes",
    "events",
    "ops",
    "ninja",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "shopsite.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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
WSGI_APPLICATION = "shopsite.wsgi.application"
DATABASES = {"default": environ.Env.db_url_config(os.environ["SHOP_DB_URL"])}
USE_TZ = True
STATIC_URL = "static/"

# ACCS reads ACC_* from the environment first, then from this dict.
# What agents may run is the site's to list (unset, they run nothing of the site's): its own modules'
# callables and @task functions, and the interpreter its label step runs.
ACCS = {"ACC_POLL_INTERVAL_SEC": "0.5", "ACC_NODE_LABELS": "site=shop", "ACC_METRICS_TOKEN": "shop-scrape-token",
        "ACC_ALLOWED_CALLABLES": "shop", "ACC_ALLOWED_EXECUTABLES": "python3"}

# Django's Tasks API on ACCS agents.
TASKS = {"default": {"BACKEND": "jobs.tasks_backend.AccsTaskBackend", "OPTIONS": {"TENANT": "default"}}}
