"""The redis-py side of the Redis Cluster tier: the URL, the client we build, and routing.

URL: ``redis+cluster://[user[:password]@]host:port[,host:port...][?query]`` (``rediss+cluster://``
for TLS; query keys ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``). The
hosts are seeds: the client reads the slot map from the first that answers (CLUSTER SLOTS) and
follows MOVED/ASK redirections itself. ACL users and passwords apply to every node.

Client configuration: the single-node tier's choices (no retries of its own, one connect timeout,
1 MiB reads, the connection class that writes payload views piece by piece instead of joining a
pipeline into one bytes object), plus ``require_full_coverage=False`` so that slots of a dead
master do not stop the others being served, and ``reinitialize_steps=0``: by default every fifth
MOVED reply (a reshard makes many) makes redis-py close every connection of every node, including
those other coroutines are reading from ("Connection closed by server"); with 0 a MOVED only
updates that slot in the map. After a connection error redis-py reloads the slot
map on the next call, which is how a promoted replica is found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from storage._redis_client import _Connection

__all__ = ["SCHEMES", "ClusterURL", "is_cluster_url", "make_cluster_client", "node_of", "parse_cluster_url"]

SCHEMES = ("redis+cluster://", "rediss+cluster://")
_TLS_KEYS = {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"}


def is_cluster_url(url: object) -> bool:
    return isinstance(url, str) and url.startswith(SCHEMES)


@dataclass(frozen=True)
class ClusterURL:
    nodes: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    tls: bool
    tls_options: dict[str, str]

    def node_url(self, host: str, port: int) -> str:
        """A plain redis:// (or rediss://) URL of one node, for a classic pub/sub connection."""
        auth = ""
        if self.password is not None or self.username:
            from urllib.parse import quote

            auth = quote(self.username or "", safe="") + (
                ":" + quote(self.password, safe="") if self.password is not None else "") + "@"
        return f"{'rediss' if self.tls else 'redis'}://{auth}{host}:{port}"


def parse_cluster_url(url: str) -> ClusterURL:
    if not is_cluster_url(url):
        raise ValueError("a cluster URL starts with redis+cluster:// or rediss+cluster://")
    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    netloc = rest.split("/", 1)[0]
    userinfo, _, hosts = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("every cluster seed must be host:port")
        nodes.append((host, int(port)))
    options = dict(parse_qsl(query))
    unknown = set(options) - _TLS_KEYS
    if unknown:
        raise ValueError(f"unknown cluster URL options: {', '.join(sorted(unknown))}")
    return ClusterURL(tuple(nodes), username, password, url.startswith("rediss+"), options)


def make_cluster_client(
    url: str, *, connect_timeout_s: float, socket_timeout_s: float, max_connections: int
) -> RedisCluster:
    """A RedisCluster for ``url``. No I/O here: the first command reads the slot map."""
    spec = parse_cluster_url(url)
    kwargs: dict[str, Any] = {
        "startup_nodes": [ClusterNode(h, p) for h, p in spec.nodes],
        "require_full_coverage": False,
        "reinitialize_steps": 0,  # else every 5th MOVED closes every connection, in flight or not
        "max_connections": max_connections,
        "retry": Retry(NoBackoff(), 0),
        "socket_connect_timeout": connect_timeout_s,
        "socket_timeout": socket_timeout_s,
        "socket_read_size": 1024 * 1024,
        "health_check_interval": 0,
        "username": spec.username,
        "password": spec.password,
    }
    if spec.tls:
        kwargs["ssl"] = True
        kwargs.update(spec.tls_options)
    client = RedisCluster(**kwargs)
    manager = client.nodes_manager
    if manager.connection_kwargs.get("connection_class") is Connection:
        manager.connection_kwargs["connection_class"] = _Connection
        for node in manager.startup_nodes.values():
            node.connection_class = _Connection
    return client


def node_of(client: RedisCluster, name: str) -> str:
    """The name (host:port) of the master that owns ``name``'s slot in the client's slot map, as
    last seen; "?" before the map is loaded."""
    nodes = client.nodes_manager.slots_cache.get(key_slot(name.encode()))
    return nodes[0].name if nodes else "?"
