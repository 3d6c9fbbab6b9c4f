"""Admin for services, workflows and governor conditions, and the tenants' pause.

Saving a service or workflow runs the full validation (``Model.clean`` → :mod:`workflows.validation`)
and shows each problem next to the field it is about. Governor conditions are raised and cleared
through :mod:`workflows.governor` (actions, and the add form, which raises a new condition), never
by editing their timestamps. Pausing a tenant is raising its governor condition, so the tenants'
list gets its pause and resume actions here (:class:`TenantPauseAdmin`, registered over
:class:`tenants.admin.TenantAdmin`).
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import connection
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse, QueryDict
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import mark_safe

from accs_site.admin_kit import ActionResult, actor, perform
from tenants.admin import TenantAdmin
from tenants.models import Tenant
from workflows import governor
from workflows.api import next_version, redacted_steps, steps_frozen_reason, steps_keeping_secrets
from workflows.dag import render_svg, steps_from
from workflows.diff import steps_diff
from workflows.models import GovernorCondition, Service, Workflow
from workflows.validation import DefinitionError


class ProblemsByFieldForm(forms.ModelForm):
    """Show each validation problem under the field it names.

    :class:`workflows.validation.Problem` renders as ``"<where>: <message>"`` with ``where`` such as
    ``executor_config.argv`` or ``cpu_weight``; ``Model.full_clean`` hands them over as plain
    messages, so they are routed by that prefix. Anything that names no field of the form stays a
    form-wide error.
    """

    def _field_for(self, message: str) -> str | None:
        where, sep, _rest = message.partition(": ")
        if not sep:
            return None
        head = where.split(".")[0].split(" ")[0].split("[")[0]
        return head if head in self.fields else None

    def _update_errors(self, errors: ValidationError) -> None:
        if not hasattr(errors, "error_dict"):
            errors = ValidationError({NON_FIELD_ERRORS: errors.messages})
        routed: dict[str, list[str]] = {}
        for name, messages_ in errors.message_dict.items():
            for message in messages_:
                target = self._field_for(message) if name == NON_FIELD_ERRORS else name
                routed.setdefault(target or NON_FIELD_ERRORS, []).append(message)
        # ModelForm's own hook for the model's validation errors: django-stubs do not declare it.
        super()._update_errors(ValidationError(routed))  # type: ignore[misc]


class ServiceForm(ProblemsByFieldForm):
    class Meta:
        model = Service
        fields = "__all__"
        widgets = {
            "executor_config": forms.Textarea(attrs={"rows": 4, "cols": 90, "style": "font-family: monospace"}),
            "params_schema": forms.Textarea(attrs={"rows": 8, "cols": 90, "style": "font-family: monospace"}),
        }


class DefinitionAdmin(admin.ModelAdmin):
    """Services and workflows decide what code agents run: only superusers add, change or delete them,
    as the HTTP API requires (a model permission given to a staff user is not enough).

    A definition stored by ``manage.py accs_sync`` (``defined_in`` set) is read-only here: its code is
    where it changes, and the next sync would undo an edit made in the admin.
    """

    def has_add_permission(self, request: HttpRequest) -> bool:
        return request.user.is_active and request.user.is_superuser

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return request.user.is_active and request.user.is_superuser and not _in_code(obj)

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return request.user.is_active and request.user.is_superuser and not _in_code(obj)

    @admin.display(description="defined")
    def origin(self, obj: Service | Workflow) -> str:
        return f"in code: {obj.defined_in}" if obj.defined_in else "in the admin"


def _in_code(obj: Model | None) -> bool:
    return bool(getattr(obj, "defined_in", ""))


@admin.register(Service)
class ServiceAdmin(DefinitionAdmin):
    form = ServiceForm
    list_display = ("key", "executor", "is_active", "max_concurrent", "cpu_weight", "base_priority",
                    "requires_approval", "exclusive_per_host", "timeout_seconds", "max_attempts", "origin")
    list_filter = ("executor", "is_active", "requires_approval", "exclusive_per_host")
    search_fields = ("key", "description")
    readonly_fields = ("origin",)
    actions = ("pause_services", "resume_services")
    fieldsets = (
        (None, {"fields": ("key", "description", "origin", "is_active", "executor", "executor_config",
                           "params_schema")}),
        ("Retries and limits", {"fields": ("timeout_seconds", "max_attempts", "backoff_base_seconds",
                                           "backoff_cap_seconds", "lease_seconds", "cpu_weight", "max_concurrent",
                                           "base_priority")}),
        ("Safety", {"fields": ("requires_approval", "exclusive_per_host", "quarantine_host_on_final_failure",
                               "required_labels")}),
        ("Resource governor", {"fields": ("block_during", "priority_adjust_during")}),
        ("Flow control", {"fields": ("rate_limit", "rate_period_seconds", "rate_key", "rate_key_limit",
                                     "concurrency_key", "concurrency_key_limit"),
                          "description": "Enforced by every agent's claim across the fleet. A key is the value at a"
                                         " dotted path in the task's params (e.g. customer_id); tasks whose params"
                                         " lack it share one key."}),
    )


    def get_list_display(self, request: HttpRequest) -> tuple[str, ...]:
        return ("key", "pause", *self.list_display[1:])

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # The pauses that hold, read once for the page (a handful of rows), not once per service.
        self._pauses = {governor.paused_service_key(c.name): c for c in GovernorCondition.objects.filter(
            name__startswith=governor.PAUSE_PREFIX) if c.holds()}
        return super().changelist_view(request, extra_context)

    @admin.display(description="paused")
    def pause(self, obj: Service) -> str:
        """Who paused the service, when and why, or a dash."""
        c = getattr(self, "_pauses", {}).get(obj.key)
        if c is None:
            return "—"
        return format_html('<span class="accs-pill accs-paused" title="{}">paused</span> by {} {}', c.reason,
                           c.raised_by or "api", f"{timezone.localtime(c.raised_at):%Y-%m-%d %H:%M}"
                           if c.raised_at else "")

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Pausing is raising a governor condition: who may raise conditions may pause."""
        return request.user.has_perm("workflows.change_governorcondition")

    @admin.action(description="Pause selected services…", permissions=["operate"])
    def pause_services(self, request: HttpRequest, queryset: QuerySet[Service]) -> TemplateResponse | None:
        """Ask why and for how long, then pause each selected service (no agent claims its tasks)."""
        form = RaiseConditionForm(request.POST if "apply" in request.POST else None)
        if "apply" in request.POST and form.is_valid():
            expires = _expires_at(form)
            perform(request, self, "Pause", list(queryset), lambda s: _pause(
                s.key, reason=form.cleaned_data["reason"], expires_at=expires, by=actor(request)))
            return None
        return _reason_page(self, request, form, queryset, title="Pause services", action="pause_services",
                            submit="Pause", what="no agent claims their queued tasks while paused (running tasks "
                                                 "finish); the dashboard and /metrics show the pause")

    @admin.action(description="Resume selected services", permissions=["operate"])
    def resume_services(self, request: HttpRequest, queryset: QuerySet[Service]) -> None:
        perform(request, self, "Resume", list(queryset), lambda s: _resume(s.key, by=actor(request)))

    def action_subject(self, obj: Service) -> str:
        return obj.key


