"""The admin toolkit the ACCS apps share: tenant-scoped model admins, actions run as transitions,
page buttons and bulk actions from one table, a list paginator that does not count millions of rows,
and the status pill.

Every operator action (the engine's verbs, the fleet's, the governor's) answers an :class:`ActionResult`,
and every action the cockpit offers goes through :func:`perform`: it names each object in the message, and writes
Django's admin log entry for each change (the object's History, the index's "Recent actions").
Destructive actions (:data:`DESTRUCTIVE`) answer first with a confirmation page (:func:`confirm_page`).

Tenant isolation has one definition, :mod:`tenants.scoping`: every tenant-owned list is filtered
through it, objects of other tenants do not exist for a tenant admin (their URLs redirect like a
deleted object's), and actions only touch objects the user may act on.
"""

from __future__ import annotations

import csv
import itertools
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone as dt_timezone
from functools import cached_property
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode
from uuid import UUID

from django.contrib import admin, messages
from django.contrib.admin import ShowFacets, helpers
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.templatetags import admin_list
from django.contrib.admin.utils import display_for_field as _django_display_for_field
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import DurationField, ExpressionWrapper, F, QuerySet
from django.db.models.functions import Coalesce, Now
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseNotAllowed,
    HttpResponseRedirect,
    StreamingHttpResponse,
)
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext

from accs_site.counting import EXACT_COUNT_LIMIT, estimated_count
from accs_site.redaction import redact_params
from tenants.models import Tenant
from tenants.scoping import can_act, scope, tenant_ids_for


@dataclass
class ActionResult:
    """Outcome of an operator action: ``changed`` False means it no longer applied (and why)."""

    changed: bool
    message: str
    # The caller may not do this at all (not merely "no longer applies"): the HTTP API answers 403.
    forbidden: bool = False


