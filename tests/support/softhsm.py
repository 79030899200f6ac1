"""Where SoftHSM2's PKCS#11 module lies, and how a test says it is missing."""

from __future__ import annotations

import os

from tests.support.services import missing

MODULE_PATHS = [
    os.environ.get("KVGATE_TEST_PKCS11_MODULE", ""),
    "/usr/lib/softhsm/libsofthsm2.so",
    "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so",
    "/usr/lib/aarch64-linux-gnu/softhsm/libsofthsm2.so",
    "/usr/local/lib/softhsm/libsofthsm2.so",
]

def _missing(what: str) -> None:
    missing(f"{what} (install: apt-get install -y softhsm2; pip install python-pkcs11)")
