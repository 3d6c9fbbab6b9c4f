from accs_site.appconfig import AccsAppConfig


class NodesConfig(AccsAppConfig):
    name = "nodes"
    verbose_name = "Nodes and hosts"