def _expires_at(form: forms.Form) -> datetime | None:
    """When a pause or a raised condition set from a reason page ends: its minutes from now, or never."""
    minutes = form.cleaned_data["minutes"]
    return timezone.now() + timedelta(minutes=minutes) if minutes else None


#: The fields a version that jobs use keeps: jobs name the version, and it names the steps they ran.
FROZEN_WHEN_USED = ("name", "version", "steps")


#: The last step key typed before a place in the steps' text, to name the step a JSON error is in.
STEP_KEY = re.compile(r'"key"\s*:\s*"((?:[^"\\]|\\.)*)"')


def json_error_where(text: str, exc: json.JSONDecodeError) -> str:
    """Say where typed JSON is broken: line, column and the step being written there, if any."""
    keys = STEP_KEY.findall(text[:exc.pos])
    step = f" (in or just after step {keys[-1]!r})" if keys else ""
    return f"not valid JSON at line {exc.lineno}, column {exc.colno}{step}: {exc.msg}"


class IndentedJSONField(forms.JSONField):
    """A JSON field shown indented, one step per block, instead of one long line; text that is not
    JSON is refused naming the line, column and step where it breaks."""

    def to_python(self, value: Any) -> Any:
        if isinstance(value, str) and value.strip() and not self.disabled:
            try:
                json.loads(value, cls=self.decoder)
            except json.JSONDecodeError as exc:
                raise ValidationError(json_error_where(value, exc), code="invalid") from None
        return super().to_python(value)

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, forms.fields.InvalidJSONInput):
            return value  # what the operator typed, to correct it
        return json.dumps(value, ensure_ascii=False, indent=2, cls=self.encoder)


