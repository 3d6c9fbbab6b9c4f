from accs_site.appconfig import AccsAppConfig


class NodesConfig(AccsAppConfig):
    default = True  # apps.py also imports the base class; this one is the app\'s config
    name = "nodes"
    verbose_name = "Nodes and hosts"
