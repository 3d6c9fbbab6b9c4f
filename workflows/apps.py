from accs_site.appconfig import AccsAppConfig


class WorkflowsConfig(AccsAppConfig):
    name = "workflows"
    verbose_name = "Services and workflows"
