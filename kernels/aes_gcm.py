"""AES-256-GCM in torch ops, on CPU or CUDA tensors, bit-identical to ``cryptography``'s ``AESGCM``.

    TorchAesGcm(key, device)        the cipher of one key on one device
      .encrypt_(buf, nonce, aad)    in place over a uint8 tensor; returns the 16-byte tag
      .decrypt_(buf, nonce, aad, tag)  checks the tag first, then decrypts in place;
                                    ``TagMismatch`` (and ``buf`` zeroed) on a bad tag
      .seal_into / .open_into       the ``crypto.aead.Aead`` protocol (``out`` = ciphertext || tag)
    AeadError > TagMismatch, AeadParameterError (also a ValueError); both are ``KVKernelError``s

Only 96-bit nonces and 128-bit tags. ``kernels`` imports nothing of the project: pass
``failure=DecryptionFailed`` (any exception factory) and ``open_into`` raises that instead of
``TagMismatch``, as ``crypto.envelope.ChunkCipher`` expects. CTR runs as table gathers over all
blocks of a slice at once, GHASH as exact float32 matmuls of 0/1 matrices mod 2; Python loops only
over rounds and slices. One host synchronisation per call (reading the tag back); the tag
comparison is ``hmac.compare_digest`` on the host. Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

import hmac
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from ._aes_tables import expand_key, gf128_basis, sbox, shift_rows, ttable
from .errors import KVKernelError

__all__ = [
    "KEY_BYTES",
    "MAX_PLAINTEXT_BYTES",
    "NONCE_BYTES",
    "TAG_BYTES",
    "AeadError",
    "AeadParameterError",
    "TagMismatch",
    "TorchAesGcm",
]

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
#: NIST SP 800-38D: at most 2^32 - 2 blocks under one 96-bit nonce.
MAX_PLAINTEXT_BYTES = ((1 << 32) - 2) * 16
_F32 = torch.float32


class AeadError(KVKernelError):
    """Base of the device AEAD's errors."""


class TagMismatch(AeadError):
    """Authentication failed (wrong key, nonce, AAD, tag or tampered data). No detail, on purpose."""

    def __init__(self) -> None:
        super().__init__("authentication tag mismatch")


class AeadParameterError(AeadError, ValueError):
    """A caller's mistake: key or nonce length, buffer type, dtype, size or device."""


class _Consts:
    """Per-device constant tensors (about 9 MB, mostly ``mul_basis``), built on first use there."""

    def __init__(self, dev: torch.device) -> None:
        if sys.byteorder != "little":  # the T-table words and bit views assume it
            raise AeadError("TorchAesGcm needs a little-endian host")
        self.shift = torch.tensor(shift_rows(), dtype=torch.int64, device=dev)
        # Two rows of a column at once: entry (u ^ 0x8000) + 65536 p, u = b0 | b1 << 8 the bytes
        # at rows 2p, 2p+1, holds T[2p][b0] ^ T[2p+1][b1]; u ^ 0x8000 is the int16 view of u
        # (sign-extended) + 32768, so a signed int16 view plus one add indexes it.
        t = torch.tensor(ttable(), dtype=torch.int32, device=dev).view(4, 256)
        halves = [(t[2 * p][None, :] ^ t[2 * p + 1][:, None]).reshape(-1) for p in (0, 1)]
        self.pair_table = torch.cat([torch.roll(h, 1 << 15) for h in halves])  # 512 KiB
        self.pair_offs = torch.tensor(
            [32768 + 65536 * (k % 2) for k in range(8)], dtype=torch.int32, device=dev
        )
        self.sbox = torch.tensor(sbox(), dtype=torch.uint8, device=dev)
        self.ctr_shifts = torch.tensor([24, 16, 8, 0], dtype=torch.int64, device=dev)
        bits = [[(v >> (7 - t)) & 1 for t in range(8)] for v in range(256)]
        self.byte_bits = torch.tensor(bits, dtype=_F32, device=dev)  # [256, 8], MSB first
        self.bit_weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=_F32, device=dev)
        q = torch.tensor(
            [[(e >> a) & 1 for a in range(128)] for e in gf128_basis()], dtype=_F32, device=dev
        )  # [255, 128]: bits of x^e mod P
        i = torch.arange(128, device=dev)
        self.mul_basis = q[i[:, None] + i[None, :]].reshape(128, 128 * 128)  # W[i, b*128 + a]
        self.one = torch.zeros(128, dtype=_F32, device=dev)
        self.one[0] = 1.0


