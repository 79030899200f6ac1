"""`kvgate bench`'s peers: a peer that fails to run fails the run with its error,
``--no-peers`` skips it on purpose, a peer environment never named is skipped with a note, and
the LMCache runner runs isolated, so no module beside it can shadow the standard library (the
bug that silently dropped the LMCache figures: ``gateway/types.py`` shadowing ``types``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.bench.peers import DEFAULT_LMCACHE_RUNNER, PeerConfig, PeerFailed, comparisons, run_lmcache
from tests.support.paths import REPO

ROOT = REPO
RUNNER = ROOT / DEFAULT_LMCACHE_RUNNER


def _fake_python(tmp_path: Path, body: str) -> Path:
    """An executable standing in for the LMCache environment's python; it records that it ran."""
    exe = tmp_path / "fake-python"
    exe.write_text(f"#!/bin/sh\ntouch '{tmp_path / 'ran'}'\n{body}\n")
    exe.chmod(0o755)
    return exe


def _run(cfg: PeerConfig) -> dict:
    return run_lmcache(cfg, [2 << 20], 4 << 20, 1, None, ["memory"])


def test_a_peer_that_crashes_fails_with_its_error(tmp_path):
    exe = _fake_python(tmp_path, 'echo "Traceback (most recent call last):" >&2\n'
                                 'echo "IndexError: list index out of range" >&2\nexit 1')
    with pytest.raises(PeerFailed, match="IndexError: list index out of range") as err:
        _run(PeerConfig(lmcache_python=exe, lmcache_runner=RUNNER))
    assert "--no-peers" in str(err.value) and (tmp_path / "ran").exists()


def test_a_peer_reporting_errors_fails_even_with_json(tmp_path):
    out = {"results": [], "errors": [{"variant": "l1-dram", "chunk_bytes": 2097152, "error": "RuntimeError('L1 full')"}]}
    (tmp_path / "out.json").write_text(json.dumps(out) + "\n")
    exe = _fake_python(tmp_path, f"cat '{tmp_path / 'out.json'}'\nexit 1")
    with pytest.raises(PeerFailed, match=r"l1-dram 2097152 B: RuntimeError\('L1 full'\)"):
        _run(PeerConfig(lmcache_python=exe, lmcache_runner=RUNNER))


def test_a_peer_that_measured_nothing_fails(tmp_path):
    exe = _fake_python(tmp_path, """echo '{"results": [], "errors": []}'""")
    with pytest.raises(PeerFailed, match="measured nothing"):
        _run(PeerConfig(lmcache_python=exe, lmcache_runner=RUNNER))


def test_a_good_peer_is_read_positive_control(tmp_path):
    row = {"path": "p/l1-dram", "op": "store", "tier": "memory", "encrypted": False, "chunk_bytes": 2 << 20, "gbps": 4.0}
    exe = _fake_python(tmp_path, f"echo 'lmcache: a log line'\necho '{json.dumps({'results': [row], 'errors': []})}'")
    got = _run(PeerConfig(lmcache_python=exe, lmcache_runner=RUNNER))
    assert got["results"] == [row]
    ours = [{"op": "store", "tier": "memory", "encrypted": enc, "chunk_bytes": 2 << 20, "threads": 1, "gbps": g,
             **({"single_pass": {"gbps": 10.0, "ratio": 0.2}} if enc else {})} for enc, g in ((False, 8.0), (True, 2.0))]
    comp = {c["kvgate_encrypted"]: c for c in comparisons(ours, got["results"])}
    assert comp[False]["ratio"] == 2.0 and comp[True]["ratio"] == 0.5  # encrypted kvgate vs plaintext L1 too
    assert comp[True]["single_pass_gbps"] == 10.0 and "LMCache path: p/l1-dram" in comp[True]["figure"]


def test_no_peers_skips_without_running_the_peer(tmp_path):
    exe = _fake_python(tmp_path, "exit 1")
    got = _run(PeerConfig(enabled=False, lmcache_python=exe, lmcache_runner=RUNNER))
    assert "--no-peers" in got["skipped"] and got["results"] == []
    assert not (tmp_path / "ran").exists()


def test_a_named_environment_must_exist_an_unnamed_one_is_a_note(tmp_path, monkeypatch):
    with pytest.raises(PeerFailed, match="no python at"):
        _run(PeerConfig(lmcache_python=tmp_path / "nope" / "python", lmcache_runner=RUNNER))
    monkeypatch.chdir(tmp_path)  # the default is relative to the current directory: absent here
    got = _run(PeerConfig(lmcache_python=None, lmcache_runner=RUNNER))
    assert "make bench-setup" in got["skipped"]
    exe = _fake_python(tmp_path, "exit 0")
    with pytest.raises(PeerFailed, match="no runner at"):
        _run(PeerConfig(lmcache_python=exe, lmcache_runner=tmp_path / "missing.py"))


def test_the_runner_is_not_shadowed_by_modules_beside_it(tmp_path):
    """The runner is started isolated: modules beside it (``gateway/types.py`` broke it inside
    gateway/) are never imported in place of the standard library's. ``argparse`` stands for any
    standard module the interpreter has not loaded at startup (``types`` may already be loaded by a
    venv's .pth files). Positive control: the same copy started the old way is shadowed."""
    d = tmp_path / "pkg"
    d.mkdir()
    shutil.copy(RUNNER, d / "lmcache_runner.py")
    for name in ("types", "argparse"):
        (d / f"{name}.py").write_text(f"raise SystemExit('shadowed: the checkout {name}.py was imported')\n")
    old_way = subprocess.run([sys.executable, str(d / "lmcache_runner.py"), "--chunk-bytes", "1024"],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert "shadowed" in old_way.stderr, old_way.stderr
    # this interpreter has no lmcache: the isolated runner gets as far as importing it
    with pytest.raises(PeerFailed) as err:
        _run(PeerConfig(lmcache_python=Path(sys.executable), lmcache_runner=d / "lmcache_runner.py"))
    assert "No module named 'lmcache'" in str(err.value) and "shadowed" not in str(err.value)


def test_the_remote_path_stands_beside_kvgates_rest_rows():
    """LMCache's cache server (plaintext, tier ``rest``) is compared with kvgate's REST data plane,
    which only ever moves ciphertext; a kvgate row of another tier or size is never its match."""
    peer = [{"path": "lmcache-server/lm", "op": "load", "tier": "rest", "encrypted": False, "chunk_bytes": 2 << 20, "gbps": 2.0}]
    ours = [
        {"op": "load", "tier": "rest", "encrypted": True, "chunk_bytes": 2 << 20, "threads": 1, "gbps": 3.0},
        {"op": "load", "tier": "rest_uds", "encrypted": True, "chunk_bytes": 2 << 20, "threads": 1, "gbps": 9.0},
        {"op": "load", "tier": "rest", "encrypted": True, "chunk_bytes": 32 << 20, "threads": 1, "gbps": 9.0},
    ]
    (comp,) = comparisons(ours, peer)
    assert comp["ratio"] == 1.5 and comp["kvgate_encrypted"] and not comp["peer_encrypted"]
    assert comp["figure"] == "load rest encrypted vs plaintext 2 MiB [LMCache path: lmcache-server/lm]"
    assert comparisons([], peer) == []  # the control: nothing of kvgate's, nothing compared
