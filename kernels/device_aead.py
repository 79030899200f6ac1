"""Which AES-GCM runs on a device: the Triton kernels or the torch-ops reference.

    triton_available()                 is ``triton`` importable (without importing it)
    choose_device_aes(device, pref)    "triton" or "torch" for a device and a setting
    device_aead_factory(device, pref, failure=...) -> (name, key -> AEAD)

``pref`` is the ``device_aes`` setting. ``auto`` takes Triton where it can run compiled (a CUDA
device with triton installed) and the torch-ops cipher (``kernels.aes_gcm.TorchAesGcm``)
elsewhere; Triton is handed out only after its self-test passes on that device (seal and open a
sample bit-identical to the torch reference, a flipped bit refused), else the failure is logged
and the torch-ops cipher is used. ``triton`` insists (an error if triton is missing, or on a CPU
device unless ``TRITON_INTERPRET=1``); ``torch`` always takes the reference. ``kernels.triton_gcm``
(which imports triton) is imported only when Triton is chosen, so the product works without it."""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Literal

import torch

from .aes_gcm import AeadParameterError, TagMismatch, TorchAesGcm

__all__ = [
    "DEVICE_AES_CHOICES",
    "choose_device_aes",
    "device_aead_factory",
    "interpreting",
    "self_test",
    "triton_available",
]

log = logging.getLogger("kvgate.kernels")
_TESTED: dict[str, bool] = {}
_TESTED_LOCK = threading.Lock()

DEVICE_AES_CHOICES = ("auto", "triton", "torch")
DeviceAes = Literal["auto", "triton", "torch"]


def triton_available() -> bool:
    """``triton`` is installed (looked up, not imported: importing it is slow)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton kernels run in its interpreter (CPU tensors) rather than compiled."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in {"1", "true", "yes", "on"}


def choose_device_aes(device: torch.device | str, pref: str = "auto") -> Literal["triton", "torch"]:
    """The AES-GCM implementation for ``device`` under the setting ``pref``."""
    if pref not in DEVICE_AES_CHOICES:
        raise AeadParameterError(f"device_aes must be one of {', '.join(DEVICE_AES_CHOICES)}, got {pref!r}")
    dev = torch.device(device)
    if pref == "torch":
        return "torch"
    if pref == "auto":
        return "triton" if dev.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise AeadParameterError("device_aes=triton, but triton is not installed")
    if dev.type != "cuda" and not interpreting():
        raise AeadParameterError(
            f"device_aes=triton on {dev.type} needs TRITON_INTERPRET=1 (Triton compiles for CUDA only)"
        )
    return "triton"


def device_aead_factory(
    device: torch.device | str,
    pref: str = "auto",
    *,
    failure: Callable[[], BaseException] = TagMismatch,
) -> tuple[Literal["triton", "torch"], Callable[[bytes], Any]]:
    """``(name, factory)``: ``factory(key)`` builds the chosen AEAD for ``device``."""
    name = choose_device_aes(device, pref)
    if name == "triton" and pref == "auto" and not self_test(device):
        name = "torch"
    if name == "triton":
        from .triton_gcm import TritonAesGcm

        return name, lambda key: TritonAesGcm(key, device, failure=failure)
    return name, lambda key: TorchAesGcm(key, device, failure=failure)


def self_test(device: torch.device | str) -> bool:
    """Do the Triton kernels work on ``device``? Once per device: a 1 KiB sample with AAD sealed by
    Triton and by the torch reference must be the same bytes, open again, and fail on a flipped
    bit. Any exception (no compiler, a launch error) counts as a failure; it is logged."""
    key = str(torch.device(device))
    with _TESTED_LOCK:
        if key in _TESTED:
            return _TESTED[key]
        try:
            from .triton_gcm import TritonAesGcm

            gen = torch.Generator().manual_seed(21)
            k, nonce, aad = bytes(range(32)), bytes(range(12)), bytes(range(40))
            data = torch.randint(0, 256, (1041,), dtype=torch.uint8, generator=gen).to(device)
            a, b = data.clone(), data.clone()
            tri = TritonAesGcm(k, device)
            ok = tri.encrypt_(a, nonce, aad) == TorchAesGcm(k, device).encrypt_(b, nonce, aad)
            ok = ok and bool(torch.equal(a, b))
            tag = TorchAesGcm(k, device).encrypt_(data.clone(), nonce, aad)
            tri.decrypt_(a, nonce, aad, tag)
            ok = ok and bool(torch.equal(a, data))
            b[7] ^= 1
            try:
                tri.decrypt_(b, nonce, aad, tag)
                ok = False
            except TagMismatch:
                pass
        except Exception:
            log.exception("the Triton AES-GCM self-test raised on %s; using the torch-ops cipher", key)
            ok = False
        else:
            if not ok:
                log.error("the Triton AES-GCM self-test gave wrong bytes on %s; using the torch-ops cipher", key)
        _TESTED[key] = ok
        return ok
