from accs_site.appconfig import AccsAppConfig


class TenantsConfig(AccsAppConfig):
    default = True  # apps.py also imports the base class; this one is the app's config
    name = "tenants"
    verbose_name = "Tenants and API access"
