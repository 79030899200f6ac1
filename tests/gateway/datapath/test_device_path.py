"""The gateway's device path (issue 7, item 3): pack into a device staging buffer, encrypt there in
place with the torch AES-GCM, copy only ciphertext to the host; and the reverse. Run on CPU tensors
(device_cipher="always") so CI checks it on every commit; a CUDA cache takes the same code."""

from __future__ import annotations

import pytest
import torch

from crypto.envelope import ChunkCipher, DataKey, EnvelopeContext, IssuedKey
from crypto.segments import derive_segment_key
from gateway.datapath import DataPath, OpenJob, SealJob
from kernels.layouts import KVLayout
from kernels.pack import slots_from_block_ids
from kernels.paged import PagedKV
from tests.support.gw import ALL_OPS, gateway_runtime, gathered, model_for, random_cache, small_geometry, zero_cache


@pytest.mark.parametrize("layout", list(KVLayout))
async def test_device_path_round_trip_and_interop_with_the_cpu_path(tmp_path, layout):
    g = small_geometry(layout)
    model = model_for(g)
    tokens, blocks = list(range(40)), list(range(10))
    src = random_cache(g, 32)
    async with gateway_runtime(tmp_path, tiers=["memory"]) as rt:
        await rt.admin.create_tenant("acme")
        cap = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        rt.gateway.datapath.device_cipher = "always"  # sealed by the torch AES-GCM
        await rt.gateway.store(cap, model, tokens, src, block_ids=blocks)
        rt.gateway.datapath.device_cipher = "auto"  # opened by cryptography on the CPU path
        dst = zero_cache(g, 32)
        assert (await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=blocks)).loaded_tokens == 40
        assert torch.equal(gathered(src, g, blocks, 40), gathered(dst, g, blocks, 40))
        # and the other way: sealed on the CPU path, opened on the device path
        await rt.gateway.store(cap, model, list(range(100, 140)), src, block_ids=blocks)
        rt.gateway.datapath.device_cipher = "always"
        dst = zero_cache(g, 32)
        assert (await rt.gateway.retrieve(cap, model, list(range(100, 140)), dst, block_ids=blocks)).loaded_tokens == 40
        assert torch.equal(gathered(src, g, blocks, 40), gathered(dst, g, blocks, 40))
        # a tampered envelope is a miss on the device path too, and nothing of it lands
        keys = await rt.gateway.keys_for("acme", "default", model, tokens)
        mem = rt.tiers.tier("memory")
        raw = bytearray((await mem.get(keys[1])).data)
        raw[-5] ^= 1
        await mem.put(keys[1], raw)
        dst = zero_cache(g, 32)
        got = await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=blocks)
        assert got.loaded_tokens == 16 and got.integrity_failures == 1
        assert not any(x[:, 4:8].any() for x in dst) if layout is KVLayout.KV_FIRST else True


def test_the_envelope_of_the_device_path_is_the_cpu_path_envelope_bit_for_bit():
    g = small_geometry()
    kv = PagedKV(random_cache(g, 16), g)
    slots = slots_from_block_ids(list(range(4)), g.block_size, 0, 16)
    ctx = EnvelopeContext("t", "n", "ab" * 32, "cd" * 32, 1)
    dek, binding = bytes(range(32)), bytes(range(32, 64))
    salt = b"\x07" * 32
    cpu = DataPath(ChunkCipher(segment_bytes=1024, salt_source=lambda n: salt), threads=0)
    dev = DataPath(ChunkCipher(segment_bytes=1024, salt_source=lambda n: salt), threads=0, device_cipher="always")
    assert dev.sealer_for(kv).name.startswith("device-")  # the device sealer, same salt source
    a = cpu.seal_batch(kv, [SealJob(slots, DataKey(dek, binding), ctx)])[0]
    b = dev.seal_batch(kv, [SealJob(slots, DataKey(dek, binding), ctx)])[0]
    assert bytes(a) == bytes(b)


@pytest.mark.parametrize("device", [False, True])
def test_an_issued_key_seals_and_opens_the_data_keys_envelope_on_either_path(device):
    """Remote mode: a worker holding only one envelope's issued (salt, key) seals the very bytes
    the data key seals with that salt, on the device path too; that key opens only that envelope."""
    g = small_geometry()
    kv = PagedKV(random_cache(g, 16), g)
    slots = slots_from_block_ids(list(range(4)), g.block_size, 0, 16)
    ctx = EnvelopeContext("t", "n", "ab" * 32, "cd" * 32, 1)
    data_key = DataKey(bytes(range(32)), bytes(range(32, 64)))
    salt, other_salt = b"\x07" * 32, b"\x08" * 32
    cpu = DataPath(ChunkCipher(segment_bytes=1024, salt_source=lambda n: salt), threads=0)
    path = DataPath(ChunkCipher(segment_bytes=1024), threads=0, device_cipher="always" if device else "auto")
    want = bytes(cpu.seal_batch(kv, [SealJob(slots, data_key, ctx)])[0])
    issued = IssuedKey(salt, derive_segment_key(data_key.dek, data_key.binding_secret, salt))
    assert bytes(path.seal_batch(kv, [SealJob(slots, issued, ctx)])[0]) == want
    dst = PagedKV(random_cache(g, 16, seed=9), g)
    assert path.open_batch(dst, [OpenJob(memoryview(want), slots, issued, ctx)]) == (1, False)
    assert torch.equal(gathered(list(kv.layers), g, list(range(4)), 16), gathered(list(dst.layers), g, list(range(4)), 16))
    # the attacker: the issued key of another envelope (another salt) does not open this one
    other = IssuedKey(other_salt, derive_segment_key(data_key.dek, data_key.binding_secret, other_salt))
    forged = bytearray(want)
    forged[8:40] = other_salt  # nor does rewriting the header's salt to the key's
    for job in (OpenJob(memoryview(want), slots, other, ctx), OpenJob(memoryview(bytes(forged)), slots, other, ctx)):
        assert path.open_batch(PagedKV(random_cache(g, 16, seed=9), g), [job]) == (0, True)


def test_a_device_cache_takes_the_device_path_unless_the_host_switch_is_set():
    g = small_geometry()
    kv = PagedKV(random_cache(g, 16), g)
    object.__setattr__(kv, "device", torch.device("meta"))  # what a CUDA cache reports
    assert DataPath(ChunkCipher(), threads=0)._on_device(kv)
    assert not DataPath(ChunkCipher(), threads=0, device_cipher="host")._on_device(kv)
    cpu_kv = PagedKV(random_cache(g, 16), g)
    assert not DataPath(ChunkCipher(), threads=0)._on_device(cpu_kv)  # a CPU cache: the fused CPU path
