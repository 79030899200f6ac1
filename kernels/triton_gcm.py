"""AES-256-GCM as Triton kernels, fused with the paged-KV gather (seal) and scatter (open).

    TritonAesGcm(key, device)            one key on one device (CUDA, or CPU under TRITON_INTERPRET=1)
      .encrypt_ / .decrypt_              in place over a contiguous uint8 tensor, as ``TorchAesGcm``
      .seal_into / .open_into            the ``crypto.aead.Aead`` protocol (``TorchAesGcm``'s code)
      .gather_encrypt_(kv, rows, out, segments) -> tags
                                         one pass: every layer's chunk rows, ciphertext into ``out``
      .decrypt_scatter_(src, kv, rows, segments)
                                         every segment's tag checked first, then one pass writes
                                         plaintext into the layers' rows

Importing this module imports ``triton``; ``kernels.device_aead`` decides whether to. Output is
bit-identical to ``cryptography``'s AESGCM (tests/kernels/test_triton_gcm.py: NIST CAVP, Wycheproof).
One host synchronisation per call (the tags come back as one small tensor). Design notes
(CTR, parallel GHASH, GF(2^128) products): docs/architecture.md, section 5."""

from __future__ import annotations

import hmac
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from ._aes_tables import expand_key, sbox, ttable
from .aes_gcm import (
    KEY_BYTES,
    MAX_PLAINTEXT_BYTES,
    TAG_BYTES,
    AeadParameterError,
    TagMismatch,
    TorchAesGcm,
    _check_nonce_aad,
    _flat_tensor,
)
from .errors import KVLayoutError
from .paged import PagedKV

__all__ = ["Segment", "TritonAesGcm"]

#: ``(start, end, nonce, aad)`` of one GCM message inside a chunk; ``decrypt_scatter_`` adds the tag.
Segment = tuple[int, int, bytes, bytes]

_GROUP = 64  # GHASH blocks per program (G): levels = ceil(log_64(blocks))
_MASK64 = (1 << 64) - 1


#: ``triton.jit``, typed for the checker (triton ships no type information): the kernels are
#: Triton source, their parameters Triton values (pointers, scalars, blocks), typed ``Any``.
_jit: Callable[[Callable[..., Any]], Any] = triton.jit


def _interpreted(dev: torch.device) -> bool:
    return dev.type != "cuda"


# -- device functions ----------------------------------------------------------------------------


