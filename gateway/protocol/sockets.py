"""The Unix stream socket's buffers, asked for by both ends of the remote data plane (the
server's listener and the worker's client): with the kernel's default the socket moves a large
envelope in many small steps, at a cost in throughput and CPU on both sides."""

from __future__ import annotations

import socket

__all__ = ["SOCKET_BUFFER_BYTES", "tune_unix_socket"]

# a Unix stream socket's send and receive buffers
SOCKET_BUFFER_BYTES = 1 << 20


def tune_unix_socket(sock: socket.socket | None) -> None:
    """Large send and receive buffers on a Unix stream socket (nothing on any other socket)."""
    if sock is None or sock.family != socket.AF_UNIX:
        return
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:  # a kernel that refuses keeps its default: slower, still right
            pass
