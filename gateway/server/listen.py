"""The server's Unix socket: remote mode for workers on the same host (``Settings.uds``).

A kvgate server that runs beside its vLLM workers (a node-local gateway, a sidecar) serves the
same API on a Unix socket as on its TCP port: same routes, same authentication and capability
checks, same audit. Only the transport differs. On this project's 2-core box, loopback TCP moves
4.5-4.9 GB/s between two processes and a Unix socket 6.2-7.7 GB/s (a raw socket each way), and
the data plane follows: ``python -m gateway.bench.net`` fetches at about 1.7x its TCP rate
(the README's table). TCP over loopback spends most of that difference in the protocol stack
(segmentation, acknowledgements, the receive path run on the sender's CPU), which a Unix socket
does not have.

Socket buffers. A Unix stream socket is created with ``net.core.wmem_default`` (208 KiB here),
and an accepted one does not inherit the listener's size; with envelopes of 2-32 MiB each
write then goes out in many small rounds. Measured: fetching 32 MiB envelopes ran at 1.6 GB/s
and 0.6 CPU s/GB on the server with the default, 7.4 GB/s and 0.14 s/GB with 4 MiB. Both ends
ask for ``gateway.wire.SOCKET_BUFFER_BYTES`` (the kernel caps it at ``wmem_max``/``rmem_max``).

The file. ``unix_listener`` replaces a stale socket at the path (a server that died leaves one)
and refuses anything else there; the socket is created with ``uds_mode`` (0660: the server's
user and group may connect; a worker of another user needs the group). It is unlinked on exit.
File permissions are defence in depth only: every request still needs its token.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path

from gateway.errors import InvalidRequest
from gateway.wire import tune_unix_socket

__all__ = ["remove_listener", "unix_listener"]

# sun_path is 108 bytes on Linux, 104 on the BSDs, with the terminating NUL
_MAX_PATH_BYTES = 103


def unix_listener(path: Path, mode: int = 0o660, backlog: int = 2048) -> socket.socket:
    """A listening Unix stream socket at ``path``, created with permissions ``mode``.

    A socket file left at ``path`` by a server that is gone is replaced; one that a live server
    still accepts on, or anything that is not a socket, is refused (``InvalidRequest``) and left
    as it is."""
    path = Path(path)
    if len(os.fsencode(path)) > _MAX_PATH_BYTES:
        raise InvalidRequest(f"the socket path is longer than {_MAX_PATH_BYTES} bytes: {path}")
    if not path.parent.is_dir():
        raise InvalidRequest(f"the socket's directory does not exist: {path.parent}")
    try:
        st = path.lstat()
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise InvalidRequest(f"{path} exists and is not a socket: not replaced")
        if _accepting(path):
            raise InvalidRequest(f"another server listens on {path}")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # bind creates the file with 0777 & ~umask: with this umask it is born with exactly ``mode``,
    # so there is no window with wider rights and no chmod by path afterwards (which would follow
    # a symlink put in the socket's place)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise InvalidRequest(f"cannot listen on {path} ({exc.strerror})") from None
    finally:
        os.umask(old)
    tune_unix_socket(sock)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def remove_listener(sock: socket.socket, path: Path) -> None:
    """Close the listener and unlink its socket file (nothing else at that path is removed)."""
    sock.close()
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


def _accepting(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True
