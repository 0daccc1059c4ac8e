"""A TCP proxy standing in for the network path to a server, for fault injection."""

from __future__ import annotations

import socket
import threading
import time


class NetworkPath:
    """A TCP proxy standing in for the network path to a server (a Kubernetes Service in front of its pod).
    `fail_over(port)` makes the connections open so far swallow every byte silently, as a frozen node or a
    partitioned network does (TCP stays up, nothing arrives), and sends the connections made from then on to `port`,
    where the replacement server listens. With `uplink_rate` it passes what clients send at that many bytes a second
    (a slow link); `.sent` counts what it has passed on that way."""

    def __init__(self, upstream: int, uplink_rate: int | None = None):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.upstream, self.generation = self.listener.getsockname()[1], upstream, 0
        self.uplink_rate, self.sent = uplink_rate, 0
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            except OSError:
                client.close()  # nothing listens there (yet): the client sees the connection fail
                continue
            self.connections += 1
            for src, dst, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, self.generation, up), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, generation: int, up: bool) -> None:
        slow = up and self.uplink_rate is not None
        try:
            while data := src.recv(8192 if slow else 65536):
                if generation == self.generation:
                    dst.sendall(data)
                    if up:
                        self.sent += len(data)
                    if slow:
                        time.sleep(len(data) / self.uplink_rate)
        except OSError:
            pass
        for sock in (src, dst):
            sock.close()

    def fail_over(self, port: int) -> None:
        self.upstream = port
        self.generation += 1

    def close(self) -> None:
        self.listener.close()
