"""`kvgate bench` as a command: the bench package is imported only by the command,
a missing ``bench`` extra is one line naming it (exit 2), and a peer that fails fails the command
with its error before any figure is spent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO

ROOT = REPO

# hides scipy as if it were not installed: every import of it, and importlib's look-up, fail
_HIDE_SCIPY = """
import sys
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "scipy" or name.startswith("scipy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Hide())
for m in [m for m in sys.modules if m == "scipy" or m.startswith("scipy.")]:
    del sys.modules[m]
"""


def _py(code: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "KVGATE_STATE_DIR": str(cwd / "state")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def _kvgate(*args: str) -> str:
    return f"import sys; sys.argv = ['kvgate', *{list(args)!r}]\nfrom gateway.cli.main import main\nmain()\n"


def test_importing_the_cli_does_not_import_the_bench(tmp_path):
    code = ("import sys, gateway.cli.main\n"
            "print(sorted(m for m in sys.modules if m == 'gateway.bench' or m.startswith('gateway.bench.')))\n"
            "import gateway.bench.run\n"  # positive control: the probe sees the package once imported
            "print('gateway.bench' in sys.modules)\n")
    out = _py(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "True"], out.stdout


def test_bench_without_scipy_fails_in_one_line_naming_the_extra(tmp_path):
    probe = _py(_HIDE_SCIPY + "import numpy\ntry:\n    import scipy.stats\nexcept ModuleNotFoundError:\n"
                "    print('hidden')\n", tmp_path)
    assert probe.stdout.strip() == "hidden", probe.stdout + probe.stderr  # the simulation works
    out = _py(_HIDE_SCIPY + _kvgate("bench", "--quick", "--json", str(tmp_path / "b.json")), tmp_path)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2, out.stdout + out.stderr
    assert len(lines) == 1 and "pip install 'kvgate[bench]'" in lines[0] and "scipy" in lines[0], out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "b.json").exists()


def test_a_failing_peer_fails_the_command_with_its_error(tmp_path):
    exe = tmp_path / "lmcache-python"
    exe.write_text("#!/bin/sh\necho 'IndexError: list index out of range' >&2\nexit 1\n")
    exe.chmod(0o755)
    out = _py(_kvgate("bench", "--quick", "--json", str(tmp_path / "b.json"), "--lmcache-python", str(exe),
                      "--lmcache-runner", str(ROOT / "scripts" / "lmcache_runner.py")), tmp_path)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2, out.stdout + out.stderr
    assert len(lines) == 1 and "LMCache runner failed" in lines[0] and "IndexError" in lines[0], out.stderr
    assert "--no-peers" in lines[0] and not (tmp_path / "b.json").exists()
    assert "bench: concurrent tenants" not in out.stdout  # it failed first, before the rest was spent


def test_the_runner_default_is_relative_to_the_current_directory(tmp_path):
    """No repo-finding from the package's own path: from a directory without scripts/, a named
    LMCache python fails for want of the runner (positive control: the same from the checkout
    finds it and gets as far as the missing lmcache)."""
    code = _kvgate("bench", "--quick", "--lmcache-python", sys.executable)
    away = _py(code, tmp_path)
    assert away.returncode == 2 and "no runner at scripts/lmcache_runner.py" in away.stderr, away.stderr
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "KVGATE_STATE_DIR": str(tmp_path / "state")}
    here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert here.returncode == 2 and "No module named 'lmcache'" in here.stderr, here.stderr
