from accs_site.appconfig import AccsAppConfig


class JobsConfig(AccsAppConfig):
    default = True  # apps.py also imports the base class; this one is the app\'s config
    name = "jobs"
    verbose_name = "Jobs and tasks"
