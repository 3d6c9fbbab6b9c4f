from accs_site.appconfig import AccsAppConfig


class WorkflowsConfig(AccsAppConfig):
    default = True  # apps.py also imports the base class; this one is the app\'s config
    name = "workflows"
    verbose_name = "Services and workflows"

    def ready(self) -> None:
        super().ready()
        # Imported here, not at the top: models may be imported only once every app is loaded.
        from workflows import checks  # noqa: F401 - registers the deploy check of definitions in code
        from workflows.models import workflows_naming_service
        from workflows.validation import register_service_users

        register_service_users(workflows_naming_service)
