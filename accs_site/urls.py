"""URL wiring: the admin with the operators' pages, the HTTP API and the metrics endpoint."""

from django.contrib import admin
from django.urls import include, path

from accs_site.api_v1 import api
from ops.metrics import metrics_view

# A transient database error raised outside a view (say, in a middleware) is a 503 too.
handler500 = "accs_site.middleware.server_error"

urlpatterns = [
    path("admin/", include("ops.urls")),  # the dashboard and the job page's downloads, staff only
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path("metrics", metrics_view, name="metrics"),
]
