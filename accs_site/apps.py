from accs_site.appconfig import AccsAppConfig


class AccsSiteConfig(AccsAppConfig):
    default = True  # apps.py also imports the base class; this one is the app\'s config
    name = "accs_site"
    verbose_name = "ACCS site"