class WorkflowForm(ProblemsByFieldForm):
    """Refuse to change the steps, name or version of a version that jobs use (as the HTTP API does)."""

    #: Set by :meth:`clean` when the edit was refused because jobs use the version.
    frozen_reason: str | None = None
    #: The refused edit's steps (a refused field leaves ``cleaned_data``, so they are kept here for the diff).
    refused_steps: Any = None

    class Meta:
        model = Workflow
        fields = "__all__"
        field_classes = {"steps": IndentedJSONField}
        widgets = {"steps": forms.Textarea(attrs={"rows": 24, "cols": 100, "style": "font-family: monospace"})}

    def _update_errors(self, errors: ValidationError) -> None:
        if "steps" in self.errors and hasattr(errors, "error_dict"):  # the errors found so far (no new cleaning)
            # Steps that are not JSON were refused already; "no steps" after that says nothing new.
            kept = {name: [m for m in msgs if not m.startswith("steps:")] for name, msgs in errors.message_dict.items()}
            kept = {name: msgs for name, msgs in kept.items() if msgs}
            if not kept:
                return
            errors = ValidationError(kept)
        super()._update_errors(errors)

    def clean(self) -> dict[str, Any]:
        super().clean()  # a ModelForm's returns its cleaned_data
        data = self.cleaned_data
        if self.instance._state.adding:  # a new version (ids are set before the first save)
            if "steps" in data and data.get("name"):
                # The page showed secret default params as ***; the new version keeps the latest's.
                data["steps"] = steps_keeping_secrets(data["steps"], name=data["name"])
            return data
        rows = Workflow.objects.all()
        if connection.in_atomic_block:  # the admin's save runs in one; see steps_frozen_reason
            rows = rows.select_for_update()
        stored = rows.get(pk=self.instance.pk)
        if "steps" in data:
            data["steps"] = steps_keeping_secrets(data["steps"], name=stored.name, stored=stored.steps)
        changed = [name for name in FROZEN_WHEN_USED if name in data and data[name] != getattr(stored, name)]
        reason = steps_frozen_reason(stored) if changed else None
        if reason:
            self.frozen_reason, self.refused_steps = reason, data.get("steps", stored.steps)
            for name in changed:
                self.add_error(name, f"{reason}, so its {name} cannot change in place; "
                                     "use \"Save as a new version\" to keep this edit as the next version")
        return data


