"""The URLs docs/embedding.md gave before 0.2.0: the metrics view from events, no ops.urls."""

from django.contrib import admin
from django.urls import path

from accs_site.api_v1 import api
from events.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path("metrics", metrics_view, name="metrics"),
]
