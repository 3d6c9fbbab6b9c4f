"""The operators' pages, behind the admin's login: include them next to the admin's URLs.

    path("admin/", include("ops.urls")),   # before admin.site.urls
    path("admin/", admin.site.urls),

Names live in the ``ops`` namespace: ``ops:dashboard``, ``ops:dashboard_data``, and the job page's
``ops:job_data`` (its live sections), ``ops:job_artifact`` (a download), ``ops:job_artifact_preview`` and
``ops:attempt_log``.
"""

from django.contrib import admin
from django.urls import path

from ops import dashboard, jobpage

app_name = "ops"

urlpatterns = [
    path("dashboard/", admin.site.admin_view(dashboard.dashboard_view), name="dashboard"),
    path("dashboard/data.json", admin.site.admin_view(dashboard.dashboard_data_view), name="dashboard_data"),
    path("job/<uuid:job_id>/data.json", admin.site.admin_view(jobpage.job_data_view), name="job_data"),
    path("job/<uuid:job_id>/artifacts/<int:artifact_id>/download",
         admin.site.admin_view(jobpage.artifact_download_view), name="job_artifact"),
    path("job/<uuid:job_id>/artifacts/<int:artifact_id>/preview",
         admin.site.admin_view(jobpage.artifact_preview_view), name="job_artifact_preview"),
    path("job/<uuid:job_id>/attempts/<int:attempt_id>/log/", admin.site.admin_view(jobpage.attempt_log_view),
         name="attempt_log"),
]
