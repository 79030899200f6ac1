"""Which AES-GCM runs on a device: the Triton kernels or the torch-ops reference.

    triton_available()                 is ``triton`` importable (without importing it)
    choose_device_aes(device, pref)    "triton" or "torch" for a device and a setting
    device_aead_factory(device, pref, failure=...) -> (name, key -> AEAD)

``pref`` is the ``device_aes`` setting: ``auto`` takes Triton where it can run compiled (a CUDA
device with triton installed) and the torch-ops cipher (``kernels.aes_gcm.TorchAesGcm``) elsewhere;
``triton`` insists (an error if triton is missing, or on a CPU device unless ``TRITON_INTERPRET=1``:
the interpreter, for tests and the CPU device check); ``torch`` always takes the reference.
``kernels.triton_gcm`` (which imports triton) is imported only when Triton is chosen, so the
product imports and works without triton.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any, Literal

import torch

from .aes_gcm import AeadParameterError, TagMismatch, TorchAesGcm

__all__ = ["DEVICE_AES_CHOICES", "choose_device_aes", "device_aead_factory", "interpreting", "triton_available"]

DEVICE_AES_CHOICES = ("auto", "triton", "torch")
DeviceAes = Literal["auto", "triton", "torch"]


def triton_available() -> bool:
    """``triton`` is installed (looked up, not imported: importing it costs about a second)."""
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
    if name == "triton":
        from .triton_gcm import TritonAesGcm

        return name, lambda key: TritonAesGcm(key, device, failure=failure)
    return name, lambda key: TorchAesGcm(key, device, failure=failure)
