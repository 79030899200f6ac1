"""A TCP forwarder of a test's own: a network path to a real service that the test can cut and
restore (a dependency outage without stopping the service, whose state then survives it).

    with tcp_proxy("127.0.0.1", port) as proxy:   # proxy.url_for("http") -> http://127.0.0.1:<its port>
        proxy.cut()       # the listener closed and every connection through it dropped: refused
        proxy.restore()   # listening again on the same port
        proxy.rate_bps = 4e6   # each direction at most 4 MB/s (all connections together); None: as fast as it goes
        proxy.throttle_up = False   # only the service's answers held to it (a client's writes go as fast as they go)
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

__all__ = ["TcpProxy", "tcp_proxy"]


class TcpProxy:
    def __init__(self, host: str, port: int, rate_bps: float | None = None) -> None:
        self.target = (host, port)
        self.rate_bps = rate_bps
        self.throttle_up = True
        self._free_at: dict[bool, float] = {True: 0.0, False: 0.0}  # per direction: when the link is free
        self.port = 0
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def url_for(self, scheme: str) -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def restore(self) -> None:
        """Listen (again, on the same port once one was taken) and forward every connection."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        self.port = sock.getsockname()[1]
        self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def cut(self) -> None:
        """Close the listener (new connections are refused) and every connection through it."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            with suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _addr = listener.accept()
            except OSError:  # closed by cut()
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns |= {client, upstream}
            for src, dst, down in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, down), daemon=True).start()

    def _throttle(self, nbytes: int, down: bool) -> None:
        """Hold ``nbytes`` back until a link of ``rate_bps`` in that direction would carry them."""
        rate = self.rate_bps
        if not rate or not (down or self.throttle_up):
            return
        with self._lock:
            now = time.monotonic()
            done = self._free_at[down] = max(now, self._free_at[down]) + nbytes / rate
        time.sleep(max(0.0, done - now))

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool = False) -> None:
        try:
            while data := src.recv(65536):
                self._throttle(len(data), down)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns -= {src, dst}


@contextmanager
def tcp_proxy(host: str, port: int, rate_bps: float | None = None) -> Iterator[TcpProxy]:
    proxy = TcpProxy(host, port, rate_bps)
    proxy.restore()
    try:
        yield proxy
    finally:
        proxy.cut()
