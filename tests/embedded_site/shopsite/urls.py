from django.contrib import admin
from django.urls import include, path

from accs_site.api_v1 import api
from ops.metrics import metrics_view

urlpatterns = [
    path("admin/", include("ops.urls")),
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path("metrics", metrics_view, name="metrics"),
]
