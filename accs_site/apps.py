from accs_site.appconfig import AccsAppConfig


class AccsSiteConfig(AccsAppConfig):
    name = "accs_site"
    verbose_name = "ACCS site"
