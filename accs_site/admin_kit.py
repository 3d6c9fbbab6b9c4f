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

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone as dt_timezone
from functools import cached_property
from typing import TYPE_CHECKING, Any
from uuid import UUID

from django.contrib import admin, messages
from django.contrib.admin import ShowFacets, helpers
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import DurationField, ExpressionWrapper, F, QuerySet
from django.db.models.functions import Coalesce, Now
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path
from django.utils.html import format_html
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.safestring import mark_safe

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
#: An action over "all N selected" acts on at most this many objects per click.
MAX_BULK = 1_000


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
           subjects: list[str] | None = None) -> None:
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
        parts.append(f"stopped after {MAX_BULK}; run the action again for the rest")
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


class TenantScopedAdmin(admin.ModelAdmin):
    """Admin for a tenant-owned model: lists, pages and actions follow :mod:`tenants.scoping`.

    Members of a tenant (non-superuser staff with a TenantMembership) may view these models
    without Django model permissions; acting needs the tenant-admin role. Superusers see all.
    """

    tenant_path = "tenant_id"
    #: JSON fields holding params: their page shows them through :func:`accs_site.redaction.redact_params`.
    redacted_fields: tuple[str, ...] = ()
    show_full_result_count = False  # no exact COUNT(*) of the unfiltered table
    show_facets = ShowFacets.NEVER  # facet counts are one COUNT per filter option
    paginator = EstimatedCountPaginator

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


def bulk_actions(table: ActionTable, noun: str, *, confirm: frozenset[str] = DESTRUCTIVE) -> tuple[Callable, ...]:
    """Build the list page's bulk actions from the same table as the page buttons.

    Each becomes ``<name>_<noun>`` ("retry_jobs"), needs the act permission, and runs its
    transition on every selected object the user may act on (:meth:`TenantScopedAdmin.act_on`).
    Those named in ``confirm`` first show :func:`confirm_page` for the selection.
    """
    built = []
    for name, (verb, fn) in table.items():
        def action(modeladmin, request, queryset, verb=verb, fn=fn, name=name):
            options = getattr(modeladmin, "page_action_options", {}).get(name, ())
            if name in confirm and "confirm" not in request.POST:
                objects = list(queryset.order_by()[:MAX_BULK])
                hidden = [("action", request.POST.get("action", "")), ("select_across", "0"), ("index", "0")]
                hidden += [(helpers.ACTION_CHECKBOX_NAME, str(obj.pk)) for obj in objects]
                return confirm_page(request, modeladmin, verb=verb, objects=objects, hidden=hidden, options=options,
                                    note=getattr(modeladmin, "confirm_notes", {}).get(name, ""))
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
