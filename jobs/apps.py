from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs and tasks"

    def ready(self) -> None:
        from jobs.definitions import connect_invalidation

        connect_invalidation()
