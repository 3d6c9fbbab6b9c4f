import logging

from accs_site.appconfig import AccsAppConfig


class EventsConfig(AccsAppConfig):
    default = True  # apps.py also imports the base class; this one is the app\'s config
    name = "events"
    verbose_name = "Timeline and artifacts"

    def ready(self) -> None:
        super().ready()
        _attach_timeline_handler()


def _attach_timeline_handler() -> None:
    """Send the ``accs`` logger's records with job context to the timeline, unless the site's LOGGING does.

    An embedding site rarely configures ACCS's loggers; without the handler, log lines that name a
    job would never reach that job's timeline.
    """
    # Run from ready(): apps.py loads before the models the handler writes to.
    from events.logging import EventBridgeHandler

    logger = logging.getLogger("accs")
    if not any(isinstance(h, EventBridgeHandler) for h in logger.handlers):
        handler = EventBridgeHandler()
        handler.setLevel(logging.INFO)
        logger.addHandler(handler)
