"""Who sent a request, as the server saw the connection: the peers trusted to name a tenant.

``TrustedPeers.parse(spec)`` reads a comma-separated list: ``unix`` (any Unix-socket peer of
this server), ``unix:/path`` (a peer of that socket only) and addresses or networks (CIDR,
IPv4 or IPv6). ``peer_of(scope)`` reads the ASGI scope as uvicorn fills it: a TCP peer's
address is ``scope["client"]``; a Unix-socket peer has no client address and the socket's path
as ``scope["server"]``. The identity is the connection's, never a header's. uvicorn's proxy
headers (on by default, for loopback peers) overwrite ``scope["client"]`` with
``X-Forwarded-For``'s word, so a TCP request carrying that header is a ``forwarded`` peer, never
trusted: its address may be the header's (a Unix-socket peer is not rewritten).

An authenticating gateway in front (Envoy, Istio, Kong) that terminates mTLS reaches the engine
over a Unix socket or from an allowlisted address; uvicorn does not pass a client certificate
into the ASGI scope, so the certificate is checked by the gateway that terminates TLS.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.vllm.errors import ConnectorConfigError

__all__ = ["Peer", "TrustedPeers", "peer_of"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Peer:
    """``kind`` is ``unix`` (``address``: the socket path, or ""), ``tcp`` (the IP address),
    ``forwarded`` (a TCP address that may be X-Forwarded-For's) or ``unknown`` (the server said
    nothing about the connection)."""

    kind: str
    address: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.address}" if self.address else self.kind


def peer_of(scope: Mapping[str, Any]) -> Peer:
    client = scope.get("client")
    if client:
        forwarded = any(name.lower() == b"x-forwarded-for" for name, _ in scope.get("headers") or ())
        return Peer("forwarded" if forwarded else "tcp", str(client[0]))
    server = scope.get("server")
    if server and server[1] is None and isinstance(server[0], str):
        return Peer("unix", server[0])
    return Peer("unknown", "")


@dataclass(frozen=True)
class TrustedPeers:
    any_unix: bool = False
    unix_paths: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, spec: str | None, what: str = "KVGATE_VLLM_TRUSTED_PEERS") -> TrustedPeers:
        any_unix, paths, nets = False, set(), []
        for item in (p.strip() for p in (spec or "").split(",")):
            if not item:
                continue
            if item == "unix":
                any_unix = True
            elif item.startswith("unix:/"):
                paths.add(item[len("unix:"):])
            else:
                try:
                    nets.append(ipaddress.ip_network(item, strict=True))
                except ValueError:
                    raise ConnectorConfigError(
                        f"{what}: {item[:80]!r} is neither 'unix', 'unix:/path' nor an address or network (CIDR)"
                    ) from None
        return cls(any_unix, frozenset(paths), tuple(nets))

    def __bool__(self) -> bool:
        return self.any_unix or bool(self.unix_paths) or bool(self.networks)

    def trusts(self, peer: Peer) -> bool:
        if peer.kind == "unix":
            return self.any_unix or peer.address in self.unix_paths
        if peer.kind != "tcp":
            return False
        try:
            addr = ipaddress.ip_address(peer.address)
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr.version == net.version and addr in net for net in self.networks)
