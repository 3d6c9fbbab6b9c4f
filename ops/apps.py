from accs_site.appconfig import AccsAppConfig


class OpsConfig(AccsAppConfig):
    """The read side: dashboard, metrics, DAG pictures, ``accs_status`` and the admin's look."""

    name = "ops"
    verbose_name = "Operations"
