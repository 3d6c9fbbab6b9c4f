"""A loopback TCP proxy a test can cut and restore, to put a network fault between a daemon and
PostgreSQL while the daemon itself lives on.

``cut()`` blackholes: connections stay open but nothing is forwarded either way and new
connections are accepted but never reach the server — what a dead switch or a firewall that
drops packets looks like to the client (its kernel sees nothing wrong). ``cut(reset=True)``
instead closes every connection at once and every new one as it comes, as a server that
restarts does. ``restore()`` lets traffic
flow again; data held back during a blackhole is delivered then, as TCP would retransmit it.
"""

from __future__ import annotations

import select
import socket
import threading

MAX_CONNECTIONS = 64
CHUNK = 65536


class TcpProxy:
    """Forward ``127.0.0.1:listen_port`` to ``target_host:target_port`` (port 0: pick a free one)."""

    def __init__(self, listen_port: int, target_host: str, target_port: int) -> None:
        if target_host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the test proxy forwards to loopback only")
        self.target = (target_host, target_port)
        self._server = socket.create_server(("127.0.0.1", listen_port))
        self.port = self._server.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._refuse = False
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket | None]] = []
        self._accept_thread = threading.Thread(target=self._accept, name="tcp-proxy-accept", daemon=True)
        self._accept_thread.start()

    # ------------------------------------------------------------------ controls
    def cut(self, *, reset: bool = False) -> None:
        """Stop forwarding; with ``reset``, also close every open connection."""
        self._refuse = reset
        self._flowing.clear()
        if reset:
            self._close_pairs()

    def restore(self) -> None:
        """Forward traffic again."""
        self._refuse = False
        self._flowing.set()

    def close(self) -> None:
        """Stop the proxy and close every connection."""
        self._closed.set()
        self._flowing.set()  # release threads waiting for a restore
        try:
            self._server.close()
        except OSError:
            pass
        self._close_pairs()
        self._accept_thread.join(timeout=5)

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._pairs)

    # ------------------------------------------------------------------ internals
    def _accept(self) -> None:
        self._server.settimeout(0.2)
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            with self._lock:
                if len(self._pairs) >= MAX_CONNECTIONS:
                    client.close()
                    continue
            threading.Thread(target=self._serve, args=(client,), name="tcp-proxy-pipe", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        pair: tuple[socket.socket, socket.socket | None] = (client, None)
        with self._lock:
            self._pairs.append(pair)
        upstream = None
        try:
            # A connection opened during a blackhole hangs until restored; during a reset cut it
            # is closed at once, as by a server that is down.
            while not self._flowing.wait(0.1):
                if self._refuse:
                    return
            if self._closed.is_set() or self._refuse:
                return
            upstream = socket.create_connection(self.target, timeout=5)
            upstream.settimeout(None)
            with self._lock:
                if pair in self._pairs:
                    self._pairs.remove(pair)
                pair = (client, upstream)
                self._pairs.append(pair)
            self._pump(client, upstream)
        except (OSError, ValueError):  # a socket closed by cut(reset=True) under the pump
            pass
        finally:
            with self._lock:
                if pair in self._pairs:
                    self._pairs.remove(pair)
            for sock in (client, upstream):
                if sock is not None:
                    try:
                        sock.close()
                    except OSError:
                        pass

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        peers = {client: upstream, upstream: client}
        while not self._closed.is_set():
            if not self._flowing.is_set():
                # Blackhole: read nothing, so data waits in the kernel's buffers.
                self._flowing.wait(0.1)
                continue
            ready, _, _ = select.select(list(peers), [], [], 0.1)
            for sock in ready:
                if not self._flowing.is_set():
                    break
                data = sock.recv(CHUNK)
                if not data:
                    return
                peers[sock].sendall(data)

    def _close_pairs(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for client, upstream in pairs:
            for sock in (client, upstream):
                if sock is None:
                    continue
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                try:
                    sock.close()
                except OSError:
                    pass
