"""Small helpers for the raw SQL of the engine."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any


def from_json(value: Any) -> Any:
    """Decode a json/jsonb column read through Django's cursor (which returns it as text)."""
    return json.loads(value) if isinstance(value, (str, bytes)) else value


# A statement's psycopg parameter: %(name)s.
_PARAMETER_RE = re.compile(r"%\((\w+)\)s")


def bind_params(sql: str, names: Mapping[str, str]) -> str:
    """Return ``sql`` with each ``%(name)s`` parameter replaced by ``names[name]``.

    How a server-side function is built from a statement the code holds: each parameter becomes one
    of the function's arguments or variables (a name the mapping lacks is a KeyError, not a function
    left with a parameter it cannot bind).
    """
    return _PARAMETER_RE.sub(lambda m: names[m.group(1)], sql)


def query_function_sql(name: str, args: str, returns: str, body: str, *, volatility: str, tag: str) -> str:
    """Return the CREATE FUNCTION statement of a PL/pgSQL function that answers one query's rows.

    A hot statement runs as such a function (the start, the step inputs' read): PL/pgSQL keeps each
    statement's plan for the server connection, a generic one (the statement's shape does not depend on
    its parameters' values), and JIT is off (a generic plan's estimate can pass ``jit_above_cost`` on a
    large table, and every call would compile). ``args`` is the argument list as written between the
    parentheses. A migration holds a copy of what this returns; a test compares the database's function
    with it.
    """
    return f"""CREATE OR REPLACE FUNCTION {name}({args})
RETURNS {returns}
LANGUAGE plpgsql {volatility}
-- One plan per server connection (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
SET jit = off
AS ${tag}$
#variable_conflict use_column
BEGIN
    RETURN QUERY
{body};
END
${tag}$"""
