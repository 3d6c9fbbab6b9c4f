from accs_site.appconfig import AccsAppConfig


class NodesConfig(AccsAppConfig):
    default = True  # apps.py also imports the base class; this one is the app\'s config
    name = "nodes"
    verbose_name = "Nodes and hosts"

    def ready(self) -> None:
        super().ready()
        # The failure path of jobs quarantines hosts through this app's own function: the host
        # state is set and cleared by one module, and jobs does not import nodes.
        from jobs.failure.apply import register_host_quarantine
        from nodes.quarantine import quarantine_hosts

        register_host_quarantine(quarantine_hosts)