@_jit
def _aes_ctr_words(rk_ptr: Any, t_ptr: Any, s_ptr: Any, nonce_ptr: Any, nidx: Any, ctr: Any) -> tuple[Any, Any, Any, Any]:
    """AES-256 of ``nonce || be32(ctr)`` for vectors of uint32 counters and nonce offsets
    ``nidx`` (words into ``nonce_ptr``): four little-endian column words per block."""
    n0 = tl.load(nonce_ptr + nidx + 0).to(tl.uint32, bitcast=True)
    n1 = tl.load(nonce_ptr + nidx + 1).to(tl.uint32, bitcast=True)
    n2 = tl.load(nonce_ptr + nidx + 2).to(tl.uint32, bitcast=True)
    c3 = ((ctr & 255) << 24) | (((ctr >> 8) & 255) << 16) | (((ctr >> 16) & 255) << 8) | (ctr >> 24)
    w0 = (c3 * 0) ^ (n0 ^ tl.load(rk_ptr + 0).to(tl.uint32, bitcast=True))
    w1 = (c3 * 0) ^ (n1 ^ tl.load(rk_ptr + 1).to(tl.uint32, bitcast=True))
    w2 = (c3 * 0) ^ (n2 ^ tl.load(rk_ptr + 2).to(tl.uint32, bitcast=True))
    w3 = c3 ^ tl.load(rk_ptr + 3).to(tl.uint32, bitcast=True)
    t1 = t_ptr + 256  # the four T-tables (row r of a column contributes T_r[byte])
    t2 = t_ptr + 512
    t3 = t_ptr + 768
    for r in range(1, 14):  # column c takes row r from column c + r (ShiftRows), then T_r
        k0 = tl.load(rk_ptr + 4 * r + 0).to(tl.uint32, bitcast=True)
        k1 = tl.load(rk_ptr + 4 * r + 1).to(tl.uint32, bitcast=True)
        k2 = tl.load(rk_ptr + 4 * r + 2).to(tl.uint32, bitcast=True)
        k3 = tl.load(rk_ptr + 4 * r + 3).to(tl.uint32, bitcast=True)
        o0 = tl.load(t_ptr + (w0 & 255)) ^ tl.load(t1 + ((w1 >> 8) & 255)) ^ tl.load(t2 + ((w2 >> 16) & 255))
        o1 = tl.load(t_ptr + (w1 & 255)) ^ tl.load(t1 + ((w2 >> 8) & 255)) ^ tl.load(t2 + ((w3 >> 16) & 255))
        o2 = tl.load(t_ptr + (w2 & 255)) ^ tl.load(t1 + ((w3 >> 8) & 255)) ^ tl.load(t2 + ((w0 >> 16) & 255))
        o3 = tl.load(t_ptr + (w3 & 255)) ^ tl.load(t1 + ((w0 >> 8) & 255)) ^ tl.load(t2 + ((w1 >> 16) & 255))
        w0, w1, w2, w3 = (
            o0 ^ tl.load(t3 + (w3 >> 24)) ^ k0,
            o1 ^ tl.load(t3 + (w0 >> 24)) ^ k1,
            o2 ^ tl.load(t3 + (w1 >> 24)) ^ k2,
            o3 ^ tl.load(t3 + (w2 >> 24)) ^ k3,
        )
    k0 = tl.load(rk_ptr + 56).to(tl.uint32, bitcast=True)
    k1 = tl.load(rk_ptr + 57).to(tl.uint32, bitcast=True)
    k2 = tl.load(rk_ptr + 58).to(tl.uint32, bitcast=True)
    k3 = tl.load(rk_ptr + 59).to(tl.uint32, bitcast=True)
    # the last round: S-box bytes, no MixColumns
    o0 = tl.load(s_ptr + (w0 & 255)) | (tl.load(s_ptr + ((w1 >> 8) & 255)) << 8)
    o1 = tl.load(s_ptr + (w1 & 255)) | (tl.load(s_ptr + ((w2 >> 8) & 255)) << 8)
    o2 = tl.load(s_ptr + (w2 & 255)) | (tl.load(s_ptr + ((w3 >> 8) & 255)) << 8)
    o3 = tl.load(s_ptr + (w3 & 255)) | (tl.load(s_ptr + ((w0 >> 8) & 255)) << 8)
    o0 |= (tl.load(s_ptr + ((w2 >> 16) & 255)) << 16) | (tl.load(s_ptr + (w3 >> 24)) << 24)
    o1 |= (tl.load(s_ptr + ((w3 >> 16) & 255)) << 16) | (tl.load(s_ptr + (w0 >> 24)) << 24)
    o2 |= (tl.load(s_ptr + ((w0 >> 16) & 255)) << 16) | (tl.load(s_ptr + (w1 >> 24)) << 24)
    o3 |= (tl.load(s_ptr + ((w1 >> 16) & 255)) << 16) | (tl.load(s_ptr + (w2 >> 24)) << 24)
    return o0 ^ k0, o1 ^ k1, o2 ^ k2, o3 ^ k3


