"""The admin site's titles; the operators' pages themselves are wired in :mod:`ops.urls`."""

from django.contrib import admin

admin.site.site_header = "ACCS operations"
admin.site.site_title = "ACCS"
admin.site.index_title = "Jobs, workflows, nodes and timeline"
