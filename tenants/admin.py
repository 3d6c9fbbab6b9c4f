"""Admin for tenants, memberships and API tokens.

Tenant admins see only their own tenants here (:mod:`tenants.scoping`). A token is created in the
add form (its secret shown once) or with ``manage.py accs_token``, and revoked by an action; a
token is never edited.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.utils import timezone

from accs_site.admin_kit import ActionResult, perform
from tenants.accounts import revoke_tokens
from tenants.auth import create_token
from tenants.models import ApiToken, Tenant, TenantMembership, TokenScope, default_token_scopes
from tenants.scoping import scope


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "timezone", "max_in_flight", "min_priority", "max_priority", "retention_days",
                    "retention_dead_days", "created_at")
    search_fields = ("slug", "name")

    def get_queryset(self, request):
        return scope(super().get_queryset(request), request.user, field="id")


@admin.register(TenantMembership)
class TenantMembershipAdmin(admin.ModelAdmin):
    list_display = ("user", "tenant", "role")
    list_filter = ("role", "tenant")
    search_fields = ("user__username", "tenant__slug")


class TokenAddForm(forms.ModelForm):
    """What creating a token asks: whose, its name, what it may do and when it expires (the secret is
    generated)."""

    scopes = forms.MultipleChoiceField(choices=TokenScope.choices, widget=forms.CheckboxSelectMultiple,
                                       initial=default_token_scopes, help_text="What the token may do.")

    class Meta:
        model = ApiToken
        fields = ("user", "name", "scopes", "expires_at")

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        user, expires = data.get("user"), data.get("expires_at")
        if user is not None and not user.is_active:
            self.add_error("user", "this user is not active; a token of theirs would be refused")
        if expires is not None and expires <= timezone.now():
            self.add_error("expires_at", "must be in the future (leave empty for no expiry)")
        return data


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

    def get_form(self, request, obj=None, change=False, **kwargs):
        if obj is None:
            kwargs["form"] = TokenAddForm
        return super().get_form(request, obj, change=change, **kwargs)

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
        token, raw = create_token(obj.user, obj.name.strip(), expires_at=obj.expires_at, scopes=list(obj.scopes))
        obj.pk, obj.prefix, obj.digest, obj.created_at = token.pk, token.prefix, token.digest, token.created_at
        obj._state.adding = False
        self.message_user(request, f"The token {obj.name!r} is {raw} — copy it now: it is not shown again.",
                          messages.WARNING)

    @admin.action(description="Revoke selected tokens", permissions=["delete"])
    def revoke_selected(self, request, queryset):
        perform(request, self, "Revoke", list(queryset.select_related("user")), _revoke)
