"""The state directory holds secrets at rest (wrapped keys in the SQLite registry, the audit log
and its spool, the local KEK file, the audit and development-issuer signing keys, the disk tier's
ciphertext): owner-only, every one of them.

``prepare_state(settings)`` creates the state directory 0700 and the SQLite database 0600 (SQLite
would create it 0644 and give its -wal/-shm/-journal files the same mode); ``check_state`` then
refuses to start (``InsecureStateFiles``, naming each path, its mode and the ``chmod`` that fixes
it) when a directory kvgate uses is not 0700 or tighter or a file not 0600 or tighter. The other
files are created 0600 by their owners; chunk files are not walked (there may be millions), their
directories are.

``open_kek(settings)`` opens the configured KEK for a process that serves the registry. A missing
KEK file is created only for a registry that holds no KEK-wrapped key (a fresh install); a key
file that wrapped none of the registry's keys is refused as well. Both raise ``KekNotForRegistry``,
naming the state directory, the KEK file, the registry and the KEK that wrapped its keys.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.cli.errors import redact_url
from gateway.config import Settings
from gateway.errors import GatewayError

if TYPE_CHECKING:
    from crypto.kek import KekProvider

__all__ = [
    "InsecureStateFiles",
    "KekNotForRegistry",
    "check_state",
    "ensure_private_sqlite",
    "open_kek",
    "prepare_state",
    "sqlite_path",
]

_GROUP_OTHER = 0o077


class InsecureStateFiles(GatewayError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__(
            "kvgate refuses to start: state files are accessible by group or others\n  " + "\n  ".join(problems)
        )
        self.problems = problems


class KekNotForRegistry(GatewayError):
    """The KEK this process would use cannot unwrap the registry's keys: the state directory (or
    the KEK file setting) does not belong to the registry. Nothing was created."""


def sqlite_path(url: str) -> Path | None:
    """The database file of an SQLite URL (None for other databases and in-memory SQLite)."""
    if not url.startswith("sqlite"):
        return None
    _, _, rest = url.partition(":///")
    return Path(rest.split("?", 1)[0]) if rest and rest != ":memory:" else None


def ensure_private_sqlite(url: str) -> None:
    """Create the SQLite database file 0600 (in a 0700 directory) before SQLite does."""
    path = sqlite_path(url)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o600)
    os.close(fd)


def prepare_state(settings: Settings) -> None:
    settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    ensure_private_sqlite(settings.db_url)
    check_state(settings)


def _loose(path: Path, want: int, problems: list[str]) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    mode = stat.S_IMODE(st.st_mode)
    if mode & _GROUP_OTHER:
        problems.append(f"{path} has mode {mode:04o}; it must be {want:04o} or tighter (chmod {want:o} {path})")


def check_state(settings: Settings) -> None:
    problems: list[str] = []
    dirs = [settings.state_dir, settings.state_dir / "audit-spool"]
    if "disk" in settings.tiers:
        dirs.append(settings.chunk_dir)
    files = [settings.audit_key_path, settings.state_dir / "dev-issuer-key.pem"]
    if settings.kek_provider == "file":
        files.append(settings.kek_path)
    db = sqlite_path(settings.db_url)
    if db is not None:
        dirs.append(db.parent)
        files += [db, *(db.with_name(db.name + s) for s in ("-wal", "-shm", "-journal"))]
    for d in dirs:
        _loose(d, 0o700, problems)
    spool = settings.state_dir / "audit-spool"
    if spool.is_dir():
        files += [p for p in spool.iterdir() if p.is_file()]
    if "disk" in settings.tiers and settings.chunk_dir.is_dir():
        dirs_below = [p for p in settings.chunk_dir.iterdir() if p.is_dir()]  # one level: the fan-out
        for d in dirs_below:
            _loose(d, 0o700, problems)
    for f in files:
        _loose(f, 0o600, problems)
    if problems:
        raise InsecureStateFiles(sorted(set(problems)))


async def open_kek(settings: Settings) -> KekProvider:
    """The configured KEK provider. For the key file: created only where the registry holds no
    wrapped key; refused (``KekNotForRegistry``) where the registry's keys were wrapped by
    another KEK. HSM and KMS providers are opened as configured (their blobs name their key)."""
    from crypto.kek import LocalFileKek
    from gateway.services.runtime import make_kek
    from tenancy.registry import Registry

    if settings.kek_provider != "file":
        return make_kek(settings)
    registry = Registry.from_url(settings.db_url)
    try:
        wrapped = await registry.wrapped_by_kek()
    finally:
        await registry.aclose()
    path = settings.kek_path
    if not path.exists():
        if wrapped:
            raise KekNotForRegistry(_kek_refusal(settings, wrapped, None))
        return make_kek(settings)
    kek = LocalFileKek(path, create=False)
    if wrapped and kek.key_id not in wrapped:
        raise KekNotForRegistry(_kek_refusal(settings, wrapped, kek.key_id))
    return kek


def _kek_refusal(settings: Settings, wrapped: dict[str, int], found: str | None) -> str:
    path = settings.kek_path
    registry = redact_url(settings.db_url)
    keys = ", ".join(f"{n} by {kek_id}" for kek_id, n in sorted(wrapped.items()))
    where = (
        f"the KEK file {path} (KVGATE_KEK_FILE)" if settings.kek_file is not None
        else f"the KEK file {path} of the state directory {settings.state_dir} (KVGATE_STATE_DIR)"
    )
    if found is None:
        what = (f"no new KEK was created: {where} does not exist, but the registry at {registry} "
                f"holds keys wrapped by an existing one ({keys}), which a new KEK could not unwrap")
    else:
        what = f"{where} holds KEK {found}, but the registry at {registry} holds keys wrapped by another ({keys})"
    if settings.database_url is None:
        fix = f"put the kek.key that wrapped them back at {path}, or point KVGATE_KEK_FILE at it"
    else:
        fix = ("point KVGATE_STATE_DIR at the state directory whose kek.key wrapped them (or KVGATE_KEK_FILE "
               "at that file); for a registry of this state directory's own, unset KVGATE_DATABASE_URL")
    return f"{what}. Fix: {fix}"
