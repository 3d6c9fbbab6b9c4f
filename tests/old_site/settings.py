"""A site written for ACCS 0.1.0: its URLs name the metrics view by its old path (events.metrics)."""

from accs_site.settings import *  # noqa: F401,F403

ROOT_URLCONF = "tests.old_site.urls"
