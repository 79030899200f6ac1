"""The server's Unix socket: remote mode for workers on the same host (``Settings.uds``).

A kvgate server beside its vLLM workers serves the same API on a Unix socket as on its TCP port:
same routes, authentication, capability checks and audit; only the transport differs, and a Unix
socket skips the TCP stack's per-segment work. Both ends ask for socket buffers of
``gateway.remote.wire.SOCKET_BUFFER_BYTES`` (the kernel caps it at ``wmem_max``/``rmem_max``).

``unix_listener`` replaces a stale socket at the path and refuses anything else there; the socket
gets ``uds_mode`` (0660) and is unlinked on exit unless a new server has taken the path over. Put
it in a directory only the server's user can write (``/run/kvgate``, 0750): in a world-writable one
another user could bind the path first and collect the workers' tokens. File permissions are
defence in depth only: every request still needs its token. ``peer_source`` reads the peer's
``SO_PEERCRED`` from the kernel (never from what the peer sends); ``unix:uid=U:pid=P`` is the
request's client (audit ``actor.source``, access log), and the failed-authentication limit counts
per uid (``failure_key``). Design notes: docs/architecture.md, section 5.
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
from gateway.protocol.sockets import tune_unix_socket

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
