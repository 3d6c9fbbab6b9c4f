from accs_site.appconfig import AccsAppConfig


class OpsConfig(AccsAppConfig):
    """The read side: dashboard, metrics, DAG pictures, ``accs_status`` and the admin's look."""

    default = True  # apps.py also imports the base class; this one is the app's config
    name = "ops"
    verbose_name = "Operations"

    def ready(self) -> None:
        super().ready()
        # The admin's look belongs to the read side: Django's own date columns say a moment as every ACCS
        # page does (zone named, display-zone picker), in every list and read-only field.
        from accs_site.admin_kit import show_times_one_way  # the admin toolkit imports models: not at load

        show_times_one_way()
