"""Host-side constants for ``kernels.aes_gcm``, in plain Python ints (no torch, no device).

    sbox()             the AES S-box (FIPS-197 5.1.1), derived from GF(2^8) inverses + the affine map
    ttable()           the four round T-tables as one 1024-entry list of signed int32 words
    shift_rows()       ShiftRows as a byte permutation of the column-major 16-byte state
    expand_key(key)    the AES-256 key schedule: 15 round keys of 16 bytes
    gf128_basis()      x^e mod (x^128 + x^7 + x^2 + x + 1) for e = 0..254, in GCM's bit order

Everything is computed on first use (``functools.cache``), never at import. ``ttable()`` entry
``256 r + x`` is the little-endian int32 contribution of byte ``x`` at row ``r`` to its output
column (``kernels.aes_gcm`` checks ``sys.byteorder``). Bit ``p`` of ``gf128_basis()[e]`` is the
coefficient of ``x^p`` (NIST SP 800-38D 6.3 bit order). Known-answer checks live in
``tests/kernels/test_aes_gcm.py``. Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

from functools import cache

__all__ = ["expand_key", "gf128_basis", "sbox", "shift_rows", "ttable", "xtime"]

_AES_POLY = 0x11B  # x^8 + x^4 + x^3 + x + 1
_GCM_REDUCE = 0x87  # x^7 + x^2 + x + 1 (x^128 folded back)
_ROUNDS = 14
_RCON = (0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40)


def xtime(b: int) -> int:
    """Multiply a byte by x in GF(2^8)."""
    b <<= 1
    return b ^ _AES_POLY if b & 0x100 else b


def _rotl8(v: int, n: int) -> int:
    return ((v << n) | (v >> (8 - n))) & 0xFF


@cache
def sbox() -> tuple[int, ...]:
    """The AES S-box: affine map of the multiplicative inverse in GF(2^8) (0 maps to 0x63)."""
    exp, log = [0] * 255, [0] * 256
    x = 1
    for i in range(255):  # 3 generates the multiplicative group
        exp[i] = x
        log[x] = i
        x ^= xtime(x)
    box = []
    for a in range(256):
        inv = 0 if a == 0 else exp[(255 - log[a]) % 255]
        box.append(inv ^ _rotl8(inv, 1) ^ _rotl8(inv, 2) ^ _rotl8(inv, 3) ^ _rotl8(inv, 4) ^ 0x63)
    return tuple(box)


def _signed32(w: int) -> int:
    return w - (1 << 32) if w >= 1 << 31 else w


@cache
def ttable() -> tuple[int, ...]:
    """``T[256 r + x]``: the output column contributed by ``x`` at row ``r`` (little-endian int32)."""
    out = []
    for r in range(4):
        for x in range(256):
            s = sbox()[x]
            s2 = xtime(s)
            s3 = s2 ^ s
            col = ((s2, s, s, s3), (s3, s2, s, s), (s, s3, s2, s), (s, s, s3, s2))[r]
            out.append(_signed32(col[0] | col[1] << 8 | col[2] << 16 | col[3] << 24))
    return tuple(out)


@cache
def shift_rows() -> tuple[int, ...]:
    """``perm`` with ``after[i] = before[perm[i]]``: row ``r`` rotates left by ``r`` columns."""
    return tuple(4 * ((c + r) % 4) + r for c in range(4) for r in range(4))


def expand_key(key: bytes) -> list[bytes]:
    """AES-256 key expansion (FIPS-197 5.2): 15 round keys of 16 bytes. ``key`` is 32 bytes."""
    if len(key) != 32:
        raise ValueError(f"AES-256 key must be 32 bytes, got {len(key)}")
    box = sbox()
    words = [list(key[4 * i : 4 * i + 4]) for i in range(8)]
    for i in range(8, 4 * (_ROUNDS + 1)):
        temp = list(words[i - 1])
        if i % 8 == 0:
            temp = [box[b] for b in temp[1:] + temp[:1]]
            temp[0] ^= _RCON[i // 8 - 1]
        elif i % 8 == 4:
            temp = [box[b] for b in temp]
        words.append([a ^ b for a, b in zip(words[i - 8], temp)])
    return [bytes(b for w in words[4 * r : 4 * r + 4] for b in w) for r in range(_ROUNDS + 1)]


@cache
def gf128_basis() -> tuple[int, ...]:
    """``x^e mod (x^128 + x^7 + x^2 + x + 1)`` for ``e`` in ``0..254``; bit ``p`` = coeff. of x^p."""
    out = []
    v = 1
    for _ in range(255):
        out.append(v)
        v <<= 1
        if v >> 128:
            v ^= (1 << 128) | _GCM_REDUCE
    return tuple(out)
