"""gunicorn settings for the ACCS web (``gunicorn -c deploy/gunicorn.conf.py accs_site.wsgi:application``).

What it adds to gunicorn's threaded worker: a graceful stop that refuses nothing. gunicorn's own
``gthread`` worker, told to stop (SIGTERM: a reload with HUP, a ``systemctl restart``, the master's
graceful shutdown), still accepts the connections that arrive during its last poll and then exits
without reading them: their clients get "connection reset" (two or three job POSTs per reload at a
few requests per second). This worker, told to stop, first stops accepting (the listening socket
stays open in the master and the other workers, so the kernel hands new connections to them), then
answers every connection it has accepted and exits once none is waiting for an answer.

The class lives in this file, not in the application, so a web still running the previous release's
code can be started with it, and ``systemctl reload accs-web`` (HUP) then moves it to new code
without a refused request: new workers import the application from the code folder, the old ones
drain. Everything else (bind address, processes, threads) stays on the command line.
"""

from __future__ import annotations

from gunicorn.workers.gthread import ThreadWorker


class DrainingThreadWorker(ThreadWorker):
    """gunicorn's threaded worker whose graceful stop answers every connection it accepted."""

    draining = False

    def handle_exit(self, sig, frame) -> None:  # noqa: ANN001 - gunicorn's signal handler signature
        # Keep the loop running: it stops accepting and ends once nothing it accepted is waiting.
        self.draining = True

    def is_parent_alive(self) -> bool:
        if self.draining:
            if self._accepting():
                with self._lock:
                    for sock in self.sockets:
                        self.poller.unregister(sock)
            # Idle keep-alive connections are not waiting for an answer; exiting closes them.
            if not self.futures and self.nr_conns <= len(self._keep):
                return False
        return super().is_parent_alive()

    def _accepting(self) -> bool:
        registered = self.poller.get_map()
        return any(sock.fileno() in registered for sock in self.sockets)


worker_class = DrainingThreadWorker
# Requests in flight when a stop begins get this long to finish (systemd's TimeoutStopSec is longer).
graceful_timeout = 30
