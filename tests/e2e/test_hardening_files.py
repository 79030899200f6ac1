"""Issue 15, point 8: the SQLite database, the spool, the keys and the disk tier's files are created
0600 in 0700 directories (under the usual umask 022), and a start refuses, with a clear error, a
state directory or file that group or others can reach."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import chunks
from tests.support.server_fixture import fake_envelope, random_hash, running_server


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(files, directories) under ``root``, path -> permission bits."""
    files, dirs = {}, {str(root): stat.S_IMODE(os.lstat(root).st_mode)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name, into in [(d, dirs) for d in dirnames] + [(f, files) for f in filenames]:
            try:
                into[str(Path(dirpath) / name)] = stat.S_IMODE(os.lstat(Path(dirpath) / name).st_mode)
            except FileNotFoundError:  # a -shm or temporary file, gone already
                pass
    return files, dirs


def test_state_files_are_created_owner_only(tmp_path: Path, umask_022: None):
    state = tmp_path / "state"
    with running_server(state, tiers=["memory", "disk"]) as live:

        async def put() -> None:
            async with live.client() as http:
                a = await live.create_tenant(http)
                cap = await live.capability(http, a)
                r = await chunks.store(http, live.headers(live.worker_token(a), cap), [(random_hash(), fake_envelope())])
                assert r.status_code == 204
            await live.call(live.runtime.audit.flush, 10)

        asyncio.run(put())
        files, dirs = _modes(state)
    assert any(p.endswith("kvgate.db") for p in files) and any("chunks" in p for p in dirs)  # positive control: they exist
    loose = {p: f"{m:04o}" for p, m in files.items() if m & 0o077} | {p: f"{m:04o}" for p, m in dirs.items() if m & 0o077}
    assert not loose, f"group/other-accessible state: {loose}"


@pytest.mark.parametrize("target,mode", [("kvgate.db", 0o644), (".", 0o755), ("kek.key", 0o640), ("audit-spool", 0o755)])
def test_a_start_refuses_loose_state(tmp_path: Path, umask_022: None, target: str, mode: int):
    from gateway.services.runtime import open_runtime
    from gateway.services.statefiles import InsecureStateFiles
    from tests.support.server_fixture import _migrate, server_settings

    settings = server_settings(tmp_path / "state", 1)
    _migrate(settings.db_url)

    async def start() -> None:
        rt = await open_runtime(settings)
        await rt.aclose()

    asyncio.run(start())  # positive control: the state it made itself opens (and kek.key, the spool exist now)
    path = (settings.state_dir / target).resolve()
    assert path.exists()
    before = stat.S_IMODE(path.stat().st_mode)
    os.chmod(path, mode)
    try:
        with pytest.raises(InsecureStateFiles) as info:
            asyncio.run(start())
        message = str(info.value)
        assert str(path) in message and f"{mode:04o}" in message and "chmod" in message
    finally:
        os.chmod(path, before)
    asyncio.run(start())  # and opens again once fixed


def test_cli_reports_loose_state_clearly(tmp_path: Path, umask_022: None, monkeypatch: pytest.MonkeyPatch):
    from typer.testing import CliRunner

    from gateway.cli.main import app

    state = tmp_path / "state"
    monkeypatch.setenv("KVGATE_STATE_DIR", str(state))
    runner = CliRunner()
    assert runner.invoke(app, ["migrate"]).exit_code == 0
    assert stat.S_IMODE((state / "kvgate.db").stat().st_mode) == 0o600
    assert runner.invoke(app, ["tenants", "list"]).exit_code == 0  # positive control
    os.chmod(state / "kvgate.db", 0o644)
    res = runner.invoke(app, ["tenants", "list"])
    assert res.exit_code == 2, res.output
    assert "kvgate.db" in res.output and "chmod 600" in res.output
