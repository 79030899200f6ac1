"""Remote mode's worker side: ``RemoteGateway`` (``client``) over the data plane's own HTTP/1.1
client (``wire``) and shared-memory regions (``shm``)."""

from gateway.remote.client import RemoteGateway
from gateway.remote.wire import RemoteUnavailable, TornResponse

__all__ = ["RemoteGateway", "RemoteUnavailable", "TornResponse"]
