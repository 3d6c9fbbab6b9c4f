"""Cron schedules in IANA time zones, with cron's daylight-saving rules (see :class:`Schedule`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from croniter.croniter import CroniterError
from django.utils import timezone as djtz

CRON_ALIASES = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *", "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *",
}
# A DST change moves wall-clock times by at most two hours anywhere; three gives margin.
DST_SLACK = timedelta(hours=3)
MAX_SCAN = 2000  # wall-clock candidates examined per computation (6 h of an every-minute cron)


class ScheduleError(ValueError):
    """A cron expression or time zone is unusable; ``field`` names which."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def zone(name: Any) -> ZoneInfo:
    """Return the IANA time zone ``name``; raise ScheduleError naming the field otherwise."""
    if not isinstance(name, str) or not name or len(name) > 64:
        raise ScheduleError("timezone", "give an IANA time zone name such as 'Europe/Budapest'")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleError("timezone", f"unknown IANA time zone {name!r}") from None


@dataclass(frozen=True)
class Schedule:
    """A cron expression read in a time zone, with cron's daylight-saving rules.

    Following Vixie/ISC cron: a *fixed-time* job (no ``*`` in the minute or hour field) runs once
    per matching day even when DST repeats its wall time (the first occurrence counts), and a time
    skipped by the spring change runs once, shifted by the size of the gap (02:30 → 03:30). A
    *wildcard* job (``*`` or ``*/n`` in the minute or hour field) follows real time: repeated wall
    times run again and skipped ones do not exist.
    """

    expr: str
    tz: ZoneInfo
    wildcard: bool

    @classmethod
    def parse(cls, cron_expr: Any, timezone: Any) -> Schedule:
        """Validate and return a schedule; raise ScheduleError naming ``cron_expr`` or ``timezone``."""
        tz = zone(timezone)
        if not isinstance(cron_expr, str) or not cron_expr.strip() or len(cron_expr) > 200:
            raise ScheduleError("cron_expr", "give a cron expression such as '0 2 * * *'")
        expr = CRON_ALIASES.get(cron_expr.strip().lower(), cron_expr.strip())
        fields = expr.split()
        if len(fields) != 5:
            raise ScheduleError("cron_expr", f"expected 5 fields (minute hour day-of-month month day-of-week) "
                                             f"or an alias {sorted(CRON_ALIASES)}, got {len(fields)} in {cron_expr!r}")
        if not croniter.is_valid(expr):
            raise ScheduleError("cron_expr", f"{cron_expr!r} is not a valid cron expression")
        schedule = cls(expr=" ".join(fields), tz=tz, wildcard="*" in fields[0] or "*" in fields[1])
        try:
            schedule.next_after(djtz.now())
        except ScheduleError:
            raise
        except (CroniterError, ValueError, OverflowError) as exc:
            raise ScheduleError("cron_expr", f"{cron_expr!r} never matches a date ({exc})") from None
        return schedule

    def _instants(self, wall: datetime) -> list[datetime]:
        """Map one wall-clock match to the instants it runs at (none, one, or two)."""
        first = wall.replace(tzinfo=self.tz, fold=0).astimezone(UTC)
        second = wall.replace(tzinfo=self.tz, fold=1).astimezone(UTC)
        exists = first.astimezone(self.tz).replace(tzinfo=None) == wall
        if not exists:  # in the spring-forward gap; fold=0 reads it with the old offset, i.e. shifted forward
            return [] if self.wildcard else [first]
        if first != second:  # repeated by the autumn change
            return [first, second] if self.wildcard else [first]
        return [first]

    def _clean(self, at: datetime) -> bool:
        """True when no DST change lies within DST_SLACK of ``at``."""
        return (at - DST_SLACK).astimezone(self.tz).utcoffset() == (at + DST_SLACK).astimezone(self.tz).utcoffset()

    def next_after(self, after: datetime) -> datetime:
        """Return the first due instant strictly after ``after`` (aware, UTC)."""
        after = after.astimezone(UTC)
        local = after.astimezone(self.tz).replace(tzinfo=None)
        wall = croniter(self.expr, local).get_next(datetime)
        candidate = wall.replace(tzinfo=self.tz).astimezone(UTC)
        if self._clean(after) and self._clean(candidate):
            return candidate  # far from any DST change, wall-clock order is time order
        # Near a DST change a wall time before ``local`` can map after ``after`` (gap shift, second
        # occurrence) and one after can map before, so examine every candidate around it.
        it = croniter(self.expr, local - DST_SLACK)
        best: datetime | None = None
        limit: datetime | None = None
        for _ in range(MAX_SCAN):
            wall = it.get_next(datetime)
            if limit is not None and wall > limit:
                break
            for instant in self._instants(wall):
                if instant > after and (best is None or instant < best):
                    best = instant
                    limit = best.astimezone(self.tz).replace(tzinfo=None) + DST_SLACK
        if best is None:
            raise ScheduleError("cron_expr", f"{self.expr!r}: no due time found after {after.isoformat()}")
        return best

    def due_times(self, start: datetime, end: datetime, *, limit: int = 1000) -> list[datetime]:
        """Return the due instants in (start, end], at most ``limit``."""
        out: list[datetime] = []
        current = start
        while len(out) < limit:
            current = self.next_after(current)
            if current > end:
                break
            out.append(current)
        return out
