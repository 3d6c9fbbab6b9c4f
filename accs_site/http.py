"""Shared pieces of the HTTP API: input base schema, error shape, small helpers.

Endpoint modules live in their apps (``jobs/http.py``, ``workflows/http.py``); the NinjaAPI instance
and the exception handlers that turn domain errors into JSON live in :mod:`accs_site.api_v1`.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from django.core.exceptions import PermissionDenied
from django.http import HttpRequest
from ninja import NinjaAPI, Schema
from pydantic import ConfigDict, model_validator

INT32 = 2**31 - 1
MAX_DEPTH = 64


def _check_storable(value: Any, depth: int = 0) -> None:
    """Raise ValueError for values PostgreSQL cannot store (NUL in text, lone surrogates, NaN/Infinity)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"JSON nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError("text must not contain NUL (\\u0000) characters")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("numbers must be finite (no NaN or Infinity)")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_storable(key, depth + 1)
            _check_storable(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_storable(item, depth + 1)


class In(Schema):
    """Base of every request schema: unknown fields are errors, and nothing unstorable gets through."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_storable(data)
        return data


class ErrorOut(Schema):
    """Every error response: ``detail`` says what is wrong; ``problems`` lists each invalid field."""

    detail: str
    problems: list[str] = []
    job_id: UUID | None = None


ERRORS: dict[int, type[ErrorOut]] = {code: ErrorOut for code in (400, 401, 403, 404, 409, 422, 429)}


def responses(ok: dict[int, Any]) -> dict[int, Any]:
    """Return a ninja ``response=`` mapping: the success shapes plus every documented error."""
    return {**ok, **ERRORS}


def utc(value: datetime | None, *, field: str) -> datetime | None:
    """Return an aware UTC datetime (naive means UTC); ValueError naming ``field`` when out of range."""
    if value is None:
        return None
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except (OverflowError, ValueError):
        raise ValueError(f"{field}: date out of range") from None


# Sphinx markup in docstrings, which the OpenAPI description shows as Markdown.
SPHINX_ROLE = re.compile(r":(?:py:)?(?:func|meth|mod|class|data|attr|exc|obj|ref|doc):`~?([^`]+)`")
SPHINX_FIELD = re.compile(r"^(\s*):(param|parameter|arg|key|keyword)\s+(?:\w+\s+)?(\w+):", re.MULTILINE)
SPHINX_RETURNS = re.compile(r"^(\s*):(returns?|rtype|raises?\s+\w+|raise\s+\w+):", re.MULTILINE)


def sphinx_to_markdown(text: str) -> str:
    """Rewrite a docstring's reStructuredText/Sphinx markup as Markdown: ``x`` and :mod:`x` become `x`,
    ``:param name:`` a list item naming the parameter, ``:returns:`` / ``:raises X:`` a bold label."""
    text = SPHINX_ROLE.sub(r"`\1`", text)
    text = text.replace("``", "`")
    text = SPHINX_FIELD.sub(r"\1- `\3`:", text)
    return SPHINX_RETURNS.sub(lambda m: f"{m.group(1)}**{m.group(2)[:1].upper()}{m.group(2)[1:]}:**", text)


def _markdown_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: sphinx_to_markdown(value) if key == "description" and isinstance(value, str)
                else _markdown_descriptions(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_markdown_descriptions(item) for item in node]
    return node


class MarkdownDescriptions(NinjaAPI):
    """A NinjaAPI whose OpenAPI descriptions (from docstrings) are Markdown, not Sphinx markup."""

    def get_openapi_schema(self, **kwargs: Any) -> Any:
        schema = super().get_openapi_schema(**kwargs)
        converted = _markdown_descriptions(dict(schema))
        schema.clear()
        schema.update(converted)
        return schema


def require_scope(request: HttpRequest, scope: str) -> None:
    """Raise PermissionDenied unless the request's API token has ``scope`` (read, run, approve,
    definitions); a request authenticated otherwise (no token scopes recorded) passes."""
    scopes = getattr(request, "token_scopes", None)
    if scopes is not None and scope not in scopes:
        raise PermissionDenied(f"this API token lacks the {scope!r} scope (it has: {', '.join(sorted(scopes))}); "
                               f"create one with manage.py accs_token create USER NAME --scope {scope}")


def require_superuser(request: HttpRequest) -> None:
    """Raise PermissionDenied unless the caller is a superuser."""
    if not getattr(request.auth, "is_superuser", False):
        raise PermissionDenied("only superusers may manage services and workflows")


def username(request: HttpRequest) -> str:
    """Return the caller's username, for ``by=`` in transitions and events."""
    return getattr(request.auth, "username", "") or "api"
