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
and 0.6 CPU s/GB on the server with the default, 7.4-7.7 GB/s and 0.12-0.15 s/GB with 1 or
4 MiB. 4 MiB also stalled about half of the small loads by about 100 ms (a 1K-token load of
50 MB: 100-117 ms instead of 16-17; the kernel allocates a send buffer's data in pieces of up
to half its size), 1 MiB never did in the same runs. Both ends ask for
``gateway.wire.SOCKET_BUFFER_BYTES`` (the kernel caps it at ``wmem_max``/``rmem_max``).

The file. ``unix_listener`` replaces a stale socket at the path (a server that died leaves one)
and refuses anything else there; the socket is created with ``uds_mode`` (0660: the server's
user and group may connect; a worker of another user needs the group). It is unlinked on exit,
unless a new server has taken the path over meanwhile. Put it in a directory only the server's
user can write (``/run/kvgate``, 0750): in a world-writable one another user could bind the path
first, and workers would hand their tokens to that process. File permissions are defence in
depth only: every request still needs its token.

Who connected. A Unix socket has no peer address, so uvicorn gives such a request no client and
the audit log had no source for it. ``peer_source`` reads the peer's credentials from the kernel
(``SO_PEERCRED``: the uid and pid of the process that connected, as of ``connect``; nothing the
peer sends), and the server uses ``unix:uid=U:pid=P`` as the request's client: the audit rows'
``actor.source``, the access log. The failed-authentication limit counts per uid there
(``failure_key``): every process of one user shares one bucket, as every connection from one IP
address does over TCP.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from gateway.errors import InvalidRequest
from gateway.wire import tune_unix_socket

__all__ = ["UnixListener", "failure_key", "peer_source", "unix_listener"]

# sun_path is 108 bytes on Linux, 104 on the BSDs, with the terminating NUL
_MAX_PATH_BYTES = 103


@dataclass(frozen=True)
class UnixListener:
    """A listening Unix socket and the file it was bound to (``close`` removes that file only)."""

    sock: socket.socket
    path: Path
    # (st_dev, st_ino, st_ctime_ns) of the file bind made: an inode number alone is reused once
    # the file is gone, the change time of the new file differs
    inode: tuple[int, int, int]

    def close(self) -> None:
        """Close the socket and unlink its file, if the file at the path is still the one this
        listener made: a server shutting down (no longer accepting) may already have been
        replaced there by a new one, whose socket must stay."""
        self.sock.close()
        with contextlib.suppress(OSError):
            st = os.lstat(self.path)
            if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino, st.st_ctime_ns) == self.inode:
                os.unlink(self.path)


def unix_listener(path: Path, mode: int = 0o660, backlog: int = 2048) -> UnixListener:
    """A listening Unix stream socket at ``path``, created with permissions ``mode``.

    A socket file left at ``path`` by a server that is gone is replaced; one that a live server
    still accepts on, or anything that is not a socket, is refused (``InvalidRequest``) and left
    as it is. Call it before the process starts threads: the file's mode is set through the
    process's umask for the instant of ``bind``."""
    path = Path(path)
    if len(os.fsencode(path)) > _MAX_PATH_BYTES:
        raise InvalidRequest(f"the socket path is longer than {_MAX_PATH_BYTES} bytes: {path}")
    if not path.parent.is_dir():
        raise InvalidRequest(f"the socket's directory does not exist: {path.parent}")
    try:
        st: os.stat_result | None = path.lstat()
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise InvalidRequest(f"cannot look at {path} ({exc.strerror})") from None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise InvalidRequest(f"{path} exists and is not a socket: not replaced")
        if _accepting(path):
            raise InvalidRequest(f"another server listens on {path}")
        try:
            path.unlink()
        except OSError as exc:  # a stale socket of another user in a sticky directory, say
            raise InvalidRequest(f"cannot replace the stale socket {path} ({exc.strerror})") from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # bind creates the file with 0777 & ~umask: with this umask it is born with exactly ``mode``,
    # so there is no window with wider rights and no chmod by path afterwards (which would follow
    # a symlink put in the socket's place)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(str(path))
        made = os.lstat(path)
    except OSError as exc:
        sock.close()
        raise InvalidRequest(f"cannot listen on {path} ({exc.strerror})") from None
    finally:
        os.umask(old)
    tune_unix_socket(sock)
    sock.listen(backlog)
    sock.setblocking(False)
    return UnixListener(sock, path, (made.st_dev, made.st_ino, made.st_ctime_ns))


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


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_source(sock: socket.socket | None) -> str | None:
    """``unix:uid=U:pid=P`` for a connected Unix socket, from the kernel's record of its peer
    (``SO_PEERCRED``); None for any other socket, or where the platform has no such option."""
    if sock is None or sock.family != socket.AF_UNIX or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    return f"unix:uid={uid}:pid={pid}"


def failure_key(client: str) -> str:
    """What the failed-authentication limit counts by: the address, or for a Unix-socket peer its
    uid (a new process per attempt must not get a new bucket)."""
    if client.startswith("unix:uid="):
        return client.split(":pid=", 1)[0]
    return client
