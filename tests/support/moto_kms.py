"""moto's KMS server, a process of a test's own on a free port, stopped by its pid.

    moto_server(log_path)   a context manager: a ``Moto`` (endpoint URL, process) while the
                            server runs; the AWS_* test credentials set for its lifetime
                            (restored after)

Needs boto3 and moto[server]; skipped without them, FAILED when CI=true.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.services import free_port, missing

REGION = "us-east-1"
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION}


@dataclass(frozen=True)
class Moto:
    endpoint: str
    proc: subprocess.Popen[bytes]  # to kill it mid-test


@contextmanager
def moto_server(log_path: Path | None = None) -> Iterator[Moto]:
    for mod in ("boto3", "moto", "flask"):
        if importlib.util.find_spec(mod) is None:
            missing(f"{mod} is not installed (install: pip install boto3 'moto[server]')")
    saved = {k: os.environ.get(k) for k in _CREDENTIALS}
    os.environ.update(_CREDENTIALS)
    log = log_path.open("wb") if log_path is not None else subprocess.DEVNULL
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not start{f' (see {log_path})' if log_path else ''}")
                time.sleep(0.2)
        yield Moto(f"http://127.0.0.1:{port}", proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=10)
        if log_path is not None and not isinstance(log, int):
            log.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
