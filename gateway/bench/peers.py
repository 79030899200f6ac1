"""Peers measured beside kvgate on the same bytes: LMCache, run from its own environment.

LMCache is never a dependency of kvgate: ``make bench-setup`` builds ``.venv-lmcache`` and
``scripts/lmcache_runner.py`` (outside every package directory, so no module of the project can
shadow the standard library in front of it) measures LMCache's storage path there and prints one
JSON object. Where both live is explicit (:class:`PeerConfig`, from ``kvgate bench``'s options
``--lmcache-python`` / ``--lmcache-runner`` or ``KVGATE_BENCH_LMCACHE_PYTHON`` /
``KVGATE_BENCH_LMCACHE_RUNNER``); the defaults are relative to the current directory, i.e. a
checkout's root: ``.venv-lmcache/bin/python`` and ``scripts/lmcache_runner.py``.

A peer that fails to run raises :class:`PeerFailed` with its error (the command exits non-zero);
``--no-peers`` skips peers on purpose. A peer environment that was neither named nor found at its
default place is skipped with a note (a fresh checkout without ``make bench-setup``); once named,
explicitly or by ``make bench``, it must run.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from gateway.cli.errors import CliError

__all__ = [
    "DEFAULT_LMCACHE_PYTHON", "DEFAULT_LMCACHE_RUNNER", "PeerConfig", "PeerFailed", "comparisons", "run_lmcache",
]

DEFAULT_LMCACHE_PYTHON = Path(".venv-lmcache/bin/python")
DEFAULT_LMCACHE_RUNNER = Path("scripts/lmcache_runner.py")


class PeerFailed(CliError):
    """A peer that was asked to run did not produce its figures (one line: the peer's error and
    the way out)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message} (`kvgate bench --no-peers` skips peers on purpose)")


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """Which peers run and from where. ``lmcache_python=None``: the default place, skipped with a
    note when absent; a path: required."""

    enabled: bool = True
    lmcache_python: Path | None = None
    lmcache_runner: Path = DEFAULT_LMCACHE_RUNNER
    timeout_s: float = 900.0


def _tail(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def run_lmcache(
    cfg: PeerConfig, chunk_sizes: list[int], total_bytes: int, reps: int, redis_url: str | None, tiers: list[str]
) -> dict[str, Any]:
    """LMCache's figures from its own environment, ``{"skipped": why}`` when not asked for, or
    :class:`PeerFailed`."""
    if not cfg.enabled:
        return {"skipped": "peers skipped on purpose (--no-peers)", "results": []}
    exe = cfg.lmcache_python or DEFAULT_LMCACHE_PYTHON
    if not exe.exists():
        if cfg.lmcache_python is None:
            return {"skipped": f"no LMCache environment at {exe} (run `make bench-setup`, or pass --lmcache-python)",
                    "results": []}
        raise PeerFailed(f"LMCache: no python at {exe} (run `make bench-setup` or fix --lmcache-python)")
    if not cfg.lmcache_runner.is_file():
        raise PeerFailed(f"LMCache: no runner at {cfg.lmcache_runner} (run from a kvgate checkout or pass --lmcache-runner)")
    hostport = ""
    if redis_url:
        u = urlparse(redis_url)
        hostport = f"{u.hostname or '127.0.0.1'}:{u.port or 6379}"
    # -I (isolated): neither the runner's directory nor PYTHON* variables reach its sys.path, so no
    # module of a checkout can shadow the standard library or LMCache there
    cmd = [str(exe.absolute()), "-I", str(cfg.lmcache_runner.resolve()), "--chunk-bytes", *map(str, chunk_sizes),
           "--total-bytes", str(total_bytes), "--reps", str(reps), "--redis", hostport, "--tiers", *tiers]
    env = {**os.environ, "LMCACHE_LOG_LEVEL": "WARNING"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.timeout_s, env=env, check=False,
                              cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        raise PeerFailed(f"LMCache runner timed out after {cfg.timeout_s:.0f} s") from None
    except OSError as exc:
        raise PeerFailed(f"LMCache runner could not start ({exc})") from None
    try:
        out: dict[str, Any] = json.loads(_tail(proc.stdout))
    except json.JSONDecodeError:
        raise PeerFailed(f"LMCache runner failed (exit {proc.returncode}): {_tail(proc.stderr)}") from None
    errors = out.get("errors") or []
    if proc.returncode != 0 or errors:
        first = errors[0] if errors else {}
        what = f"{first.get('variant')} {first.get('chunk_bytes')} B: {first.get('error')}" if first else _tail(proc.stderr)
        raise PeerFailed(f"LMCache runner failed (exit {proc.returncode}, {len(errors)} error(s)): {what}")
    if not out.get("results"):
        raise PeerFailed("LMCache runner measured nothing")
    return out


def comparisons(results: list[dict[str, Any]], peer: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvgate (one thread) / LMCache on the same op, tier, chunk bytes and encryption; for the
    memory tier, kvgate's encrypted figure beside LMCache's plaintext L1 too, and for the remote
    path (tier ``rest``: kvgate's REST data plane, always ciphertext) beside LMCache's plaintext
    cache server."""
    ours = {(r["op"], r["tier"], r["chunk_bytes"], r["encrypted"]): r for r in results if r["threads"] == 1}
    out = []
    for p in peer:
        wanted = [p["encrypted"]] + ([True] if p["tier"] in ("memory", "rest") and not p["encrypted"] else [])
        for encrypted in wanted:
            r = ours.get((p["op"], p["tier"], p["chunk_bytes"], encrypted))
            if r is None or not p["gbps"]:
                continue
            ours_enc = "encrypted" if encrypted else "plaintext"
            peer_enc = "encrypted" if p["encrypted"] else "plaintext"
            label = ours_enc if encrypted == p["encrypted"] else f"{ours_enc} vs {peer_enc}"  # kvgate vs LMCache
            row = {
                "figure": f"{p['op']} {p['tier']} {label} {p['chunk_bytes'] / 2**20:.0f} MiB [LMCache path: {p['path']}]",
                "kvgate": r["gbps"], "kvgate_encrypted": encrypted, "peer": "lmcache", "peer_value": p["gbps"],
                "peer_encrypted": p["encrypted"], "ratio": round(r["gbps"] / p["gbps"], 3), "peer_path": p["path"],
            }
            if "single_pass" in r:
                row["single_pass_gbps"] = r["single_pass"]["gbps"]
            out.append(row)
    return out
