"""URL wiring: the admin and, as later capabilities land, the HTTP API and metrics."""

from django.contrib import admin
from django.urls import path

urlpatterns = [
    path("admin/", admin.site.urls),
]
