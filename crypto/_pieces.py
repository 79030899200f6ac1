"""Sealing the concatenation of a list of buffers (a chunk's contiguous runs straight out of a
paged KV cache) without gathering them first, and opening a segment straight into such a list;
used by ``ChunkCipher.seal_pieces_into`` and ``ChunkCipher.iter_segments_into``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from crypto.aead import TAG_BYTES, Aead, wipe
from crypto.errors import DecryptionFailed, InvalidParameter
from crypto.format import flat_view
from crypto.segments import KeySchedule, Segment

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["BOUNCE_BYTES", "Target", "open_gathered", "open_streaming", "piece_views", "seal_gathered", "seal_streaming"]

Target = memoryview | int
"""Where a run of a segment's plaintext goes: a writable flat byte view that receives it, or a
byte count that is authenticated and dropped."""

BOUNCE_BYTES = 64  # the least scratch ``open_streaming`` needs: the 15-byte tail of a run, and room


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


def open_streaming(aes: algorithms.AES, s: Segment, src: memoryview, targets: Sequence[Target], bounce: memoryview) -> bool:
    """Decrypt segment ``s`` of the envelope ``src`` straight into ``targets`` (they concatenate
    to its plaintext) as one streaming AES-GCM operation, then check its tag. True if authentic;
    False on a bad tag, with every target zeroed. ``bounce`` (at least ``BOUNCE_BYTES``, wiped
    before returning) takes what cannot be decrypted in place: ``update_into`` wants 15 bytes of
    room past its output, which a target has not, so each target's last 15 bytes go through it,
    and so does a dropped run. The plaintext is written before the tag is known: a caller lets
    nothing read the targets until this returned True."""
    room = bounce.nbytes - 15
    if room < BOUNCE_BYTES - 15:
        raise InvalidParameter(f"the bounce buffer must hold {BOUNCE_BYTES} bytes, has {bounce.nbytes}")
    ct = src[s.offset : s.tag_offset]
    dec = Cipher(aes, modes.GCM(s.nonce, bytes(src[s.tag_offset : s.sealed_end]))).decryptor()
    dec.authenticate_additional_data(s.aad)
    update = dec.update_into
    pos, ok = 0, False
    try:
        for t in targets:
            if isinstance(t, int):  # authenticated, dropped
                end = pos + t
                while pos < end:
                    take = min(room, end - pos)
                    update(ct[pos : pos + take], bounce[: take + 15])
                    pos += take
                continue
            n = t.nbytes
            inplace = max(0, n - 15)  # the rest of the target is the room update_into wants
            if inplace and update(ct[pos : pos + inplace], t) != inplace:
                raise InvalidParameter("the AES-GCM stream did not decrypt a run whole")
            tail = n - inplace
            if update(ct[pos + inplace : pos + n], bounce[: tail + 15]) != tail:
                raise InvalidParameter("the AES-GCM stream did not decrypt a run whole")
            t[inplace:] = bounce[:tail]
            pos += n
        if pos != s.length:
            raise InvalidParameter(f"the targets hold {pos} bytes, the segment {s.length}")
        try:
            dec.finalize()
            ok = True
        except InvalidTag:
            pass
    finally:
        wipe(bounce)
        if not ok:
            for t in targets:
                if not isinstance(t, int):
                    wipe(t)
    return ok


def open_gathered(aead: Aead, s: Segment, src: memoryview, targets: Sequence[Target], scratch: memoryview) -> bool:
    """Any other AEAD: open the segment into ``scratch`` (its length at least), then copy it out
    to the targets; ``scratch`` is wiped before returning. False on a bad tag (nothing copied)."""
    part = scratch[: s.length]
    try:
        aead.open_into(s.nonce, src[s.offset : s.sealed_end], s.aad, part)
    except DecryptionFailed:
        return False
    try:
        pos = 0
        for t in targets:
            if isinstance(t, int):
                pos += t
                continue
            t[:] = part[pos : pos + t.nbytes]
            pos += t.nbytes
    finally:
        wipe(part)
    return True
