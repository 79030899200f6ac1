"""Fill 1,000,000 tiny chunks of one group in a throwaway redis-server, then time
RedisTier.delete_group. Run from the repository root:

    PYTHONPATH=. python scripts/redis_million_clear.py
"""
import asyncio
import os
import subprocess
import time

import redis.asyncio as aioredis

from storage.redis import RedisTier
from tests.support.redis_server import fill
from tests.support.services import free_port

N = 1_000_000

async def main(url):
    t = time.perf_counter()
    await fill(url, "m:", "0a", "01", N, batch=10_000)
    print(f"fill {N} chunks: {time.perf_counter() - t:.1f} s")
    raw = aioredis.from_url(url)
    print("dbsize", await raw.dbsize(), "used_memory", (await raw.info("memory"))["used_memory_human"])
    tier = RedisTier(url, prefix="m:", clear_batch=int(os.environ.get("BATCH", "2000")))
    t = time.perf_counter()
    n = await tier.delete_group("01")
    print(f"delete_group removed {n} chunks in {time.perf_counter() - t:.2f} s")
    print("dbsize after", await raw.dbsize())
    await tier.aclose()
    await raw.aclose()

port = free_port()
proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                         "--daemonize", "no"], stdout=subprocess.DEVNULL)
try:
    time.sleep(0.5)
    asyncio.run(main(f"redis://127.0.0.1:{port}/0"))
finally:
    proc.terminate()
    proc.wait(5)
