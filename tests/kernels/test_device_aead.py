"""Which device AES-GCM runs (``kernels.device_aead``), the ``device_aes`` setting, and the
segment copier of the transfer path (``kernels.transfer``), which is inert on the CPU. None of
these tests needs triton: the product must work without it."""

from __future__ import annotations

import os

import pytest
import torch

from crypto.envelope import ChunkCipher
from kernels import device_aead
from kernels.aes_gcm import AeadParameterError, TorchAesGcm
from kernels.transfer import SegmentCopier
from tests.support.paths import REPO


@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setattr(device_aead, "triton_available", lambda: False)


@pytest.fixture
def with_triton(monkeypatch):
    monkeypatch.setattr(device_aead, "triton_available", lambda: True)


def test_auto_takes_triton_only_on_cuda_with_triton(with_triton) -> None:
    assert device_aead.choose_device_aes("cuda:0", "auto") == "triton"
    assert device_aead.choose_device_aes("cpu", "auto") == "torch"  # not even under the interpreter
    assert device_aead.choose_device_aes("cuda", "torch") == "torch"


def test_auto_falls_back_to_torch_without_triton(no_triton) -> None:
    assert device_aead.choose_device_aes("cuda", "auto") == "torch"
    assert device_aead.choose_device_aes("cpu", "auto") == "torch"
    name, factory = device_aead.device_aead_factory("cpu", "auto")
    assert name == "torch" and isinstance(factory(bytes(32)), TorchAesGcm)


def test_forcing_triton_fails_clearly(no_triton, monkeypatch) -> None:
    with pytest.raises(AeadParameterError, match="not installed"):
        device_aead.choose_device_aes("cuda", "triton")
    monkeypatch.setattr(device_aead, "triton_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(AeadParameterError, match="TRITON_INTERPRET"):
        device_aead.choose_device_aes("cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert device_aead.choose_device_aes("cpu", "triton") == "triton"


def test_auto_falls_back_to_torch_when_the_self_test_fails(with_triton, monkeypatch, caplog) -> None:
    monkeypatch.setattr(device_aead, "_TESTED", {})
    monkeypatch.setattr(device_aead, "choose_device_aes", lambda device, pref: "triton")

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    import kernels.aes_gcm

    monkeypatch.setitem(__import__("sys").modules, "kernels.triton_gcm", type("M", (), {"TritonAesGcm": broken}))
    name, factory = device_aead.device_aead_factory("cpu", "auto")
    assert name == "torch" and isinstance(factory(bytes(32)), kernels.aes_gcm.TorchAesGcm)
    assert "self-test raised" in caplog.text
    assert device_aead._TESTED == {"cpu": False}
    with pytest.raises(RuntimeError):  # forced: no silent fallback
        device_aead.device_aead_factory("cpu", "triton")[1](bytes(32))


def test_a_bad_setting_is_refused() -> None:
    with pytest.raises(AeadParameterError):
        device_aead.choose_device_aes("cpu", "fast")


def test_the_setting_reaches_the_data_path(tmp_path, no_triton) -> None:
    from gateway.config import Settings
    from gateway.datapath import DataPath

    assert Settings(state_dir=tmp_path).device_aes == "auto"
    assert Settings(state_dir=tmp_path, device_aes="torch").device_aes == "torch"
    with pytest.raises(ValueError):
        Settings(state_dir=tmp_path, device_aes="fast")
    dp = DataPath(ChunkCipher(), threads=0, device_aes="auto")
    assert dp.device_aes_name(torch.device("cpu")) == "torch"


def test_the_product_imports_without_triton(tmp_path) -> None:
    """A fresh interpreter where ``import triton`` fails still builds the data path's cipher."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import importlib.util as u; u.find_spec = (lambda f: (lambda n, *a: None if n == 'triton' else f(n, *a)))(u.find_spec)\n"
        "import torch\n"
        "from gateway.datapath import DataPath\n"
        "from crypto.envelope import ChunkCipher\n"
        "dp = DataPath(ChunkCipher(), threads=0, device_cipher='always')\n"
        "name = dp.device_aes_name(torch.device('cpu'))\n"
        "assert name == 'torch', name\n"
        "assert 'kernels.triton_gcm' not in sys.modules\n"
        "print('ok')\n"
    )
    root = str(REPO)
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# -- the transfer path ------------------------------------------------------------------------------


def test_the_segment_copier_is_a_plain_copy_on_the_cpu() -> None:
    copier = SegmentCopier("cpu", 64)
    assert not copier.active
    src = torch.arange(64, dtype=torch.uint8)
    copier.issue_d2h(src, 0, 40)  # nothing to overlap on the CPU: a no-op
    dst = bytearray(40)
    copier.fetch_d2h(src, 0, 40, memoryview(dst))
    assert bytes(dst) == bytes(range(40))
    back = torch.zeros(64, dtype=torch.uint8)
    copier.h2d(memoryview(bytes(range(100, 124))), back, 10, 34)
    assert back[10:34].tolist() == list(range(100, 124)) and not back[:10].any() and not back[34:].any()
    copier.fetch_d2h(src, 5, 5, memoryview(bytearray()))  # empty ranges are fine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
def test_the_segment_copier_overlaps_on_a_side_stream() -> None:
    copier = SegmentCopier("cuda", 1 << 20)
    assert copier.active
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    for s in range(0, 1 << 20, 1 << 18):
        copier.issue_d2h(src, s, s + (1 << 18))
    dst = bytearray(1 << 20)
    for s in range(0, 1 << 20, 1 << 18):
        copier.fetch_d2h(src, s, s + (1 << 18), memoryview(dst)[s : s + (1 << 18)])
    assert bytes(dst) == src.cpu().numpy().tobytes()
    back = torch.zeros_like(src)
    copier.h2d(memoryview(bytes(dst)), back, 0, 1 << 20)
    assert torch.equal(back, src)
