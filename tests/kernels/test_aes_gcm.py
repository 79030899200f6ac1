"""``kernels.aes_gcm.TorchAesGcm`` against ``cryptography``: random cases, known answers, tampering,
envelope interop through ``crypto.envelope.ChunkCipher``, bad input. CPU tensors here; the same
checks on a CUDA device are marked ``cuda`` (skipped without one)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from crypto.aead import CpuAesGcm
from crypto.envelope import ChunkCipher, DataKey, EnvelopeContext
from crypto.errors import DecryptionFailed
from kernels._aes_tables import expand_key, sbox
from kernels.aes_gcm import AeadParameterError, TagMismatch, TorchAesGcm
from kernels.errors import KVKernelError
from tests.support.vectors import AeadVector, load_nist_gcm, load_wycheproof_gcm

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """These tests run thousands of tiny CPU ops; on a shared 2-core box OpenMP's second thread
    only adds contention (3-10x slower under load). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _t(data: bytes, device: str = "cpu") -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _b(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


def _seal(key: bytes, nonce: bytes, data: bytes, aad: bytes, device: str = "cpu", **kw) -> bytes:
    buf = _t(data, device)
    tag = TorchAesGcm(key, device, **kw).encrypt_(buf, nonce, aad)
    return _b(buf) + tag


# -- the block cipher and its tables ----------------------------------------------------------


def test_tables_known_answers() -> None:
    box = sbox()
    assert (box[0x00], box[0x01], box[0x53], box[0xFF]) == (0x63, 0x7C, 0xED, 0x16)
    assert sorted(box) == list(range(256))
    # FIPS-197 A.3: the last round key of the AES-256 expansion of 60 3d eb ... f4
    key = bytes.fromhex("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4")
    assert expand_key(key)[14] == bytes.fromhex("fe4890d1e6188d0b046df344706c631e")


def test_block_cipher_matches_fips197_and_ecb() -> None:
    key = bytes(range(32))
    aes = TorchAesGcm(key)
    blocks = os.urandom(16 * 300)
    got = aes._encrypt_blocks(_t(blocks).view(-1, 16))
    enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    assert _b(got) == enc.update(blocks) + enc.finalize()
    fips = aes._encrypt_blocks(_t(bytes.fromhex("00112233445566778899aabbccddeeff")).view(1, 16))
    assert _b(fips) == bytes.fromhex("8ea2b7ca516745bfeafc49904b496089")  # FIPS-197 C.3


# -- equal to cryptography ---------------------------------------------------------------------

LENGTHS = st.one_of(st.integers(0, 40), st.integers(0, 1300), st.sampled_from([255, 256, 257, 4111]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.binary(min_size=32, max_size=32),
    nonce=st.binary(min_size=12, max_size=12),
    aad=st.one_of(st.just(b""), st.binary(max_size=100)),
    length=LENGTHS,
    slice_bytes=st.sampled_from([256, 1024, None]),
    seed=st.integers(0, 2**32 - 1),
)
@example(key=b"\0" * 32, nonce=b"\0" * 12, aad=b"", length=0, slice_bytes=None, seed=0)
def test_equals_cryptography(
    key: bytes, nonce: bytes, aad: bytes, length: int, slice_bytes: int | None, seed: int
) -> None:
    data = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    expected = AESGCM(key).encrypt(nonce, _b(data), aad)
    aes = TorchAesGcm(key, slice_bytes=slice_bytes)
    buf = data.clone()
    tag = aes.encrypt_(buf, nonce, aad)
    assert _b(buf) + tag == expected
    aes.decrypt_(buf, nonce, aad, tag)
    assert torch.equal(buf, data)


@pytest.mark.parametrize(
    ("length", "aad_len", "slice_bytes"),
    [
        (70_001, 1000, 4096),  # 17 slices and a partial block, AAD over many blocks
        ((1 << 20) + 5, 13, None),  # the default CPU slice, once and a bit
        (1 << 16, 0, 256),  # slices of one GHASH group each
    ],
)
def test_equals_cryptography_across_slices(length: int, aad_len: int, slice_bytes: int | None) -> None:
    key, nonce, aad, data = os.urandom(32), os.urandom(12), os.urandom(aad_len), os.urandom(length)
    assert _seal(key, nonce, data, aad, slice_bytes=slice_bytes) == AESGCM(key).encrypt(nonce, data, aad)


# -- known answers -------------------------------------------------------------------------------

SOURCES = {
    "nist-encrypt": lambda: load_nist_gcm("gcmEncryptExtIV256.rsp"),
    "nist-decrypt": lambda: load_nist_gcm("gcmDecrypt256.rsp"),
    "wycheproof": load_wycheproof_gcm,
}


def _check(v: AeadVector) -> str | None:
    aead = TorchAesGcm(v.key)
    out = bytearray(b"\xa5" * len(v.ct))
    try:
        aead.open_into(v.iv, v.ct + v.tag, v.aad, out)
    except TagMismatch:
        if v.ok:
            return f"{v.source} {v.case}: valid case rejected"
        return f"{v.source} {v.case}: output not wiped" if any(out) else None
    if not v.ok:
        return f"{v.source} {v.case}: invalid case accepted"
    if bytes(out) != v.pt:
        return f"{v.source} {v.case}: wrong plaintext"
    sealed = bytearray(len(v.pt) + 16)
    aead.seal_into(v.iv, v.pt, v.aad, sealed)
    return None if bytes(sealed) == v.ct + v.tag else f"{v.source} {v.case}: wrong ciphertext or tag"


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_known_answers(source: str) -> None:
    vectors = SOURCES[source]()
    assert sum(v.ok for v in vectors) >= 35 and len(vectors) >= 55  # the loader found them
    assert [msg for v in vectors if (msg := _check(v)) is not None] == []


def test_known_answer_checker_catches_a_wrong_answer() -> None:
    v = next(v for v in load_nist_gcm("gcmEncryptExtIV256.rsp") if v.pt)
    assert _check(AeadVector(**{**v.__dict__, "ct": bytes([v.ct[0] ^ 1]) + v.ct[1:]})) is not None
    assert _check(AeadVector(**{**v.__dict__, "ok": False})) is not None


# -- tampering -------------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["ciphertext", "tag", "aad", "nonce"])
@pytest.mark.parametrize("bit", [0, 7, 1001])
def test_flipped_bit_is_detected_and_buffer_zeroed(what: str, bit: int) -> None:
    key, nonce, aad, data = os.urandom(32), os.urandom(12), os.urandom(40), os.urandom(333)
    aes = TorchAesGcm(key)
    buf = _t(data)
    tag = aes.encrypt_(buf, nonce, aad)

    def flip(b: bytes) -> bytes:
        i = bit % (8 * len(b))
        return b[: i // 8] + bytes([b[i // 8] ^ (0x80 >> (i % 8))]) + b[i // 8 + 1 :]

    if what == "ciphertext":
        buf = _t(flip(_b(buf)))
    tag = flip(tag) if what == "tag" else tag
    aad = flip(aad) if what == "aad" else aad
    nonce = flip(nonce) if what == "nonce" else nonce
    with pytest.raises(TagMismatch) as info:
        aes.decrypt_(buf, nonce, aad, tag)
    assert isinstance(info.value, KVKernelError)
    assert not buf.any()


def test_open_into_raises_the_injected_failure_and_wipes_out() -> None:
    key, nonce = os.urandom(32), os.urandom(12)
    sealed = bytearray(AESGCM(key).encrypt(nonce, b"secret kv" * 50, b"ctx"))
    sealed[3] ^= 1
    out = bytearray(len(sealed) - 16)
    with pytest.raises(DecryptionFailed):
        TorchAesGcm(key, failure=DecryptionFailed).open_into(nonce, sealed, b"ctx", out)
    assert not any(out)
    with pytest.raises(DecryptionFailed):  # a wrong size fails the same way, as with CpuAesGcm
        TorchAesGcm(key, failure=DecryptionFailed).open_into(nonce, bytes(sealed), b"ctx", bytearray(5))


# -- the Aead protocol and envelopes ---------------------------------------------------------------


def test_seal_and_open_into_tensors_and_buffers() -> None:
    key, nonce, aad, data = os.urandom(32), os.urandom(12), b"aad", os.urandom(1000)
    expected = AESGCM(key).encrypt(nonce, data, aad)
    aes = TorchAesGcm(key)
    out = torch.zeros(len(data) + 16, dtype=torch.uint8)
    aes.seal_into(nonce, _t(data), aad, out)
    assert _b(out) == expected
    inplace = torch.cat([_t(data), torch.zeros(16, dtype=torch.uint8)])
    aes.seal_into(nonce, inplace[:-16], aad, inplace)  # data aliasing out's head
    assert _b(inplace) == expected
    plain = bytearray(len(data))
    aes.open_into(nonce, memoryview(expected), aad, plain)
    assert bytes(plain) == data
    back = torch.empty(len(data), dtype=torch.uint8)
    aes.open_into(nonce, out, aad, back)
    assert _b(back) == data


CTX = EnvelopeContext("tenant-a", "ns", "0" * 64, "llama-3-8b/fp16/32x8x128/tp0", 3)


@pytest.mark.parametrize("segment_bytes", [4096, 1 << 20])
def test_envelopes_interoperate_with_the_cpu_cipher(segment_bytes: int) -> None:
    dek, secret, plaintext = os.urandom(32), os.urandom(32), os.urandom(10_000)
    device = ChunkCipher(lambda k: TorchAesGcm(k, "cpu", failure=DecryptionFailed), segment_bytes=segment_bytes)
    cpu = ChunkCipher(CpuAesGcm, segment_bytes=segment_bytes)
    assert cpu.open(DataKey(dek, secret), CTX, device.seal(DataKey(dek, secret), CTX, plaintext)) == plaintext
    assert device.open(DataKey(dek, secret), CTX, cpu.seal(DataKey(dek, secret), CTX, plaintext)) == plaintext
    pieces = [plaintext[:1], plaintext[1:5000], plaintext[5000:]]
    out = bytearray(device.envelope_size(len(plaintext)))
    device.seal_pieces_into(DataKey(dek, secret), CTX, pieces, len(plaintext), out)
    assert cpu.open(DataKey(dek, secret), CTX, out) == plaintext
    out[-1] ^= 1
    with pytest.raises(DecryptionFailed):
        device.open(DataKey(dek, secret), CTX, out)


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda: TorchAesGcm(b"short"),
        lambda: TorchAesGcm(bytes(32), slice_bytes=1000),
        lambda: TorchAesGcm(bytes(32), "no-such-device"),
        lambda: TorchAesGcm(bytes(32), "cuda:99"),  # no CUDA here, or no 100th GPU
        lambda: TorchAesGcm(bytes(32)).encrypt_(torch.zeros(4, dtype=torch.uint8), b"short", b""),
        lambda: TorchAesGcm(bytes(32)).encrypt_(torch.zeros(4, dtype=torch.int32), bytes(12), b""),
        lambda: TorchAesGcm(bytes(32)).encrypt_(torch.zeros(4, 4, dtype=torch.uint8).t(), bytes(12), b""),
        lambda: TorchAesGcm(bytes(32)).encrypt_(bytearray(4), bytes(12), b""),  # type: ignore[arg-type]
        lambda: TorchAesGcm(bytes(32)).seal_into(bytes(12), b"abc", b"", bytearray(18)),
        lambda: TorchAesGcm(bytes(32)).seal_into(bytes(12), b"abc", b"", bytes(19)),
        lambda: TorchAesGcm(bytes(32)).open_into(bytes(11), bytes(20), b"", bytearray(4)),
    ],
)
def test_bad_input_is_a_typed_error(call: Callable[[], object]) -> None:
    with pytest.raises(AeadParameterError) as info:
        call()
    assert isinstance(info.value, (KVKernelError, ValueError))


def test_bad_input_changes_nothing() -> None:
    aes = TorchAesGcm(bytes(32))
    buf = _t(b"plaintext stays")
    with pytest.raises(AeadParameterError):
        aes.encrypt_(buf, b"bad nonce", b"")
    out = bytearray(b"\x01" * 10)
    with pytest.raises(AeadParameterError):
        aes.seal_into(bytes(12), b"abc", b"", out)
    right_size = bytearray(b"\x01" * 19)
    with pytest.raises(AeadParameterError):
        aes.seal_into(b"bad nonce", b"abc", b"", right_size)
    assert _b(buf) == b"plaintext stays" and out == b"\x01" * 10 and right_size == b"\x01" * 19
    assert "key" in repr(aes) and bytes(32).hex() not in repr(aes)


def test_one_instance_shared_by_threads() -> None:
    key, aad = os.urandom(32), b"t"
    aes, ref = TorchAesGcm(key, slice_bytes=1024), AESGCM(key)
    jobs = [(os.urandom(12), os.urandom(n)) for n in (0, 17, 5000, 9000, 3000, 1)]
    results: dict[int, bytes] = {}

    def run(i: int) -> None:
        nonce, data = jobs[i]
        buf = _t(data)
        tag = aes.encrypt_(buf, nonce, aad)
        results[i] = _b(buf) + tag

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(jobs))] == [ref.encrypt(n, d, aad) for n, d in jobs]


