from accs_site.appconfig import AccsAppConfig


class JobsConfig(AccsAppConfig):
    name = "jobs"
    verbose_name = "Jobs and tasks"
