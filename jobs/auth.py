"""Deprecated: moved to :mod:`tenants.auth` in ACCS 0.2.0; this path is removed in 0.3.0."""

from events._moved import forward

__getattr__ = forward("jobs.auth", "tenants.auth")
