"""Issue 15, point 4: a dependency outage is a problem+json 503 with Retry-After, on a connection
that stays usable -- never a 500 that drops keep-alive, never a 403 "not allowed".

A live server on a throwaway Postgres cluster of this test's own (``ThrowawayPostgres``, stopped
with ``pg_ctl`` on its own data directory), which is stopped in the middle of the test and started
again; requests go over ONE keep-alive connection, whose client port is compared across them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support import chunks
from tests.support.moto_kms import moto_server
from tests.support.postgres import ThrowawayPostgres
from tests.support.server_fixture import (
    assert_problem,
    fake_envelope,
    random_hash,
    running_server,
)

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _port_of(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def _unavailable(r: httpx.Response) -> None:
    assert_problem(r, 503)
    assert int(r.headers["retry-after"]) > 0
    assert r.headers.get("connection", "").lower() != "close"


async def test_postgres_outage_is_503_on_a_usable_connection(pg_cluster: ThrowawayPostgres, tmp_path: Path):
    with running_server(tmp_path / "state", pg_cluster.url) as live:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with live.client(limits=limits) as http:
            a = await live.create_tenant(http)
            admin = live.token(a, ("kv.worker", "kv.admin"))
            cap = await live.capability(http, a, ops=("lookup", "get", "put", "pin"), token=admin)
            h = random_hash()
            r = await chunks.store(http, live.headers(admin, cap), [(h, fake_envelope())])
            assert r.status_code == 204
            port = _port_of(r)

            pg_cluster.stop("immediate")
            try:
                calls = [
                    ("mint", lambda: http.post("/v1/capabilities", json={"namespace": "other", "ops": ["get"]}, headers=live.headers(admin))),
                    ("pin", lambda: http.post("/v1/pins", json={"hash": h}, headers=live.headers(admin, cap))),
                    ("rotate", lambda: http.post(f"/v1/admin/tenants/{a}/keys/rotate", headers=live.headers(live.operator_token()))),
                    ("create", lambda: http.post("/v1/admin/tenants", json={"tenant": "new-" + a}, headers=live.headers(live.operator_token()))),
                ]
                for name, call in calls:
                    for _ in range(2):  # twice: the first failure must not poison the next
                        r = await call()
                        _unavailable(r)
                        assert _port_of(r) == port, f"{name}: the keep-alive connection was dropped"
                r = await http.get("/readyz")
                assert r.status_code == 503 and r.json()["checks"]["database"] == "unavailable"
                assert _port_of(r) == port
            finally:
                pg_cluster.start()

            # positive control: once the database is back, the same calls succeed on the same connection
            for _ in range(50):
                r = await http.post("/v1/capabilities", json={"namespace": "other", "ops": ["get"]}, headers=live.headers(admin))
                if r.status_code == 201:
                    break
            assert r.status_code == 201, r.text
            r = await http.post(f"/v1/admin/tenants/{a}/keys/rotate", headers=live.headers(live.operator_token()))
            assert r.status_code == 200
            assert _port_of(r) == port


# -- the KEK provider: AWS KMS (moto_server, a process of this test's own, stopped by its pid) ------
@pytest.fixture
def moto_kms(tmp_path: Path):
    with moto_server(tmp_path / "moto.log") as moto:
        import boto3

        arn = boto3.client("kms", region_name="us-east-1", endpoint_url=moto.endpoint).create_key()["KeyMetadata"]["Arn"]
        yield moto.proc, moto.endpoint, arn


async def test_kek_provider_outage_is_503_on_a_usable_connection(moto_kms, tmp_path: Path):
    proc, endpoint, arn = moto_kms
    kms = {"kek_provider": "kms", "kms_key_id": arn, "kms_region": "us-east-1", "kms_endpoint_url": endpoint}
    with running_server(tmp_path / "state", **kms) as live:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with live.client(limits=limits) as http:
            a = await live.create_tenant(http)
            admin = live.token(a, ("kv.worker", "kv.admin"))
            r = await http.post("/v1/capabilities", json={"namespace": "default", "ops": ["get"]}, headers=live.headers(admin))
            assert r.status_code == 201  # positive control, the provider up
            port = _port_of(r)
            proc.terminate()
            proc.wait(10)
            # a mint needs no key: it answers with the registry's epoch (the vLLM middleware goes on
            # serving inference, without the cache), and what it grants is then a 503 to use
            r = await http.post("/v1/capabilities", json={"namespace": "fresh", "ops": ["get", "lookup"]}, headers=live.headers(admin))
            assert r.status_code == 201 and r.json()["epoch"] == 0, r.text
            fresh = r.json()["capability"]
            for name, call in (
                ("rotate", lambda: http.post(f"/v1/admin/tenants/{a}/keys/rotate", headers=live.headers(live.operator_token()))),
                ("lookup, new namespace", lambda: http.post("/v1/lookup", json={"hashes": ["00" * 32]}, headers=live.headers(admin, fresh))),
            ):
                for _ in range(2):
                    r = await call()
                    _unavailable(r)
                    assert _port_of(r) == port, f"{name}: the keep-alive connection was dropped"
