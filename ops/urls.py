"""The operators' pages, behind the admin's login: include them next to the admin's URLs.

    path("admin/", include("ops.urls")),   # before admin.site.urls
    path("admin/", admin.site.urls),

Names live in the ``ops`` namespace (``ops:dashboard``, ``ops:dashboard_data``).
"""

from django.contrib import admin
from django.urls import path

from ops import dashboard

app_name = "ops"

urlpatterns = [
    path("dashboard/", admin.site.admin_view(dashboard.dashboard_view), name="dashboard"),
    path("dashboard/data.json", admin.site.admin_view(dashboard.dashboard_data_view), name="dashboard_data"),
]