# -- on a CUDA device --------------------------------------------------------------------------------


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("length", [0, 1, 15, 16, 4097, (1 << 20) + 3, 33_554_432])
def test_cuda_equals_cryptography(length: int) -> None:
    key, nonce, aad = os.urandom(32), os.urandom(12), os.urandom(77)
    data = torch.randint(0, 256, (length,), dtype=torch.uint8)
    expected = AESGCM(key).encrypt(nonce, data.numpy().tobytes(), aad)
    buf = data.cuda()
    aes = TorchAesGcm(key, "cuda")
    tag = aes.encrypt_(buf, nonce, aad)
    assert buf.is_cuda and _b(buf) + tag == expected
    aes.decrypt_(buf, nonce, aad, tag)
    assert torch.equal(buf.cpu(), data)


@pytest.mark.cuda
@CUDA
def test_cuda_envelopes_interoperate_and_detect_tampering() -> None:
    dek, secret, plaintext = os.urandom(32), os.urandom(32), os.urandom(3 << 20)
    gpu = ChunkCipher(lambda k: TorchAesGcm(k, "cuda", failure=DecryptionFailed))
    cpu = ChunkCipher()
    assert cpu.open(DataKey(dek, secret), CTX, gpu.seal(DataKey(dek, secret), CTX, plaintext)) == plaintext
    sealed = cpu.seal(DataKey(dek, secret), CTX, plaintext)
    assert gpu.open(DataKey(dek, secret), CTX, sealed) == plaintext
    sealed[-100] ^= 4
    with pytest.raises(DecryptionFailed):
        gpu.open(DataKey(dek, secret), CTX, sealed)
    key, nonce = os.urandom(32), os.urandom(12)
    buf = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    aes = TorchAesGcm(key, "cuda")
    tag = aes.encrypt_(buf, nonce, b"a")
    buf[12345] ^= 1
    with pytest.raises(TagMismatch):
        aes.decrypt_(buf, nonce, b"a", tag)
    assert not buf.any()


@pytest.mark.cuda
@CUDA
def test_cuda_instance_built_on_one_stream_used_on_another() -> None:
    key, nonce, data = os.urandom(32), os.urandom(12), os.urandom(5 << 20)
    aes = TorchAesGcm(key, "cuda")  # tables built on the default stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        buf = _t(data, "cuda")
        tag = aes.encrypt_(buf, nonce, b"side")  # first use of the higher powers of H, too
        sealed = _b(buf) + tag
    assert sealed == AESGCM(key).encrypt(nonce, data, b"side")
