"""A PostgreSQL server of a test's own (initdb in a temp dir, on a free port), to stop, kill and restart by its pid.

    ThrowawayPostgres   the server; ``init``, ``start``, ``stop``, ``cleanup``
    started()           one, initialised and started, cleaned up after (a context manager)
    pg_cluster          the same as a fixture (registered for every test module in tests/conftest.py)
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.services import IN_CI, free_port

PG_BIN = Path(os.environ.get("KVGATE_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


class ThrowawayPostgres:
    def __init__(self) -> None:
        if not (PG_BIN / "pg_ctl").exists():
            msg = f"no Postgres binaries in {PG_BIN}"
            pytest.fail(msg) if IN_CI else pytest.skip(msg)
        self.root = Path(tempfile.mkdtemp(prefix="kvgate-audit-pg-"))
        self.prefix: list[str] = []
        if os.geteuid() == 0:
            pg = pwd.getpwnam("postgres")
            os.chown(self.root, pg.pw_uid, pg.pw_gid)
            self.prefix = ["runuser", "-u", "postgres", "--"]
        self.data = self.root / "data"
        self.port = free_port()
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 120) -> None:
        done = subprocess.run([*self.prefix, *args], capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {done.stdout}\n{done.stderr}")

    def init(self) -> None:
        self._run(str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.root / "log"),
            "-w",
            "-t",
            "60",
            "-o",
            options,
            "start",
        )

    def stop(self, mode: str = "immediate") -> None:
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def cleanup(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def started() -> Iterator[ThrowawayPostgres]:
    """A throwaway server, initialised and started; stopped and removed after, whatever happens."""
    pg = ThrowawayPostgres()
    try:
        pg.init()
        pg.start()
        yield pg
    finally:
        pg.cleanup()


@pytest.fixture
def pg_cluster() -> Iterator[ThrowawayPostgres]:
    """A Postgres server of this test's own, to stop and start (see ``started``)."""
    with started() as pg:
        yield pg
