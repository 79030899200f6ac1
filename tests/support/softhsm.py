"""Where SoftHSM2's PKCS#11 module lies, how a test says it is missing, and a token of a test's own."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO
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


def token_in_subprocesses(root: Path, label: str, kek_label: str = "kek-1", signing_label: str | None = None) -> dict[str, str]:
    """A SoftHSM2 token of a test's own under ``root`` (PIN 1111) holding a KEK and, where named,
    an audit signing key pair, set up entirely in subprocesses: SoftHSM2 reads SOFTHSM2_CONF once
    per process, so loading it in the test's process would pin it to this token directory and
    break other tests' tokens later in the same run. Returns the settings that name it (the PIN
    is left to the caller)."""
    module = next((p for p in MODULE_PATHS if p and Path(p).is_file()), None)
    util = shutil.which("softhsm2-util")
    if module is None or util is None or importlib.util.find_spec("pkcs11") is None:
        _missing("SoftHSM2 or python-pkcs11 is not installed")
    assert module is not None and util is not None
    (root / "tokens").mkdir(parents=True)
    conf = root / "softhsm2.conf"
    conf.write_text(f"directories.tokendir = {root / 'tokens'}\nobjectstore.backend = file\nlog.level = ERROR\n")
    env = {**os.environ, "SOFTHSM2_CONF": str(conf)}
    subprocess.run([util, "--init-token", "--free", "--label", label, "--pin", "1111", "--so-pin", "so-1111"],
                   check=True, capture_output=True, env=env)
    code = ("from crypto.kek import Secret; from crypto.kek_pkcs11 import generate_pkcs11_kek;"
            f"generate_pkcs11_kek({module!r}, {label!r}, Secret(b'1111'), {kek_label!r})")
    if signing_label is not None:
        code += (";from crypto.signer_pkcs11 import generate_pkcs11_signing_key;"
                 f"generate_pkcs11_signing_key({module!r}, {label!r}, Secret(b'1111'), {signing_label!r})")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=env, cwd=str(REPO))
    return {"SOFTHSM2_CONF": str(conf), "KVGATE_KEK_PROVIDER": "pkcs11", "KVGATE_PKCS11_MODULE": module,
            "KVGATE_PKCS11_TOKEN_LABEL": label, "KVGATE_PKCS11_KEY_LABEL": kek_label}


def token_dir(tokens: Path, label: str) -> Path:
    """The directory under ``tokens`` (a ``directories.tokendir``) that holds the token ``label``
    (SoftHSM2 stores the label padded to 32 bytes in ``token.object``): moving it aside and back
    is how a test makes the token go away and return."""
    padded = label.encode().ljust(32)
    for d in tokens.iterdir():
        obj = d / "token.object"
        if obj.is_file() and padded in obj.read_bytes():
            return d
    raise FileNotFoundError(f"no SoftHSM2 token directory for {label} in {tokens}")