def human_age(seconds: float | None) -> str:
    """Format a duration for people: ``42 s``, ``7 min``, ``3 h 5 min``, ``2 d 4 h``."""
    if seconds is None:
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes = seconds / 60
    if minutes < 90:
        return f"{minutes:.0f} min"
    hours = int(minutes // 60)
    if hours < 48:
        return f"{hours} h {int(minutes % 60)} min"
    return f"{hours // 24} d {hours % 24} h"


#: From this offset on, a list page picks its rows' keys first (EstimatedCountPaginator.page).
DEFERRED_OFFSET = 1_000
#: An action over the selected rows acts on at most this many objects per click.
MAX_BULK = 1_000
#: An action over the whole filtered list (the admin's "Select all N") acts on at most this many rows per
#: click, :data:`FILTER_BATCH` per transaction.
MAX_FILTER_BULK, FILTER_BATCH = 10_000, 500


class EstimatedCountPaginator(Paginator):
    """Count exactly up to :data:`EXACT_COUNT_LIMIT` rows, then use PostgreSQL's row estimate.

    Django's changelist counts the filtered rows on every page view; on a table with millions of
    rows that exact ``COUNT(*)`` costs more than the page itself.
    """

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return super().count
        return estimated_count(queryset, exact_up_to=EXACT_COUNT_LIMIT)[0]

    def page(self, number: Any) -> Any:
        """Return a page; past the first pages, skip the offset over the ordering's keys only.

        ``OFFSET 50000`` on the full rows reads 50,000 wide rows to throw them away (page 500 of
        the tasks took 2 s). Picking the page's keys first (``WHERE pk IN (SELECT pk ... OFFSET n
        LIMIT 100)``) lets PostgreSQL walk the ordering's index alone, then read 100 rows.
        """
        number = self.validate_number(number)
        bottom = (number - 1) * self.per_page
        queryset = self.object_list
        if bottom < DEFERRED_OFFSET or not isinstance(queryset, QuerySet):
            return super().page(number)
        top = bottom + self.per_page
        if top + self.orphans >= self.count:
            top = self.count
        keys = queryset.values("pk")[bottom:top]
        # Paginator's own page factory (Django has it; the stubs leave it out as private).
        return self._get_page(queryset.filter(pk__in=keys), number, self)  # type: ignore[attr-defined]


def actor(request: HttpRequest) -> str:
    """Name the operator for the timeline (events record ``user:<name>``)."""
    return request.user.get_username()


def subject_of(modeladmin: admin.ModelAdmin, obj: Any) -> str:
    """Name an object in action messages and the admin log (the admin's ``action_subject``, if any)."""
    name = getattr(modeladmin, "action_subject", None)
    return name(obj) if name else f"{modeladmin.opts.verbose_name} {obj}"


def _named(subject: str, message: str) -> str:
    """Return ``subject: message``, or the message alone when it names the subject already."""
    return message if subject in message else f"{subject}: {message}"


def _some(subjects: list[str], limit: int = 5) -> str:
    return ", ".join(subjects[:limit]) + (f" and {len(subjects) - limit} more" if len(subjects) > limit else "")


def report(request: HttpRequest, modeladmin: admin.ModelAdmin, verb: str,
           results: list[ActionResult], *, denied: int = 0, capped: bool = False,
           subjects: list[str] | None = None, cap: int = MAX_BULK) -> None:
    """Summarise action outcomes in one message naming what changed, what did not and why.

    ``subjects`` names the object of each result (in order); without them the message gives
    counts and reasons only.
    """
    named = list(zip(subjects, results, strict=True)) if subjects else [("", r) for r in results]
    changed = [(s, r) for s, r in named if r.changed]
    unchanged: dict[str, list[str]] = {}
    for subject, result in named:
        if not result.changed:
            unchanged.setdefault(result.message, []).append(subject)
    parts = []
    if len(changed) == 1:
        subject, result = changed[0]
        parts.append(f"{verb}: {_named(subject, result.message)}" if subject else f"{verb}: {result.message}")
    elif changed:
        names = [s for s, _r in changed if s]
        parts.append(f"{verb}: {len(changed)} changed" + (f" ({_some(names)})" if names else ""))
    for message, names in sorted(unchanged.items(), key=lambda item: -len(item[1])):
        if len(names) == 1:
            parts.append(f"unchanged: {_named(names[0], message)}" if names[0] else f"unchanged: {message}")
        else:
            listed = [n for n in names if n]
            parts.append(f"{len(names)} unchanged ({message})" + (f": {_some(listed)}" if listed else ""))
    if denied:
        parts.append(f"{denied} not permitted (another tenant, or viewer role)")
    if capped:
        parts.append(f"stopped after {cap:,}; run the action again for the rest")
    level = messages.SUCCESS if changed and not unchanged and not denied else (
        messages.WARNING if changed else messages.ERROR)
    modeladmin.message_user(request, "; ".join(parts) or f"{verb}: nothing selected", level)


def log_action(request: HttpRequest, modeladmin: admin.ModelAdmin, obj: Any, verb: str, result: ActionResult) -> None:
    """Record an action that changed ``obj`` in Django's admin log (its History, "Recent actions")."""
    if result.changed:
        modeladmin.log_change(request, obj, f"{verb}: {result.message}")


def log_bulk(request: HttpRequest, model: type, message: str) -> None:
    """Record an action over many objects of ``model`` (a redrive by filter) as one admin log entry."""
    from django.contrib.admin.models import CHANGE, LogEntry
    from django.contrib.contenttypes.models import ContentType

    # Admin views run for a logged-in user only, so the user has a primary key.
    LogEntry.objects.create(user_id=request.user.pk,  # type: ignore[misc]
                            content_type=ContentType.objects.get_for_model(model),
                            object_id=None, object_repr=message[:200], action_flag=CHANGE, change_message=message)


def perform(request: HttpRequest, modeladmin: admin.ModelAdmin, verb: str, objects: list[Any],
            fn: Callable[[Any], ActionResult], *, denied: int = 0, capped: bool = False) -> list[ActionResult]:
    """Run an operator action on each object: record each change in the admin log, then report.

    Every action the cockpit offers (page buttons, bulk actions, node and host actions, governor
    conditions, tokens) comes through here, so each one is named in its message and in the
    admin's history of the object, with the operator who did it.
    """
    results = []
    for obj in objects:
        result = fn(obj)
        log_action(request, modeladmin, obj, verb, result)
        results.append(result)
    report(request, modeladmin, verb, results, denied=denied, capped=capped,
           subjects=[subject_of(modeladmin, obj) for obj in objects])
    return results


def run_interval() -> ExpressionWrapper:
    """How long a row ran (``finished_at - started_at``), or has run so far, by PostgreSQL's clock.

    The database's ``now()`` is the clock that stamped the times, so a web server whose own clock
    is off shows neither negative nor inflated durations.
    """
    return ExpressionWrapper(Coalesce(F("finished_at"), Now()) - F("started_at"), output_field=DurationField())


def uuid_or_none(text: str) -> UUID | None:
    """Return ``text`` as a UUID, or None when it is not one."""
    try:
        return uuid.UUID(text.strip())
    except (ValueError, AttributeError):
        return None


#: The shortest id prefix a search turns into a key range (shorter ones match too much to be useful).
MIN_ID_PREFIX = 4


def uuid_prefix_range(text: str) -> tuple[UUID, UUID] | None:
    """Return the (lowest, highest) UUIDs that start with ``text``, or None when it is no id prefix.

    A prefix is at least :data:`MIN_ID_PREFIX` hex digits (dashes as in a pasted id are ignored).
    Searching ``pk >= lowest AND pk <= highest`` reads the primary-key index; ``LIKE`` on the id
    cast to text would read every row.
    """
    digits = text.strip().replace("-", "").lower()
    if not (MIN_ID_PREFIX <= len(digits) <= 32) or any(c not in "0123456789abcdef" for c in digits):
        return None
    return UUID(digits.ljust(32, "0")), UUID(digits.ljust(32, "f"))


class TenantListFilter(admin.SimpleListFilter):
    """Filter by tenant, offering only the tenants the viewer may see (never other tenants' names)."""

    title = "tenant"
    parameter_name = "tenant"
    tenant_path = "tenant_id"

    def lookups(self, request, model_admin):
        return [(str(t.id), t.slug) for t in scope(Tenant.objects.all(), request.user, field="id")]

    def queryset(self, request, queryset):
        value = uuid_or_none(self.value() or "")
        return queryset.filter(**{self.tenant_path: value}) if value else queryset


#: Rows an export reads per query (keyset pagination by primary key).
EXPORT_BATCH = 1_000
EXPORT_FORMATS = ("csv", "json")


class _Echo:
    """A file-like object whose ``write`` returns what it was given (csv.writer into a stream)."""

    def write(self, value: str) -> str:
        return value


def _cell(value: Any) -> str:
    """Return a value as a CSV cell: JSON for objects and lists, ISO 8601 for times, '' for none."""
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, cls=DjangoJSONEncoder)
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def export_rows(queryset: QuerySet, fields: tuple[str, ...], *, redacted: tuple[str, ...],
                batch: int = EXPORT_BATCH) -> Iterator[dict[str, Any]]:
    """Yield the rows of ``queryset`` (newest first by primary key), ``batch`` per query, secrets as ``***``.

    Keyset pagination: each query starts below the last key read, so each costs its batch (the
    primary key's index read backwards), and no more than one batch is ever held in memory.
    """
    if batch < 1:
        raise ValueError(f"an export batch must be at least one row, got {batch}")
    rows = queryset.order_by("-pk").values("pk", *fields)
    last = None
    while True:
        page = list((rows if last is None else rows.filter(pk__lt=last))[:batch])
        for row in page:
            key = row.pop("pk")
            yield {name: redact_params(row[name]) if name in redacted else row[name] for name in fields}
        if len(page) < batch:
            return
        last = key


