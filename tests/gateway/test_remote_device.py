"""Remote mode with the device path: a worker whose KV lives on a device
seals where the KV is, so what leaves the device, and the wire, is ciphertext; its envelopes are
the CPU path's, byte for byte in format, so either kind of worker (and the server's own core)
opens what the other stored.

On a CPU-only host the device path is forced onto CPU tensors (``device_cipher="always"``: the
torch-ops cipher, the same code a CUDA cache runs); on a CUDA host (``-m cuda``, the device check)
the cache is on the GPU and ``auto`` chooses it, as a worker's connector would."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gateway.remote.client import RemoteGateway
from gateway.remote.wire import WirePool
from kernels.paged import PagedKV
from tests.support import server_fixture
from tests.support.gw import gathered, model_for, random_cache, small_geometry, zero_cache
from tests.support.server_fixture import ALL_OPS, LiveServer

live_server = server_fixture.live_server  # a fixture, registered in this module

NUM_BLOCKS = 32
N = 16 * 3 + 5  # three full chunks (chunk_tokens=16 in the test settings) and a partial one
BLOCKS = list(range(14))

DEVICES = [
    pytest.param("cpu", "always", id="cpu-forced"),
    pytest.param(
        "cuda", "auto", id="cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")],
    ),
]


class _Recorder:
    """A wire connection's socket that keeps a copy of every byte sent on it."""

    def __init__(self, sock: Any, sent: bytearray) -> None:
        self._sock, self._sent = sock, sent

    def sendall(self, data: Any) -> None:
        self._sent += bytes(data)
        self._sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _samples(plain: bytes, n: int = 16, size: int = 48) -> list[bytes]:
    step = max(1, (len(plain) - size) // n)
    return [plain[i : i + size] for i in range(0, len(plain) - size, step)][:n]


@pytest.mark.parametrize(("device", "device_cipher"), DEVICES)
async def test_a_device_worker_sends_only_ciphertext_and_interoperates(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch, device: str, device_cipher: str
) -> None:
    live = live_server
    sent = bytearray()
    connect = WirePool._connect

    def recording(self: WirePool) -> Any:
        conn = connect(self)
        conn.sock = _Recorder(conn.sock, sent)
        return conn

    monkeypatch.setattr(WirePool, "_connect", recording)
    async with live.client() as http:
        a = await live.create_tenant(http, "acme")
        b = await live.create_tenant(http, "globex")
    g = small_geometry()
    model = model_for(g)
    src = [t.to(device) for t in random_cache(g, NUM_BLOCKS, seed=7)]
    tokens = list(range(700, 700 + N))
    plain = gathered([t.cpu() for t in src], g, BLOCKS, N).numpy().tobytes()

    def worker(tenant: str, cipher: str) -> RemoteGateway:
        return RemoteGateway(
            live.base_url, live.worker_token(tenant), chunk_tokens=live.settings.chunk_tokens, device_cipher=cipher
        )

    async with worker(a, device_cipher) as dev, worker(a, "auto") as cpu, worker(b, device_cipher) as other:
        stored = await dev.store(model, tokens, src, block_ids=BLOCKS)
        assert (stored.chunks, stored.stored) == (4, 4)
        sealer = dev._plane.datapath.sealer_for(PagedKV.of(src, g))
        assert sealer.name.startswith("device-"), sealer.name  # the device path sealed them
        # the wire carried the envelopes (about the plaintext's size) and no run of the plaintext
        assert len(sent) > len(plain)
        assert not [s for s in _samples(plain) if s in sent]
        assert all(s in plain for s in _samples(plain))  # the control: the samples are the KV's bytes

        # a CPU-path worker of the same tenant opens them bit-exactly, and the server's core too
        host = zero_cache(g, NUM_BLOCKS)
        got = await cpu.retrieve(model, tokens, host, block_ids=BLOCKS)
        assert got.loaded_tokens == N and got.integrity_failures == 0
        assert gathered(host, g, BLOCKS, N).numpy().tobytes() == plain
        cap = await live.call(live.gateway.mint_capability, a, "default", ALL_OPS, 600)
        core = zero_cache(g, NUM_BLOCKS)
        got = await live.call(live.gateway.retrieve, cap, model, tokens, core, block_ids=BLOCKS)
        assert got.loaded_tokens == N and gathered(core, g, BLOCKS, N).numpy().tobytes() == plain

        # the device worker opens what the CPU path stored (other tokens), back on its device
        more = list(range(9000, 9000 + N))
        src2 = random_cache(g, NUM_BLOCKS, seed=8)
        assert (await cpu.store(model, more, src2, block_ids=BLOCKS)).stored == 4
        dst = [t.to(device) for t in zero_cache(g, NUM_BLOCKS)]
        got = await dev.retrieve(model, more, dst, block_ids=BLOCKS)
        assert got.loaded_tokens == N and got.integrity_failures == 0
        assert torch.equal(gathered([t.cpu() for t in dst], g, BLOCKS, N), gathered(src2, g, BLOCKS, N))

        # another tenant's device worker: nothing of A's, its cache left as it was
        dst_b = [t.to(device) for t in zero_cache(g, NUM_BLOCKS)]
        assert (await other.lookup(model, tokens)).hit_tokens == 0
        assert (await other.retrieve(model, tokens, dst_b, block_ids=BLOCKS)).loaded_tokens == 0
        assert all(not t.any() for t in dst_b)
