"""Admin for tenants, memberships and API tokens.

Tenant admins see only their own tenants here (:mod:`tenants.scoping`). A token is created in the
add form (its secret shown once) or with ``manage.py accs_token``, and revoked by an action; a
token is never edited.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.utils import timezone

from accs_site.admin_kit import ActionResult, TenantListFilter, perform
from tenants.accounts import revoke_tokens
from tenants.models import ApiToken, Tenant, TenantMembership, TokenScope, default_token_scopes
from tenants.scoping import can_act, scope
from tenants.tokens import create_token


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "timezone", "max_in_flight", "min_priority", "max_priority", "retention_days",
                    "retention_dead_days", "created_at")
    search_fields = ("slug", "name")

    def get_queryset(self, request):
        return scope(super().get_queryset(request), request.user, field="id")

    def has_change_permission(self, request, obj=None):
        """Changing a tenant's limits and retention takes the model permission *and* the admin role
        in that tenant: a viewer (or an admin of another tenant) with ``change_tenant`` only reads."""
        allowed = super().has_change_permission(request, obj)
        return allowed and (obj is None or request.user.is_superuser or can_act(request.user, obj.id, write=True))

    def has_delete_permission(self, request, obj=None):
        """Deleting a tenant deletes its jobs and history: a superuser's act only."""
        return request.user.is_superuser and super().has_delete_permission(request, obj)

    def has_add_permission(self, request):
        """A new tenant has no admins yet, so only a superuser creates one."""
        return request.user.is_superuser and super().has_add_permission(request)


def membership_problem(granter: Any, membership: TenantMembership) -> str | None:
    """Return why ``granter`` may not create, change or delete ``membership``, or None when they may.

    A superuser may do anything; anyone else acts only in tenants they admin and never on their
    own membership (so nobody grants themselves a role or a tenant).
    """
    if granter.is_superuser:
        return None
    if membership.user_id == granter.pk:
        return "you may not change your own membership; ask another admin of the tenant or a superuser"
    if not can_act(granter, membership.tenant_id, write=True):
        return "you may only manage memberships of tenants you are an admin of"
    return None


class MembershipForm(forms.ModelForm):
    """Names what the person granting may not do, field by field."""

    granted_by: Any = None

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        probe = TenantMembership(user=data.get("user"), tenant=data.get("tenant"), role=data.get("role") or "")
        if self.instance.pk is not None and (problem := membership_problem(self.granted_by, self.instance)):
            raise forms.ValidationError(problem)
        if data.get("user") is not None and data.get("tenant") is not None:
            if problem := membership_problem(self.granted_by, probe):
                raise forms.ValidationError(problem)
        return data


@admin.register(TenantMembership)
class TenantMembershipAdmin(admin.ModelAdmin):
    """Memberships: a superuser manages all; a tenant admin (staff, with the model permissions) sees
    and grants memberships of the tenants they admin only, and never changes their own."""

    list_display = ("user", "tenant", "role")
    list_filter = ("role", TenantListFilter)
    search_fields = ("user__username", "tenant__slug")
    form = MembershipForm

    def get_queryset(self, request):
        return scope(super().get_queryset(request), request.user, write=True)

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "tenant":
            kwargs["queryset"] = scope(Tenant.objects.all(), request.user, write=True, field="id")
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_form(self, request, obj=None, change=False, **kwargs):
        form = super().get_form(request, obj, change=change, **kwargs)
        return type(form.__name__, (form,), {"granted_by": request.user})

    def save_model(self, request, obj, form, change) -> None:
        if membership_problem(request.user, obj) is not None:
            raise PermissionDenied  # the form names the problem; this guards forged posts
        super().save_model(request, obj, form, change)

    def delete_model(self, request, obj) -> None:
        if membership_problem(request.user, obj) is not None:
            raise PermissionDenied
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset) -> None:
        if not request.user.is_superuser:
            queryset = queryset.exclude(user=request.user)  # nobody removes their own membership
        super().delete_queryset(request, queryset)


