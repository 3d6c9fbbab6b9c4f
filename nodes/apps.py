from accs_site.appconfig import AccsAppConfig


class NodesConfig(AccsAppConfig):
    default = True  # apps.py also imports the base class; this one is the app\'s config
    name = "nodes"
    verbose_name = "Nodes and hosts"

    def ready(self) -> None:
        super().ready()
        # The builder takes the fleet's duties (presence, wake) from its registry, never by import.
        # Imported here, not at the top: nodes.duties loads models, which apps.py may not do.
        from jobs.duties import register_duties
        from jobs.failure.apply import register_host_quarantine
        from nodes import checks  # noqa: F401 - registers the check naming daemons of another release
        from nodes.duties import duties
        from nodes.quarantine import quarantine_hosts

        register_duties("nodes", duties)
        # The failure path of jobs quarantines hosts through this app's own function: the host
        # state is set and cleared by one module, and jobs does not import nodes.
        register_host_quarantine(quarantine_hosts)
