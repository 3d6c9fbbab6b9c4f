from accs_site.appconfig import AccsAppConfig


class WorkflowsConfig(AccsAppConfig):
    default = True  # apps.py also imports the base class; this one is the app\'s config
    name = "workflows"
    verbose_name = "Services and workflows"
