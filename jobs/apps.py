from django.core.exceptions import ImproperlyConfigured

from accs_site.appconfig import AccsAppConfig


class JobsConfig(AccsAppConfig):
    default = True  # apps.py also imports the base class; this one is the app\'s config
    name = "jobs"
    verbose_name = "Jobs and tasks"

    def import_models(self) -> None:
        # Jobs and triggers belong to a tenants.Tenant; without that app Django would stop on an
        # import error that does not say what to change.
        if self.apps is not None and not self.apps.is_installed("tenants"):
            raise ImproperlyConfigured(
                "INSTALLED_APPS lacks 'tenants': tenants, memberships and API tokens moved out of 'jobs' in "
                "ACCS 0.2.0; add 'tenants' to INSTALLED_APPS (docs/embedding.md shows the full list)")
        super().import_models()
        # The event receipts live in their own module; importing it here registers the model.
        from jobs import receipts  # noqa: F401

    def ready(self) -> None:
        super().ready()
        # Imported here, not at the top: models may be imported only once every app is loaded.
        from jobs.definitions import connect_invalidation, jobs_naming_service
        from workflows.code import register_task_services
        from workflows.validation import register_service_users

        connect_invalidation()
        register_service_users(jobs_naming_service)
        register_task_services("jobs.tasks_backend.task_step_service")
