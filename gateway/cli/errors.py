"""One line, with the cause and the fix, for every error a `kvgate` command can meet (exit 2).

The command line never prints a traceback unless asked (`kvgate --debug ...` or
``KVGATE_DEBUG=1``). ``explain`` turns an exception into that line; it knows the errors of the
layers below by type, and walks ``__cause__``/``__context__`` so a library error wrapped by ours
is still named. Secrets never reach the line: URLs are shown without their password.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator

__all__ = ["CliError", "MissingExtra", "explain", "redact_url", "require_extra"]


class CliError(Exception):
    """An error a command states itself (already one line with its fix)."""


class MissingExtra(CliError):
    pass


_EXTRAS = {  # module -> (extra, what needs it)
    "matplotlib": ("bench", "benchmark plots"),
    "scipy": ("bench", "the benchmark's statistics"),
    "vllm": ("vllm", "the vLLM connector"),
    "pkcs11": ("pkcs11", "the PKCS#11 KEK provider"),
    "boto3": ("kms", "the AWS KMS KEK provider"),
    "botocore": ("kms", "the AWS KMS KEK provider"),
}


def require_extra(module: str) -> None:
    """Import check for an optional dependency: MissingExtra names the extra to install."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        extra, what = _EXTRAS.get(module, ("", module))
        hint = f"pip install 'kvgate[{extra}]'" if extra else f"pip install {module}"
        raise MissingExtra(f"{what} needs {module}, which is not installed: {hint}")


def redact_url(text: str) -> str:
    """``scheme://user:password@host`` -> ``scheme://user:***@host`` anywhere in ``text``."""
    return re.sub(r"(\w[\w+.-]*://[^:/@\s]*:)[^@\s]+@", r"\1***@", text)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        # ``raise ... from None`` hides the context, as Python's own traceback does
        e = e.__cause__ if e.__cause__ is not None else None if e.__suppress_context__ else e.__context__


def _one(exc: BaseException) -> str | None:
    """The line for one exception of a known kind, or None."""
    from pydantic import ValidationError

    name = type(exc).__name__
    mod = type(exc).__module__ or ""
    text = redact_url(str(exc)).strip().splitlines()[0] if str(exc).strip() else name
    if isinstance(exc, CliError) or name in ("VerifyInputError", "InvalidName", "KekNotForRegistry"):  # already a sentence
        return text
    if name == "InsecureStateFiles":  # a list of paths with their fix: one line, every item
        return "; ".join(part.strip() for part in redact_url(str(exc)).splitlines() if part.strip())
    if name == "SchemaBehind":
        return f"{text} (or use the embedded SQLite default, which kvgate serve migrates itself)"
    if isinstance(exc, ValidationError):
        errs = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()[:5])
        return f"configuration error: {redact_url(errs)} (see the configuration table in the README)"
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        root = exc.name.split(".")[0]
        extra, what = _EXTRAS.get(root, ("", root))
        hint = f"pip install 'kvgate[{extra}]'" if extra else f"pip install {root}"
        return f"{what} needs {root}, which is not installed: {hint}"
    if isinstance(exc, FileNotFoundError):
        return f"{exc.filename or text}: no such file or directory (create its directory or fix the path)"
    if isinstance(exc, IsADirectoryError):
        return f"{exc.filename}: is a directory, expected a file"
    if isinstance(exc, PermissionError):
        return f"{exc.filename or text}: permission denied (check the owner and mode; kvgate wants 0700 dirs, 0600 files)"
    if isinstance(exc, (ConnectionError, TimeoutError)) or (isinstance(exc, OSError) and exc.errno in _NET_ERRNOS):
        service = _service_of(exc)
        fix = {"database": "check KVGATE_DATABASE_URL and that the database is up",
               "redis": "check KVGATE_REDIS_URL and that Redis is up"}.get(service, "check the URL and that the service is up")
        return f"cannot reach the {service or 'service'} ({text}): {fix}"
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return "the address is already in use: another kvgate serve (or another program) listens there; use --port"
    if mod.startswith("sqlalchemy") or mod.startswith("asyncpg") or name in ("OperationalError", "InvalidCatalogNameError"):
        if "no such table" in text or "does not exist" in text and "relation" in text:
            return "the database has no kvgate schema yet: run `kvgate migrate`"
        return f"cannot use the database ({text}): check KVGATE_DATABASE_URL and that the server is up"
    if mod.startswith("redis"):
        return f"cannot reach Redis ({text}): check KVGATE_REDIS_URL and that the server is up"
    if name == "AuditKeyError":  # named for the audit key, even where its cause is a KekError of the token
        return f"the audit signing key is not usable: {text}"
    if name in ("KekError", "KeyUnavailable"):
        return f"the key-encryption key is not usable ({text}): check KVGATE_KEK_PROVIDER and its settings (kvgate doctor)"
    if name in ("ConnectError", "ConnectTimeout"):
        return f"cannot connect ({text}): is the server running, and is the URL right?"
    if name in ("TierUnavailable", "TierTimeout"):
        return f"a storage tier is unreachable ({text}): check its URL (KVGATE_REDIS_URL) and that it is up"
    return None


_NET_ERRNOS = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.ECONNRESET}


def _service_of(exc: BaseException) -> str:
    """Which client raised a network error, from the modules on its traceback."""
    tb = exc.__traceback__
    mods: list[str] = []
    while tb is not None:
        mods.append(tb.tb_frame.f_globals.get("__name__", ""))
        tb = tb.tb_next
    for m in reversed(mods):
        if m.startswith(("asyncpg", "sqlalchemy", "aiosqlite", "tenancy.registry", "audit.")):
            return "database"
        if m.startswith(("redis", "storage.redis", "storage._redis")):
            return "redis"
        if m.startswith(("httpx", "httpcore")):
            return "server"
    return ""


def explain(exc: BaseException) -> str:
    """The one line for ``exc`` (the most specific known cause in its chain)."""
    for e in _chain(exc):
        line = _one(e)
        if line is not None:
            return line
    text = redact_url(str(exc)).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text} (run with --debug for the traceback)"
