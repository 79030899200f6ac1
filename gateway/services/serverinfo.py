"""Where the running `kvgate serve` of a state directory listens: one source of truth for the
public URL (the development issuer's ``iss`` is ``<public_url>/dev-issuer``).

``kvgate serve --port 8431`` writes ``<state_dir>/server.json`` (0600: the URL and its process
id); ``kvgate token mint`` in another shell reads it, so the tokens it mints carry the issuer that
server checks. An explicit ``KVGATE_PUBLIC_URL`` always wins; a file whose process is gone is
ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gateway.config import Settings

__all__ = ["publish_server", "published_public_url", "unpublish_server"]


def _path(settings: Settings) -> Path:
    return settings.state_dir / "server.json"


def publish_server(settings: Settings, host: str, port: int) -> None:
    path = _path(settings)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"public_url": settings.public_url, "host": host, "port": port, "pid": os.getpid()}, f)
    os.replace(tmp, path)


def unpublish_server(settings: Settings) -> None:
    try:
        data = json.loads(_path(settings).read_text())
        if data.get("pid") == os.getpid():
            _path(settings).unlink()
    except (OSError, ValueError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def published_public_url(settings: Settings) -> str | None:
    """The public URL of this state directory's running server, unless KVGATE_PUBLIC_URL is set."""
    if "public_url" in settings.model_fields_set:
        return None
    try:
        data = json.loads(_path(settings).read_text())
        url, pid = str(data["public_url"]), int(data["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return url if _alive(pid) else None
