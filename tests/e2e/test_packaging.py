"""`pip install kvgate` into a fresh virtual environment, then `kvgate demo` works, and a command
whose extra is missing says which extra in one line. Builds the wheel from this
checkout; torch comes from the CPU wheel the project's machines carry (TORCH_SPEC as in the
Makefile)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv

import pytest

from tests.support.paths import REPO

ROOT = REPO
pytestmark = [pytest.mark.slow]


def test_fresh_venv_install_then_demo_and_missing_extras(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = str(env_dir / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, os.environ.get("TORCH_SPEC", "torch==2.13.0")], check=True, timeout=900)
    src = tmp_path / "src"  # a copy without the checkout's venvs and build leftovers
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv*", ".git", "*.egg-info", "build", "__pycache__", "bench-results"))
    subprocess.run([*pip, str(src)], check=True, timeout=900)
    kvgate = str(env_dir / "bin" / "kvgate")
    env = {**os.environ, "KVGATE_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200"}
    env.pop("PYTHONPATH", None)
    demo = subprocess.run([kvgate, "demo", "--tokens", "1024", "--layers", "4"], capture_output=True, text=True, env=env,
                          timeout=600, cwd=tmp_path)
    assert demo.returncode == 0 and "FAIL" not in demo.stdout, demo.stdout + demo.stderr
    # the installed package is the one under test, not this checkout
    where = subprocess.run([py, "-c", "import gateway; print(gateway.__file__)"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert str(env_dir) in where.stdout, where.stdout
    bench = subprocess.run([kvgate, "bench", "--quick", "--reps", "1"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    lines = [ln for ln in bench.stderr.splitlines() if ln.strip()]
    assert bench.returncode == 2 and len(lines) == 1 and "kvgate[bench]" in lines[0], bench.stdout + bench.stderr
    doctor = subprocess.run([kvgate, "doctor"], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert sys.executable != py
