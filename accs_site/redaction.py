"""The one place that decides what is secret, and hides it.

A param is secret when its name looks secret (``password``, ``token``, ``secret``, ``api_key``,
``credential``…): every value under such a name, in nested objects and lists too. The agent
redacts the *values* of secret params (and its own secrets) from what a task prints
(:func:`secrets_in`, :func:`redact`); everything that *shows* params to a person (the HTTP API,
the admin, the job page, exports) shows them through :func:`redact_params`, which replaces each
secret value with ``***`` and keeps the shape, so the reader still sees which params were given.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from accs_site.conf import MIN_SECRET_CHARS

SECRET_KEY_RE = re.compile(r"(pass(word|wd|phrase)?|secret|token|api[_-]?key|credential|private[_-]?key|authorization)",
                           re.I)
MASK = "***"


def is_secret_name(name: object) -> bool:
    """Return whether a param named ``name`` holds a secret."""
    return bool(SECRET_KEY_RE.search(str(name)))


def secrets_in(params: Any, *, secret: bool = False) -> list[str]:
    """Return the values of params whose names look secret (every value under such a name, in lists
    and objects too), to redact from logs and tails."""
    found: list[str] = []
    if isinstance(params, dict):
        for key, value in params.items():
            found += secrets_in(value, secret=secret or is_secret_name(key))
    elif isinstance(params, (list, tuple)):
        for value in params:
            found += secrets_in(value, secret=secret)
    elif secret and isinstance(params, (str, int, float)) and not isinstance(params, bool):
        if len(str(params)) >= MIN_SECRET_CHARS:
            found.append(str(params))
    return found


def redact(text: str, secrets: Iterable[str]) -> str:
    """Replace every secret value in ``text`` with ``***`` (longest first, so a URL goes before its password)."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def redact_params(params: Any, *, secret: bool = False) -> Any:
    """Return a copy of ``params`` in which every value under a secret-looking name is ``***``.

    Objects and lists keep their shape (a list of tokens becomes a list of ``***``); ``None`` stays
    ``None``, so "not given" still reads as such. Values are never read as text, so nothing secret
    can survive by being a number or a nested structure.
    """
    if isinstance(params, dict):
        return {key: redact_params(value, secret=secret or is_secret_name(key)) for key, value in params.items()}
    if isinstance(params, (list, tuple)):
        return [redact_params(value, secret=secret) for value in params]
    if secret and params is not None:
        return MASK
    return params


def keep_secrets(given: Any, stored: Any, *, secret: bool = False) -> Any:
    """Return ``given`` (an edited copy of redacted params) with each ``***`` under a secret name
    replaced by the value ``stored`` holds at the same place, so that saving what a page showed
    never overwrites a secret with its mask."""
    if isinstance(given, dict):
        stored_map = stored if isinstance(stored, dict) else {}
        return {key: keep_secrets(value, stored_map.get(key), secret=secret or is_secret_name(key))
                for key, value in given.items()}
    if isinstance(given, list):
        stored_list = stored if isinstance(stored, list) else []
        return [keep_secrets(value, stored_list[i] if i < len(stored_list) else None, secret=secret)
                for i, value in enumerate(given)]
    if secret and given == MASK and stored is not None:
        return stored
    return given