_CONSTS: dict[torch.device, _Consts] = {}
_CONSTS_LOCK = threading.Lock()


def _consts(dev: torch.device) -> _Consts:
    with _CONSTS_LOCK:
        c = _CONSTS.get(dev)
        if c is None:
            c = _CONSTS[dev] = _Consts(dev)
            if dev.type == "cuda":  # built once, then read from any stream
                torch.cuda.synchronize(dev)
        return c


def _mod2(x: torch.Tensor) -> torch.Tensor:
    """In place: every value is a non-negative integer below 2^24, so this is exact."""
    return x.remainder_(2.0)


def _xor_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.remainder(a + b, 2.0)


_GROUP_LOG2 = 4  # GHASH folds 16 blocks per matmul row before the tree


class _Ghash:
    """GHASH under one hash key ``H`` (bits ``[128]`` float32 on the device).

    ``horner(blocks)`` is ``f(X) = sum_i X_i H^(m-1-i)`` (GHASH without its last multiply by
    ``H``). Runs of 16 blocks are folded by one matmul of their bits ``[n/16, 16*128]`` with the
    stacked matrices of ``H^15 .. H^0``; then a binary tree: adjacent pairs ``(A, B)`` of
    sub-sequences of ``2^t`` blocks become ``A * H^(2^t) + B``, one ``addmm`` with the matrix of
    ``H^(2^t)`` for all pairs at once. Zero blocks put in front pad a count (leading zeros leave
    ``f`` unchanged).

    The matrices are built by squaring as far as the inputs need, under a lock. On CUDA each new
    one is waited for (one host sync, the first time a size is seen), so a matrix built on one
    stream can be read from any other."""

    def __init__(self, h_bits: torch.Tensor, c: _Consts, slice_blocks: int) -> None:
        self._c = c
        self._slice_log2 = slice_blocks.bit_length() - 1  # slices of 2^s blocks, s >= 4
        self._mats = [_mod2(h_bits @ c.mul_basis).view(128, 128)]  # row b: bits of H * x^b
        self._group: torch.Tensor | None = None  # [16*128, 128]: matrices of H^15 .. H^0
        self._lock = threading.Lock()

    def _published(self) -> None:
        dev = self._mats[0].device
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def _matrix(self, t: int) -> torch.Tensor:
        """The matrix of multiplication by ``H^(2^t)``."""
        mats = self._mats
        if t < len(mats):  # a published list never changes; a longer one replaces it
            return mats[t]
        with self._lock:
            mats = list(self._mats)
            while len(mats) <= t:
                mats.append(_mod2(mats[-1] @ mats[-1]))
            self._published()
            self._mats = mats
            return mats[t]

    def _group_matrix(self) -> torch.Tensor:
        group = self._group
        if group is not None:
            return group
        m1 = self._matrix(0)
        with self._lock:
            if self._group is None:
                mats = [torch.eye(128, dtype=_F32, device=m1.device), m1]  # H^0, H^1
                while len(mats) < 1 << _GROUP_LOG2:  # doubling: H^(t..2t-1) = H^(0..t-1) H^t
                    step = _mod2(mats[-1] @ m1)
                    mats += list(_mod2(torch.stack(mats) @ step))
                group = torch.cat(mats[::-1])
                self._published()
                self._group = group
            return self._group

    def times_power(self, a: torch.Tensor, n: int) -> torch.Tensor:
        """``a * H^n`` for any ``n >= 0``: one 128x128 product per set bit of ``n``."""
        t = 0
        while n:
            if n & 1:
                a = _mod2(a @ self._matrix(t))
            n, t = n >> 1, t + 1
        return a

    def _run(self, blocks: torch.Tensor) -> torch.Tensor:
        """``f`` over uint8 blocks ``[n, 16]``: runs of 16 folded by one matmul (zeros in front
        pad ``n``), then the tree. Under 64 blocks the tree alone is cheaper."""
        idx = blocks.reshape(-1).to(torch.int32)
        bits = torch.index_select(self._c.byte_bits, 0, idx).view(-1, 128)
        if bits.shape[0] < 64:
            return self._tree(bits, 0)
        pad = -bits.shape[0] % (1 << _GROUP_LOG2)
        if pad:
            bits = torch.cat([bits.new_zeros(pad, 128), bits])
        folded = _mod2(bits.view(-1, 128 << _GROUP_LOG2) @ self._group_matrix())
        return self._tree(folded, _GROUP_LOG2)

    def _tree(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """``f`` over elements ``x`` (bits ``[m, 128]``), each standing for ``2^t`` blocks."""
        if x.shape[0] == 0:
            return self._c.one.new_zeros(128)
        while x.shape[0] > 1:
            if x.shape[0] % 2:
                x = torch.cat([x.new_zeros(1, 128), x])
            pairs = x.view(-1, 2, 128)
            x = _mod2(torch.addmm(pairs[:, 1], pairs[:, 0], self._matrix(t)))
            t += 1
        return x[0]

    def horner(self, blocks: torch.Tensor) -> torch.Tensor:
        """``f`` over uint8 blocks ``[m, 16]``: whole slices of ``2^s`` blocks, then the rest."""
        m, s = blocks.shape[0], self._slice_log2
        q, r = m >> s, m & ((1 << s) - 1)
        out = self._run(blocks[q << s :]) if r else self._c.one.new_zeros(128)
        if q:
            heads = [self._run(blocks[i << s : (i + 1) << s]) for i in range(q)]
            out = _xor_bits(out, self.times_power(self._tree(torch.stack(heads), s), r))
        return out

    def to_bytes(self, bits: torch.Tensor) -> torch.Tensor:
        return (bits.view(16, 8) * self._c.bit_weights).sum(-1).to(torch.uint8)


def _flat_tensor(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype != torch.uint8 or not t.is_contiguous():
        raise AeadParameterError(f"{what} must be a contiguous torch.uint8 tensor")
    return t.view(-1)


def _byte_view(buf: Any, what: str, *, writable: bool) -> memoryview:
    try:
        view = memoryview(buf)
    except TypeError:
        raise AeadParameterError(f"{what} must be a uint8 tensor or a buffer") from None
    if not view.c_contiguous or (writable and view.readonly):
        raise AeadParameterError(f"{what} must be a {'writable, ' if writable else ''}contiguous buffer")
    return view.cast("B")


def _tensor_of(view: memoryview) -> torch.Tensor:
    """A CPU uint8 tensor sharing a writable byte view's memory."""
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


def _check_nonce_aad(nonce: object, aad: object) -> None:
    if not isinstance(nonce, (bytes, bytearray, memoryview)) or len(nonce) != NONCE_BYTES:
        raise AeadParameterError(f"nonce must be {NONCE_BYTES} bytes")
    if not isinstance(aad, (bytes, bytearray, memoryview)) or len(aad) > MAX_PLAINTEXT_BYTES:
        raise AeadParameterError("aad must be bytes, at most 2^32 - 2 blocks")


def _default_slice_bytes(dev: torch.device) -> int:
    return (16 << 20) if dev.type == "cuda" else (1 << 20)


class TorchAesGcm:
    """AES-256-GCM (96-bit nonce, 128-bit tag) over uint8 tensors on one device.

    ``failure`` builds the exception ``open_into`` raises on any failure (default ``TagMismatch``;
    the gateway passes ``crypto.errors.DecryptionFailed``). ``slice_bytes`` (a power of two; 1 MiB
    on CPU, 16 MiB on CUDA by default) bounds the temporaries, about 40x a slice (GHASH's bits are
    float32); it changes no output bit. Safe to share between threads and CUDA streams: the key's
    tables are waited for once built (a host sync at construction and when GHASH first needs a
    bigger power of ``H``), and later growth is locked."""

    __slots__ = ("_c", "_device", "_failure", "_ghash", "_rk_bytes", "_rk_words", "_slice_bytes")

    def __init__(
        self,
        key: bytes,
        device: torch.device | str = "cpu",
        *,
        failure: Callable[[], BaseException] = TagMismatch,
        slice_bytes: int | None = None,
    ) -> None:
        if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
            raise AeadParameterError(f"AES-256-GCM key must be {KEY_BYTES} bytes")
        try:
            dev = torch.empty(0, device=device).device  # normalises "cuda" -> "cuda:0"
        except (RuntimeError, TypeError, ValueError, AssertionError) as exc:  # Assertion: no CUDA
            raise AeadParameterError(f"unusable device {device!r}: {exc}") from None
        slice_bytes = _default_slice_bytes(dev) if slice_bytes is None else slice_bytes
        if isinstance(slice_bytes, bool) or not isinstance(slice_bytes, int):
            raise AeadParameterError("slice_bytes must be an int")
        if slice_bytes < 256 or slice_bytes & (slice_bytes - 1):
            raise AeadParameterError("slice_bytes must be a power of two >= 256")
        self._device, self._failure, self._slice_bytes = dev, failure, slice_bytes
        self._c = _consts(dev)
        rks = expand_key(bytes(key))
        self._rk_bytes = torch.tensor([list(rk) for rk in rks], dtype=torch.uint8, device=dev)
        self._rk_words = self._rk_bytes.view(torch.int32)  # [15, 4], the same little-endian words
        h = self._encrypt_blocks(torch.zeros(1, 16, dtype=torch.uint8, device=dev))
        self._ghash = _Ghash(self._c.byte_bits[h.view(-1).long()].view(128), self._c, slice_bytes // 16)
        if dev.type == "cuda":  # the key's tables may be read from another stream later
            torch.cuda.current_stream(dev).synchronize()

    def __repr__(self) -> str:
        return f"TorchAesGcm(key=<hidden>, device={str(self._device)!r})"

    @property
    def device(self) -> torch.device:
        return self._device

    # -- the block cipher and CTR ------------------------------------------------------------

    def _encrypt_blocks(self, state: torch.Tensor) -> torch.Tensor:
        """AES-256 of every row of ``state`` (uint8 ``[N, 16]``), all rows at once."""
        c, n = self._c, state.shape[0]
        shift = c.shift.expand(n, 16)  # a stride-0 index: gather is much faster than index_select
        s = state ^ self._rk_bytes[0]
        for r in range(1, 14):
            pairs = torch.gather(s, 1, shift).view(torch.int16)  # ShiftRows, 2 bytes a word
            idx = pairs.to(torch.int32).add_(c.pair_offs)
            g = torch.index_select(c.pair_table, 0, idx.view(-1)).view(n, 4, 2)
            w = g[:, :, 0] ^ g[:, :, 1]  # SubBytes + MixColumns of each column
            w ^= self._rk_words[r]
            s = w.view(torch.uint8)
        last = torch.gather(s, 1, shift).view(-1).to(torch.int32)
        return torch.index_select(c.sbox, 0, last).view(n, 16) ^ self._rk_bytes[14]

    def _counter_blocks(self, nonce: torch.Tensor, first: int, n: int) -> torch.Tensor:
        """``nonce || be32(first + i)`` for ``i < n``."""
        ctr = torch.arange(first, first + n, dtype=torch.int64, device=self._device) & 0xFFFFFFFF
        low = ((ctr[:, None] >> self._c.ctr_shifts) & 0xFF).to(torch.uint8)
        return torch.cat([nonce.expand(n, NONCE_BYTES), low], dim=1)

    def _xor_keystream(self, flat: torch.Tensor, nonce: torch.Tensor) -> None:
        """``flat ^= CTR keystream`` starting at counter 2 (J0 + 1), slice by slice."""
        for start in range(0, flat.numel(), self._slice_bytes):
            part = flat[start : start + self._slice_bytes]
            blocks = -(-part.numel() // 16)
            ks = self._encrypt_blocks(self._counter_blocks(nonce, 2 + start // 16, blocks))
            part ^= ks.view(-1)[: part.numel()]

    def _tag(self, ct: torch.Tensor, small: torch.Tensor) -> bytes:
        """``E_K(J0) xor GHASH_H(A || pad || C || pad || len64(A) || len64(C))``, by linearity:
        ``GHASH = f(A)*H^(c+s+1) + f(C_full)*H^(s+1) + f(C_tail || lengths)*H`` where ``f`` is
        Horner without the last multiply, ``c`` the full ciphertext blocks and ``s`` the rest.
        ``small`` is ``_prepare``'s nonce || lengths || padded AAD, already on the device."""
        g, n = self._ghash, ct.numel()
        full, tail = divmod(n, 16)
        suffix = small[NONCE_BYTES : NONCE_BYTES + 16].view(1, 16)
        if tail:
            padded = torch.zeros(1, 16, dtype=torch.uint8, device=self._device)
            padded[0, :tail] = ct[full * 16 :]
            suffix = torch.cat([padded, suffix])
        s = suffix.shape[0]
        y = g.times_power(g.horner(suffix), 1)
        if full:
            y = _xor_bits(y, g.times_power(g.horner(ct[: full * 16].view(full, 16)), s + 1))
        aad_blocks = small[NONCE_BYTES + 16 :].view(-1, 16)
        if aad_blocks.shape[0]:
            y = _xor_bits(y, g.times_power(g.horner(aad_blocks), full + s + 1))
        mask = self._encrypt_blocks(self._counter_blocks(small[:NONCE_BYTES], 1, 1))[0]
        return bytes((g.to_bytes(y) ^ mask).cpu().tolist())  # the one host sync of a call

    # -- tensor API ----------------------------------------------------------------------------

    def _prepare(
        self, buf: torch.Tensor, nonce: bytes, aad: bytes
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Checks; then ``(flat buf, small, host copy of small)``: ``small`` = nonce || len64(A) ||
        len64(C) || AAD zero-padded to 16, moved in ONE copy that does not wait for the stream
        (the caller keeps the host copy alive until its tag sync)."""
        if not isinstance(buf, torch.Tensor):
            raise AeadParameterError("buf must be a torch.uint8 tensor")
        flat = _flat_tensor(buf, "buf")
        if flat.device != self._device:
            raise AeadParameterError(f"buf is on {flat.device}, the cipher on {self._device}")
        if flat.numel() > MAX_PLAINTEXT_BYTES:
            raise AeadParameterError("more than 2^32 - 2 blocks under one nonce")
        _check_nonce_aad(nonce, aad)
        lengths = (8 * len(aad)).to_bytes(8, "big") + (8 * flat.numel()).to_bytes(8, "big")
        host = torch.frombuffer(
            bytearray(nonce) + lengths + bytes(aad) + bytes(-len(aad) % 16), dtype=torch.uint8
        )
        return flat, host.to(self._device, non_blocking=True), host

    def encrypt_(self, buf: torch.Tensor, nonce: bytes, aad: bytes = b"") -> bytes:
        """Encrypt ``buf`` (contiguous uint8, on this device) in place; return the 16-byte tag."""
        flat, small, host = self._prepare(buf, nonce, aad)
        self._xor_keystream(flat, small[:NONCE_BYTES])
        tag = self._tag(flat, small)
        del host  # the tag's sync has passed: the upload is done
        return tag

    def decrypt_(self, buf: torch.Tensor, nonce: bytes, aad: bytes, tag: bytes | torch.Tensor) -> None:
        """Check ``tag`` over the ciphertext in ``buf``, then decrypt it in place.

        On a bad tag ``buf`` is zeroed (nothing was decrypted) and ``TagMismatch`` is raised."""
        flat, small, host = self._prepare(buf, nonce, aad)
        if isinstance(tag, torch.Tensor):
            tag = bytes(_flat_tensor(tag, "tag").cpu().tolist())
        if not isinstance(tag, (bytes, bytearray, memoryview)):
            raise AeadParameterError("tag must be bytes or a uint8 tensor")
        expected = self._tag(flat, small)
        del host  # the tag's sync has passed: the upload is done
        if len(tag) != TAG_BYTES or not hmac.compare_digest(expected, bytes(tag)):
            flat.zero_()
            raise TagMismatch
        self._xor_keystream(flat, small[:NONCE_BYTES])

    # -- the crypto.aead.Aead protocol -------------------------------------------------------

    def seal_into(self, nonce: bytes, data: Any, aad: bytes, out: Any) -> None:
        """``out`` (``len(data) + 16`` bytes: a uint8 tensor or a writable buffer) receives
        ciphertext || tag. ``data`` may be a tensor or a buffer, and may be ``out[:-16]`` itself."""
        _check_nonce_aad(nonce, aad)  # before anything is written
        out_t = self._writable(out, "out")
        n = out_t.numel() - TAG_BYTES
        if n < 0:
            raise AeadParameterError("out must hold len(data) + 16 bytes")
        body = out_t[:n]
        self._load(body, data)
        work = body if body.device == self._device else body.to(self._device)
        tag = self.encrypt_(work, nonce, aad)
        if work is not body:
            body.copy_(work)
        out_t[n:] = torch.tensor(list(tag), dtype=torch.uint8).to(out_t.device)

    def open_into(self, nonce: bytes, data_with_tag: Any, aad: bytes, out: Any) -> None:
        """``out`` (``len(data_with_tag) - 16`` bytes) receives the plaintext; on any failure it is
        zeroed and ``failure()`` is raised (one error, whatever failed)."""
        _check_nonce_aad(nonce, aad)
        out_t = self._writable(out, "out")
        ok = False
        try:
            src = self._readable(data_with_tag)
            n = out_t.numel()
            if src.numel() == n + TAG_BYTES:
                tag = bytes(src[n:].cpu().tolist())
                body = out_t[:n]
                if body.data_ptr() != src.data_ptr() or body.device != src.device:
                    body.copy_(src[:n])
                work = body if body.device == self._device else body.to(self._device)
                self.decrypt_(work, nonce, aad, tag)
                if work is not body:
                    body.copy_(work)
                ok = True
        except (TagMismatch, AeadParameterError):  # as CpuAesGcm: every failure is one error
            pass
        if not ok:  # raised outside the handler: nothing chained, no view kept alive
            out_t.zero_()
            raise self._failure()

    def _writable(self, out: Any, what: str) -> torch.Tensor:
        if isinstance(out, torch.Tensor):
            return _flat_tensor(out, what)
        return _tensor_of(_byte_view(out, what, writable=True))

    def _readable(self, data: Any) -> torch.Tensor:
        """A uint8 tensor of ``data`` (a tensor as is; a read-only buffer is copied once)."""
        if isinstance(data, torch.Tensor):
            return _flat_tensor(data, "data")
        view = _byte_view(data, "data", writable=False)
        return _tensor_of(view if not view.readonly else memoryview(bytearray(view)))

    def _load(self, body: torch.Tensor, data: Any) -> None:
        """Copy ``data`` into ``body`` (nothing to do when ``data`` is ``body`` itself)."""
        src = self._readable(data)
        if src.numel() != body.numel():
            raise AeadParameterError("out must hold len(data) + 16 bytes")
        if src.data_ptr() != body.data_ptr() or src.device != body.device:
            body.copy_(src)