@admin.register(Workflow)
class WorkflowAdmin(DefinitionAdmin):
    """Workflow versions: a version that jobs use keeps its steps; an edit becomes the next version.

    "Save as a new version" (Django's save-as) stores the form as the next free version number
    when the one in the form is taken. The page shows the steps' changes against the previous
    version, and, when an edit is refused, the edit's changes against the stored version.
    """

    form = WorkflowForm
    save_as = True
    list_display = ("name", "version", "is_active", "max_active_jobs", "step_count", "origin", "updated_at")
    list_filter = ("is_active",)
    search_fields = ("name", "description")
    readonly_fields = ("picture", "origin")
    fields = ("name", "version", "description", "origin", "is_active", "max_active_jobs", "steps", "picture")
    change_form_template = "admin/workflows/workflow/change_form.html"

    def changeform_view(self, request: HttpRequest, object_id: str | None = None, form_url: str = "",
                        extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if request.method == "POST" and "_saveasnew" in request.POST:
            # The admin reads the form from request.POST; the stubs type it immutable, the copy is not.
            request.POST = self._as_next_version(request.POST)  # type: ignore[assignment]
        response = super().changeform_view(request, object_id, form_url, extra_context)
        form = getattr(getattr(response, "context_data", {}).get("adminform"), "form", None)
        if form is not None and form.frozen_reason:
            response.status_code = 409  # the same answer as PATCH /workflows/{name}/{version}
        return response

    @staticmethod
    def _as_next_version(post: QueryDict) -> QueryDict:
        """Give the posted version the next free number when the posted one exists already."""
        name, version = post.get("name", ""), post.get("version", "")
        if name and Workflow.objects.filter(name=name, version=int(version) if version.isdigit() else 0).exists():
            post = post.copy()
            post["version"] = str(next_version(name))
        return post

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        """The version a page shows, its secret-named default params ``***`` (the form puts them back)."""
        obj = super().get_object(request, object_id, from_field)
        if obj is not None:
            obj.steps = redacted_steps(obj.steps)
        return obj

    def render_change_form(self, request: HttpRequest, context: dict[str, Any], add: bool = False, change: bool = False,
                           form_url: str = "", obj: Workflow | None = None) -> HttpResponse:
        if obj is not None and not obj._state.adding:
            context.update(self._version_context(obj, context["adminform"].form))
        return super().render_change_form(request, context, add, change, form_url, obj)

    def _version_context(self, obj: Workflow, form: WorkflowForm) -> dict[str, Any]:
        """The stored version, its predecessor and the step changes the page shows."""
        stored = Workflow.objects.get(pk=obj.pk)  # obj carries the posted values after a refused edit
        previous = (Workflow.objects.filter(name=stored.name, version__lt=stored.version)
                    .order_by("-version").first())
        context: dict[str, Any] = {
            "stored_version": stored, "previous_version": previous,
            "jobs_use_version": steps_frozen_reason(stored) is not None,
            "diff_previous": (steps_diff(redacted_steps(previous.steps), redacted_steps(stored.steps))
                              if previous else None),
        }
        if form.is_bound and form.frozen_reason:
            context["diff_edit"] = steps_diff(redacted_steps(stored.steps), redacted_steps(form.refused_steps))
        return context

    @admin.display(description="steps")
    def step_count(self, obj: Workflow) -> int:
        return len(obj.steps or [])

    @admin.display(description="DAG")
    def picture(self, obj: Workflow) -> str:
        if not obj.pk:
            return "(shown once saved)"
        svg = render_svg(steps_from(obj.steps or [], []), title=str(obj))
        return format_html('<div class="accs-dag-wrap">{}</div>', mark_safe(svg))  # noqa: S308 - render_svg escapes


# --------------------------------------------------------------------------------------------
# Governor conditions
# --------------------------------------------------------------------------------------------

class RaiseConditionForm(forms.Form):
    """What an operator gives when raising conditions: why, and for how long."""

    reason = forms.CharField(max_length=500, required=True)
    minutes = forms.IntegerField(min_value=1, required=False, help_text="Empty: holds until cleared.")


class AddConditionForm(forms.ModelForm):
    """Adding a condition raises it (through the governor), so its name, reason and expiry are asked."""

    class Meta:
        model = GovernorCondition
        fields = ("name", "reason", "expires_at")

    def clean_expires_at(self) -> datetime | None:
        expires = self.cleaned_data.get("expires_at")
        if expires is not None and expires <= timezone.now():
            raise ValidationError("must be in the future (leave empty to hold until cleared)")
        return expires


def _raise(name: str, *, reason: str, expires_at: datetime | None, by: str) -> ActionResult:
    try:
        governor.raise_condition(name, reason=reason, expires_at=expires_at, by=by)
    except DefinitionError as exc:
        return ActionResult(False, "; ".join(str(p) for p in exc.problems))
    until = f"until {timezone.localtime(expires_at):%Y-%m-%d %H:%M}" if expires_at else "until cleared"
    return ActionResult(True, f"{name} raised {until}")


def _pause(key: str, *, reason: str, expires_at: datetime | None, by: str) -> ActionResult:
    try:
        governor.pause_service(key, reason=reason, expires_at=expires_at, by=by)
    except DefinitionError as exc:
        return ActionResult(False, "; ".join(str(p) for p in exc.problems))
    until = f"until {timezone.localtime(expires_at):%Y-%m-%d %H:%M}" if expires_at else "until resumed"
    return ActionResult(True, f"{key} paused {until}: {reason}")


def _resume(key: str, *, by: str) -> ActionResult:
    try:
        resumed = governor.resume_service(key, by=by)
    except DefinitionError as exc:
        return ActionResult(False, "; ".join(str(p) for p in exc.problems))
    return ActionResult(True, f"{key} resumed") if resumed else ActionResult(False, f"{key} is not paused")


def _pause_tenant(tenant: Tenant, *, reason: str, expires_at: datetime | None, by: str) -> ActionResult:
    try:
        governor.pause_tenant(tenant, reason=reason, expires_at=expires_at, by=by)
    except DefinitionError as exc:
        return ActionResult(False, "; ".join(str(p) for p in exc.problems))
    until = f"until {timezone.localtime(expires_at):%Y-%m-%d %H:%M}" if expires_at else "until resumed"
    return ActionResult(True, f"tenant {tenant.slug} paused {until}: {reason}")


def _resume_tenant(tenant: Tenant, *, by: str) -> ActionResult:
    if governor.resume_tenant(tenant, by=by):
        return ActionResult(True, f"tenant {tenant.slug} resumed")
    return ActionResult(False, f"tenant {tenant.slug} is not paused")


def _reason_page(modeladmin: admin.ModelAdmin, request: HttpRequest, form: forms.Form, queryset: QuerySet[Any], *,
                 title: str, action: str, submit: str, what: str) -> TemplateResponse:
    """The intermediate page of an action that asks a reason and a duration (raise conditions, pause services)."""
    context: dict[str, Any] = {
        **modeladmin.admin_site.each_context(request), "title": title, "form": form, "objects": queryset,
        "opts": modeladmin.opts, "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME, "action": action,
        "submit": submit, "what": what,
        "list_url": reverse(f"admin:{modeladmin.opts.app_label}_{modeladmin.opts.model_name}_changelist"),
    }
    return TemplateResponse(request, "admin/accs/raise_conditions.html", context)


def _clear(name: str, *, by: str) -> ActionResult:
    if governor.clear_condition(name, by):
        return ActionResult(True, f"{name} cleared")
    return ActionResult(False, f"{name} does not hold")


@admin.register(GovernorCondition)
class GovernorConditionAdmin(admin.ModelAdmin):
    list_display = ("name", "holding", "raised_at", "expires_at", "cleared_at", "raised_by", "reason")
    search_fields = ("name", "reason")
    actions = ("raise_conditions", "clear_conditions")

    def get_form(self, request: HttpRequest, obj: GovernorCondition | None = None, change: bool = False,
                 **kwargs: Any) -> type[forms.ModelForm]:
        if obj is None:
            kwargs["form"] = AddConditionForm
        return super().get_form(request, obj, change=change, **kwargs)

    def get_fields(self, request: HttpRequest, obj: GovernorCondition | None = None) -> tuple[str, ...]:
        if obj is None:
            return ("name", "reason", "expires_at")
        return ("name", "holding", "reason", "raised_at", "expires_at", "cleared_at", "raised_by")

    def get_readonly_fields(self, request: HttpRequest, obj: GovernorCondition | None = None) -> tuple[str, ...]:
        return () if obj is None else self.get_fields(request, obj)

    def has_change_permission(self, request: HttpRequest, obj: GovernorCondition | None = None) -> bool:
        return False  # state: raise and clear with the actions

    def has_operate_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("workflows.change_governorcondition")

    @admin.display(description="holds", boolean=True)
    def holding(self, obj: GovernorCondition) -> bool:
        return obj.holds()

    def save_model(self, request: HttpRequest, obj: GovernorCondition, form: forms.ModelForm, change: bool) -> None:
        """Raise the new condition through the governor (it writes the row and its event)."""
        raised = governor.raise_condition(obj.name, reason=obj.reason, expires_at=obj.expires_at, by=actor(request))
        obj.pk = raised.pk
        obj.raised_at, obj.raised_by = raised.raised_at, raised.raised_by

    @admin.action(description="Raise selected conditions…", permissions=["operate"])
    def raise_conditions(self, request: HttpRequest,
                         queryset: QuerySet[GovernorCondition]) -> TemplateResponse | None:
        """Ask for a reason and a duration, then raise each selected condition."""
        form = RaiseConditionForm(request.POST if "apply" in request.POST else None)
        if "apply" in request.POST and form.is_valid():
            expires = _expires_at(form)
            perform(request, self, "Raise", list(queryset), lambda c: _raise(
                c.name, reason=form.cleaned_data["reason"], expires_at=expires, by=actor(request)))
            return None
        return _reason_page(self, request, form, queryset, title="Raise governor conditions",
                            action="raise_conditions", submit="Raise",
                            what="services that name them in block_during are not claimed while they hold, and "
                                 "priority_adjust_during applies")

    @admin.action(description="Clear selected conditions", permissions=["operate"])
    def clear_conditions(self, request: HttpRequest, queryset: QuerySet[GovernorCondition]) -> None:
        perform(request, self, "Clear", list(queryset), lambda c: _clear(c.name, by=actor(request)))

    def action_subject(self, obj: GovernorCondition) -> str:
        return obj.name


class TenantPauseAdmin(TenantAdmin):
    """The tenants' list with a *paused* column and the pause and resume actions.

    Who may pause a tenant may change it: the ``tenants.change_tenant`` permission and, unless a
    superuser, the admin role in that very tenant (:meth:`TenantAdmin.has_change_permission`),
    checked for each selected tenant, so an operator of one tenant cannot pause another even with
    a forged selection.
    """

    actions = ("pause_tenants", "resume_tenants")

    def get_list_display(self, request: HttpRequest) -> tuple[str, ...]:
        return ("slug", "pause", *self.list_display[1:])

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # The pauses that hold, read once for the page (a handful of rows), not once per tenant.
        self._pauses = {governor.paused_tenant_id(c.name): c for c in GovernorCondition.objects.filter(
            name__startswith=governor.TENANT_PAUSE_PREFIX) if c.holds()}
        return super().changelist_view(request, extra_context)

    @admin.display(description="paused")
    def pause(self, obj: Tenant) -> str:
        """Who paused the tenant, when, until when and why, or a dash."""
        c = getattr(self, "_pauses", {}).get(obj.pk)
        if c is None:
            return "—"
        until = f"until {timezone.localtime(c.expires_at):%Y-%m-%d %H:%M}" if c.expires_at else "until resumed"
        return format_html('<span class="accs-pill accs-paused" title="{}">paused</span> by {} {}, {}: {}', c.reason,
                           c.raised_by or "api", f"{timezone.localtime(c.raised_at):%Y-%m-%d %H:%M}"
                           if c.raised_at else "", until, c.reason)

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """The actions show to whoever may change tenants; each tenant is checked again when acted on."""
        return request.user.is_active and request.user.has_perm("tenants.change_tenant")

    def _may_pause(self, request: HttpRequest, tenant: Tenant) -> ActionResult | None:
        """Refuse a tenant the user may not change (a viewer, or an admin of another tenant)."""
        if self.has_change_permission(request, tenant):
            return None
        return ActionResult(False, "you may pause and resume only tenants you are an admin of")

    @admin.action(description="Pause selected tenants…", permissions=["operate"])
    def pause_tenants(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> TemplateResponse | None:
        """Ask why and for how long, then pause each selected tenant (no agent claims its tasks)."""
        form = RaiseConditionForm(request.POST if "apply" in request.POST else None)
        if "apply" in request.POST and form.is_valid():
            expires = _expires_at(form)
            perform(request, self, "Pause", list(queryset), lambda t: self._may_pause(request, t) or _pause_tenant(
                t, reason=form.cleaned_data["reason"], expires_at=expires, by=actor(request)))
            return None
        return _reason_page(self, request, form, queryset, title="Pause tenants", action="pause_tenants",
                            submit="Pause", what="no agent claims their queued tasks, of any service, while "
                                                 "paused (running tasks finish); the dashboard and /metrics show "
                                                 "the pause")

    @admin.action(description="Resume selected tenants", permissions=["operate"])
    def resume_tenants(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        perform(request, self, "Resume", list(queryset),
                lambda t: self._may_pause(request, t) or _resume_tenant(t, by=actor(request)))

    def action_subject(self, obj: Tenant) -> str:
        return f"tenant {obj.slug}"


admin.site.unregister(Tenant)
admin.site.register(Tenant, TenantPauseAdmin)


__all__ = ["GovernorConditionAdmin", "ProblemsByFieldForm", "ServiceAdmin", "TenantPauseAdmin", "WorkflowAdmin"]
