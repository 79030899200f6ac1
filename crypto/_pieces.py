"""Sealing the concatenation of a list of buffers (a chunk's contiguous runs straight out of a
paged KV cache) without gathering them first; used by ``ChunkCipher.seal_pieces_into``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from crypto.aead import TAG_BYTES, Aead, wipe
from crypto.errors import InvalidParameter
from crypto.format import flat_view
from crypto.segments import KeySchedule

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["piece_views", "seal_gathered", "seal_streaming"]


def piece_views(pieces: Sequence[Buffer], plaintext_len: int) -> list[memoryview]:
    """The non-empty pieces as flat byte views; their total must be ``plaintext_len``."""
    if isinstance(plaintext_len, bool) or not isinstance(plaintext_len, int) or plaintext_len < 0:
        raise InvalidParameter("plaintext_len must be an int >= 0")
    views: list[memoryview] = []
    total = 0
    for p in pieces:
        # fast path: the data path hands over flat byte views already
        if type(p) is memoryview and p.format == "B" and p.ndim == 1 and p.c_contiguous:
            v = p
        else:
            v = flat_view(p, writable=False, what="each piece")
        if v.nbytes:
            views.append(v)
            total += v.nbytes
    if total != plaintext_len:
        raise InvalidParameter(f"the pieces hold {total} bytes, plaintext_len is {plaintext_len}")
    return views


def seal_streaming(schedule: KeySchedule, views: list[memoryview], dst: memoryview) -> None:
    """Each segment as one streaming AES-GCM operation fed piece by piece (bit-identical to
    ``AESGCM`` over the joined segment). ``update_into`` wants 15 bytes of room past its output;
    every segment's ciphertext is followed by its 16-byte tag, written after ``finalize``, so the
    envelope itself has that room. The inner loop is the hot path (one turn per piece): whole
    pieces go straight through; only a piece across a segment boundary is sliced."""
    aes = algorithms.AES(schedule.key)
    vi, off = 0, 0
    for s in schedule.plan.segments():
        pos, seg_end, dst_pos = s.start, s.end, s.offset
        enc = Cipher(aes, modes.GCM(s.nonce)).encryptor()
        enc.authenticate_additional_data(s.aad)
        update = enc.update_into
        while pos < seg_end:
            v = views[vi]
            take = v.nbytes - off
            if off == 0 and pos + take <= seg_end:  # a whole piece
                part = v
                vi += 1
            else:
                take = min(take, seg_end - pos)
                part = v[off : off + take]
                off += take
                if off == v.nbytes:
                    vi, off = vi + 1, 0
            if update(part, dst[dst_pos : dst_pos + take + 15]) != take:
                raise InvalidParameter("the AES-GCM stream did not encrypt a piece whole")
            pos += take
            dst_pos += take
        enc.finalize()
        dst[dst_pos : dst_pos + TAG_BYTES] = enc.tag


def seal_gathered(schedule: KeySchedule, aead: Aead, views: list[memoryview], dst: memoryview) -> None:
    """Any other AEAD: gather each segment into one segment-sized buffer, then seal it."""
    buf = memoryview(bytearray(schedule.plan.scratch_bytes))
    vi, off = 0, 0
    for s in schedule.plan.segments():
        n, pos = s.length, 0
        while pos < n:
            v = views[vi]
            take = min(v.nbytes - off, n - pos)
            buf[pos : pos + take] = v[off : off + take]
            pos += take
            off += take
            if off == v.nbytes:
                vi, off = vi + 1, 0
        aead.seal_into(s.nonce, buf[:n], s.aad, dst[s.offset : s.sealed_end])
    wipe(buf)
