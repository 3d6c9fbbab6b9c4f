from django.apps import AppConfig


class AccsSiteConfig(AppConfig):
    name = "accs_site"
    verbose_name = "ACCS site"

    def ready(self) -> None:
        from accs_site import checks  # noqa: F401  (registers the system checks)