def stream_export(rows: Iterator[dict[str, Any]], fields: tuple[str, ...], *, fmt: str,
                  filename: str) -> StreamingHttpResponse:
    """Stream ``rows`` as CSV (a header line, then one line a row) or as a JSON array, as a download."""
    if fmt == "csv":
        writer = csv.writer(_Echo())
        body: Iterator[str] = itertools.chain(
            [writer.writerow(fields)], (writer.writerow([_cell(r[f]) for f in fields]) for r in rows))
        content_type = "text/csv; charset=utf-8"
    elif fmt == "json":
        def array() -> Iterator[str]:
            yield "["
            for i, row in enumerate(rows):
                yield ("," if i else "") + "\n" + json.dumps(row, cls=DjangoJSONEncoder, sort_keys=True)
            yield "\n]\n"

        body, content_type = array(), "application/json"
    else:
        raise ValueError(f"unknown export format {fmt!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    response = StreamingHttpResponse(body, content_type=content_type)
    response["Content-Disposition"] = f'attachment; filename="{filename}.{fmt}"'
    return response


class TenantScopedAdmin(admin.ModelAdmin):
    """Admin for a tenant-owned model: lists, pages and actions follow :mod:`tenants.scoping`.

    Members of a tenant (non-superuser staff with a TenantMembership) may view these models
    without Django model permissions; acting needs the tenant-admin role. Superusers see all.

    A list naming ``export_fields`` offers its rows as CSV and JSON (``export.csv`` / ``export.json``
    beside the list, URL ``admin:<app>_<model>_export``): the rows the list shows under the same
    filters, search and tenant scope, streamed, their ``redacted_fields`` redacted as the pages show them.
    """

    tenant_path = "tenant_id"
    #: JSON fields holding params: their page shows them through :func:`accs_site.redaction.redact_params`.
    redacted_fields: tuple[str, ...] = ()
    #: The columns an export writes (model fields; foreign keys by their ``_id``); none: no export.
    export_fields: tuple[str, ...] = ()
    show_full_result_count = False  # no exact COUNT(*) of the unfiltered table
    show_facets = ShowFacets.NEVER  # facet counts are one COUNT per filter option
    paginator = EstimatedCountPaginator
    change_list_template = "admin/accs/export_change_list.html"

    def get_urls(self) -> list[URLPattern]:
        urls = super().get_urls()
        if not self.export_fields:
            return urls
        name = f"{self.opts.app_label}_{self.opts.model_name}_export"
        return [path("export.<str:fmt>", self.admin_site.admin_view(self.export_view), name=name), *urls]

    def action_checkbox(self, obj: models.Model) -> SafeString:
        """Return the row's checkbox for the actions: the markup Django's widget renders (the test compares
        them), joined as a string. Through the widget's template it was a fifth of a 100-row list page."""
        label = format_html(gettext("Select this object for an action - {}"), str(obj))
        return format_html('<input type="checkbox" name="{}" value="{}" class="action-select" aria-label="{}">',
                           helpers.ACTION_CHECKBOX_NAME, str(obj.pk), label)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        extra = dict(extra_context or {})
        if self.export_fields:
            url = reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_export", args=["csv"])[:-len("csv")]
            query = f"?{request.GET.urlencode()}" if request.GET else ""
            extra["export_urls"] = [(fmt.upper(), f"{url}{fmt}{query}") for fmt in EXPORT_FORMATS]
        return super().changelist_view(request, extra_context=extra)

    def export_view(self, request: HttpRequest, fmt: str) -> HttpResponse | StreamingHttpResponse:
        """Stream the list's rows (its filters, search and the viewer's tenants) as ``fmt``."""
        if fmt not in EXPORT_FORMATS:
            return HttpResponseBadRequest(f"unknown export format {fmt!r}: choose one of {', '.join(EXPORT_FORMATS)}")
        if not self.has_view_permission(request):
            raise PermissionDenied
        try:
            changelist = self.get_changelist_instance(request)
        except IncorrectLookupParameters as exc:
            return HttpResponseBadRequest(f"the list's filters are not valid: {exc}")
        rows = export_rows(changelist.queryset, self.export_fields, redacted=self.redacted_fields)
        stamp = timezone.now().strftime("%Y%m%d-%H%M%S")
        return stream_export(rows, self.export_fields, fmt=fmt, filename=f"{self.opts.model_name}s-{stamp}")

    def tenant_of(self, obj: Any) -> UUID | None:
        """Return the tenant id an object belongs to (override when ``tenant_path`` crosses a relation)."""
        return getattr(obj, "tenant_id", None)

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return scope(super().get_queryset(request), request.user, field=self.tenant_path)

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        """Return the object a page shows, its secret-named params already ``***`` (a form that saves
        such a field puts the stored secrets back with :func:`accs_site.redaction.keep_secrets`)."""
        obj = super().get_object(request, object_id, from_field)
        for name in self.redacted_fields if obj is not None else ():
            setattr(obj, name, redact_params(getattr(obj, name)))
        return obj

    def _member(self, request: HttpRequest, *, write: bool = False) -> bool:
        allowed = tenant_ids_for(request.user, write=write)
        return request.user.is_staff and (allowed is None or bool(allowed))

    def has_module_permission(self, request: HttpRequest) -> bool:
        return super().has_module_permission(request) or self._member(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and not can_act(request.user, self.tenant_of(obj), write=False):
            return False
        return super().has_view_permission(request, obj) or self._member(request)

    def has_act_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Whether the user may run state-changing actions (on ``obj``, or on anything here)."""
        if not request.user.is_staff:
            return False
        if obj is not None:
            return can_act(request.user, self.tenant_of(obj), write=True)
        return self._member(request, write=True)

    def act_on(self, request: HttpRequest, queryset: QuerySet, verb: str,
               fn: Callable[[Any], ActionResult]) -> None:
        """Run ``fn`` on each selected object the user may act on, then report."""
        ids = list(queryset.order_by().values_list("pk", flat=True)[: MAX_BULK + 1])
        capped = len(ids) > MAX_BULK
        ids = ids[:MAX_BULK]
        allowed = scope(self.model.objects.filter(pk__in=ids), request.user, write=True, field=self.tenant_path)
        objects = list(allowed)
        perform(request, self, verb, objects, fn, denied=len(ids) - len(objects), capped=capped)


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows shown, never added, changed or deleted through the admin."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class ReadOnlyScopedAdmin(ReadOnlyAdmin, TenantScopedAdmin):
    """State changes go through jobs.transitions, never through a form."""


def when_text(value: datetime, *, ms: bool = False) -> str:
    """Say a moment the one way the admin does: ``2026-11-28 13:04:39 UTC`` (``.123`` before the zone with ``ms``)."""
    utc = value.astimezone(dt_timezone.utc)
    clock = f"{utc:%Y-%m-%d %H:%M:%S}" + (f".{utc.microsecond // 1000:03d}" if ms else "")
    return f"{clock} UTC"


def when_html(value: datetime | None, *, ms: bool = False) -> str:
    """Render a moment as a ``<time>`` element in UTC (:func:`when_text`); the page's display-zone choice
    (ops/static/ops/timezone.js) rewrites it in the operator's zone, the zone named either way."""
    if value is None:
        return "—"
    return format_html('<time class="accs-when" datetime="{}"{}>{}</time>', value.isoformat(),
                       mark_safe(' data-ms="1"') if ms else "", when_text(value, ms=ms))


def when_ago_html(value: datetime | None, *, never: str = "—", note: str = "") -> str:
    """Render a moment the one way (:func:`when_html`) followed by how long ago it was (or how soon it
    comes), for columns whose point is the age: ``2026-11-28 13:04:39 UTC · 7 min ago``."""
    if value is None:
        return never
    ahead = (value - timezone.now()).total_seconds()
    relative = f"in {human_age(ahead)}" if ahead >= 0 else f"{human_age(-ahead)} ago"
    return format_html('<span class="accs-when-ago">{} <small>· {}</small>{}</span>', when_html(value), relative,
                       note)


def display_for_field(value: Any, field: Any, empty_value_display: str, **options: Any) -> str:
    """Render a model field's value in an admin list or a read-only form field as Django does, except a
    moment, which is said the one way (:func:`when_html`) with its zone named and the display-zone picker."""
    if isinstance(field, models.DateTimeField) and value is not None and not getattr(field, "flatchoices", None):
        return when_html(value)
    return _django_display_for_field(value, field, empty_value_display, **options)


_django_add_preserved_filters = admin_list.add_preserved_filters  # type: ignore[attr-defined]


def add_preserved_filters(context: dict[str, Any], url: str, popup: bool = False, to_field: str | None = None) -> str:
    """Return Django's ``add_preserved_filters`` of a row's change link without its ``resolve``.

    Django resolves every row's URL to learn whether it is the list itself (whose own filters it then
    unwraps): about a tenth of a 100-row list page. A change view's URL never is; any other goes to
    Django's function.
    """
    path, _, query = url.partition("?")
    filters = context.get("preserved_filters")
    if (not filters or popup or to_field or context.get("preserved_qsl") or not context.get("opts")
            or not path.endswith("/change/") or "#" in url):
        return _django_add_preserved_filters(context, url, popup=popup, to_field=to_field)
    merged = urlencode({**dict(parse_qsl(filters)), **dict(parse_qsl(query))})
    return f"{path}?{merged}" if merged else path


def show_times_one_way() -> None:
    """Make Django's own date columns (every changelist, every read-only field, Django's own models too) use
    :func:`display_for_field`: Django formats them in its locale's way in exactly these two places."""
    # Both modules import Django's function by name; their stubs do not declare it.
    admin_list.display_for_field = display_for_field  # type: ignore[attr-defined]
    helpers.display_for_field = display_for_field  # type: ignore[attr-defined]
    # And the row links keep the list's filters without resolving each row's URL (same URLs).
    admin_list.add_preserved_filters = add_preserved_filters  # type: ignore[attr-defined]


def status_pill(status: str, *, extra: str = "", label: str | None = None) -> str:
    """Render a status as a coloured pill (colours in ``admin/accs/_styles.html``), ``label`` as its text."""
    return format_html('<span class="accs-pill accs-{}">{}</span>{}', status, status if label is None else label, extra)


def safe_next(request: HttpRequest, fallback: str) -> str:
    """Return the ``next`` URL when it points back into this site, else ``fallback``."""
    target = request.POST.get("next") or request.GET.get("next") or ""
    if target and url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                                  require_https=request.is_secure()):
        return target
    return fallback


#: An action table: name → (verb, transition called as ``fn(pk, by=operator)``).
ActionTable = dict[str, tuple[str, Callable[..., ActionResult]]]

#: Actions that stop work or refuse it for good: they ask for a confirmation first.
DESTRUCTIVE = frozenset({"cancel", "reject"})

CONFIRM_TEMPLATE = "admin/accs/confirm_action.html"


def confirm_page(request: HttpRequest, modeladmin: admin.ModelAdmin, *, verb: str, objects: list[Any],
                 hidden: list[tuple[str, str]], options: tuple[str, ...] = (), note: str = "") -> HttpResponse:
    """Ask before a destructive action: what it does to which objects, then POST again with ``confirm``.

    ``hidden`` carries the original request's fields (the action, the selection, ``next``) so
    the confirmed POST repeats it; ``options`` are text fields handed to the action (a reason).
    """
    subjects = [subject_of(modeladmin, obj) for obj in objects]
    context = {
        **modeladmin.admin_site.each_context(request), "opts": modeladmin.opts, "verb": verb,
        "title": f"{verb} {subjects[0]}?" if len(subjects) == 1 else (
            f"{verb} {len(subjects)} {modeladmin.opts.verbose_name_plural}?"),
        "subjects": subjects, "hidden": hidden, "options": options, "note": note,
        "back_url": safe_next(request, _same_site(request, request.META.get("HTTP_REFERER") or "")),
    }
    return TemplateResponse(request, CONFIRM_TEMPLATE, context)


def _same_site(request: HttpRequest, url: str) -> str:
    """Return ``url`` when it points into this site, else an empty string."""
    ok = url_has_allowed_host_and_scheme(url, allowed_hosts={request.get_host()}, require_https=request.is_secure())
    return url if ok else ""


def _options(request: HttpRequest, names: tuple[str, ...]) -> dict[str, str]:
    return {name: request.POST.get(name, "").strip() for name in names}


#: Verbs that act on a batch of ids in one transaction (their rows locked in the engine's lock order),
#: for an action over a whole filtered list: name → ``fn(ids, by=operator)`` → {id: ActionResult}.
BatchTable = dict[str, Callable[..., dict[Any, ActionResult]]]


def filtered_keys(queryset: QuerySet, *, limit: int, batch: int) -> Iterator[list[Any]]:
    """Yield the primary keys of ``queryset`` in ascending order, ``batch`` at a time, ``limit`` in all.

    Keyset pagination: each query starts after the last key read, so a batch costs its own size.
    """
    keys = queryset.order_by("pk").values_list("pk", flat=True)
    taken, last = 0, None
    while taken < limit:
        page = list((keys if last is None else keys.filter(pk__gt=last))[:min(batch, limit - taken)])
        if not page:
            return
        yield page
        taken += len(page)
        last = page[-1]


def confirm_filter_page(request: HttpRequest, modeladmin: admin.ModelAdmin, *, verb: str, noun: str,
                        queryset: QuerySet, options: tuple[str, ...], note: str) -> HttpResponse:
    """Ask before an action over the whole filtered list, naming how many rows it matches (counted up to
    :data:`MAX_FILTER_BULK`, the most one click acts on)."""
    matched = queryset.order_by()[:MAX_FILTER_BULK + 1].count()
    over = matched > MAX_FILTER_BULK
    count = f"more than {MAX_FILTER_BULK:,}" if over else f"{matched:,}"
    hidden = [("action", request.POST.get("action", "")), ("select_across", "1"), ("index", "0")]
    # The admin runs an action only with a row ticked, even over every row; one of the list's stands for them.
    hidden += [(helpers.ACTION_CHECKBOX_NAME, str(pk)) for pk in queryset.order_by().values_list("pk", flat=True)[:1]]
    context = {
        **modeladmin.admin_site.each_context(request), "opts": modeladmin.opts, "verb": verb,
        "title": f"{verb} all {count} {noun} matching the list's filter?", "subjects": [], "hidden": hidden,
        "options": options, "filter_bulk": True, "filter_count": matched, "filter_over": over,
        "filter_cap": MAX_FILTER_BULK, "filter_query": request.GET.urlencode(),
        "note": " ".join(x for x in (note, f"Only the first {MAX_FILTER_BULK:,} (oldest first) are done by this click; "
                                           "run the action again for the rest." if over else "") if x),
        "back_url": safe_next(request, _same_site(request, request.META.get("HTTP_REFERER") or "")),
    }
    return TemplateResponse(request, CONFIRM_TEMPLATE, context)


def act_on_filter(request: HttpRequest, modeladmin: TenantScopedAdmin, queryset: QuerySet, *, verb: str, noun: str,
                  fn: Callable[[Any], ActionResult], batch_fn: Callable[[list[Any]], dict[Any, ActionResult]] | None,
                  ) -> None:
    """Run an action on every row of the filtered list the user may act on, in batches of :data:`FILTER_BATCH`.

    A verb with a batch form (``batch_fn``) takes each batch in one transaction, locking its job
    rows, then its task rows, each sorted by id (:mod:`jobs.locks`); the others run per row, each in
    its own transaction. One admin log entry per click names the verb, the count and the filter.
    """
    allowed = scope(queryset, request.user, write=True, field=modeladmin.tenant_path)
    denied = queryset.order_by()[:MAX_FILTER_BULK + 1].count() - allowed.order_by()[:MAX_FILTER_BULK + 1].count()
    results: list[ActionResult] = []
    batches, last = 0, None
    for keys in filtered_keys(allowed, limit=MAX_FILTER_BULK, batch=FILTER_BATCH):
        outcome = batch_fn(keys) if batch_fn is not None else {key: fn(key) for key in keys}
        results += [outcome.get(key) or ActionResult(False, "no longer there") for key in keys]
        batches, last = batches + 1, keys[-1]
    capped = len(results) >= MAX_FILTER_BULK and allowed.filter(pk__gt=last).exists()
    report(request, modeladmin, f"{verb} (every {modeladmin.opts.verbose_name} matching the filter)", results,
           denied=max(denied, 0), capped=capped, cap=MAX_FILTER_BULK)
    changed = sum(r.changed for r in results)
    if changed:
        log_bulk(request, modeladmin.model, f"{verb}: {changed} of {len(results)} {noun} matching the filter "
                                            f"({request.GET.urlencode() or 'no filter'}), {batches} batch(es)")


def bulk_actions(table: ActionTable, noun: str, *, confirm: frozenset[str] = DESTRUCTIVE,
                 batched: BatchTable | None = None) -> tuple[Callable, ...]:
    """Build the list page's bulk actions from the same table as the page buttons.

    Each becomes ``<name>_<noun>`` ("retry_jobs"), needs the act permission, and runs its
    transition on every selected object the user may act on (:meth:`TenantScopedAdmin.act_on`).
    Those named in ``confirm`` first show :func:`confirm_page` for the selection.

    Over the whole filtered list (the admin's "Select all N"), every action first shows how many rows
    the filter matches and asks (:func:`confirm_filter_page`), then runs over them in batches
    (:func:`act_on_filter`), through the verb's batch form in ``batched`` when it has one.
    """
    built = []
    for name, (verb, fn) in table.items():
        def action(modeladmin, request, queryset, verb=verb, fn=fn, name=name):
            options = getattr(modeladmin, "page_action_options", {}).get(name, ())
            note = getattr(modeladmin, "confirm_notes", {}).get(name, "")
            if request.POST.get("select_across") == "1":
                if "confirm" not in request.POST:
                    return confirm_filter_page(request, modeladmin, verb=verb, noun=noun, queryset=queryset,
                                               options=options, note=note)
                extra = _options(request, options)
                by = actor(request)
                many = (batched or {}).get(name)
                act_on_filter(request, modeladmin, queryset, verb=verb, noun=noun,
                              fn=lambda key: fn(key, by=by, **extra),
                              batch_fn=(lambda keys: many(keys, by=by, **extra)) if many else None)
                return None
            if name in confirm and "confirm" not in request.POST:
                objects = list(queryset.order_by()[:MAX_BULK])
                hidden = [("action", request.POST.get("action", "")), ("select_across", "0"), ("index", "0")]
                hidden += [(helpers.ACTION_CHECKBOX_NAME, str(obj.pk)) for obj in objects]
                return confirm_page(request, modeladmin, verb=verb, objects=objects, hidden=hidden, options=options,
                                    note=note)
            extra = _options(request, options)
            modeladmin.act_on(request, queryset, verb, lambda obj: fn(obj.pk, by=actor(request), **extra))
            return None

        action.__name__ = f"{name}_{noun}"
        built.append(admin.action(description=f"{verb}: the selected {noun}", permissions=["act"])(action))
    return tuple(built)


if TYPE_CHECKING:
    # The mixin only ever sits before a ModelAdmin; mypy checks it as one.
    _MixinBase = admin.ModelAdmin[Any]
else:
    _MixinBase = object


class PageActionsMixin(_MixinBase):
    """Run one action from a button on an object's page (POST ``<id>/act/<action>/``), then go back.

    Subclasses name their actions (``page_actions``, an :data:`ActionTable`; :func:`bulk_actions`
    builds the list's actions from the same table) and where to return (``after_action_url``);
    the URL is ``admin:<app>_<model>_act``. Actions in ``confirm_actions`` answer the first POST
    with a confirmation page (``confirm_notes`` says what they do); ``page_action_options`` names
    text fields an action takes (``{"reject": ("reason",)}``).
    """

    page_actions: ActionTable = {}
    confirm_actions: frozenset[str] = DESTRUCTIVE
    confirm_notes: dict[str, str] = {}
    page_action_options: dict[str, tuple[str, ...]] = {}

    def after_action_url(self, request: HttpRequest, obj: Any) -> str:
        raise NotImplementedError

    if TYPE_CHECKING:
        def has_act_permission(self, request: HttpRequest, obj: Any = None) -> bool: ...

        def _get_obj_does_not_exist_redirect(self, request: HttpRequest, opts: Any,
                                             object_id: str) -> HttpResponse: ...

    def get_urls(self):
        name = f"{self.opts.app_label}_{self.opts.model_name}_act"
        return [
            path("<path:object_id>/act/<str:action>/", self.admin_site.admin_view(self.act_view), name=name),
        ] + super().get_urls()

    def act_view(self, request: HttpRequest, object_id: str, action: str) -> HttpResponse:
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        obj = self.get_object(request, object_id)
        if obj is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if action not in self.page_actions or not self.has_act_permission(request, obj):
            raise PermissionDenied
        verb, fn = self.page_actions[action]
        options = self.page_action_options.get(action, ())
        if action in self.confirm_actions and "confirm" not in request.POST:
            hidden = [("next", request.POST["next"])] if request.POST.get("next") else []
            return confirm_page(request, self, verb=verb, objects=[obj], hidden=hidden, options=options,
                                note=self.confirm_notes.get(action, ""))
        extra = _options(request, options)
        perform(request, self, verb, [obj], lambda o: fn(o.pk, by=actor(request), **extra))
        return HttpResponseRedirect(self.after_action_url(request, obj))


class PageActionsAdmin(PageActionsMixin, ReadOnlyScopedAdmin):
    """A tenant-scoped, read-only admin whose objects change through page buttons and bulk actions."""
