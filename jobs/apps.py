from accs_site.appconfig import AccsAppConfig


class JobsConfig(AccsAppConfig):
    default = True  # apps.py also imports the base class; this one is the app\'s config
    name = "jobs"
    verbose_name = "Jobs and tasks"

    def import_models(self) -> None:
        super().import_models()
        # The event receipts live in their own module; importing it here registers the model.
        from jobs import receipts  # noqa: F401

    def ready(self) -> None:
        super().ready()
        # apps.py loads before the models whose saves clear the cache.
        from jobs.definitions import connect_invalidation

        connect_invalidation()
