"""The time range an operator looks at, shared by the dashboard and the lists.

A range is a preset (``?range=15m`` … ``7d``, or ``all``) or a custom one (``?range=custom&from=…&to=…``,
local times as a ``datetime-local`` input sends them, in the site's time zone). The query string
chooses it; the choice is remembered in the session, so the next page (the dashboard, a list) opens on
the same range until the operator picks another. A list shows the range in its filter sidebar
(:func:`time_range_filter`), the dashboard above its charts (``admin/accs/_time_range.html``).

Every list filters its own indexed column: jobs by ``created_at`` (``job_created_idx``), tasks by their
time-ordered id (the primary key), attempts by ``started_at`` (``attempt_started_idx``), events by
``ts`` (the partitions' key).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.contrib import admin, messages
from django.db.models import Q, QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.http import urlencode

from jobs import ids

#: The presets, shortest first: key → (length, label).
PRESETS: dict[str, tuple[timedelta, str]] = {
    "15m": (timedelta(minutes=15), "15 min"),
    "1h": (timedelta(hours=1), "1 h"),
    "6h": (timedelta(hours=6), "6 h"),
    "24h": (timedelta(hours=24), "24 h"),
    "7d": (timedelta(days=7), "7 d"),
}
ALL, CUSTOM = "all", "custom"
#: "All time" for this page only, not remembered: the dashboard's cards link their lists with it (a card
#: counts what is there now), so following one does not forget the range the operator picked.
ALL_ONCE = "any"
#: What "all time" draws on the dashboard (a chart needs two ends), and the longest custom range it draws.
LONGEST, LONGEST_CUSTOM = PRESETS["7d"][0], timedelta(days=92)
#: The session key remembering the last range chosen.
SESSION_KEY = "accs_time_range"
#: The query parameters a range is made of.
PARAMS = ("range", "from", "to")
#: The format of a custom range's ends (what ``<input type="datetime-local">`` sends).
INPUT_FORMAT = "%Y-%m-%dT%H:%M"


class RangeError(ValueError):
    """A time range that cannot be read; the message names the parameter and what is wrong."""


@dataclass(frozen=True)
class TimeRange:
    """From ``since`` to ``until`` (None: open on that side); ``key`` is the preset, ``custom`` or ``all``."""

    key: str
    since: datetime | None
    until: datetime | None

    @property
    def label(self) -> str:
        if self.key in PRESETS:
            return f"last {PRESETS[self.key][1]}"
        if self.key == ALL:
            return "all time"
        return f"{_local(self.since)} – {_local(self.until) if self.until else 'now'}"

    def params(self) -> dict[str, str]:
        """Return the query parameters that choose this range."""
        if self.key != CUSTOM:
            return {"range": self.key}
        out = {"range": CUSTOM, "from": _local(self.since, INPUT_FORMAT)}
        return {**out, "to": _local(self.until, INPUT_FORMAT)} if self.until else out

    def query(self) -> str:
        return urlencode(self.params())

    def bounded(self, *, now: datetime) -> tuple[datetime, datetime]:
        """Return the range's (start, end) for a chart: an open end is ``now``, an open start ``end − 7 d``;
        a custom range longer than :data:`LONGEST_CUSTOM` is drawn up to its end."""
        until = min(self.until or now, now)
        since = self.since if self.since is not None else until - LONGEST
        # A range starting in the future still draws its first quarter hour (empty bars, not none).
        return min(max(since, until - LONGEST_CUSTOM), until - PRESETS["15m"][0]), until

    def q(self, field: str, *, by_id: bool = False) -> Q:
        """Return the condition keeping the rows of ``field`` inside the range (``by_id``: a uuid7 key)."""
        if self.since is None and self.until is None:
            return Q()
        if by_id:
            lo, hi = ids.id_range(self.since or datetime(1970, 1, 1, tzinfo=UTC),
                                  self.until or timezone.now() + timedelta(days=1))
            return Q(**{f"{field}__gte": lo, f"{field}__lte": hi})
        cond = Q(**{f"{field}__gte": self.since}) if self.since else Q()
        return cond & Q(**{f"{field}__lt": self.until}) if self.until else cond


def _local(when: datetime | None, fmt: str = "%Y-%m-%d %H:%M") -> str:
    return timezone.localtime(when).strftime(fmt) if when else ""


def _parse_time(name: str, text: str) -> datetime:
    try:
        naive = datetime.strptime(text.strip(), INPUT_FORMAT)
    except ValueError:
        raise RangeError(f"{name}={text!r} is not a time: write it as YYYY-MM-DDTHH:MM "
                         f"(e.g. 2026-11-28T13:05), in {timezone.get_current_timezone_name()}") from None
    return timezone.make_aware(naive)


def parse_range(params: Mapping[str, str], *, now: datetime) -> TimeRange | None:
    """Return the range ``params`` choose, None when they choose none; :class:`RangeError` names bad input."""
    key = (params.get("range") or "").strip()
    if not key:
        return None
    if key in (ALL, ALL_ONCE):
        return TimeRange(ALL, None, None)
    if key in PRESETS:
        return TimeRange(key, now - PRESETS[key][0], None)
    if key != CUSTOM:
        raise RangeError(f"range={key!r} is not a range: choose one of {', '.join([*PRESETS, ALL, CUSTOM])}")
    if not (params.get("from") or "").strip():
        raise RangeError("a custom range needs its start: from=YYYY-MM-DDTHH:MM")
    since = _parse_time("from", params["from"])
    until = _parse_time("to", params["to"]) if (params.get("to") or "").strip() else None
    if until is not None and until <= since:
        raise RangeError(f"the range ends ({params['to']}) before it starts ({params['from']})")
    return TimeRange(CUSTOM, since, until)


def current_range(request: HttpRequest, *, default: str = ALL, now: datetime | None = None) -> TimeRange:
    """Return the range this request looks at: its query string's (then remembered), else the session's.

    A range the query string gets wrong is reported on the page (a message naming the problem) and
    the remembered one is used instead.
    """
    now = now or timezone.now()
    try:
        chosen = parse_range(request.GET, now=now)
    except RangeError as exc:
        messages.error(request, f"Time range: {exc}", fail_silently=True)
        chosen = None
    session = getattr(request, "session", None)
    if chosen is not None:
        if session is not None and request.GET.get("range") != ALL_ONCE:
            session[SESSION_KEY] = chosen.params()
        return chosen
    try:
        remembered = parse_range(session.get(SESSION_KEY) or {}, now=now) if session is not None else None
    except RangeError:
        remembered = None
    return remembered or parse_range({"range": default}, now=now) or TimeRange(ALL, None, None)


def picker(request: HttpRequest, chosen: TimeRange, *, path: str = "") -> dict[str, Any]:
    """Return the picker's context: a link per preset (keeping the page's other parameters) and the custom form."""
    keep: dict[str, str] = {k: str(v) for k, v in request.GET.items() if k not in PARAMS and k != "p"}
    base = path or request.path

    def link(key: str) -> str:
        return f"{base}?{urlencode({**keep, 'range': key})}"

    presets = [{"key": k, "label": label, "url": link(k), "on": chosen.key == k} for k, (_d, label) in PRESETS.items()]
    return {"presets": presets, "all_url": link(ALL), "all_on": chosen.key == ALL, "chosen": chosen,
            "keep": sorted(keep.items()), "action": base, "zone": timezone.get_current_timezone_name(),
            "from_value": _local(chosen.since, INPUT_FORMAT) if chosen.key == CUSTOM else "",
            "to_value": _local(chosen.until, INPUT_FORMAT) if chosen.key == CUSTOM else ""}


class TimeRangeFilter(admin.ListFilter):
    """A list's time range: the presets, "all time" and a custom from/to, remembered with the dashboard's.

    Subclasses (see :func:`time_range_filter`) name the column (``field``) and whether it is a
    time-ordered id (``by_id``).
    """

    title = "time range"
    template = "admin/accs/time_range_filter.html"
    field = "created_at"
    by_id = False

    def __init__(self, request: HttpRequest, params: dict[str, Any], model: Any, model_admin: Any) -> None:
        super().__init__(request, params, model, model_admin)
        for name in PARAMS:
            if name in params:
                value = params.pop(name)
                self.used_parameters[name] = value[-1] if isinstance(value, list) else value
        self.range = current_range(request)
        self.request = request

    def has_output(self) -> bool:
        return True

    def expected_parameters(self) -> list[str | None]:
        return list(PARAMS)

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return queryset.filter(self.range.q(self.field, by_id=self.by_id))

    def choices(self, changelist: Any) -> Iterator[dict[str, Any]]:
        # The template draws the picker itself (picker()); one entry, so the sidebar shows it.
        yield picker(self.request, self.range)


def time_range_filter(field: str, *, by_id: bool = False) -> type[TimeRangeFilter]:
    """Return the time-range filter of a list whose rows' time is ``field``."""
    return type(f"TimeRangeFilter_{field}", (TimeRangeFilter,), {"field": field, "by_id": by_id})


__all__ = ["PRESETS", "RangeError", "TimeRange", "TimeRangeFilter", "current_range", "parse_range", "picker",
           "time_range_filter"]