class TokenAddForm(forms.ModelForm):
    """What creating a token asks: whose, its name, what it may do and when it expires (the secret is
    generated)."""

    scopes = forms.MultipleChoiceField(choices=TokenScope.choices, widget=forms.CheckboxSelectMultiple,
                                       initial=default_token_scopes, help_text="What the token may do.")

    class Meta:
        model = ApiToken
        fields = ("user", "name", "scopes", "expires_at")

    #: The signed-in user creating the token (set by :meth:`ApiTokenAdmin.get_form`).
    minted_by: Any = None

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        user, expires = data.get("user"), data.get("expires_at")
        if user is not None and not user.is_active:
            self.add_error("user", "this user is not active; a token of theirs would be refused")
        if user is not None and (problem := minting_problem(self.minted_by, user, data.get("scopes") or [])):
            self.add_error(*problem)
        if expires is not None and expires <= timezone.now():
            self.add_error("expires_at", "must be in the future (leave empty for no expiry)")
        return data


def minting_problem(minter: Any, owner: Any, scopes: list[str]) -> tuple[str, str] | None:
    """Return (field, why) when ``minter`` may not create a token with ``scopes`` for ``owner``, else None.

    A token acts as its owner, so minting one for someone else is acting as them: only a superuser
    may (nobody is more privileged than a superuser), everyone else mints for themselves. The
    ``definitions`` scope changes what every tenant runs: only a superuser mints it, and only for
    a superuser (another user's ``definitions`` token could do nothing anyway).
    """
    if minter is None or not minter.is_superuser:
        if minter is None or owner.pk != minter.pk:
            return "user", "only a superuser may create a token for another user; create your own"
    if TokenScope.DEFINITIONS in scopes and not (minter.is_superuser and owner.is_superuser):
        return "scopes", "the definitions scope is for superusers' tokens, created by a superuser"
    return None


def _revoke(token: ApiToken) -> ActionResult:
    if token.revoked_at is not None:
        return ActionResult(False, "already revoked")
    revoke_tokens(prefix=token.prefix, username=token.user.get_username(), name=token.name)
    return ActionResult(True, "revoked; the API refuses it from now on")


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """API tokens: created here (the secret is shown once) or with ``manage.py accs_token``, revoked
    with the action; both are recorded in the admin's history."""

    list_display = ("name", "user", "prefix", "scopes", "created_at", "last_used_at", "expires_at", "revoked_at")
    search_fields = ("name", "user__username", "prefix")
    actions = ("revoke_selected",)

    def get_queryset(self, request):
        # A token is its owner's credential: others' tokens are a superuser's business only.
        qs = super().get_queryset(request)
        return qs if request.user.is_superuser else qs.filter(user=request.user)

    def get_form(self, request, obj=None, change=False, **kwargs):
        if obj is None:
            kwargs["form"] = type("TokenAddForm", (TokenAddForm,), {"minted_by": request.user})
        return super().get_form(request, obj, change=change, **kwargs)

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "user" and not request.user.is_superuser:
            kwargs["queryset"] = get_user_model()._default_manager.filter(pk=request.user.pk)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ("user", "name", "scopes", "expires_at")
        return ("user", "name", "prefix", "scopes", "created_at", "last_used_at", "expires_at", "revoked_at")

    def get_readonly_fields(self, request, obj=None):
        return () if obj is None else self.get_fields(request, obj)

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # a token's secret and state change by creating and revoking, never by editing

    def action_subject(self, obj: ApiToken) -> str:
        return f"token {obj}"

    def save_model(self, request, obj, form, change) -> None:
        """Create the token the way ``accs_token`` does; show the secret this once."""
        if minting_problem(request.user, obj.user, list(obj.scopes)) is not None:
            raise PermissionDenied  # the form names the problem; this guards forged posts
        token, raw = create_token(obj.user, obj.name.strip(), expires_at=obj.expires_at, scopes=list(obj.scopes))
        obj.pk, obj.prefix, obj.digest, obj.created_at = token.pk, token.prefix, token.digest, token.created_at
        obj._state.adding = False
        self.message_user(request, f"The token {obj.name!r} is {raw} — copy it now: it is not shown again.",
                          messages.WARNING)

    @admin.action(description="Revoke selected tokens", permissions=["delete"])
    def revoke_selected(self, request, queryset):
        perform(request, self, "Revoke", list(queryset.select_related("user")), _revoke)