@_jit
def _ctr_kernel(
    in_ptr: Any, out_ptr: Any, in_rows_ptr: Any, out_rows_ptr: Any,
    rk_ptr: Any, t_ptr: Any, s_ptr: Any, nonce_ptr: Any,
    q0: Any, nbytes: Any, ctr0: Any, in_base: Any, out_base: Any, row_bytes: Any,
    IN_ROWS: tl.constexpr, OUT_ROWS: tl.constexpr, BB: tl.constexpr, MASKS: tl.constexpr = False,
) -> None:
    """``out[..] = in[..] ^ keystream`` over bytes ``[q0, q0 + nbytes)`` of one GCM message; byte
    ``q`` uses counter ``ctr0 + q // 16``. Position ``u = q - q0`` maps to ``in_base + u`` (flat) or
    to a row of a layer (``IN_ROWS``), likewise on the output side."""
    pid = tl.program_id(0)
    blk = (q0 // 16 + pid * BB + tl.arange(0, BB)).to(tl.int64)
    if MASKS:  # block b: counter ctr0 under nonce b (the E_K(J0) of many messages at once)
        ctr = ((blk * 0 + ctr0) & 0xFFFFFFFF).to(tl.uint32)
        nidx = (blk * 4).to(tl.int32)
    else:
        ctr = ((blk + ctr0) & 0xFFFFFFFF).to(tl.uint32)
        nidx = (blk * 0).to(tl.int32)
    w0, w1, w2, w3 = _aes_ctr_words(rk_ptr, t_ptr, s_ptr, nonce_ptr, nidx, ctr)
    j = tl.arange(0, 16)
    jw = j[None, :] // 4
    word = tl.where(jw == 0, w0[:, None], tl.where(jw == 1, w1[:, None], tl.where(jw == 2, w2[:, None], w3[:, None])))
    ks = ((word >> ((j[None, :] % 4) * 8).to(tl.uint32)) & 255).to(tl.uint8)
    u = blk[:, None] * 16 + j[None, :] - q0
    mask = (u >= 0) & (u < nbytes)
    u = tl.where(mask, u, 0)
    if IN_ROWS:
        pos = in_base + u
        src = tl.load(in_rows_ptr + pos // row_bytes, mask=mask, other=0) * row_bytes + pos % row_bytes
    else:
        src = in_base + u
    if OUT_ROWS:
        pos = out_base + u
        dst = tl.load(out_rows_ptr + pos // row_bytes, mask=mask, other=0) * row_bytes + pos % row_bytes
    else:
        dst = out_base + u
    data = tl.load(in_ptr + src, mask=mask, other=0)
    tl.store(out_ptr + dst, data ^ ks, mask=mask)


@_jit
def _gf_mul_serial(xh: Any, xl: Any, yh: Any, yl: Any) -> tuple[Any, Any]:
    """``x * y``, SP 800-38D algorithm 1: 128 shift-and-add steps (registers only; compiled)."""
    zero = xh ^ xh
    zh = zero
    zl = zero
    vh = yh
    vl = yl
    r = (zero + 0xE1) << 56
    for i in range(128):
        word = tl.where(i < 64, xh, xl)
        m = zero - ((word >> (63 - i % 64)) & 1)  # all ones where bit i of x is set
        zh ^= vh & m
        zl ^= vl & m
        lsb = zero - (vl & 1)  # v = v * x (inline: a nested call is costly in the interpreter)
        vl = (vl >> 1) | (vh << 63)
        vh = (vh >> 1) ^ (r & lsb)
    return zh, zl


@_jit
def _gf_mul_table(xh: Any, xl: Any, yh: Any, yl: Any, r8_ptr: Any) -> tuple[Any, Any]:
    """``x * y`` a byte of ``x`` at a time: a per-lane table ``M[f] = f(x) * y`` of 256 entries
    (from ``y * x^0..7``), then Horner in ``x^8`` over the 16 bytes of ``x`` (high degrees, the low
    bits, first), ``z * x^8 = (z >> 8) ^ R8[z & 255]``. 16 steps instead of 128: the interpreter's
    cost is per operation, not per element. Wide tiles (lanes x 256): not for compiled kernels."""
    col = tl.arange(0, 256)
    zero = xh ^ xh
    mh = zero[:, None] + (col[None, :] * 0).to(tl.uint64)
    ml = mh
    th = yh
    tlo = yl
    for t in tl.static_range(8):
        bit = ((col[None, :] >> (7 - t)) & 1) == 1
        mh = mh ^ tl.where(bit, th[:, None], 0)
        ml = ml ^ tl.where(bit, tlo[:, None], 0)
        lsb = zero - (tlo & 1)
        tlo = (tlo >> 1) | (th << 63)
        th = (th >> 1) ^ (((zero + 0xE1) << 56) & lsb)
    zh = zero
    zl = zero
    for k in range(16):
        rem = (zl & 255).to(tl.int32)
        zl = (zl >> 8) | (zh << 56)
        zh = (zh >> 8) ^ tl.load(r8_ptr + rem).to(tl.uint64, bitcast=True)
        sh = (k % 8) * 8
        f = tl.where(k < 8, (xl >> sh) & 255, (xh >> sh) & 255).to(tl.int32)
        sel = f[:, None] == col[None, :]
        zh ^= tl.sum(tl.where(sel, mh, 0), axis=1)
        zl ^= tl.sum(tl.where(sel, ml, 0), axis=1)
    return zh, zl


@_jit
def _gf_mul(xh: Any, xl: Any, yh: Any, yl: Any, r8_ptr: Any, TABLE: tl.constexpr) -> tuple[Any, Any]:
    """``x * y`` in GF(2^128), GCM bit order, elementwise on uint64 pairs (``hi`` = bytes 0..7
    big-endian)."""
    if TABLE:
        zh, zl = _gf_mul_table(xh, xl, yh, yl, r8_ptr)
    else:
        zh, zl = _gf_mul_serial(xh, xl, yh, yl)
    return zh, zl


@_jit
def _load_pairs(ptr: Any, idx: Any, mask: Any) -> tuple[Any, Any]:
    h = tl.load(ptr + 2 * idx, mask=mask, other=0).to(tl.uint64, bitcast=True)
    lo = tl.load(ptr + 2 * idx + 1, mask=mask, other=0).to(tl.uint64, bitcast=True)
    return h, lo


@_jit
def _powers_kernel(base_ptr: Any, out_ptr: Any, r8_ptr: Any, G: tl.constexpr, TABLE: tl.constexpr) -> None:
    """``out[k] = K^k`` for ``k`` in ``0..G`` (uint64 pairs as int64), ``K`` at ``base_ptr``. One
    program: doubling, ``out[s + k] = out[k] * K^s`` for ``k < s``, then ``K^s`` squared."""
    k = tl.arange(0, G)
    zero = (k * 0).to(tl.uint64)
    ph, pl = _load_pairs(base_ptr, k * 0, k >= 0)
    oneh = zero + 1
    tl.store(out_ptr + 2 * k, (oneh << 63).to(tl.int64, bitcast=True), mask=k == 0)
    tl.store(out_ptr + 2 * k + 1, zero.to(tl.int64, bitcast=True), mask=k == 0)
    s = 1
    while s <= G // 2:
        tl.debug_barrier()
        ah, al = _load_pairs(out_ptr, k, k < s)
        zh, zl = _gf_mul(ah, al, ph, pl, r8_ptr, TABLE)
        tl.store(out_ptr + 2 * (k + s), zh.to(tl.int64, bitcast=True), mask=k < s)
        tl.store(out_ptr + 2 * (k + s) + 1, zl.to(tl.int64, bitcast=True), mask=k < s)
        ph, pl = _gf_mul(ph, pl, ph, pl, r8_ptr, TABLE)
        s = s * 2
    tl.store(out_ptr + 2 * (k + G), ph.to(tl.int64, bitcast=True), mask=k == 0)  # K^G
    tl.store(out_ptr + 2 * (k + G) + 1, pl.to(tl.int64, bitcast=True), mask=k == 0)


@_jit
def _ghash_bytes_kernel(
    head_ptr: Any, ct_ptr: Any, pw_ptr: Any, out_ptr: Any, r8_ptr: Any,
    a_blocks: Any, ct_bytes: Any, m: Any, pad: Any, G: tl.constexpr, TABLE: tl.constexpr,
) -> None:
    """Level 0: block ``i`` of ``AAD (a_blocks, in head) || C (ct_bytes, zero-padded) || lengths
    (head[a_blocks])``; ``out[g] = sum_j X_(gG + j - pad) * H^(G - j)``."""
    g = tl.program_id(0)
    j = tl.arange(0, G)
    i = (g * G + j - pad).to(tl.int64)
    valid = (i >= 0) & (i < m)
    c_blocks = m - 1 - a_blocks
    b = tl.arange(0, 16)
    in_head = valid & ((i < a_blocks) | (i == m - 1))
    hblk = tl.where(i < a_blocks, i, a_blocks)
    hoff = hblk[:, None] * 16 + b[None, :]
    x = tl.load(head_ptr + hoff, mask=in_head[:, None] & (b[None, :] >= 0), other=0)
    coff = (i - a_blocks)[:, None] * 16 + b[None, :]
    in_ct = valid & (i >= a_blocks) & (i < a_blocks + c_blocks)
    cmask = in_ct[:, None] & (coff < ct_bytes) & (coff >= 0)
    x = x | tl.load(ct_ptr + tl.where(cmask, coff, 0), mask=cmask, other=0)
    x = x.to(tl.uint64)
    sh = ((7 - (b % 8)) * 8).to(tl.uint64)
    xh = tl.sum(tl.where(b[None, :] < 8, x << sh[None, :], 0), axis=1)
    xl = tl.sum(tl.where(b[None, :] >= 8, x << sh[None, :], 0), axis=1)
    ph, pl = _load_pairs(pw_ptr, G - j, j >= 0)
    zh, zl = _gf_mul(xh, xl, ph, pl, r8_ptr, TABLE)
    rh = tl.xor_sum(zh, axis=0)
    rl = tl.xor_sum(zl, axis=0)
    tl.store(out_ptr + 2 * g, rh.to(tl.int64, bitcast=True))
    tl.store(out_ptr + 2 * g + 1, rl.to(tl.int64, bitcast=True))


@_jit
def _ghash_pairs_kernel(
    in_ptr: Any, pw_ptr: Any, out_ptr: Any, r8_ptr: Any, m: Any, pad: Any, G: tl.constexpr, TABLE: tl.constexpr
) -> None:
    """Level >= 1: ``out[g] = sum_j Z_(gG + j - pad) * K^(G - 1 - j)``."""
    g = tl.program_id(0)
    j = tl.arange(0, G)
    i = g * G + j - pad
    valid = (i >= 0) & (i < m)
    xh, xl = _load_pairs(in_ptr, tl.where(valid, i, 0), valid)
    ph, pl = _load_pairs(pw_ptr, G - 1 - j, j >= 0)
    zh, zl = _gf_mul(xh, xl, ph, pl, r8_ptr, TABLE)
    tl.store(out_ptr + 2 * g, tl.xor_sum(zh, axis=0).to(tl.int64, bitcast=True))
    tl.store(out_ptr + 2 * g + 1, tl.xor_sum(zl, axis=0).to(tl.int64, bitcast=True))


# -- per-device constants -----------------------------------------------------------------------


class _Consts:
    def __init__(self, dev: torch.device) -> None:
        if sys.byteorder != "little":
            raise AeadParameterError("TritonAesGcm needs a little-endian host")
        self.t = torch.tensor(ttable(), dtype=torch.int32).view(torch.uint32).to(dev)
        self.s = torch.tensor(sbox(), dtype=torch.int32).view(torch.uint32).to(dev)
        self.zero_nonce = torch.zeros(4, dtype=torch.int32, device=dev)
        self.r8 = torch.tensor(_reduce8(), dtype=torch.int64, device=dev)


_CONSTS: dict[torch.device, _Consts] = {}
_CONSTS_LOCK = threading.Lock()


def _consts(dev: torch.device) -> _Consts:
    with _CONSTS_LOCK:
        c = _CONSTS.get(dev)
        if c is None:
            c = _CONSTS[dev] = _Consts(dev)
        return c


def _reduce8() -> list[int]:
    """``R8[r]``: the high word of ``r * x^8`` for a byte ``r`` (what falls off when a value is
    shifted right by 8 in GCM's reflected order, folded back), as signed int64."""
    out = []
    for r in range(256):
        v = r
        for _ in range(8):
            v = (v >> 1) ^ (0xE1 << 120) if v & 1 else v >> 1
        hi = v >> 64
        out.append(hi - (1 << 64) if hi >= 1 << 63 else hi)
    return out


def _words(data: bytes) -> list[int]:
    """Little-endian int32 words of ``data`` (a multiple of 4 bytes)."""
    return [int.from_bytes(data[i : i + 4], "little", signed=True) for i in range(0, len(data), 4)]


def _pair_bytes(hi: int, lo: int) -> bytes:
    return ((hi & _MASK64) << 64 | (lo & _MASK64)).to_bytes(16, "big")


class _Msg:
    """One GCM message's small device inputs: nonce words, AAD blocks || lengths block."""

    __slots__ = ("a_blocks", "head", "n", "nonce")

    def __init__(self, nonce: torch.Tensor, head: torch.Tensor, a_blocks: int, n: int) -> None:
        self.nonce, self.head, self.a_blocks, self.n = nonce, head, a_blocks, n


class TritonAesGcm:
    """AES-256-GCM (96-bit nonce, 128-bit tag) in Triton kernels, on one device.

    Same contract as ``TorchAesGcm`` (``failure`` for ``open_into``); on a CPU device it needs
    ``TRITON_INTERPRET=1`` (tests). ``block_tile`` (AES blocks per program of the CTR kernel) and
    ``group`` (GHASH blocks per program) change no output bit."""

    __slots__ = ("_block_tile", "_c", "_device", "_failure", "_gf_table", "_group", "_h", "_lock", "_powers", "_rk")

    def __init__(
        self,
        key: bytes,
        device: torch.device | str = "cuda",
        *,
        failure: Callable[[], BaseException] = TagMismatch,
        block_tile: int | None = None,
        group: int = _GROUP,
        gf_table: bool | None = None,
    ) -> None:
        if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
            raise AeadParameterError(f"AES-256-GCM key must be {KEY_BYTES} bytes")
        try:
            dev = torch.empty(0, device=device).device
        except (RuntimeError, TypeError, ValueError, AssertionError) as exc:
            raise AeadParameterError(f"unusable device {device!r}: {exc}") from None
        if group < 2 or group & (group - 1):
            raise AeadParameterError("group must be a power of two >= 2")
        tile = block_tile if block_tile is not None else (256 if _interpreted(dev) else 64)
        if tile < 1 or tile & (tile - 1):
            raise AeadParameterError("block_tile must be a power of two")
        self._device, self._failure, self._block_tile, self._group = dev, failure, tile, group
        # GF(2^128) products: byte tables under the interpreter (16 steps), bit-serial compiled
        self._gf_table = _interpreted(dev) if gf_table is None else bool(gf_table)
        self._c = _consts(dev)
        self._rk = torch.tensor(_words(b"".join(expand_key(bytes(key)))), dtype=torch.int32, device=dev)
        self._lock = threading.Lock()
        h = torch.zeros(16, dtype=torch.uint8, device=dev)
        self._ctr(h, h, q0=0, nbytes=16, ctr0=0, nonce=self._c.zero_nonce)  # H = E_K(0^128)
        self._h = _pair_of(h)
        self._powers: list[torch.Tensor] = []  # level l: K_l^0 .. K_l^G, K_l = H^(G^l)

    def __repr__(self) -> str:
        return f"TritonAesGcm(key=<hidden>, device={str(self._device)!r})"

    @property
    def device(self) -> torch.device:
        return self._device

    # -- kernels' launchers ----------------------------------------------------------------------

    def _ctr(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        *,
        q0: int,
        nbytes: int,
        ctr0: int,
        nonce: torch.Tensor,
        in_base: int = 0,
        out_base: int = 0,
        in_rows: torch.Tensor | None = None,
        out_rows: torch.Tensor | None = None,
        row_bytes: int = 1,
        masks: bool = False,
    ) -> None:
        if nbytes <= 0:
            return
        blocks = (q0 % 16 + nbytes + 15) // 16
        tile = min(self._block_tile, triton.next_power_of_2(blocks))
        dummy = self._rk
        _ctr_kernel[(triton.cdiv(blocks, tile),)](
            src, dst,
            in_rows if in_rows is not None else dummy,
            out_rows if out_rows is not None else dummy,
            self._rk, self._c.t, self._c.s, nonce,
            q0, nbytes, ctr0, in_base, out_base, row_bytes,
            IN_ROWS=in_rows is not None, OUT_ROWS=out_rows is not None, BB=tile, MASKS=masks,
        )

    def _table(self, level: int) -> torch.Tensor:
        tables = self._powers
        if level < len(tables):
            return tables[level]
        with self._lock:
            tables = list(self._powers)
            while len(tables) <= level:
                base = self._h if not tables else tables[-1][self._group]
                out = torch.empty(self._group + 1, 2, dtype=torch.int64, device=self._device)
                _powers_kernel[(1,)](base, out, self._c.r8, G=self._group, TABLE=self._gf_table)
                tables.append(out)
            self._powers = tables
            return tables[level]

    def _ghash(self, msg: _Msg, ct: torch.Tensor) -> torch.Tensor:
        """GHASH of ``AAD || C || lengths`` as one uint64 pair (int64 ``[2]``) on the device."""
        g = self._group
        m = msg.a_blocks + (msg.n + 15) // 16 + 1
        groups = triton.cdiv(m, g)
        out = torch.empty(groups, 2, dtype=torch.int64, device=self._device)
        _ghash_bytes_kernel[(groups,)](
            msg.head, ct if ct.numel() else msg.head, self._table(0), out, self._c.r8,
            msg.a_blocks, msg.n, m, groups * g - m, G=g, TABLE=self._gf_table,
        )
        level = 1
        while groups > 1:
            m = groups
            groups = triton.cdiv(m, g)
            nxt = torch.empty(groups, 2, dtype=torch.int64, device=self._device)
            _ghash_pairs_kernel[(groups,)](
                out, self._table(level), nxt, self._c.r8, m, groups * g - m, G=g, TABLE=self._gf_table
            )
            out, level = nxt, level + 1
        return out.view(2)

    def _messages(self, specs: Sequence[tuple[int, bytes, bytes]]) -> tuple[list[_Msg], torch.Tensor]:
        """``(length, nonce, aad)`` each -> its small device inputs, in one upload; also the
        nonce table (int32 ``[k, 4]``: nonce words and a zero word per message)."""
        k = len(specs)
        blobs, layout = bytearray(16 * k), []
        for i, (n, nonce, aad) in enumerate(specs):
            _check_nonce_aad(nonce, aad)
            if n > MAX_PLAINTEXT_BYTES:
                raise AeadParameterError("more than 2^32 - 2 blocks under one nonce")
            blobs[16 * i : 16 * i + 12] = nonce
            start = len(blobs)
            blobs += bytes(aad) + bytes(-len(aad) % 16)
            blobs += (8 * len(aad)).to_bytes(8, "big") + (8 * n).to_bytes(8, "big")
            layout.append((start, len(blobs), -(-len(aad) // 16), n))
        blob = torch.frombuffer(blobs, dtype=torch.uint8).to(self._device)
        nonces = blob[: 16 * k].view(torch.int32).view(k, 4)
        msgs = [_Msg(nonces[i], blob[s:e], a, n) for i, (s, e, a, n) in enumerate(layout)]
        return msgs, nonces

    def _tags(self, msgs: Sequence[_Msg], nonces: torch.Tensor, cts: Sequence[torch.Tensor]) -> list[bytes]:
        """``GHASH ^ E_K(J0)`` of each message; one host sync for all of them."""
        k = len(msgs)
        masks = torch.zeros(16 * k, dtype=torch.uint8, device=self._device)
        self._ctr(masks, masks, q0=0, nbytes=16 * k, ctr0=1, nonce=nonces, masks=True)
        hashes = [self._ghash(msg, ct).view(torch.uint8) for msg, ct in zip(msgs, cts, strict=True)]
        host = torch.cat([*hashes, masks]).cpu()
        tags = []
        for i in range(k):
            pair = host[16 * i : 16 * i + 16].view(torch.int64).tolist()
            ghash = _pair_bytes(pair[0], pair[1])
            mask = bytes(host[16 * (k + i) : 16 * (k + i + 1)].tolist())
            tags.append(bytes(a ^ b for a, b in zip(ghash, mask, strict=True)))
        return tags

    # -- in place, like TorchAesGcm ------------------------------------------------------------

    def _flat(self, buf: Any) -> torch.Tensor:
        if not isinstance(buf, torch.Tensor):
            raise AeadParameterError("buf must be a torch.uint8 tensor")
        flat = _flat_tensor(buf, "buf")
        if flat.device != self._device:
            raise AeadParameterError(f"buf is on {flat.device}, the cipher on {self._device}")
        return flat

    def encrypt_(self, buf: torch.Tensor, nonce: bytes, aad: bytes = b"") -> bytes:
        """Encrypt ``buf`` (contiguous uint8, on this device) in place; return the 16-byte tag."""
        flat = self._flat(buf)
        (msg,), nonces = self._messages([(flat.numel(), nonce, aad)])
        self._ctr(flat, flat, q0=0, nbytes=flat.numel(), ctr0=2, nonce=msg.nonce)
        return self._tags([msg], nonces, [flat])[0]

    def decrypt_(self, buf: torch.Tensor, nonce: bytes, aad: bytes, tag: bytes | torch.Tensor) -> None:
        """Check ``tag``, then decrypt ``buf`` in place; on a bad tag ``buf`` is zeroed and
        ``TagMismatch`` raised."""
        flat = self._flat(buf)
        if isinstance(tag, torch.Tensor):
            tag = bytes(_flat_tensor(tag, "tag").cpu().tolist())
        if not isinstance(tag, (bytes, bytearray, memoryview)):
            raise AeadParameterError("tag must be bytes or a uint8 tensor")
        (msg,), nonces = self._messages([(flat.numel(), nonce, aad)])
        expected = self._tags([msg], nonces, [flat])[0]
        if len(tag) != TAG_BYTES or not hmac.compare_digest(expected, bytes(tag)):
            flat.zero_()
            raise TagMismatch
        self._ctr(flat, flat, q0=0, nbytes=flat.numel(), ctr0=2, nonce=msg.nonce)

    seal_into = TorchAesGcm.seal_into
    open_into = TorchAesGcm.open_into
    _writable = TorchAesGcm._writable
    _readable = TorchAesGcm._readable
    _load = TorchAesGcm._load

    # -- fused with the paged gather / scatter ---------------------------------------------------

    def _check_fused(self, kv: PagedKV, rows: torch.Tensor, chunk: torch.Tensor, segments: Sequence[Any]) -> int:
        if not isinstance(kv, PagedKV):
            raise KVLayoutError(f"kv must be a PagedKV, got {type(kv).__name__}")
        if kv.device != self._device:
            raise AeadParameterError(f"the cache is on {kv.device}, the cipher on {self._device}")
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or rows.dim() != 1:
            raise KVLayoutError("rows must be a 1-D int64 tensor (PagedKV.row_index)")
        if rows.device != self._device or not rows.is_contiguous():
            raise KVLayoutError("rows must be contiguous, on the cipher's device")
        flat = self._flat(chunk)
        layer = rows.numel() * kv.geometry.row_nbytes
        if flat.numel() != layer * kv.geometry.num_layers:
            raise KVLayoutError(f"the chunk buffer holds {flat.numel()} bytes, the rows need {layer * kv.geometry.num_layers}")
        pos = 0
        for seg in segments:
            start, end = seg[0], seg[1]
            if start != pos or end < start:
                raise AeadParameterError("segments must partition the chunk, in order")
            pos = end
        if pos != flat.numel():
            raise AeadParameterError("segments must cover the whole chunk")
        return layer

    def _layer_launches(self, kv: PagedKV, layer: int, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
        """``(layer index, offset within the layer, offset within the segment, bytes)`` of the
        pieces of segment ``[start, end)``."""
        pos = start
        while pos < end:
            li, within = divmod(pos, layer)
            n = min(layer - within, end - pos)
            yield li, within, pos - start, n
            pos += n

    def gather_encrypt_(
        self,
        kv: PagedKV,
        rows: torch.Tensor,
        out: torch.Tensor,
        segments: Sequence[Segment],
        *,
        on_segment: Callable[[int, int], None] | None = None,
    ) -> list[bytes]:
        """Read the chunk of ``rows`` (``kv.row_index(slots)``) from every layer, encrypt it, write
        the ciphertext into ``out`` (contiguous uint8, the chunk's bytes); return one tag per
        segment ``(start, end, nonce, aad)`` (they partition the chunk in order).
        ``on_segment(start, end)`` runs once a segment's kernels are queued (to start its copy to
        the host while the next segment is encrypted)."""
        layer = self._check_fused(kv, rows, out, segments)
        flat = _flat_tensor(out, "out")
        msgs, nonces = self._messages([(e - s, nonce, aad) for s, e, nonce, aad in segments])
        layers = kv.rows(torch.uint8)
        rb = kv.geometry.row_nbytes
        for (start, end, _, _), msg in zip(segments, msgs, strict=True):
            for li, within, q0, n in self._layer_launches(kv, layer, start, end):
                self._ctr(layers[li], flat, q0=q0, nbytes=n, ctr0=2, nonce=msg.nonce,
                          in_base=within, out_base=start + q0, in_rows=rows, row_bytes=rb)
            if on_segment is not None:
                on_segment(start, end)
        return self._tags(msgs, nonces, [flat[s:e] for s, e, _, _ in segments])

    def decrypt_scatter_(
        self,
        src: torch.Tensor,
        kv: PagedKV,
        rows: torch.Tensor,
        segments: Sequence[tuple[int, int, bytes, bytes, bytes]],
    ) -> None:
        """Check every segment's tag over the ciphertext in ``src``; only if all verify, decrypt
        and write the plaintext into the layers' ``rows`` in one pass. On a bad tag nothing is
        written to the cache and ``TagMismatch`` is raised (``src`` is left as it was)."""
        layer = self._check_fused(kv, rows, src, segments)
        flat = _flat_tensor(src, "src")
        msgs, nonces = self._messages([(e - s, nonce, aad) for s, e, nonce, aad, _ in segments])
        expected = self._tags(msgs, nonces, [flat[s:e] for s, e, *_ in segments])
        ok = True
        for want, seg in zip(expected, segments, strict=True):
            tag = seg[4]
            ok &= isinstance(tag, (bytes, bytearray)) and len(tag) == TAG_BYTES and hmac.compare_digest(want, bytes(tag))
        if not ok:
            raise TagMismatch
        layers = kv.rows(torch.uint8)
        rb = kv.geometry.row_nbytes
        for (start, end, *_), msg in zip(segments, msgs, strict=True):
            for li, within, q0, n in self._layer_launches(kv, layer, start, end):
                self._ctr(flat, layers[li], q0=q0, nbytes=n, ctr0=2, nonce=msg.nonce,
                          in_base=start + q0, out_base=within, out_rows=rows, row_bytes=rb)


def _pair_of(block: torch.Tensor) -> torch.Tensor:
    """16 bytes (uint8, device) -> the big-endian uint64 pair as int64 ``[2]`` (no host sync)."""
    shifts = torch.arange(56, -8, -8, device=block.device, dtype=torch.int64)
    b = block.view(2, 8).to(torch.int64)
    return (b << shifts).sum(dim=1)
